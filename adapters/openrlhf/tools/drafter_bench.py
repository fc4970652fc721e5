"""``rlhfless drafter-bench``: each drafter's acceptance on real rollouts, and the engine's output unchanged.

One vLLM engine (CPU build here) runs SmolLM2-135M-Instruct on GSM8K questions (``../shared/data`` or a file),
n samples a question, several epochs over the same questions, once per drafter and once without. Per drafter it
reports vLLM's own speculative-decoding counters (drafts, drafted and accepted tokens, acceptance per position),
the tokens a verification step yields a sequence, and the generation time beside the run without it; it writes
the acceptance as the simulator reads it (``rlhfless_sdk.api.speculation.Acceptance``). Losslessness: at
temperature 0 the drafted run's tokens are compared with the plain run's wherever the plain engine repeats itself
run to run.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from rlhfless_openrlhf.tools.options import question_options


@dataclass
class BenchSettings:
    prompts_file: str | None = None
    num_prompts: int = 16
    samples: int = 4
    epochs: int = 3
    max_new_tokens: int = 256
    temperature: float = 1.0
    drafters: tuple[str, ...] = ("ngram", "history")
    cache: Path | None = None
    seed: int = 0
    check_greedy: int = 8  # prompts of the temperature-0 losslessness check (0: none)
    write: Path | None = None  # folder for one acceptance YAML per drafter
    record: Path | None = None  # the plain engine's rollouts, as `rlhfless drafter-replay` reads them
    command: str = "rlhfless drafter-bench"


def _metrics(llm: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name.removeprefix("vllm:spec_decode_")] = getattr(m, "values", None) or getattr(m, "value", None)
    return out


def _delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in after.items():
        b = before.get(k)
        if isinstance(v, list):
            out[k] = [x - (b[i] if b else 0) for i, x in enumerate(v)]
        else:
            out[k] = v - (b or 0)
    return out


#: Each drafter measured at its whole budget every step (the simulator applies its budget rule to the acceptance).
#: What a CPU engine's drafted runs show (docs/drafters.md, examples/drafter_sampling_check.py).
CPU_CAVEAT = (
    "note: vLLM's CPU build does not sample the target's tokens while it verifies drafts at temperature > 0 "
    "(docs/drafters.md): these engines show the drafts' mechanics and time, not a lossless engine's acceptance"
)

WHOLE_BUDGET: dict[str, dict[str, Any]] = {
    name: {"step_tokens": 1_000_000, "long_tokens": 1} for name in ("history", "suffix")
}


def _engine(model: Path, drafter: str, seed: int, max_len: int) -> Any:
    from rlhfless_openrlhf.drafting import speculative_config
    from vllm import LLM

    spec = speculative_config({"name": drafter, "params": WHOLE_BUDGET.get(drafter, {})}, "cpu")
    # collective_rpc with a function (the drafter's feed) needs pickle, as OpenRLHF's engines set it
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV, as the demo's engines (vLLM's default: most RAM)
    return LLM(
        str(model),
        speculative_config=spec,
        max_model_len=max_len,
        enforce_eager=True,
        seed=seed,
        disable_log_stats=False,
        enable_prefix_caching=False,
    )


def _questions(settings: BenchSettings) -> tuple[list[dict[str, str]], str]:
    from rlhfless_openrlhf.tools.workbench import gsm8k_style_questions, load_questions

    path = settings.prompts_file
    if path is None:
        shared = Path(__file__).resolve().parents[3] / ".." / "shared" / "data" / "gsm8k" / "test.jsonl"
        path = str(shared.resolve()) if shared.exists() else None
    if path is None:
        return gsm8k_style_questions(settings.num_prompts, settings.seed), "GSM8K-style questions made here"
    return load_questions(
        path, settings.num_prompts
    ), f"the first {settings.num_prompts} questions of {Path(path).name}"


def run_bench(settings: BenchSettings, say=print) -> dict[str, Any]:
    """Run every drafter and the plain engine; returns the report (acceptance files written when asked)."""
    import gc

    from rlhfless_openrlhf.tools.workbench import chat_prompts, default_cache, smollm2_model
    from transformers import AutoTokenizer

    model = smollm2_model(settings.cache or default_cache(), say)
    tokenizer = AutoTokenizer.from_pretrained(model)
    questions, source = _questions(settings)
    prompts, _ = chat_prompts(tokenizer, questions)
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    max_len = max(len(p) for p in ids) + settings.max_new_tokens + 16
    report: dict[str, Any] = {"source": source, "settings": {k: str(v) for k, v in vars(settings).items()}, "runs": {}}
    greedy: dict[str, list[list[list[int]]]] = {}
    for name in ("none", *settings.drafters):
        report["runs"][name], checked = _bench_one(model, name, ids, max_len, settings, say)
        if checked is not None:
            greedy[name] = checked
        gc.collect()  # the engine, before the next one starts
    report["lossless"] = _lossless(greedy)
    report["acceptance"] = _acceptances(report, settings, source)
    return report


def _bench_one(
    model: Path, name: str, ids: list[list[int]], max_len: int, settings: BenchSettings, say: Callable[[str], None]
) -> tuple[dict[str, Any], list[list[list[int]]] | None]:
    """One engine with drafter ``name`` (``none``: the plain engine): its epochs, its proposer's figures and host
    time, and its greedy outputs where the settings check them (twice for the plain engine: its own repeat)."""
    from rlhfless_openrlhf import drafting
    from vllm import SamplingParams

    say(f"{name}: starting a vLLM engine (CPU) ...")
    llm = _engine(model, name, settings.seed, max_len)
    inputs = [{"prompt_token_ids": p} for p in ids]
    if name not in ("none", "ngram"):
        drafting.expect(llm, ids)
    epochs, done, earlier = _epochs(llm, name, inputs, ids, settings, say)
    greedy = None
    if settings.check_greedy:
        check = SamplingParams(temperature=0.0, max_tokens=settings.max_new_tokens)
        runs = [
            llm.generate(inputs[: settings.check_greedy], check, use_tqdm=False)
            for _ in range(2 if name == "none" else 1)
        ]
        greedy = [[list(o.outputs[0].token_ids) for o in r] for r in runs]
    run: dict[str, Any] = {"epochs": epochs, "proposer": drafting.proposer_stats(llm) if name != "none" else None}
    if name != "none":  # the proposer's host time, on this run's last rollouts (``done``: its last epoch)
        unit, cost = search_cost(name, done, earlier)
        run["search"] = {unit: cost}
        took = f"{cost * 1e9:.1f} ns a context token" if unit.endswith("token") else f"{cost * 1e6:.0f} us a sequence"
        say(f"{name}: the proposer takes {took} a step")
    return run, greedy


def _epochs(
    llm: Any, name: str, inputs: list[dict], ids: list[list[int]], settings: BenchSettings, say: Callable[[str], None]
) -> tuple[list[dict[str, Any]], list, list]:
    """The settings' epochs over the prompts on ``llm``, each timed with its speculative-decoding counters; a
    drafter observes each epoch's rollouts. Returns the epochs, the last epoch's rollouts and the earlier ones'."""
    from rlhfless_openrlhf import drafting
    from vllm import SamplingParams

    earlier: list[tuple[list[int], list[list[int]]]] = []  # the history a drafter held before the last epoch
    epochs, done = [], []
    for epoch in range(settings.epochs):
        # no per-request seed: vLLM's CPU sampler refuses a seeded generator mid-prefill; the engine's seed holds
        params = SamplingParams(
            temperature=settings.temperature, max_tokens=settings.max_new_tokens, n=settings.samples
        )
        before = _metrics(llm)
        t0 = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        spec = _delta(_metrics(llm), before)
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        if name == "none" and settings.record is not None:
            record_rollouts(settings.record, llm.get_tokenizer(), ids, outs, epoch)
        if name != "none":
            done = [(ids[i], [list(c.token_ids) for c in o.outputs]) for i, o in enumerate(outs)]
            drafting.observe(llm, done)
            if epoch + 1 < settings.epochs:
                earlier.extend(done)
        per_step = tokens / max(tokens - (spec.get("num_accepted_tokens", 0) or 0), 1)
        epochs.append({"epoch": epoch + 1, "wall_s": wall, "tokens": tokens, "spec": spec, "tokens_per_step": per_step})
        say(f"{name}: epoch {epoch + 1}: {tokens} tokens in {wall:.1f} s, {per_step:.2f} tokens a verification step")
    return epochs, done, earlier


def record_rollouts(path: Path, tokenizer: Any, ids: list[list[int]], outs: list[Any], epoch: int) -> None:
    """Append an epoch's groups to ``path`` as JSON lines (``{"uid", "step", "prompt", "responses"}``: the
    format ``rlhfless drafter-replay`` reads; the uid is the question's index, the step the epoch)."""
    import json

    with path.open("w" if epoch == 0 else "a", encoding="utf-8") as f:
        for i, o in enumerate(outs):
            row = {"uid": str(i), "step": epoch + 1, "prompt": tokenizer.decode(ids[i])}
            row["responses"] = [c.text for c in o.outputs]
            f.write(json.dumps(row) + "\n")


def _acceptances(report: dict[str, Any], settings: BenchSettings, source: str) -> dict[str, Any]:
    """Each drafter's acceptance (its epochs after the first, where there are more), with its host time; written
    as ``NAME.yaml`` under ``settings.write`` when asked."""
    import yaml

    out: dict[str, Any] = {}
    for name in settings.drafters:
        run = report["runs"][name]
        acc = acceptance_of(name, run["epochs"][1:] or run["epochs"], settings, source)
        if acc is not None:
            acc.update({unit: float(f"{cost:.3g}") for unit, cost in run["search"].items()})
        out[name] = acc
        if settings.write is not None and acc is not None:
            settings.write.mkdir(parents=True, exist_ok=True)
            (settings.write / f"{name}.yaml").write_text(yaml.safe_dump(acc, sort_keys=False), encoding="utf-8")
    return out


def search_cost(
    name: str, groups: list[tuple[list[int], list[list[int]]]], earlier: list[tuple[list[int], list[list[int]]]]
) -> tuple[str, float]:
    """The host time of a drafter's proposal for each sample of ``groups`` (prompt and response) at its full length,
    one a row as in a decode step, on one thread: ``("search_s_per_token", s)`` for ``ngram``, timed as vLLM runs it
    (its numba search scans the whole sequence; one thread, as vLLM sets it); ``("search_s_per_seq", s)`` for any
    other drafter, through its ``propose`` after ``observe`` of ``earlier`` groups, with the row's siblings."""
    import numpy as np

    from rlhfless_sdk.api.plugins import get_plugin_manager

    rows = [(p, r, [o for o in rs if o is not r]) for p, rs in groups for r in rs]
    tokens = sum(len(p) + len(r) for p, r, _ in rows)
    if tokens == 0:
        return ("search_s_per_token" if name == "ngram" else "search_s_per_seq"), 0.0
    drafter = get_plugin_manager().registry.create("drafter", {"name": name, "params": WHOLE_BUDGET.get(name, {})})
    if name == "ngram":  # vLLM's search with this drafter's settings (engine_method: what the engine is built with)
        from numba import get_num_threads, set_num_threads
        from vllm.v1.spec_decode.ngram_proposer import batch_propose_numba

        width = max(len(p) + len(r) for p, r, _ in rows) + 1
        table = np.zeros((len(rows), width), dtype=np.int32)
        counts = np.zeros(len(rows), dtype=np.int32)
        for i, (p, r, _) in enumerate(rows):
            table[i, : len(p) + len(r)] = p + r
            counts[i] = len(p) + len(r)
        vllm = drafter.engine_method()
        lo, hi, k = vllm["prompt_lookup_min"], vllm["prompt_lookup_max"], vllm["num_speculative_tokens"]
        drafts, sizes = np.zeros((len(rows), k), dtype=np.int32), np.zeros(len(rows), dtype=np.int32)
        threads = get_num_threads()
        set_num_threads(1)
        try:
            search = lambda: batch_propose_numba(list(range(len(rows))), counts, table, lo, hi, width, k, drafts, sizes)  # noqa: E731
            search()  # compiled
            repeats = 20
            t0 = time.perf_counter()
            for _ in range(repeats):
                search()
            return "search_s_per_token", (time.perf_counter() - t0) / (repeats * tokens)
        finally:
            set_num_threads(threads)
    for prompt, responses in earlier:
        drafter.observe(prompt, responses)
    k = max(int(drafter.draft_tokens(1, None)), 1)
    t0 = time.perf_counter()
    for p, r, siblings in rows:
        drafter.propose(p, r, k, siblings)
    return "search_s_per_seq", (time.perf_counter() - t0) / len(rows)


def _lossless(greedy: dict[str, list[list[list[int]]]]) -> dict[str, Any]:
    """At temperature 0: the prompts whose plain runs agree, and how many of them each drafter reproduced."""
    plain = greedy.get("none")
    if not plain or len(plain) < 2:
        return {}
    stable = [i for i, (a, b) in enumerate(zip(plain[0], plain[1], strict=True)) if a == b]
    out: dict[str, Any] = {"plain_repeats": f"{len(stable)}/{len(plain[0])}"}
    for name, runs in greedy.items():
        if name == "none":
            continue
        same = sum(1 for i in stable if runs[0][i] == plain[0][i])
        out[name] = {"identical": same, "of": len(stable)}
    return out


def acceptance_of(name: str, epochs: list[dict[str, Any]], settings: BenchSettings, source: str) -> dict | None:
    """The ``Acceptance`` record (as a dict) of these epochs' counters."""
    drafts = sum(e["spec"].get("num_drafts", 0) or 0 for e in epochs)
    if drafts <= 0:
        return None
    drafted = sum(e["spec"].get("num_draft_tokens", 0) or 0 for e in epochs)
    accepted = sum(e["spec"].get("num_accepted_tokens", 0) or 0 for e in epochs)
    per_pos = [0.0] * max(len(e["spec"].get("num_accepted_tokens_per_pos") or []) for e in epochs)
    for e in epochs:
        for j, x in enumerate(e["spec"].get("num_accepted_tokens_per_pos") or []):
            per_pos[j] += x
    tokens = sum(e["tokens"] for e in epochs)
    steps = max(tokens - accepted, 1)
    at = [min(x / drafts, 1.0) for x in per_pos]
    for j in range(1, len(at)):  # counters are exact, but keep the record's invariant under rounding
        at[j] = min(at[j], at[j - 1])
    n = len(epochs)
    return {
        "drafter": name,
        "source": (
            f"measured: vLLM {_vllm_version()} (CPU) speculative decoding, SmolLM2-135M-Instruct, {source}, "
            f"{settings.samples} samples each, temperature {settings.temperature}, {settings.max_new_tokens} new "
            f"tokens at most, the last {n} of {settings.epochs} epochs; command: {settings.command}"
        ),
        "draft_rate": round(min(drafts / steps, 1.0), 4),
        "accepted_at": [round(x, 4) for x in at],
        "drafted_per_draft": round(drafted / drafts, 4),
        "tokens_per_step_measured": round(tokens / steps, 4),
    }


def _vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def print_report(report: dict[str, Any], say=print) -> None:
    """Per drafter: tokens a step, acceptance by position, generation time against the plain engine's."""
    plain = sum(e["wall_s"] for e in report["runs"]["none"]["epochs"])
    say(f"\n{report['source']}")
    say(f"{'drafter':<10}{'gen s':>8}{'vs none':>9}{'tok/step':>10}{'drafts':>8}{'accepted by position'}")
    for name, run in report["runs"].items():
        wall = sum(e["wall_s"] for e in run["epochs"])
        tokens = sum(e["tokens"] for e in run["epochs"])
        acc = report.get("acceptance", {}).get(name)
        steps = tokens / max(e_tps, 1e-9) if (e_tps := _mean_tps(run)) else tokens
        pos = " ".join(f"{x:.2f}" for x in acc["accepted_at"]) if acc else "-"
        drafts = sum(e["spec"].get("num_drafts", 0) or 0 for e in run["epochs"])
        say(f"{name:<10}{wall:>8.1f}{plain / wall:>8.2f}x{tokens / max(steps, 1):>10.3f}{drafts:>8}  {pos}")
    lossless = report.get("lossless") or {}
    if lossless:
        same = ", ".join(f"{k} {v['identical']}/{v['of']}" for k, v in lossless.items() if isinstance(v, dict))
        say(
            f"temperature 0: the plain engine repeated itself on {lossless['plain_repeats']} prompts; identical "
            f"tokens with drafts: {same}"
        )
    say(CPU_CAVEAT)


def _mean_tps(run: dict[str, Any]) -> float:
    tokens = sum(e["tokens"] for e in run["epochs"])
    accepted = sum(e["spec"].get("num_accepted_tokens", 0) or 0 for e in run["epochs"])
    return tokens / max(tokens - accepted, 1)


@click.command("drafter-bench")
@question_options(
    16, "GSM8K JSON lines (default: ../shared/data/gsm8k/test.jsonl when present, else questions generated here)."
)
@click.option("--temperature", default=1.0, type=float, show_default=True)
@click.option("--drafter", "drafters", multiple=True, default=("ngram", "history"), show_default=True)
@click.option(
    "--write-acceptance",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Folder for one acceptance YAML per drafter (what `rlhfless simulate --acceptance FILE` reads).",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Write the whole report (every epoch's counters) to this file.",
)
@click.option(
    "--record",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Write the plain engine's rollouts here, one group a line, for `rlhfless drafter-replay` (each epoch a step).",
)
def drafter_bench_cmd(drafters: tuple[str, ...], write_acceptance: Path | None, json_path: Path | None, **kw) -> None:
    """Each drafter's acceptance and time on a real vLLM engine (CPU), and its tokens beside a plain engine's."""
    import json

    from rlhfless_openrlhf.tools.options import check_drafter, real_engine_command

    real_engine_command("drafter-bench")
    for name in drafters:
        check_drafter(name)
    command = " ".join(["rlhfless drafter-bench", *_measuring_flags(sys.argv[2:])])
    settings = BenchSettings(**kw, drafters=tuple(drafters), write=write_acceptance, command=command)
    report = run_bench(settings, say=lambda m: click.echo(m, err=True))
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=1), encoding="utf-8")
    print_report(report, say=click.echo)


def _measuring_flags(argv: list[str]) -> list[str]:
    """The command line without where it writes (no machine-local path reaches an acceptance file)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.partition("=")[0]
        if name in ("--write-acceptance", "--json", "--record"):
            skip = "=" not in arg
            continue
        out.append(arg)
    return out
