"""The drafter kind: its invariants (hypothesis), speculative decoding in the engine model and the work bound, and
the proposer that runs a drafter inside vLLM's engines (its fallback when the drafter raises)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from rlhfless_policies.drafters import (
    HistoryDrafter,
    HistoryParams,
    NgramDrafter,
    NgramParams,
    NoDrafter,
    SuffixDrafter,
    SuffixParams,
)

from rlhfless_sdk import PolicySpec, hookimpl
from rlhfless_sdk.api.profiles import load_acceptance, load_profile
from rlhfless_sdk.api.records import Cluster
from rlhfless_sdk.api.speculation import Acceptance, Speculation, acceptance_tokens_needed, geometric
from rlhfless_sdk.simulation.bound import work_bound
from rlhfless_sdk.simulation.simulator import Simulator
from rlhfless_sdk.workloads.synthetic import SyntheticWorkload
from rlhfless_sdk.workloads.traces import synthetic_workload

TOKENS = st.lists(st.integers(0, 5), max_size=40)
DRAFTERS = [
    NoDrafter(),
    NgramDrafter(),
    HistoryDrafter(HistoryParams(max_tokens=400, responses_per_prompt=3)),
    SuffixDrafter(SuffixParams(max_tokens=400, responses_per_prompt=3)),
]


@pytest.mark.parametrize("drafter", DRAFTERS, ids=lambda d: type(d).__name__)
@given(
    history=st.lists(st.tuples(TOKENS, st.lists(TOKENS, max_size=4)), max_size=6),
    prompt=TOKENS,
    response=TOKENS,
    siblings=st.lists(TOKENS, max_size=3),
    k=st.integers(0, 12),
)
def test_a_draft_is_at_most_k_tokens(drafter, history, prompt, response, siblings, k):
    for p, responses in history:
        drafter.observe(p, responses)
    draft = drafter.propose(prompt, response, k, siblings)
    assert isinstance(draft, list) and len(draft) <= k and all(isinstance(t, int) for t in draft)


@given(
    history=st.lists(st.tuples(TOKENS, st.lists(TOKENS, max_size=4)), max_size=12),
    prompt=TOKENS,
    response=TOKENS,
    siblings=st.lists(TOKENS, max_size=3),
)
def test_a_history_draft_continues_a_match_of_the_sequences_last_tokens(history, prompt, response, siblings):
    """What ``history`` drafts follows an occurrence of the sequence's last ``min_match`` tokens in the prompt's
    earlier responses or its siblings (each after the prompt's last tokens)."""
    d = HistoryDrafter(HistoryParams(min_match=2, max_match=6))
    for p, responses in history:
        d.observe(p, responses)
    draft = d.propose(prompt, response, 4, siblings)
    if not draft:
        return
    head = list(prompt)[-6:]
    ctx = (head + list(response))[-6:]
    sources = [head + list(s) for s in siblings] + [head + list(r) for p, rs in history if p == prompt for r in rs]
    key = ctx[-2:]
    assert any(
        src[i - 2 : i] == key and src[i : i + len(draft)] == draft for src in sources for i in range(2, len(src))
    )


@given(
    groups=st.lists(st.tuples(st.integers(0, 5), st.lists(st.lists(st.integers(0, 9), max_size=60), max_size=5))),
    max_tokens=st.integers(1, 300),
    window=st.integers(1, 4),
)
def test_history_memory_stays_within_its_bound(groups, max_tokens, window):
    d = HistoryDrafter(HistoryParams(max_tokens=max_tokens, responses_per_prompt=window, max_match=4))
    for prompt_id, responses in groups:
        d.observe([prompt_id, 7, 7], responses)
        held = sum(e.tokens for e in d._prompts.values())
        assert held <= max_tokens and d._held == held  # the bound, and the running count the eviction reads
        assert all(len(e.seqs) <= window for e in d._prompts.values())


@given(
    running=st.integers(1, 512),
    more=st.integers(0, 64),
    remaining=st.none() | st.floats(0, 10_000),
    extra=st.floats(0, 10_000),
)
def test_the_length_aware_budget_falls_with_concurrency_and_rises_with_remaining_length(
    running, more, remaining, extra
):
    d = HistoryDrafter()
    p = d.params
    k = d.draft_tokens(running, remaining)
    assert 0 <= k <= p.max_draft
    assert d.draft_tokens(running + more, remaining) <= k
    if remaining is not None:
        assert d.draft_tokens(running, remaining + extra) >= k
    if running * 2 > p.step_tokens:
        assert k == 0  # a step with a draft each would verify more than step_tokens


def test_history_drafts_the_earlier_response_of_the_same_prompt_not_another_prompts():
    d = HistoryDrafter()
    d.observe([1, 2, 3], [[10, 11, 12, 13, 14, 15]])
    d.observe([9, 9, 9], [[10, 11, 40, 41, 42]])
    assert d.propose([1, 2, 3], [10, 11], 3) == [12, 13, 14]
    assert d.propose([9, 9, 9], [10, 11], 3) == [40, 41, 42]
    assert d.propose([5, 5, 5], [10, 11], 3) == []  # never seen, no sibling
    assert d.propose([5, 5, 5], [10, 11], 3, siblings=[[10, 11, 77, 78]]) == [77, 78]


# -- acceptance and the engine model ---------------------------------------------------------------------------
@given(
    rate=st.floats(0, 1),
    a=st.lists(st.floats(0, 1), min_size=1, max_size=10),
    k=st.integers(0, 16),
)
def test_tokens_a_step_grow_with_the_budget_and_never_exceed_what_it_computes(rate, a, k):
    acc = Acceptance(
        drafter="x", source="test", draft_rate=rate, accepted_at=sorted(a, reverse=True), drafted_per_draft=len(a)
    )
    assert acc.tokens_per_step(k + 1) >= acc.tokens_per_step(k) - 1e-12 and acc.tokens_per_step(k) >= 1.0
    assert acc.tokens_per_step(k) <= 1.0 + acc.drafted(k) + 1e-9


def test_an_acceptance_that_rises_with_position_is_refused():
    with pytest.raises(ValueError, match="non-increasing"):
        Acceptance(drafter="x", source="t", draft_rate=1.0, accepted_at=[0.2, 0.5], drafted_per_draft=2)


def _acceptance(rate: float) -> Acceptance:
    return Acceptance(drafter="t", source="test", draft_rate=1.0, accepted_at=geometric(rate, 8), drafted_per_draft=8)


PROFILE = load_profile("qwen2.5-7b-l40s")


@pytest.mark.parametrize("overlap", [False, True])
def test_a_drafter_that_drafts_nothing_costs_plain_decoding_and_the_lost_async_scheduling(registry, overlap):
    """An engine built with a drafter that never drafts decodes as a plain one, but for what vLLM's async
    scheduling would have hidden (``sync_penalty``): equal without it, slower with the default."""
    work = synthetic_workload(SyntheticWorkload(32, 4, seed=2), 2)
    prof = PROFILE.model_copy(update={"decode_overlap": overlap})
    idle = Speculation(acceptance=_acceptance(0.7), budget=[0])
    runs = [
        Simulator(p, Cluster.uniform(1, 2), registry=registry, plan_s=0.0).run(registry.scheduler("openrlhf"), work)
        for p in (  # plan_s: the runs compare to the last digit
            prof,
            prof.model_copy(update={"speculation": idle.model_copy(update={"sync_penalty": 0.0})}),
            prof.model_copy(update={"speculation": idle}),
        )
    ]
    plain, free, synced = ([r.generation_s for r in run.reports] for run in runs)
    assert plain == pytest.approx(free, rel=1e-12)
    assert all(p < s <= p * (1 + idle.sync_penalty) + 1e-9 for p, s in zip(plain, synced, strict=True))


@pytest.mark.parametrize("overlap", [False, True])
def test_the_proposers_host_time_is_paid_on_drafting_steps_by_sequence_and_context_token(registry, overlap):
    """A proposer's measured host time lengthens every step that drafts (per running sequence, and per context
    token for a whole-sequence search), and no step that drafts nothing; the cost model's steady step agrees."""
    from rlhfless_sdk.planning.engine_model import steady_step

    work = synthetic_workload(SyntheticWorkload(24, 4, median_length=600, max_length=2048, seed=4), 1)
    prof = PROFILE.model_copy(update={"decode_overlap": overlap})

    def run(budget: list[int], **search: float) -> float:
        acc = _acceptance(0.5).model_copy(update=search)
        spec = Speculation(acceptance=acc, budget=budget)
        spec_prof = prof.model_copy(update={"speculation": spec})
        sim = Simulator(
            spec_prof, Cluster.uniform(1, 2), registry=registry, plan_s=0.0
        )  # a fixed plan time: the runs compare to the last digit
        return sum(r.generation_s for r in sim.run(registry.scheduler("openrlhf"), work).reports)

    free = run([4])
    per_seq, per_token = run([4], search_s_per_seq=2e-4), run([4], search_s_per_token=2e-7)
    assert per_seq > free and per_token > free
    assert run([0], search_s_per_seq=2e-4, search_s_per_token=2e-7) == pytest.approx(run([0]), rel=1e-12)
    acc = _acceptance(0.5)
    prompt, response = np.full(8, 200), np.full(8, 800)
    steady = [
        steady_step(prof.model_copy(update={"speculation": Speculation(acceptance=a, budget=[4])}), prompt, response)
        for a in (acc, acc.model_copy(update={"search_s_per_token": 2e-7}))
    ]
    assert steady[1][0] == steady[0][0] and steady[1][1] > steady[0][1]  # as many running, each token dearer


def test_the_bench_times_vllms_ngram_search_per_token_and_a_history_proposal_per_sequence():
    pytest.importorskip("vllm")
    from rlhfless_openrlhf.tools.drafter_bench import search_cost

    rng = np.random.default_rng(0)
    groups = [
        (rng.integers(0, 50, 60).tolist(), [rng.integers(0, 50, 200).tolist() for _ in range(4)]) for _ in range(6)
    ]
    unit, cost = search_cost("ngram", groups, [])
    assert unit == "search_s_per_token" and 0 < cost < 1e-5
    unit, cost = search_cost("history", groups[3:], groups[:3])
    assert unit == "search_s_per_seq" and 0 < cost < 1.0


def test_accepted_drafts_shorten_a_long_tail_and_lower_the_bound(registry):
    """Few sequences running (the tail): verifying 8 drafted tokens costs little more than a plain step, so at a
    per-token acceptance of 0.7 the run is faster; no run beats the work bound at that acceptance."""
    work = synthetic_workload(SyntheticWorkload(16, 2, median_length=2000, max_length=8192, seed=3), 2)
    spec = Speculation(acceptance=_acceptance(0.7), budget=[8] * 32 + [0])
    plain = Simulator(PROFILE, Cluster.uniform(1, 4), registry=registry).run(registry.scheduler("openrlhf"), work)
    fast = Simulator(PROFILE.model_copy(update={"speculation": spec}), Cluster.uniform(1, 4), registry=registry).run(
        registry.scheduler("openrlhf"), work
    )
    assert sum(r.generation_s for r in fast.reports) < 0.8 * sum(r.generation_s for r in plain.reports)
    assert [r.samples for r in fast.reports] == [r.samples for r in plain.reports]
    bound = work_bound(work, PROFILE.model_copy(update={"speculation": spec}), work.algo).bound_s(4)
    assert bound < work_bound(work, PROFILE, work.algo).bound_s(4)
    assert bound <= sum(r.time_s for r in fast.reports)
    assert spec.tokens_per_step() == pytest.approx(spec.acceptance.tokens_per_step(8), rel=1e-6)


def test_a_scheduler_with_a_drafter_runs_at_the_acceptance_and_reports_both_bounds(registry):
    work = synthetic_workload(SyntheticWorkload(16, 2, median_length=1500, max_length=8192, seed=5), 3)
    config = registry.scheduler("rlhfless").derive(name="rlhfless.history", drafter="history")
    sim = Simulator(PROFILE, Cluster.uniform(1, 4), registry=registry, acceptance=_acceptance(0.6))
    res = sim.run(config, work)
    plain = sim.run(registry.scheduler("rlhfless"), work)
    tot = res.totals()
    assert res.drafter is not None and res.drafter["name"] == "history"
    assert 1.0 < res.drafter["tokens_per_step"] <= res.drafter["best_tokens_per_step"] * (1 + 1e-9)
    assert tot["bound_drafted_s"] < tot["bound_s"] <= plain.totals()["total_time_s"]
    assert tot["bound_drafted_s"] <= tot["total_time_s"] < plain.totals()["total_time_s"]
    assert plain.drafter is None and sim.profile.speculation is None  # the drafter was this run's only


@given(
    tokens=st.integers(1, 12),
    step_tokens=st.integers(1, 2048),
    running=st.integers(1, 1024),
    more=st.integers(0, 256),
)
def test_the_ngram_roofline_budget_stays_memory_bound_and_falls_with_concurrency(tokens, step_tokens, running, more):
    d = NgramDrafter(NgramParams(tokens=tokens, step_tokens=step_tokens))
    k = d.draft_tokens(running)
    assert 0 <= k <= tokens
    assert d.draft_tokens(running + more) <= k
    if k > 0:
        assert running * (k + 1) <= step_tokens  # a step verifies no more than step_tokens
    if running * (tokens + 1) <= step_tokens:
        assert k == tokens  # the whole budget wherever it fits
    assert NgramDrafter(NgramParams(tokens=tokens)).draft_tokens(running) == tokens  # no roofline: vLLM's fixed k


@given(tokens=st.integers(1, 8), step_tokens=st.integers(1, 1200), max_num_seqs=st.integers(1, 512))
def test_the_ngram_schedule_is_the_budget_at_every_batch_size_as_vllm_expands_it(tokens, step_tokens, max_num_seqs):
    """vLLM's own expansion of ``num_speculative_tokens_per_batch_size`` gives, for every batch size an engine can
    run, the draft tokens the simulator prices (``draft_tokens``)."""
    utils = pytest.importorskip("vllm.v1.spec_decode.dynamic.utils")
    d = NgramDrafter(NgramParams(tokens=tokens, step_tokens=step_tokens))
    config = d.engine_method()
    dense = utils.build_dynamic_sd_schedule_lookup(
        config["num_speculative_tokens_per_batch_size"], max_num_seqs, config["num_speculative_tokens"]
    )
    assert dense[1:] == [d.draft_tokens(b) for b in range(1, max_num_seqs + 1)]


def test_a_gpu_only_drafter_drafts_on_gpu_engines_and_nothing_on_cpu_ones(registry):
    """A drafter with ``gpu_only``: speculative decoding priced on a GPU profile (its roofline budget falling with
    the running count), none on a profile of CPU engines (the adapter builds CPU engines without it); the async form
    of a scheduler drafts with its drafter."""
    ref = {"name": "ngram", "params": {"step_tokens": 768, "gpu_only": True}}
    config = registry.scheduler("rlhfless").derive(name="rlhfless.ngram", drafter=ref)
    gpu = Simulator(PROFILE, Cluster.uniform(1, 4), registry=registry).speculation(config)
    assert gpu is not None and gpu.draft_tokens(1) == 4 and gpu.draft_tokens(256) == 2
    cpu_profile = PROFILE.model_copy(update={"device": "cpu"})
    assert Simulator(cpu_profile, Cluster.uniform(1, 4), registry=registry).speculation(config) is None
    anywhere = config.derive(drafter="ngram")  # not GPU-only: drafts on any engine
    assert Simulator(cpu_profile, Cluster.uniform(1, 4), registry=registry).speculation(anywhere) is not None
    assert config.launched(registry, True).name == "rlhfless-stream"
    assert config.launched(registry, True).policy("drafter") == config.policy("drafter")


def test_every_shipped_acceptance_loads_and_says_where_it_came_from():
    from rlhfless_sdk.api.profiles import _shipped

    names = sorted(_shipped("acceptance"))
    assert {"history", "ngram", "das-assumption"} <= set(names)
    for name in names:
        acc = load_acceptance(name)
        assert acc.source and (acc.assumption == name.endswith("assumption"))


def test_the_acceptance_needed_for_a_speedup_solves_the_geometric_sum():
    a = acceptance_tokens_needed(2.0, 8)
    assert sum(a**j for j in range(9)) == pytest.approx(2.0, rel=1e-6)
    assert acceptance_tokens_needed(1.0, 8) == 0.0 and acceptance_tokens_needed(20.0, 8) == 1.0


# -- the proposer inside vLLM's engines ------------------------------------------------------------------------
class Raising:
    description = "raises on propose (a broken plugin)"

    def __init__(self, params=None) -> None:
        pass

    def draft_tokens(self, running, remaining=None):
        return 3

    def propose(self, prompt, response, k, siblings=()):
        raise RuntimeError("broken drafter")

    def observe(self, prompt, responses):
        return None


class RaisingPlugin:
    @hookimpl
    def rlhfless_register_drafters(self, register):
        register(PolicySpec(name="raising", factory=Raising))


def _rows(prompt: list[int], responses: list[list[int]]):
    seqs = [prompt + r for r in responses]
    width = max(len(s) for s in seqs) + 4
    table = np.zeros((len(seqs), width), dtype=np.int32)
    for i, s in enumerate(seqs):
        table[i, : len(s)] = s
    return [[r[-1]] for r in responses], np.array([len(s) for s in seqs]), table


def test_the_engine_proposer_drafts_from_history_and_siblings(monkeypatch):
    pytest.importorskip("ray")
    from rlhfless_openrlhf import drafting

    monkeypatch.setenv(drafting.ENV, '{"name": "history", "params": {"step_tokens": 1000, "long_tokens": 1}}')
    prop = drafting.EngineProposer(SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=4)))
    prompt = [5, 6, 7, 8]
    prop.expect([prompt, [1, 1]])
    prop.observe([(prompt, [[20, 21, 22, 23, 24, 25]])])
    sampled, counts, table = _rows(prompt, [[20, 21], [30, 31, 32], [40, 30, 31]])
    drafts = prop.propose(sampled, counts, table)
    assert drafts[0] == [22, 23, 24, 25]  # the prompt's earlier response
    assert drafts[2] == [32]  # a sibling's tokens after the same two
    assert all(len(d) <= 4 for d in drafts)


def _proposer(monkeypatch, name: str = "suffix", k: int = 4):
    from rlhfless_openrlhf import drafting

    monkeypatch.setenv(drafting.ENV, f'{{"name": "{name}", "params": {{"step_tokens": 1000, "long_tokens": 1}}}}')
    return drafting.EngineProposer(SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k)))


def test_a_finished_siblings_tokens_stay_with_the_running_ones_until_the_group_is_observed(monkeypatch):
    """Step 1: two samples of a prompt run; step 2: the first has finished (its row is gone), and the second,
    after "50 51", is drafted what the finished one wrote after them. Once the group is observed the proposer
    holds no finished sibling of it."""
    pytest.importorskip("ray")
    prop = _proposer(monkeypatch)
    prompt = [5, 6, 7, 8]
    prop.expect([prompt])
    prop.propose(*_rows(prompt, [[50, 51, 60, 61, 62], [70]]))
    sampled, counts, table = _rows(prompt, [[70, 50, 51]])  # the first sample's row is gone: it finished
    assert prop.propose(sampled, counts, table) == [[60, 61]]  # a two-token match drafts two (spec_factor 1)
    prop.observe([(prompt, [[50, 51, 60, 61, 62], [70, 50, 51, 9]])])
    assert prop.siblings.finished(prop.prompts.find(table[0])[1]) == []


def test_a_sibling_finished_on_another_engine_is_drafted_from_until_the_group_is_observed(monkeypatch):
    """The stream splits a group across engines: a sample that finished elsewhere, sent to this engine's proposer
    (``finished_elsewhere``), is drafted from to the group's running sample here, counted, and dropped once the
    group is observed (it is history then, not held twice)."""
    pytest.importorskip("ray")
    prop = _proposer(monkeypatch)
    prompt = [5, 6, 7, 8]
    prop.expect([prompt])
    sampled, counts, table = _rows(prompt, [[70, 50, 51]])
    assert prop.propose(sampled, counts, table) == [[]]  # nothing to match yet
    prop.finished_elsewhere([(prompt, [[50, 51, 60, 61, 62]])])
    assert prop.stats["told"] == 1 and prop.finished_siblings(prompt) == [[50, 51, 60, 61, 62]]
    sampled, counts, table = _rows(prompt, [[70, 50, 51, 60]])
    assert prop.propose(sampled, counts, table) == [[61, 62]]
    prop.observe([(prompt, [[50, 51, 60, 61, 62]])])
    assert prop.finished_siblings(prompt) == [] and prop.siblings._held == 0


def test_finished_siblings_from_other_engines_are_bounded(monkeypatch):
    pytest.importorskip("ray")
    from rlhfless_openrlhf.drafting import SiblingMemory

    memory = SiblingMemory(max_tokens=100)
    for i in range(30):
        memory.add(bytes([i]), [np.arange(10)])
    assert memory._held <= 100 and memory.finished(bytes([29])) and not memory.finished(bytes([0]))


def test_a_carried_samples_earlier_tokens_are_its_response_and_its_siblings_match_it(monkeypatch):
    """Two samples of one prompt carried from an earlier step, each run with its tokens after the prompt and told
    so with the prompt's length: they are one group (not two prompts of their own), and one is drafted what the
    other's carried tokens hold."""
    pytest.importorskip("ray")
    prop = _proposer(monkeypatch)
    prompt = [5, 6, 7, 8]
    prop.expect([([*prompt, 40, 41, 42, 43, 44], len(prompt)), ([*prompt, 40], len(prompt))])
    drafts = prop.propose(*_rows(prompt, [[40, 41, 42, 43, 44, 45], [40, 41]]))
    assert drafts[1] == [42, 43, 44, 45]


def test_the_proposers_prompt_table_is_bounded(monkeypatch):
    pytest.importorskip("ray")
    from rlhfless_openrlhf.drafting import PromptTable

    table = PromptTable(max_tokens=100)
    for i in range(50):
        table.add([i] * 10)
    assert len(table) == 10 and table.find(np.array([49] * 12)) is not None and table.find(np.array([0] * 12)) is None


def test_a_drafter_that_raises_is_switched_off_with_a_warning_naming_it(registry_with, monkeypatch, caplog):
    pytest.importorskip("ray")
    from rlhfless_openrlhf import drafting

    reg = registry_with(raising=RaisingPlugin())
    monkeypatch.setattr(drafting, "_registry", lambda: reg)
    monkeypatch.setenv(drafting.ENV, '{"name": "raising"}')
    prop = drafting.EngineProposer(SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=3)))
    prompt = [5, 6, 7]
    prop.expect([prompt])
    sampled, counts, table = _rows(prompt, [[1, 2], [3, 4]])
    with caplog.at_level(logging.WARNING, logger="rlhfless.drafting"):
        assert prop.propose(sampled, counts, table) == [[], []]
    assert "'raising'" in caplog.text and "broken drafter" in caplog.text
    assert prop.failed and prop.propose(sampled, counts, table) == [[], []]  # off from here on


def test_speculative_config_names_vllms_method_or_the_proposer(monkeypatch):
    pytest.importorskip("ray")
    from rlhfless_openrlhf import drafting

    monkeypatch.delenv(drafting.ENV, raising=False)
    assert drafting.speculative_config("none") is None
    assert drafting.speculative_config("ngram")["method"] == "ngram"
    cfg = drafting.speculative_config("history")
    assert cfg == {"method": "custom_class", "model": drafting.PROPOSER, "num_speculative_tokens": 8}
    assert '"history"' in drafting.os.environ[drafting.ENV]


def test_a_drafter_that_raises_runs_as_none_in_the_simulator_with_a_warning_naming_it(registry_with):
    reg = registry_with(raising=RaisingBudget())
    work = synthetic_workload(SyntheticWorkload(8, 2, seed=1), 2)
    config = reg.scheduler("rlhfless").derive(name="rlhfless.raising", drafter="raising")
    sim = Simulator(PROFILE, Cluster.uniform(1, 2), registry=reg, acceptance=_acceptance(0.5), plan_s=0.0)
    with pytest.warns(UserWarning, match=r"drafter 'raising' raised.*drafter none"):
        res = sim.run(config, work)
    plain = sim.run(reg.scheduler("rlhfless"), work)
    assert res.drafter is None and res.totals()["total_time_s"] == plain.totals()["total_time_s"]


class _BudgetRaises(Raising):
    def draft_tokens(self, running, remaining=None):
        raise RuntimeError("no budget")


class RaisingBudget:
    @hookimpl
    def rlhfless_register_drafters(self, register):
        register(PolicySpec(name="raising", factory=_BudgetRaises))


def test_simulate_names_a_bad_drafter_or_acceptance_and_prints_where_it_drafts_and_both_bounds():
    from click.testing import CliRunner

    from rlhfless_sdk.cli.main import main as cli

    small = ["simulate", "--prompts", "8", "--samples", "2", "--steps", "2", "--gpus", "2", "--no-frontier"]
    res = CliRunner().invoke(cli, [*small, "--drafter", "histroy"])
    assert res.exit_code == 2 and "no drafter named 'histroy'" in res.output
    res = CliRunner().invoke(cli, [*small, "--drafter", "history", "--acceptance", "geometric:1.5"])
    assert res.exit_code == 2 and "geometric:A takes a per-token acceptance" in res.output
    res = CliRunner().invoke(
        cli, [*small, "--scheduler", "openrlhf", "--scheduler", "rlhfless", "--drafter", "history"]
    )
    assert res.exit_code == 0, res.output  # the acceptance measured on a CPU is priced to lose on a GPU's engines
    assert "rlhfless.history: drafter history is priced to lose at every running count on these engines" in res.output
    res = CliRunner().invoke(
        cli, [*small, "--scheduler", "rlhfless", "--drafter", "history", "--acceptance", "das-assumption"]
    )
    assert res.exit_code == 0, res.output
    assert "rlhfless.history: drafter history drafting at 1-" in res.output and "ASSUMED acceptance" in res.output
    assert "plain decoding" in res.output


def test_a_preset_that_carries_its_tail_is_judged_on_the_steps_it_cuts_and_carries_into():
    """``rlhfless-fast`` cuts a step's tail and carries it into the next. On the 16k long-reasoning workload of
    docs/results.md at the measured ``suffix`` acceptance, its first step run alone (to its end) gains with the
    drafter, while the step it cuts and the one it carries into lose: the simulator judges the first two steps, so
    the drafter is dropped and the preset is never slower with ``--drafter suffix``."""
    import json

    from click.testing import CliRunner

    from rlhfless_sdk.cli.main import main as cli

    shape = ["--prompts", "512", "--samples", "8", "--median-length", "1500", "--sample-sigma", "0.5", "--runaway",
             "0.03", "--max-length", "16384", "--gpus", "16", "--memory", "dedicated", "--no-frontier"]  # fmt: skip

    def run(steps: int) -> list[dict]:
        args = ["simulate", *shape, "--steps", str(steps), "--scheduler", "rlhfless-fast", "--drafter", "suffix"]
        res = CliRunner().invoke(cli, [*args, "--json"])
        assert res.exit_code == 0, res.output
        return json.loads(res.output)["schedulers"]

    plain, drafted = run(2)
    assert drafted["name"] == "rlhfless-fast.suffix" and drafted["drafter"]["drafts_at"] is None
    assert drafted["total_time_s"] <= plain["total_time_s"] * 1.001  # up to the measured planning time charged
    alone = run(1)[1]["drafter"]
    assert alone["drafts_at"] is not None  # one step run to its end: the drafter gains there


def test_an_acceptance_priced_by_position_charges_each_sequence_where_it_is(registry):
    """Slices that repeat the overall acceptance price a run as the overall one does; an acceptance that holds only
    in a response's last quarter gains less than one that holds everywhere, and more than none."""
    from rlhfless_sdk.api.speculation import PositionAcceptance

    work = synthetic_workload(SyntheticWorkload(24, 4, median_length=600, max_length=2048, seed=4), 1)
    high, none = _acceptance(0.7), Acceptance(drafter="t", source="t", draft_rate=0.0, accepted_at=[0.0] * 8,
                                              drafted_per_draft=0.0)  # fmt: skip

    def sliced(*parts: Acceptance) -> Acceptance:
        pieces = [
            PositionAcceptance(upto=u, **a.model_dump(include={"draft_rate", "accepted_at", "drafted_per_draft"}))
            for u, a in zip((0.25, 0.75, 1.0), parts, strict=True)
        ]
        return high.model_copy(update={"by_position": pieces})

    def run(acc: Acceptance) -> float:
        prof = PROFILE.model_copy(update={"speculation": Speculation(acceptance=acc, budget=[4])})
        sim = Simulator(prof, Cluster.uniform(1, 2), registry=registry, plan_s=0.0)
        return sum(r.generation_s for r in sim.run(registry.scheduler("openrlhf"), work).reports)

    overall, same = run(high), run(sliced(high, high, high))
    assert same == pytest.approx(overall, rel=1e-9)
    assert run(sliced(none, none, none)) > run(sliced(none, none, high)) > overall


def test_a_drafter_whose_step_loses_to_plain_engines_is_dropped_whatever_its_tail_gain(registry):
    """At a low acceptance a drafter's price per running count can gain where few sequences run while the lost
    async scheduling costs every step more: the simulator runs the workload's first step with and without it and
    runs plain engines where drafting loses there; where a long tail gains it keeps the budget."""
    from rlhfless_sdk.planning.engine_model import priced_budget, steady_context

    config = registry.scheduler("rlhfless").derive(name="rlhfless.history", drafter="history")
    low = Acceptance(drafter="t", source="t", draft_rate=1.0, accepted_at=geometric(0.1, 8), drafted_per_draft=8)
    full = synthetic_workload(SyntheticWorkload(512, 8, median_length=600, max_length=1024, seed=4), 1)  # no tail
    tail = synthetic_workload(SyntheticWorkload(64, 8, median_length=600, max_length=4096, seed=4), 1)
    sim = Simulator(PROFILE, Cluster.uniform(1, 4), registry=registry, acceptance=low)
    own = sim.speculation(config)  # the drafter's own budget, unpriced
    first = full.steps[0]
    context = steady_context(np.repeat(first.batch.prompt_lengths, first.batch.n_samples), first.lengths)
    assert max(priced_budget(PROFILE.model_copy(update={"speculation": own}), context)) > 0  # gains at low counts
    assert max(sim.speculation(config, full).budget) == 0  # but the step, mostly a full batch, loses
    assert max(sim.speculation(config, tail).budget) > 0  # a long tail's step gains
