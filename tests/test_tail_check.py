"""Tail batching where the predicted tail pays (``rlhfless_sdk.planning.tail_check``, the ``margin`` of the
``tail-batch`` straggler policy): the estimate's arithmetic, its verdicts on the two shapes it separates, and a
round-by-round run in which every prompt still trains exactly once."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfless_sdk.api.plugins import get_plugin_manager
from rlhfless_sdk.api.profiles import load_profile
from rlhfless_sdk.api.records import Cluster
from rlhfless_sdk.planning.tail_check import TailEstimate, estimate_tail
from rlhfless_sdk.rollout.tail import TailRounds
from rlhfless_sdk.simulation.simulator import Simulator
from rlhfless_sdk.workloads.synthetic import SyntheticWorkload
from rlhfless_sdk.workloads.traces import synthetic_workload

PROFILE = load_profile("qwen2.5-7b-l40s")


@settings(max_examples=200, deadline=None)
@given(
    st.floats(1.0, 1e4),
    st.floats(1.0, 1e4),
    st.floats(0.0, 1e4),
    st.integers(1, 64),
    st.integers(0, 64),
    st.floats(0.0, 0.5),
)
def test_the_cost_per_trained_group_weighs_the_long_rounds_by_how_often_they_come(
    plain, short, long, train, deferred, margin
):
    est = TailEstimate(plain, short, long, train, deferred)
    assert est.per_group_plain == pytest.approx(plain / train)
    if deferred:
        k = train / deferred  # a long round of B deferred groups every k short rounds
        assert est.per_group_tail == pytest.approx((k * short + long) / ((k + 1) * train))
    assert est.pays(margin) == (est.per_group_tail <= (1 - margin) * est.per_group_plain)


def _groups(rng: np.random.Generator, n: int, size: int, tail_every: int, cap: int) -> list[np.ndarray]:
    out = []
    for g in range(n):
        lengths = rng.integers(200, 400, size)
        if tail_every and g % tail_every == 0:
            lengths[0] = cap  # one sample runs to the cap
        out.append(lengths)
    return out


def test_the_check_batches_a_rare_tail_and_leaves_a_common_one_to_plain_steps():
    """A few groups holding the tail: deferring them pays. Equal groups: aborting only wastes tokens."""
    rng = np.random.default_rng(0)
    rare = _groups(rng, 48, 4, 16, 4000)  # 3 of 48 groups: fewer than the 16 a round defers
    est = estimate_tail(PROFILE, rare, [100] * 48, 32, 2)
    assert est.deferred == 16 and est.short_s < est.plain_s and est.pays(0.0)
    even = [np.full(4, 300) for _ in range(48)]
    assert not estimate_tail(PROFILE, even, [100] * 48, 32, 2).pays(0.0)


def test_a_round_cannot_train_more_groups_than_it_starts():
    with pytest.raises(ValueError, match="cannot train"):
        estimate_tail(PROFILE, [np.array([10])], [10], 2, 1)


def test_short_candidates_draws_without_starting_anything():
    rounds = TailRounds(4, range(20))
    assert rounds.short_candidates(0.5) == [0, 1, 2, 3, 4, 5]
    assert rounds.next(0.0).prompts == [0, 1, 2, 3]  # a plain round: the first B of them
    rounds.settle([0, 1, 2, 3])
    assert rounds.short_candidates(0.5) == [4, 5, 6, 7, 8, 9]
    rounds.deferred.extend([90, 91, 92, 93])
    assert rounds.short_candidates(0.5) is None  # a long round is due


def test_rlhfless_trains_every_prompt_once_whichever_rounds_it_picks():
    """The preset on a simulated run: each round is a tail round or OpenRLHF's plain step, as its check decides;
    every prompt of the workload trains exactly once, and no token from older weights trains."""
    registry = get_plugin_manager().registry
    shape = SyntheticWorkload(32, 4, median_length=300, max_length=2048, runaway=0.02, seed=3)
    workload = synthetic_workload(shape, 6)
    sim = Simulator(PROFILE, Cluster.of_gpus(4, 4), registry=registry)
    result = sim.run(registry.scheduler("rlhfless"), workload)
    assert sum(r.groups_trained for r in result.reports) == sum(len(ws.batch) for ws in workload.steps)
    assert max(r.max_token_age_steps for r in result.reports) == 0


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 16), st.integers(0, 80), st.integers(0, 20), st.floats(0.0, 1.5))
def test_tail_batching_begins_only_where_its_whole_cycle_fits_in_the_stream(b, stream, deferred, over):
    """``cycle_candidates``: the next short round's prompts exactly when the stream still holds the fresh prompts of
    every short round until a long round is due; it starts nothing and loses no prompt either way."""
    rounds = TailRounds(b, range(stream), deferred=range(1000, 1000 + deferred))
    got = rounds.cycle_candidates(over)
    start = max(int(np.ceil((1.0 + over) * b)), b)
    per_round = start - b
    fits = per_round > 0 and deferred < b and stream >= -(-(b - deferred) // per_round) * start
    assert (got is not None) == fits
    if got is not None:
        assert got == list(range(start))
    assert rounds.waiting() == [*range(1000, 1000 + deferred), *range(len(rounds.fresh))]  # drawn, not started
    drawn = list(rounds.fresh)
    rest = []
    while not rounds.done():  # every prompt still trains exactly once, whatever was drawn ahead
        r = rounds.next(0.0)
        rounds.settle(r.prompts[: r.train])
        rest += r.prompts[: r.train]
    assert sorted(rest) == sorted([*range(stream), *range(1000, 1000 + deferred)])
    assert drawn == list(range(len(drawn)))


def test_a_run_too_short_for_a_cycle_is_openrlhfs_step_on_every_round():
    """Three rounds of B prompts leave no room for a short round, another and the long round its deferred groups
    need: `rlhfless` runs OpenRLHF's plain step on each, and takes exactly its time (its check never begins a
    cycle whose deferred groups would drain unamortized at the run's end, as they did on one real CPU engine)."""
    registry = get_plugin_manager().registry
    shape = SyntheticWorkload(12, 4, median_length=120, max_length=256, runaway=0.05, seed=1)
    workload = synthetic_workload(shape, 3)
    sim = Simulator(PROFILE, Cluster.of_gpus(1, 1), registry=registry)
    ours = sim.run(registry.scheduler("rlhfless"), workload)
    theirs = sim.run(registry.scheduler("openrlhf"), workload)
    assert [r.deferred_prompts for r in ours.reports] == [0, 0, 0]
    assert [r.groups_trained for r in ours.reports] == [12, 12, 12]
    # its time and OpenRLHF's differ by what each spent planning (charged to the steps: the tail check is ours)
    plan = sum(r.planner_ms for r in ours.reports) / 1000 - sum(r.planner_ms for r in theirs.reports) / 1000
    assert sum(r.generation_s for r in ours.reports) == pytest.approx(
        sum(r.generation_s for r in theirs.reports) + plan, abs=1e-9
    )


def test_with_a_balancing_migrator_a_round_run_to_its_end_lasts_its_mean_engines_work():
    """``balanced`` (the share of the tail's imbalance a migrator evens out, ``balance``): at 1 the plain step and
    the long round last the mean engine's work, or the longest sample's own decode steps where those are longer;
    at a share in between, that share of the way from round robin's slowest engine; never longer than it. The short
    round, cut at its B-th group, is the same either way."""
    from rlhfless_sdk.planning.tail_check import _run

    rng = np.random.default_rng(2)
    groups = _groups(rng, 48, 4, 6, 4000)
    raw = estimate_tail(PROFILE, groups, [100] * 48, 32, 4)
    bal = estimate_tail(PROFILE, groups, [100] * 48, 32, 4, balanced=1.0)
    half = estimate_tail(PROFILE, groups, [100] * 48, 32, 4, balanced=0.5)
    assert (bal.short_s, bal.deferred) == (raw.short_s, raw.deferred) == (half.short_s, half.deferred)
    _, engines = _run(PROFILE, 4, groups[:32], [100] * 32)
    mean_work = float(np.mean([e.busy for e in engines]))
    assert bal.plain_s == pytest.approx(max(mean_work, 4000 * PROFILE.decode_base_s))
    assert bal.plain_s < raw.plain_s and bal.long_s <= raw.long_s
    assert half.plain_s == pytest.approx((raw.plain_s + bal.plain_s) / 2)
    one = [np.array([4000])]  # one sample on one engine: its own decode steps are the floor
    assert estimate_tail(PROFILE, one, [100], 1, 1, balanced=1.0).plain_s >= 4000 * PROFILE.decode_base_s


def test_the_balance_migrator_evens_out_only_what_may_still_move():
    """``balance`` moves a sample only while it may decode ``min_left`` more tokens: under a cap at or below that
    it evens out nothing, and above it the share of a sample's decode before its last ``min_left`` tokens."""
    from rlhfless_policies.migrators import BalanceMigrator, BalanceParams

    m = BalanceMigrator(BalanceParams(min_left=2000))
    assert m.balanced_share(0) == m.balanced_share(1024) == m.balanced_share(2000) == 0.0
    assert m.balanced_share(8192) == pytest.approx(1 - 2000 / 8192)
    assert 0 < m.balanced_share(4096) < m.balanced_share(16384) < 1


@pytest.mark.parametrize("scheduler", ["rlhfless", "rlhfless-onpolicy"])
@pytest.mark.parametrize("cap", [0, 1024, 8192])
def test_the_planners_check_is_balanced_as_far_as_its_migrator_evens_out_the_tail(scheduler, cap):
    """``rlhfless`` spreads the tail by KV (``balance``), so its check prices the rounds that run to their end as
    balanced as ``balanced_share`` says for the run's length cap (none before a step has shown one);
    ``rlhfless-onpolicy`` migrates nothing, so its check prices round robin's."""
    from rlhfless_sdk.planning.engine_model import LengthSpread

    registry = get_plugin_manager().registry
    sim = Simulator(PROFILE, Cluster.of_gpus(4, 4), registry=registry)
    planner = sim.planner(registry.scheduler(scheduler))
    planner.spread = LengthSpread(cap=cap) if cap else None
    batch, _ = SyntheticWorkload(48, 4, median_length=300, max_length=4096, runaway=0.05, seed=2).batch()
    lengths = planner.check_model.lengths(batch, planner.predict(batch, []), planner.spread or LengthSpread())
    groups = [lengths[a:b] for a, b in zip(batch.sample_offsets[:-1], batch.sample_offsets[1:], strict=True)]
    engines = planner.actor_range([])[1]  # the fleet, and burst engines where the preset allows them
    share = planner.policies["migrator"].balanced_share(cap) if scheduler == "rlhfless" and cap else 0.0
    assert (share > 0) == (scheduler == "rlhfless" and cap == 8192)
    expected = estimate_tail(PROFILE, groups, batch.prompt_lengths.tolist(), 32, engines, balanced=share)
    assert planner.tail_check(batch, 32, []) == expected
