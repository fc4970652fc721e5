"""Scoring in the generation tail (``pipeline: {mode: sync, tail_prepare: true}``, simulator only): the fluid model
against an independent formula, its billing, and the on-policy preset that uses it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfless_sdk.api.config import PipelineConfig
from rlhfless_sdk.api.plugins import get_plugin_manager
from rlhfless_sdk.api.profiles import load_profile
from rlhfless_sdk.api.records import Cluster
from rlhfless_sdk.simulation.simulator import Simulator
from rlhfless_sdk.simulation.tail_prepare import (
    gradient_reduce_s,
    group_gpus,
    in_groups,
    learning_switch_s,
    score_in_tail,
    scoring_switch_s,
)
from rlhfless_sdk.workloads.synthetic import SyntheticWorkload
from rlhfless_sdk.workloads.traces import synthetic_workload

times = st.floats(0.0, 100.0, allow_nan=False)
#: long reasoning at a test's scale: 64 prompts of 8 samples, median 1,500 tokens, 3% running away to the 8,192 cap
LONG_REASONING = SyntheticWorkload(num_prompts=64, median_length=1500, sample_sigma=0.5, max_length=8192, runaway=0.03)


def processed(free, ready, end, switch):
    """Work a pool of GPUs joining at ``free + switch`` does on work arriving at ``ready`` by ``end``, from the
    fluid queue's formula: what arrived before ``end`` less the largest backlog, sup over s of the work arrived
    from s on less the capacity from s on."""
    joins = [f + switch for f in free if f + switch < end]
    arrivals = [(c, w) for c, w in ready if c < end]

    def capacity(a, b):  # GPU-seconds the pool offers in [a, b]
        return sum(max(0.0, b - max(j, a)) for j in joins if j < b)

    total = sum(w for _, w in arrivals)
    backlog = 0.0
    for s in [0.0, *(c for c, _ in arrivals)]:
        backlog = max(backlog, sum(w for c, w in arrivals if c >= s) - capacity(s, end))
    return total - backlog


@settings(deadline=None, max_examples=300)
@given(
    free=st.lists(times, min_size=1, max_size=12),
    ready=st.lists(st.tuples(times, st.floats(0.0, 50.0, allow_nan=False)), min_size=0, max_size=20),
    end=st.floats(1.0, 120.0, allow_nan=False),
    switch=st.floats(0.0, 30.0, allow_nan=False),
)
def test_scoring_in_the_tail_does_what_the_fluid_queue_allows_and_leaves_the_rest(free, ready, end, switch):
    got = score_in_tail(free, ready, end, switch)
    total = sum(w for _, w in ready)
    assert got.done_gpu_s == pytest.approx(processed(free, ready, end, switch), rel=1e-6, abs=1e-6)
    assert got.left_gpu_s == pytest.approx(total - got.done_gpu_s, abs=1e-6)
    assert 0.0 <= got.done_gpu_s <= total + 1e-9
    # a GPU that switched is billed from its engine's last token to the end of generation: at least its scoring
    assert got.held_gpu_s + 1e-9 >= got.done_gpu_s + got.scorers * switch
    assert got.scorers == sum(f + switch < end for f in free)


def test_a_switch_that_never_pays_scores_nothing_in_the_tail():
    got = score_in_tail([10.0, 20.0], [(5.0, 100.0)], end_s=30.0, switch_s=25.0)
    assert got.done_gpu_s == 0.0 and got.left_gpu_s == 100.0 and got.scorers == 0 and got.held_gpu_s == 0.0


def test_the_switch_is_the_weights_out_and_in_over_the_host_link():
    profile = load_profile("qwen2.5-7b-l40s")  # 15.22 GB of weights, 25 GB/s host link, 5 s fixed
    assert scoring_switch_s(profile) == pytest.approx(2 * 15.25 / 25 + 5.0, rel=1e-2)


def test_tail_prepare_is_a_sync_option():
    assert PipelineConfig(tail_prepare=True).tail_prepare
    with pytest.raises(ValueError, match="tail_prepare applies to mode: sync only"):
        PipelineConfig(mode="stream", max_age=2, tail_prepare=True)


@pytest.mark.parametrize("memory", ["dedicated", "colocated"])
def test_scoring_in_the_tail_shortens_a_step_without_stale_tokens_and_bills_its_gpus(memory):
    """The same steps with and without ``tail_prepare``: generation and learning unchanged, the scoring left after
    generation shorter, the scorers billed, no stale token."""
    registry = get_plugin_manager().registry
    profile = load_profile("qwen2.5-7b-l40s")
    work = synthetic_workload(LONG_REASONING, steps=2)
    base = registry.scheduler("rlhfless-onpolicy")
    runs = {}
    for tail in (False, True):
        config = base.derive(
            name=f"tail-{str(tail).lower()}", pipeline={"mode": "sync", "tail_prepare": tail}, burst=1.0
        )
        sim = Simulator(profile, Cluster.of_gpus(8, 8), registry=registry, memory=memory, plan_s=0.0)
        runs[tail] = sim.run(config, work)
    for a, b in zip(runs[False].steps, runs[True].steps, strict=True):
        ra, rb = a.report, b.report
        assert rb.generation_s == pytest.approx(ra.generation_s) and rb.learn_s == pytest.approx(ra.learn_s)
        assert rb.prepare_s <= ra.prepare_s + 1e-9 and rb.time_s <= ra.time_s + 1e-9
        assert rb.stale_token_fraction == 0.0 and rb.max_token_age_steps == 0
    assert sum(s.report.prepare_s for s in runs[True].steps) < sum(s.report.prepare_s for s in runs[False].steps)


# -- learning in the tail (``tail_learn``) -----------------------------------------------------------------------
@given(free=st.lists(times, min_size=0, max_size=20), size=st.integers(1, 5))
def test_gradient_groups_form_in_the_order_gpus_free_and_never_before_their_last_member(free, size):
    never = 1e9
    got = in_groups(free, size, never)
    joined = [i for i, t in enumerate(got) if t < never]
    assert len(joined) == (len(free) // size) * size  # whole groups only; the rest learn after generation
    assert all(got[i] >= free[i] for i in joined)  # a GPU never starts before it is free
    times_of = sorted({got[i] for i in joined})
    for t in times_of:  # each formation time is one whole group (or several forming at once)
        members = [i for i in joined if got[i] == t]
        assert len(members) % size == 0 and max(free[i] for i in members) == t
    if joined and len(joined) < len(free):  # the GPUs left out are the last to free
        assert max(free[i] for i in joined) <= min(free[i] for i, t in enumerate(got) if t >= never)


def test_a_gradient_group_is_the_fewest_gpus_that_hold_its_models():
    """L40S, Qwen2.5-7B (15.2 GB of bf16 weights; 48 GB a GPU, from the profile's KV derivation): GRPO's group
    holds the policy with fp32 gradients and the reference, 4 x 15.2 = 61 GB, in 0.9 x 48 - 2 = 41.2 GB a GPU: 2
    GPUs; PPO's adds the critic and the reward model, 122 GB: 3 GPUs."""
    profile = load_profile("qwen2.5-7b-l40s")
    assert group_gpus(profile, "grpo") == 2 and group_gpus(profile, "ppo") == 3
    assert learning_switch_s(profile, "grpo", 2) == pytest.approx(scoring_switch_s(profile) + 61.0 / 2 / 25, rel=1e-2)
    assert gradient_reduce_s(profile) == pytest.approx(2 * 15.22 / 12.5)


def test_tail_learn_extends_tail_prepare():
    assert PipelineConfig(tail_prepare=True, tail_learn=True, updates_per_batch=2).tail_learn
    with pytest.raises(ValueError, match="tail_learn extends tail_prepare"):
        PipelineConfig(tail_learn=True)
    with pytest.raises(ValueError, match="updates_per_batch bounds what tail_learn moves"):
        PipelineConfig(tail_prepare=True, updates_per_batch=2)


def test_learning_in_the_tail_of_a_consolidated_step_is_on_policy_and_bills_its_gpus():
    """The same long-reasoning steps under the shipped preset and under it without learning in the tail (same
    consolidation): generation unchanged, less scoring and learning after it, every token on-policy; the gradient
    reduce is charged; the GPUs held in the tail are billed. With two optimizer steps a batch, at most half the
    learning moves into the tail."""
    registry = get_plugin_manager().registry
    profile = load_profile("qwen2.5-7b-l40s")
    work = synthetic_workload(LONG_REASONING, steps=2)
    tail = registry.scheduler("research-onpolicy-tail")
    runs = {}
    for k in (0, 1, 2):  # no tail work; one optimizer step a batch; two
        pipeline = {"tail_prepare": k > 0, "tail_learn": k > 0, "updates_per_batch": max(k, 1)}
        sim = Simulator(profile, Cluster.of_gpus(8, 8), registry=registry, algo="grpo", plan_s=0.0)
        runs[k] = sim.run(tail.derive(name=f"tail-{k}", pipeline=pipeline), work)
    for a, b in zip(runs[0].steps, runs[2].steps, strict=True):  # the second step's learning waits for the first's
        assert b.report.learn_s >= a.report.learn_s / 2 and b.report.generation_s == a.report.generation_s
    learned = False
    for a, b in zip(runs[0].steps, runs[1].steps, strict=True):
        ra, rb = a.report, b.report
        assert rb.generation_s == pytest.approx(ra.generation_s)
        assert ra.migrations > 0 and rb.migrations == ra.migrations  # the tail was consolidated in both
        after_a, after_b = ra.prepare_s + ra.learn_s, rb.prepare_s + rb.learn_s
        done = b.usage.extra["tail_scored_gpu_s"]
        if done > 0:
            learned = True
            assert after_b == pytest.approx(after_a - done / 8 + gradient_reduce_s(profile), rel=1e-6)
            assert b.usage.tail_scoring_gpu_s >= done
        assert rb.stale_token_fraction == 0.0 and rb.max_token_age_steps == 0
    assert learned


def test_a_tail_too_short_to_consolidate_is_left_alone_and_frees_no_gpu_to_learn():
    """n=4 synthetic steps: no sample may still decode ``min_tail_tokens`` when a fifth are left, so nothing moves
    and no GPU joins the tail: the step is billed exactly as without tail work. On long reasoning the GPUs that
    learn in the tail were freed by the consolidation or after it, never before it (they were released)."""
    registry = get_plugin_manager().registry
    profile = load_profile("qwen2.5-7b-l40s")
    tail = registry.scheduler("research-onpolicy-tail")
    plain = tail.derive(name="no-tail-work", pipeline={"tail_prepare": False, "tail_learn": False})
    short = synthetic_workload(SyntheticWorkload(num_prompts=64, n_samples=4), steps=2)
    reports = {}
    for config in (tail, plain):
        sim = Simulator(profile, Cluster.of_gpus(8, 8), registry=registry, algo="grpo", plan_s=0.0)
        reports[config.name] = [s.report for s in sim.run(config, short).steps]
    for a, b in zip(reports[tail.name], reports[plain.name], strict=True):
        assert a.migrations == 0
        assert (a.time_s, a.gpu_seconds, a.prepare_s, a.learn_s) == (
            b.time_s,
            b.gpu_seconds,
            b.prepare_s,
            b.learn_s,
        )
    sim = Simulator(profile, Cluster.of_gpus(8, 8), registry=registry, algo="grpo")
    for step in sim.run(tail, synthetic_workload(LONG_REASONING, steps=2)).steps:
        extra = step.usage.extra
        joined = [
            i for i, e in enumerate(step.usage.engines) if i in extra["cut_engines"] or e.last_s >= extra["first_cut_s"]
        ]
        assert step.report.migrations > 0 and extra["tail_scorers"] <= len(joined) * step.usage.gpus_per_engine
