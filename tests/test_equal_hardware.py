"""Comparisons on equal hardware: every scheduler, every step, any workload (hypothesis).

- serverless billing never exceeds serverful billing;
- a step never takes less time than its generation;
- without burst a run never holds more GPUs than the fleet; with burst, at most the fleet plus its burst engines,
  and every burst engine is billed for as long as it is held (serverful = the fleet's time + burst held);
- no run beats the work bound (the GPU work of the workload over its peak GPUs).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfless_sdk.api.profiles import load_profile
from rlhfless_sdk.api.records import Cluster
from rlhfless_sdk.rollout.billing import held, held_s
from rlhfless_sdk.simulation.bound import decode_engine_s, work_bound
from rlhfless_sdk.simulation.simulator import Simulator, equal_peak
from rlhfless_sdk.workloads.synthetic import SyntheticWorkload
from rlhfless_sdk.workloads.traces import synthetic_workload

SCHEDULERS = [
    "openrlhf",
    "verl",
    "openrlhf-async",
    "openrlhf-async-partial",
    "rlhfless",
    "rlhfless-paper",
    "rlhfless-fast",
    "rlhfless-onpolicy",
]


def _workload(prompts: int, n: int, seed: int, steps: int, runaway: float):
    shape = SyntheticWorkload(prompts, n, seed=seed, median_length=80, max_length=400, runaway=runaway)
    return synthetic_workload(shape, steps)


def _check_steps(res, gpus: int, burst: bool) -> None:
    for s in res.steps:
        r = s.report
        assert r.gpu_seconds <= r.gpu_seconds_serverful * (1 + 1e-9), r
        assert r.time_s >= r.generation_s * (1 - 1e-9), r
        if not burst:
            assert r.peak_gpus == gpus
        usage = s.usage if s.usage is not None else s.outcome.usage
        bursts = [e for e in usage.engines if e.burst]
        assert r.peak_gpus == gpus + sum(1 for e in bursts if held(e))
        for e in bursts:
            if held(e):
                assert held_s(e, r.time_s) > 0  # billed whenever held
        extra = sum(held_s(e, r.time_s) for e in bursts)
        if res.rollout_gpus is None:  # synchronous: the fleet for the whole step, burst engines as held
            assert r.gpu_seconds_serverful == pytest.approx(gpus * r.time_s + extra)


@settings(max_examples=16, deadline=None)
@given(
    name=st.sampled_from(SCHEDULERS),
    prompts=st.integers(2, 16),
    n=st.integers(1, 4),
    seed=st.integers(0, 10_000),
    steps=st.integers(1, 4),
    runaway=st.sampled_from([0.0, 0.1]),
    memory=st.sampled_from(["colocated", "dedicated"]),
    tp=st.sampled_from([1, 2]),
)
def test_every_step_bills_within_its_hardware_and_no_run_beats_the_work_bound(
    registry_with, name, prompts, n, seed, steps, runaway, memory, tp
):
    """... on one-GPU engines or tensor-parallel ones (``tp``): the bound is on one-GPU engines either way."""
    registry = registry_with()
    # no learner block: a 4-GPU fleet cannot hold a 7B learner's state beside an engine (tests/test_stream.py)
    prof = load_profile("qwen2.5-7b-l40s").model_copy(update={"colocated_kv_capacity_tokens": 3000, "learner": None})
    gpus = 4
    sim = Simulator(
        prof.sharded(tp),
        Cluster.uniform(1, gpus),
        registry=registry,
        memory=memory,
        split_probe_steps=2,
        bound_profile=prof,
    )
    config = equal_peak(registry.resolve(name), gpus // tp)  # the fleet's engines
    work = _workload(prompts, n, seed, steps, runaway)
    res = sim.run(config, work)
    _check_steps(res, gpus, burst=False)
    tot = res.totals()
    assert tot["peak_gpus"] == gpus
    assert tot["total_time_s"] >= tot["bound_s"] * (1 - 1e-9)
    assert 0 < tot["bound_fraction"] <= 1 + 1e-9


@settings(max_examples=10, deadline=None)
@given(
    extra=st.integers(1, 4),
    prompts=st.integers(4, 24),
    seed=st.integers(0, 10_000),
    cold=st.sampled_from([0.5, 60.0, 900.0]),
)
def test_burst_engines_are_billed_whenever_held(registry_with, extra, prompts, seed, cold):
    registry = registry_with()
    prof = load_profile("qwen2.5-7b-l40s").model_copy(update={"cold_start_s": cold})
    gpus = 4
    sim = Simulator(prof, Cluster.uniform(1, gpus), registry=registry)
    config = registry.scheduler("openrlhf").derive(
        name="burst", scaler={"name": "fixed", "params": {"num_actors": gpus + extra}}, burst=2.0
    )
    res = sim.run(config, _workload(prompts, 4, seed, 3, 0.0))
    _check_steps(res, gpus, burst=True)
    assert gpus <= res.totals()["peak_gpus"] <= gpus + extra  # a burst engine no prompt reached is not held


def test_the_bound_is_the_decode_roofline_at_full_batches():
    """One engine, 256 samples of 100 tokens after 10-token prompts: 100 full decode steps at most."""
    prof = load_profile("qwen2.5-7b-l40s")
    prompt = [10] * 256
    length = [100] * 256
    ctx = 256 * (10 * 100 + 100 * 99 / 2)
    o, w = prof.decode_overhead_s, prof.decode_base_s - prof.decode_overhead_s
    want = 100 * o + max(100 * w + prof.decode_per_ctx_token_s * ctx, prof.decode_per_seq_s * 25600)
    assert decode_engine_s(prof, prompt, length) == pytest.approx(want)
    # KV-bound: a capacity of 2,000 tokens admits far fewer sequences a step, so more steps
    small = prof.model_copy(update={"kv_capacity_tokens": 2000})
    assert decode_engine_s(small, prompt, length) > decode_engine_s(prof, prompt, length)


def test_work_bound_counts_every_trained_token_and_each_prompt_prefix_once():
    prof = load_profile("qwen2.5-7b-l40s")
    work = _workload(8, 4, 3, 2, 0.0)
    bound = work_bound(work, prof, "grpo")
    prepare, learn = prof.learner_rates("grpo")
    tokens = sum(float(ws.batch.prompt_lengths @ ws.batch.n_samples + ws.lengths.sum()) for ws in work.steps)
    assert bound.learn_gpu_s == pytest.approx(tokens * (prepare + learn))
    # shared templates make the prefix tree smaller than the prompts, never larger
    prompts = sum(int(ws.batch.prompt_lengths.sum()) for ws in work.steps)
    assert 0 < bound.prefill_gpu_s < prompts * prof.prefill_per_new_token_s
    assert bound.bound_s(8) == pytest.approx(bound.gpu_s / 8)
