"""The suffix drafter (what it matches, that it drafts only continuations, within k) and ``rlhfless drafter-replay``
(recorded rollouts replayed offline, figures known by construction, the acceptance file it writes)."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st
from rlhfless_policies.drafters import SuffixDrafter, SuffixParams

from rlhfless_sdk.api.profiles import load_acceptance
from rlhfless_sdk.cli.main import main
from rlhfless_sdk.workloads.draft_replay import RecordedGroup, replay

TOKENS = st.lists(st.integers(0, 5), max_size=40)


def _occurs(source: list[int], ctx: list[int], draft: list[int], n: int) -> bool:
    """``draft`` follows an occurrence of ``ctx``'s last ``n`` tokens somewhere in ``source`` (the match may
    not be ``ctx``'s own end, which nothing follows)."""
    key = ctx[-n:]
    return any(source[i : i + n] == key and source[i + n : i + n + len(draft)] == draft for i in range(len(source) - n))


@given(
    history=st.lists(st.lists(TOKENS, max_size=4), max_size=4),
    prompt=TOKENS,
    response=TOKENS,
    siblings=st.lists(TOKENS, max_size=3),
    k=st.integers(0, 10),
)
def test_a_suffix_draft_is_within_k_and_continues_a_match_in_one_source(history, prompt, response, siblings, k):
    """What ``suffix`` drafts is at most k tokens and follows an occurrence of the sequence's last ``min_match``
    tokens in the sequence itself, a sibling (after the prompt's last tokens) or the prompt's earlier responses."""
    d = SuffixDrafter(SuffixParams(min_match=2, max_match=6))
    for responses in history:
        d.observe(prompt, responses)
    draft = d.propose(prompt, response, k, siblings)
    assert len(draft) <= k and all(isinstance(t, int) for t in draft)
    if not draft:
        return
    head = list(prompt)[-6:]
    own = list(prompt) + list(response)
    sources = [own] + [head + list(s) for s in siblings] + [head + list(r) for rs in history for r in rs]
    # a majority walk may switch sources after the first token; the first token always follows a match
    assert any(_occurs(s, own, draft[:1], 2) for s in sources), (draft, sources)


def test_suffix_drafts_from_the_sequence_itself_a_finished_sibling_and_the_majority():
    d = SuffixDrafter(SuffixParams(min_match=2, max_match=8, spec_factor=4.0))
    # the sequence repeats itself (prompt lookup): after "7 8" came "9 10 11" before
    assert d.propose([1, 2], [7, 8, 9, 10, 11, 3, 7, 8], 3) == [9, 10, 11]
    # a finished sibling, in full: after "5 6" it went on "40 41"
    assert d.propose([1, 2], [5, 6], 2, siblings=[[5, 6, 40, 41]]) == [40, 41]
    # three sources match as long; two go on with 30, one with 20: the majority's continuation
    sibs = [[9, 5, 6, 30, 31], [8, 5, 6, 30, 32], [7, 5, 6, 20, 21]]
    assert d.propose([1, 2], [5, 6], 1, siblings=sibs) == [30]


def test_a_short_match_drafts_little():
    """A match of m tokens drafts at most ceil(spec_factor * m): a two-token chance match drafts 2, not k."""
    d = SuffixDrafter(SuffixParams(min_match=2, max_match=16, spec_factor=1.0))
    assert d.propose([1, 2], [5, 6], 8, siblings=[[9, 5, 6, 40, 41, 42, 43, 44]]) == [40, 41]


def _words(n: int, stem: str) -> str:
    return " ".join(f"{stem}{i}" for i in range(n))


#: Rollouts whose replay is known by construction (a word-level tokenizer: one word, one token). Step 1: prompt a
#: answered once (16 words, nothing to match), prompt b twice (4 words y, then 6 words z and the same 4 y, whose
#: last two follow the finished sibling's "y0 y1"). Step 2: prompt a answered as in step 1 (history matches all).
GROUPS = [
    {"uid": "a", "step": 1, "prompt": "p0 p1 p2", "responses": [_words(16, "w")]},
    {"uid": "b", "step": 1, "prompt": "q0 q1", "responses": [_words(4, "y"), _words(6, "z") + " " + _words(4, "y")]},
    {"uid": "a", "step": 2, "prompt": "p0 p1 p2", "responses": [_words(16, "w")]},
]


def _tokenizer_folder(folder: Path) -> Path:
    """A word-level Hugging Face tokenizer over the words of ``GROUPS``, saved as a tokenizer folder."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for g in GROUPS for text in (g["prompt"], *g["responses"]) for w in text.split()})
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", *words])}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(folder)
    return folder


def test_drafter_replay_gives_the_figures_known_by_construction(tmp_path):
    """``history`` at k = 4 on ``GROUPS``: step 1 drafts once (b's second response, after the finished "y0 y1":
    2 tokens kept, the step yields 2 as the response ends); step 2 drafts a's answer from step 1 at t = 0, 5, 10
    and 15 (4, 4, 4 and the 1 token left: kept). 46 tokens in 16 + 4 + 9 + 4 = 33 verification steps."""
    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_text("".join(json.dumps(g) + "\n" for g in GROUPS))
    tok = _tokenizer_folder(tmp_path / "tok")
    out = tmp_path / "history.yaml"
    args = ["drafter-replay", str(rollouts), "--drafter", "history", "--tokenizer", str(tok), "--k", "2,4,8"]
    run = CliRunner().invoke(main, [*args, "--json", "--out", str(out)])
    assert run.exit_code == 0, run.output
    report = json.loads(run.output[run.output.index("{") :])
    assert (report["groups"], report["responses"], report["steps"]) == (3, 4, 2)
    k2, k4, k8 = report["drafters"]["history"]
    assert [r["k"] for r in (k2, k4, k8)] == [2, 4, 8]
    assert Fraction(k4["tokens_per_step"]).limit_denominator(100) == Fraction(46, 33)
    assert k4["draft_rate"] == pytest.approx(5 / 33) and k4["first_acceptance"] == 1.0
    # step 2 alone: 16 tokens in 4 steps at k 4; at k 2: 0, 3, 6, 9, 12, 15 (6 steps); at k 8: 0 and 9 (2 steps)
    assert [r["by_step"]["2"]["tokens_per_step"] for r in (k2, k4, k8)] == [16 / 6, 4.0, 8.0]
    assert k4["by_step"]["1"]["tokens_per_step"] == pytest.approx(30 / 29)
    # by position at k 4 (a's step-2 drafts start at 0, 5, 10, 15 of 16; b's one draft at 8 of 10)
    positions = k4["positions"]
    assert positions["first quarter"]["tokens_per_step"] == pytest.approx((4 + 1 + 3 + 5) / (4 + 1 + 3 + 1))
    assert positions["last quarter"]["tokens_per_step"] == pytest.approx((4 + 1 + 2 + 1) / (4 + 1 + 1 + 1))
    # each group's longest response: a (16 in 16 steps, then 16 in 4) and b's second (10 in 9)
    assert k4["longest"]["tokens_per_step"] == pytest.approx(42 / 29)
    acc = load_acceptance(out)  # what `rlhfless simulate --acceptance` reads: the replay at k 8
    assert acc.drafter == "history" and acc.budget == 8 and [p.upto for p in acc.by_position] == [0.25, 0.75, 1.0]
    assert acc.tokens_per_step_measured == pytest.approx(46 / 31, abs=1e-4)  # k 8: step 2 takes 2 steps, not 4
    assert acc.accepted_at[0] == 1.0 and acc.search_s_per_seq > 0


def test_drafter_replay_names_a_bad_line_and_a_bad_budget(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(GROUPS[0]) + "\n" + json.dumps({"uid": "x", "step": 1, "prompt": "p"}) + "\n")
    tok = _tokenizer_folder(tmp_path / "tok")
    run = CliRunner().invoke(main, ["drafter-replay", str(bad), "--tokenizer", str(tok)])
    assert run.exit_code != 0 and f"{bad}:2: missing responses" in run.output, run.output
    run = CliRunner().invoke(main, ["drafter-replay", str(bad), "--tokenizer", str(tok), "--k", "0,4"])
    assert run.exit_code == 2 and "each k at least 1" in run.output


def test_the_replay_keeps_a_finished_siblings_tokens_for_a_running_one():
    """At position t a sibling is its first t tokens, or the whole response once it ended: the second response's
    "y0 y1" finds the first one's "y2 y3" only because the finished one is kept whole."""
    ids = {w: i for i, w in enumerate(["q0", "q1", *(f"y{i}" for i in range(4)), *(f"z{i}" for i in range(6))])}
    enc = lambda text: [ids[w] for w in text.split()]  # noqa: E731
    group = RecordedGroup("b", 1, enc("q0 q1"), [enc(_words(4, "y")), enc(_words(6, "z") + " " + _words(4, "y"))])
    from rlhfless_policies.drafters import HistoryDrafter

    result = replay(HistoryDrafter(), [group], 4)
    assert result.overall.drafts == 1 and result.overall.kept_at[:2] == [1, 1] and result.overall.steps == 4 + 9


def test_the_host_time_script_times_a_proposal_at_each_length():
    import subprocess
    import sys

    script = Path(__file__).resolve().parent.parent / "examples" / "drafter_host_time.py"
    out = subprocess.run([sys.executable, str(script), "--repeat", "1"], capture_output=True, text=True, check=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("L ")]
    assert [line.split(":")[0].split()[-1] for line in lines] == ["1,000", "4,000", "16,000"]
    assert all(float(line.split(":")[1].split()[0]) > 0 for line in lines)
