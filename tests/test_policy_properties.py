"""Property-based tests of every policy invariant (hypothesis), for every registered policy of each kind."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import rlhfless_test_helpers as H  # registered by conftest.py
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from rlhfless_policies.scalers import first_meeting

from rlhfless_sdk import CandidateSearch, PluginManager
from rlhfless_sdk.api.batch import PromptBatch
from rlhfless_sdk.api.profiles import load_profile
from rlhfless_sdk.api.records import Actor, CandidateEstimate, FinishedSample
from rlhfless_sdk.planning.costmodel import AnalyticCostModel
from rlhfless_sdk.planning.planner import (
    MigrationController,
    StepPlanner,
    check_assignment,
    check_placement,
    planner_for,
)
from rlhfless_sdk.workloads.synthetic import SyntheticWorkload, finished_samples

S = H.sibling("strategies")

REG = PluginManager().registry
#: Reference assigners documented to split a prompt's group across actors (the controller regroups it).
SPLITS_GROUPS = {"chunks", "work", "work-pull"}  # work-pull assigns as work does (the estimate)
PROFILE = load_profile("qwen2.5-7b-l40s")


def policies(kind):
    return [n for n in REG.names(kind) if not (kind == "predictor" and n == "oracle")]


# -- predictors --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", REG.names("predictor"))
@given(batch=S.prompt_batches(), history=st.lists(st.integers(0, 5000), max_size=60))
def test_predictions_finite_nonnegative(name, batch, history):
    pred = REG.create("predictor", name)
    if len(batch):  # an earlier step's samples for some of the prompts
        pred.observe(
            [
                FinishedSample(uid=batch.uids[i % len(batch)], sample_index=0, prompt_length=1, response_length=h)
                for i, h in enumerate(history)
            ]
        )
    out = pred.predict(batch)
    assert out.shape == (len(batch),)
    assert np.isfinite(out).all() and (out >= 0).all()


@given(st.lists(st.lists(st.integers(0, 4000), min_size=1, max_size=4), min_size=1, max_size=6))
def test_ewma_window_one_is_the_last_step_mean(steps):
    pred = REG.create("predictor", {"name": "ewma", "params": {"window": 1}})
    batch = PromptBatch(uids=["q"], prompt_lengths=np.array([5]), n_samples=np.array([4]))
    for lengths in steps:
        pred.observe(
            [FinishedSample(uid="q", sample_index=k, prompt_length=5, response_length=x) for k, x in enumerate(lengths)]
        )
    assert pred.predict(batch)[0] == pytest.approx(np.mean(steps[-1]))


def test_ewma_cold_start_and_smoothing():
    pred = REG.create("predictor", {"name": "ewma", "params": {"window": 3, "alpha": 0.5, "default_length": 77}})
    batch = PromptBatch(uids=["a", "new"], prompt_lengths=np.array([5, 9]), n_samples=np.array([1, 1]))
    assert pred.predict(batch).tolist() == [77.0, 77.0]  # nothing observed yet
    for x in (100, 200, 400):
        pred.observe([FinishedSample(uid="a", sample_index=0, prompt_length=5, response_length=x)])
    a, new = pred.predict(batch)
    assert a == pytest.approx(0.5 * 400 + 0.5 * (0.5 * 200 + 0.5 * 100))
    assert new == 400.0  # cold start "mean": the last step's mean length


def test_oracle_refuses_without_true_lengths():
    batch = PromptBatch(uids=["a"], prompt_lengths=np.array([5]), n_samples=np.array([1]))
    with pytest.raises(Exception, match="true response lengths"):
        REG.create("predictor", "oracle").predict(batch)


# -- prefill -----------------------------------------------------------------------------------------------
def block_tree_tokens(batch, L, bs):
    """Brute force: distinct full-block prefixes within L (once each) plus each prompt's partial last block."""
    blocks, tails = set(), 0
    for i in range(len(batch)):
        cut = min(L, int(batch.prompt_lengths[i]))
        toks = batch.tokens(i).tolist()
        for end in range(bs, cut - cut % bs + 1, bs):
            blocks.add(tuple(toks[:end]))
        tails += cut % bs
    return bs * len(blocks) + tails


@given(batch=S.prompt_batches(with_tokens=True), capacity=st.integers(1, 200), bs=st.sampled_from([1, 2, 4, 16]))
def test_dedup_groups_share_their_prefix_and_fit(batch, capacity, bs):
    plan = REG.create("prefill_planner", {"name": "dedup", "params": {"block_size": bs}}).plan(batch, capacity)
    before = int((batch.prompt_lengths * batch.n_samples).sum())
    assert plan.tokens_before == before and plan.tokens_after <= before
    if not plan.prompt_group:
        assert plan.tokens_after == before
        if len(batch) and before:  # even one block would not fit
            assert block_tree_tokens(batch, bs, bs) > capacity or int(batch.prompt_lengths.max()) == 0
        return
    L = plan.shared_prefix_length
    assert L % bs == 0 or int(batch.prompt_lengths.max()) == L
    assert len(plan.prompt_group) == len(batch)  # every prompt in exactly one group
    for g in plan.groups():
        cut = g.prefix_tokens
        first = batch.tokens(g.prompt_indices[0])[:cut].tolist()
        for i in g.prompt_indices:
            assert cut == min(L, int(batch.prompt_lengths[i]))
            assert batch.tokens(i)[:cut].tolist() == first
    # groups are maximal: two prompts with the same truncated prefix are never in different groups
    keys = {tuple(batch.tokens(i)[: min(L, int(batch.prompt_lengths[i]))].tolist()) for i in range(len(batch))}
    assert len(keys) == len(plan.group_prefix_tokens)
    work = block_tree_tokens(batch, L, bs)
    assert plan.prefill_actor_tokens == work <= capacity
    rest = int((np.maximum(batch.prompt_lengths - L, 0) * batch.n_samples).sum())
    assert plan.tokens_after == min(work + rest, before)
    # L is the largest block multiple that fits: one more block would overflow the prefill actor
    if int(batch.prompt_lengths.max()) > L:
        assert block_tree_tokens(batch, L + bs, bs) > capacity


@given(batch=S.prompt_batches(with_tokens=False), capacity=st.integers(1, 500))
def test_dedup_without_tokens_shares_only_within_a_prompt(batch, capacity):
    plan = REG.create("prefill_planner", "dedup").plan(batch, capacity)
    if plan.prompt_group:
        assert len(set(plan.prompt_group)) == len(batch)


def test_dedup_saves_n_minus_1_over_n_of_whole_prompts():
    batch = PromptBatch(
        uids=["a", "b"],
        prompt_lengths=np.array([4, 4]),
        n_samples=np.array([3, 3]),
        token_flat=np.array([1, 2, 3, 4, 1, 2, 5, 6]),
    )
    dedup = REG.create("prefill_planner", {"name": "dedup", "params": {"block_size": 2}})
    plan = dedup.plan(batch, capacity_tokens=10_000)
    assert plan.tokens_before == 24
    # Blocks of 2: "1 2" is computed once for both prompts, "3 4" and "5 6" once each, instead of each
    # prompt three times (once per sample).
    assert plan.prefill_actor_tokens == plan.tokens_after == 6
    assert plan.shared_prefix_length == 4 and plan.group_prefix_tokens == [4, 4]
    # A capacity of 4 tokens fits the shared template block "1 2" but not the rest.
    small = dedup.plan(batch, capacity_tokens=4)
    assert small.shared_prefix_length == 2 and small.group_prefix_tokens == [2]
    assert small.tokens_after == 2 + 3 * 2 + 3 * 2


# -- assigners ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", REG.names("assigner"))
@given(data=st.data(), batch=S.prompt_batches(), num_actors=st.integers(1, 12))
def test_every_sample_assigned_once_groups_together(name, data, batch, num_actors):
    pred = data.draw(S.predictions(len(batch)))
    raw = REG.create("assigner", name).assign(batch, pred, num_actors)
    per_sample = check_assignment(raw, batch, num_actors)  # raises on a lost or duplicated sample
    assert per_sample.shape == (batch.total_samples,)
    assert ((per_sample >= 0) & (per_sample < num_actors)).all()
    if name in SPLITS_GROUPS:
        return
    for i in range(len(batch)):  # the other reference assigners never split a group
        lo, hi = batch.sample_offsets[i], batch.sample_offsets[i + 1]
        assert len(set(per_sample[lo:hi].tolist())) == 1


@given(batch=S.prompt_batches(), num_actors=st.integers(1, 12))
def test_chunks_are_verls_equal_contiguous_split(batch, num_actors):
    actor = REG.create("assigner", "chunks").assign(batch, np.zeros(len(batch)), num_actors)
    check_assignment(actor, batch, num_actors)
    assert (np.diff(actor) >= 0).all()  # contiguous: sample order, engine after engine
    sizes = np.bincount(actor, minlength=num_actors)
    assert sizes.max() - sizes.min() <= 1  # equal chunks, whatever the lengths
    assert sizes.sum() == batch.total_samples


@given(
    data=st.data(), batch=S.prompt_batches(), num_actors=st.integers(1, 12), split=st.sampled_from(["work", "count"])
)
def test_sorted_ranges_do_not_overlap(data, batch, num_actors, split):
    pred = data.draw(S.predictions(len(batch)))
    actor = REG.create("assigner", {"name": "sorted", "params": {"split": split}}).assign(batch, pred, num_actors)
    used = sorted(set(actor.tolist()))
    for a, b in itertools.pairwise(used):  # actor a holds longer prompts than actor b > a
        assert pred[actor == a].min() >= pred[actor == b].max()


@given(batch=S.prompt_batches(equal_n=False), num_actors=st.integers(1, 6))
def test_least_pending_is_openrlhfs_dispatch(batch, num_actors):
    actor = REG.create("assigner", "least-pending").assign(batch, np.zeros(len(batch)), num_actors)
    pending = [0] * num_actors
    for i, n in enumerate(batch.n_samples.tolist()):
        best = min(range(num_actors), key=lambda a: (pending[a], a))
        assert actor[i] == best
        pending[best] += n


@given(data=st.data(), batch=S.prompt_batches(), num_actors=st.integers(1, 6))
def test_balanced_is_within_one_prompt_of_the_mean(data, batch, num_actors):
    pred = data.draw(S.predictions(len(batch)))
    actor = REG.create("assigner", "balanced").assign(batch, pred, num_actors)
    work = batch.n_samples * pred
    load = np.bincount(actor, weights=work, minlength=num_actors)
    if len(batch):  # LPT: the most loaded actor exceeds the least loaded by at most the largest job
        assert load.max() - load.min() <= work.max() + 1e-6


@given(data=st.data(), batch=S.prompt_batches(), num_actors=st.integers(1, 8))
def test_work_balances_per_sample_and_dispatches_longest_first(data, batch, num_actors):
    pred = data.draw(S.predictions(len(batch)))
    policy = REG.create("assigner", "work")
    actor = policy.assign(batch, pred, num_actors)
    check_assignment(actor, batch, num_actors)
    work = policy.work(batch, pred)
    load = np.bincount(actor, weights=work, minlength=num_actors)
    if batch.total_samples:  # LPT per sample: within the largest single sample's work
        assert load.max() - load.min() <= work.max() + 1e-6
    order = policy.order(batch, pred, actor)
    assert sorted(order.tolist()) == list(range(batch.total_samples))  # every sample dispatched once
    assert (np.diff(work[order]) <= 1e-9).all()  # longest first


def test_the_controller_dispatches_in_the_plans_order(registry):
    from rlhfless_sdk.api.records import Cluster
    from rlhfless_sdk.simulation.simulator import Simulator
    from rlhfless_sdk.workloads.synthetic import SyntheticWorkload
    from rlhfless_sdk.workloads.traces import synthetic_workload

    work = synthetic_workload(SyntheticWorkload(20, 2, seed=3), 2)
    config = registry.scheduler("openrlhf").derive(name="w", assigner="work", predictor="oracle")
    steps = Simulator(PROFILE, Cluster.uniform(1, 2), registry=registry).run(config, work).steps
    for st_ in steps:
        plan = st_.plan
        assert sorted(plan.order) == list(range(len(plan.assignment)))
        pred = np.asarray(plan.predicted_lengths)[work.steps[0].batch.sample_prompt_index()]
        assert (np.diff(pred[plan.order]) <= 1e-9).all()


# -- migrators ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", REG.names("migrator"))
@given(progress=S.step_progress())
def test_migration_keeps_tokens_and_respects_free_slots(name, progress):
    decisions = REG.create("migrator", name).decide(progress)
    MigrationController.check(decisions, progress)  # once per sample, to a free slot, tokens stated right
    where = {(s.uid, s.sample_index): [s.actor_id, s.tokens_generated] for s in progress.unfinished}
    assume(len(where) == len(progress.unfinished))
    before = sum(t for _, t in where.values())
    taken = {}
    for d in decisions:
        assert d.from_actor != d.to_actor
        where[(d.uid, d.sample_index)][0] = d.to_actor
        taken[d.to_actor] = taken.get(d.to_actor, 0) + 1
    assert sum(t for _, t in where.values()) == before  # no token lost or invented
    free = {a.actor_id: a.free_slots for a in progress.actors}
    assert all(taken[a] <= free[a] for a in taken)


@settings(max_examples=300)
@given(progress=S.step_progress(kv=True), fill=st.floats(0.05, 1.0), threshold=st.floats(0.05, 1.0))
def test_kv_consolidation_fills_keepers_within_their_kv_and_releases_the_rest(progress, fill, threshold):
    """The global migrator with ``kv_fill``: samples move once, never off a keeper or onto a released actor; a
    keeper takes no more than its free slots and its KV room at ``fill`` (each moved sample's context: its tokens
    and its actor's mean prompt); an actor with queued samples is never released; no token lost."""
    params = {"threshold": threshold, "kv_fill": fill}
    decisions = REG.create("migrator", {"name": "global", "params": params}).decide(progress)
    MigrationController.check(decisions, progress)
    actors = {a.actor_id: a for a in progress.actors}
    sources = {d.from_actor for d in decisions}
    dests = {d.to_actor for d in decisions}
    assert not sources & dests
    assert all(actors[a].waiting == 0 for a in sources)
    on = {}
    for s in progress.unfinished:
        on.setdefault(s.actor_id, []).append(s)
    taken = {}
    for d in decisions:
        src = on[d.from_actor]
        prompt = (actors[d.from_actor].context_tokens - sum(s.tokens_generated for s in src)) / len(src)
        slots, kv = taken.get(d.to_actor, (0, 0.0))
        taken[d.to_actor] = (slots + 1, kv + d.tokens_generated + prompt)
    for a, (slots, kv) in taken.items():
        assert slots <= actors[a].free_slots
        assert actors[a].context_tokens + kv <= fill * actors[a].kv_capacity_tokens + 1e-6
    if len(progress.unfinished) > threshold * max(progress.total_samples, len(progress.unfinished)):
        assert decisions == []


@settings(max_examples=300)
@given(
    progress=S.step_progress(kv=True),
    margin=st.floats(0.01, 1.0),
    moves=st.integers(1, 8),
    left=st.integers(0, 3000),
    queued=st.booleans(),
)
def test_balancing_narrows_the_kv_spread_and_waits_for_the_queues(progress, margin, moves, left, queued):
    """The balance migrator: nothing moves while an actor has queued samples; each move takes a sample that may
    still decode ``min_left`` tokens, once, to an actor with a free slot and KV room; the actors' KV (each moved
    sample's context: its tokens and its actor's mean prompt) keeps its sum, and its spread never widens."""
    if not queued:  # the tail: every actor's queue empty
        progress = progress.model_copy(
            update={"actors": [a.model_copy(update={"waiting": 0}) for a in progress.actors]}
        )
    params = {"margin": margin, "moves": moves, "min_left": left}
    decisions = REG.create("migrator", {"name": "balance", "params": params}).decide(progress)
    MigrationController.check(decisions, progress)
    assert len(decisions) <= moves
    if any(a.waiting for a in progress.actors):
        assert decisions == []
    actors = {a.actor_id: a for a in progress.actors}
    on: dict[int, list] = {}
    for s in progress.unfinished:
        on.setdefault(s.actor_id, []).append(s)
    kv = {a: float(x.context_tokens) for a, x in actors.items()}
    spread = max(kv.values()) - min(kv.values())
    taken: dict[int, int] = {}
    for d in decisions:
        moved = next(s for s in on[d.from_actor] if (s.uid, s.sample_index) == (d.uid, d.sample_index))
        assert moved.max_tokens - moved.tokens_generated >= left and moved.migrations == 0
        src = on[d.from_actor]
        prompt = max(actors[d.from_actor].context_tokens - sum(s.tokens_generated for s in src), 0) / len(src)
        kv[d.from_actor] -= d.tokens_generated + prompt
        kv[d.to_actor] += d.tokens_generated + prompt
        taken[d.to_actor] = taken.get(d.to_actor, 0) + 1
        assert kv[d.to_actor] <= actors[d.to_actor].kv_capacity_tokens + 1e-6
    assert sum(kv.values()) == pytest.approx(sum(float(a.context_tokens) for a in progress.actors))
    assert max(kv.values()) - min(kv.values()) <= spread + 1e-6
    assert all(n <= actors[a].free_slots for a, n in taken.items())


def test_kv_consolidation_keeps_enough_actors_for_the_tails_kv():
    """Four actors holding about 100 tokens of KV each of 300: by slots alone one actor takes everyone's samples;
    at fill 0.7 (210 tokens each) two keepers hold all 406, and at 0.5 no keeper has room for one more sample."""
    from rlhfless_sdk.api.records import ActorProgress, StepProgress

    unfinished = [H.in_flight(f"p{a}", actor=a, tokens=90, predicted=40, max_tokens=512) for a in range(4)]
    actors = [
        ActorProgress(
            actor_id=a,
            planned_tokens=100,
            generated_tokens=90,
            running=1,
            free_slots=8,
            context_tokens=100 + a,
            kv_capacity_tokens=300,
        )
        for a in range(4)
    ]
    progress = StepProgress(total_samples=4, actors=actors, unfinished=unfinished)
    slots = REG.create("migrator", {"name": "global", "params": {"threshold": 1.0}}).decide(progress)
    assert len(slots) == 3
    by_kv = REG.create("migrator", {"name": "global", "params": {"threshold": 1.0, "kv_fill": 0.7}}).decide(progress)
    assert {(d.from_actor, d.to_actor) for d in by_kv} == {(0, 2), (1, 3)}  # the two holding the most KV keep theirs
    full = REG.create("migrator", {"name": "global", "params": {"threshold": 1.0, "kv_fill": 0.5}})
    assert full.decide(progress) == []


@given(progress=S.step_progress(), tau=st.floats(0.05, 1.0))
def test_tau_moves_only_underestimated_samples_of_actors_past_tau(progress, tau):
    decisions = REG.create("migrator", {"name": "tau", "params": {"tau": tau}}).decide(progress)
    actors = {a.actor_id: a for a in progress.actors}
    samples = {(s.uid, s.sample_index): s for s in progress.unfinished}
    for d in decisions:
        s = samples[(d.uid, d.sample_index)]
        assert s.tokens_generated > s.predicted_length
        assert actors[d.from_actor].done_fraction >= tau


def test_tau_moves_a_laggard_to_an_idle_actor():
    from rlhfless_sdk.api.records import ActorProgress, StepProgress

    progress = StepProgress(
        total_samples=4,
        actors=[
            ActorProgress(actor_id=0, planned_tokens=100, generated_tokens=80, running=2, free_slots=2),
            ActorProgress(actor_id=1, planned_tokens=100, generated_tokens=100, running=0, free_slots=4),
            ActorProgress(actor_id=2, planned_tokens=100, generated_tokens=10, running=1, free_slots=0),
        ],
        unfinished=[
            H.in_flight("late", actor=0, tokens=60, predicted=40, max_tokens=512),
            H.in_flight("ok", actor=0, tokens=20, predicted=40, max_tokens=512),
            H.in_flight("early", actor=2, tokens=90, predicted=40, max_tokens=512),
        ],
    )
    (d,) = REG.create("migrator", {"name": "tau", "params": {"wake_idle": True}}).decide(progress)
    assert (d.uid, d.from_actor, d.to_actor, d.tokens_generated) == ("late", 0, 1, 60)
    assert REG.create("migrator", "tau").decide(progress) == []  # actor 1 is idle (released), actor 2 is full
    # "early" is underestimated too, but its actor has done only 10% of its work (< tau)
    (g,) = REG.create("migrator", {"name": "global", "params": {"threshold": 1.0}}).decide(progress)
    assert g.from_actor == 2 and g.to_actor == 0  # consolidate onto the busiest actor with room


# -- scalers ------------------------------------------------------------------------------------------------
estimates = st.lists(st.tuples(st.floats(0, 1e4), st.floats(0, 1e5)), min_size=1, max_size=20).map(
    lambda xs: [CandidateEstimate(num_actors=i + 1, time_s=t, gpu_seconds=c) for i, (t, c) in enumerate(xs)]
)


@given(est=estimates, lam=st.floats(0, 1))
def test_cost_aware_choice_is_the_argmin(est, lam):
    scaler = REG.create("scaler", {"name": "cost-aware", "params": {"lambda": lam}})
    chosen = scaler.choose(est)
    t = np.array([e.time_s for e in est])
    c = np.array([e.gpu_seconds for e in est])

    def norm(x):
        return np.zeros_like(x) if np.ptp(x) == 0 else (x - x.min()) / np.ptp(x)

    score = lam * norm(t) + (1 - lam) * norm(c)
    # the argmin, computed here from the raw estimates: lowest score, ties to the faster, then the smaller N
    tied = [i for i in range(len(est)) if score[i] == score.min()]
    expected = min(tied, key=lambda i: (t[i], est[i].num_actors))
    assert score[chosen - 1] <= score.min() + 1e-12
    assert chosen == est[expected].num_actors


def _dominated(est, data):
    """A candidate slower and dearer than (or as slow and as dear as, but not equal to) one of ``est``."""
    base = data.draw(st.sampled_from(est))
    dt, dc = data.draw(st.floats(0, 1e3)), data.draw(st.floats(0, 1e4))
    if dt == 0 and dc == 0:
        dc = 1.0
    n = max(e.num_actors for e in est) + data.draw(st.integers(1, 5))
    return CandidateEstimate(num_actors=n, time_s=base.time_s + dt, gpu_seconds=base.gpu_seconds + dc)


@given(est=estimates, lam=st.floats(0, 1), data=st.data())
def test_relative_normalisation_ignores_dominated_candidates(est, lam, data):
    scaler = REG.create("scaler", {"name": "cost-aware", "params": {"lambda": lam, "normalise": "relative"}})
    before = scaler.choose(est)
    extra = _dominated(est, data)
    assert scaler.choose([*est, extra]) == before  # added
    at = data.draw(st.integers(0, len(est)))
    assert scaler.choose([*est[:at], extra, *est[at:]]) == before  # wherever it sits


def test_min_max_normalisation_can_be_moved_by_a_dominated_candidate():
    """Why ``relative`` exists: the paper's min-max form changes its pick when a dominated candidate widens the
    time span (the same happens when the candidate range changes)."""
    est = [
        CandidateEstimate(num_actors=2, time_s=100.0, gpu_seconds=200.0),
        CandidateEstimate(num_actors=4, time_s=60.0, gpu_seconds=240.0),
    ]
    paper = REG.create("scaler", {"name": "cost-aware", "params": {"lambda": 0.5}})
    slow = CandidateEstimate(num_actors=1, time_s=400.0, gpu_seconds=400.0)  # dominated by both
    assert paper.choose(est) != paper.choose([*est, slow])
    relative = REG.create("scaler", {"name": "cost-aware", "params": {"lambda": 0.5, "normalise": "relative"}})
    assert relative.choose(est) == relative.choose([*est, slow])


@pytest.mark.parametrize("name", REG.names("scaler"))
@given(lo=st.integers(1, 50), span=st.integers(0, 2000))
def test_scaler_candidates_within_range(name, lo, span):
    cands = list(REG.create("scaler", name).candidates(lo, lo + span))
    assert cands and len(set(cands)) == len(cands)
    assert all(lo <= c <= lo + span for c in cands)


# -- placers ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", REG.names("placer"))
@given(data=st.data(), cluster=S.clusters(min_gpus=3), gpus_per_actor=st.integers(1, 2))
def test_placement_within_each_nodes_gpus(name, data, cluster, gpus_per_actor):
    if gpus_per_actor == 2:  # tensor-parallel pairs: even-sized nodes, so the pairs always fit
        cluster = type(cluster)(nodes=[n.model_copy(update={"num_gpus": 2 * n.num_gpus}) for n in cluster.nodes])
    extra = [Actor(actor_id=0, role="learner"), Actor(actor_id=0, role="prefill")]
    n = data.draw(st.integers(1, (cluster.total_gpus - 2) // gpus_per_actor))
    loads = np.array(data.draw(st.lists(st.floats(0, 1e4), min_size=n, max_size=n)))
    placed = REG.create("placer", name).place(loads, cluster, gpus_per_actor, extra)
    check_placement(placed, cluster, n, gpus_per_actor, extra)  # every actor once, GPUs in range, none twice


@given(data=st.data(), cluster=S.clusters(min_gpus=4))
def test_locality_aware_puts_the_heaviest_beside_the_learner(data, cluster):
    extra = [Actor(actor_id=0, role="learner"), Actor(actor_id=0, role="prefill")]
    n = data.draw(st.integers(1, cluster.total_gpus - 2))
    loads = np.array(data.draw(st.lists(st.floats(0, 1e4), min_size=n, max_size=n)))
    placed = REG.create("placer", "locality-aware").place(loads, cluster, 1, extra)
    node_of = {(p.actor.role, p.actor.actor_id): p.node for p in placed}
    home = node_of[("learner", 0)]
    home_size = next(x.num_gpus for x in cluster.nodes if x.name == home)
    assert home_size == max(x.num_gpus for x in cluster.nodes)
    if home_size >= 2:
        assert node_of[("prefill", 0)] == home
    if home_size > 2:
        assert node_of[("decode", int(np.argmax(loads)))] == home


# -- the planner, end to end --------------------------------------------------------------------------------
@pytest.mark.parametrize("scheduler", REG.names("scheduler"))
@given(
    batch=S.prompt_batches(),
    cluster=S.clusters(min_gpus=3),
    lo=st.integers(1, 3),
    extra_hi=st.none() | st.integers(0, 6),
)
def test_plan_is_valid_for_every_preset(scheduler, batch, cluster, lo, extra_hi):
    hi = None if extra_hi is None else lo + extra_hi
    config = REG.scheduler(scheduler).model_copy(update={"min_actors": lo, "max_actors": hi})
    assume(cluster.total_gpus - 2 >= lo)
    planner = StepPlanner(config, cluster=cluster, cost_model=AnalyticCostModel(PROFILE), registry=REG)
    plan = planner.plan(batch)
    assert plan.fallbacks == []
    extra = planner.extra_actors(plan.prefill)
    fit = cluster.total_gpus - sum(a.num_gpus for a in extra)
    assert lo <= plan.num_actors <= min(fit, hi or fit)  # actor count within [min, max] and the cluster
    assert len(plan.assignment) == batch.total_samples
    assert all(0 <= a < plan.num_actors for a in plan.assignment)
    check_placement(plan.placement, cluster, plan.num_actors, 1, extra)
    assert plan.num_actors in {e.num_actors for e in plan.candidates}
    type(plan).model_validate(plan.model_dump())  # the record is valid, not only constructed


@pytest.mark.parametrize("scheduler", ["rlhfless", "rlhfless-paper"])
def test_empty_batch_and_single_prompt(scheduler):
    cluster = S.Cluster.uniform(1, 8)
    planner = StepPlanner(
        REG.scheduler(scheduler), cluster=cluster, cost_model=AnalyticCostModel(PROFILE), registry=REG
    )
    empty = planner.plan(PromptBatch.empty())
    assert empty.assignment == [] and empty.num_actors >= 1
    one = PromptBatch(uids=["x"], prompt_lengths=np.array([3]), n_samples=np.array([4]), token_flat=np.array([1, 2, 3]))
    plan = planner.plan(one)
    assert len(plan.assignment) == 4 and len(set(plan.assignment)) == 1


@given(est=estimates, slack=st.floats(0, 0.5))
def test_deadline_picks_the_cheapest_feasible(est, slack):
    scaler = REG.create("scaler", {"name": "deadline", "params": {"slack": slack}})
    chosen = next(e for e in est if e.num_actors == scaler.choose(est))
    limit = (1 + slack) * min(e.time_s for e in est)
    feasible = [e for e in est if e.time_s <= limit * (1 + 1e-12)]
    assert feasible  # the fastest candidate always meets a slack-relative deadline
    assert chosen in feasible
    assert chosen.gpu_seconds == min(e.gpu_seconds for e in feasible)


@given(est=estimates, slack=st.floats(0, 0.5), u=st.floats(0, 2), limit=st.floats(0, 0.5))
def test_deadline_runs_the_fleet_when_the_estimates_were_off(est, slack, u, limit):
    """Estimates recently off by more than ``max_uncertainty``: never fewer actors than the fleet (the most that
    need no burst actor); among the fleet and more, the usual cheapest within slack."""
    scaler = REG.create("scaler", {"name": "deadline", "params": {"slack": slack, "max_uncertainty": limit}})
    fleet_size = max(e.num_actors for e in est) // 2 + 1
    est = tuple(e.model_copy(update={"uncertainty": u, "burst": e.num_actors > fleet_size}) for e in est)
    chosen = scaler.choose(est)
    plain = REG.create("scaler", {"name": "deadline", "params": {"slack": slack}})

    def sure(ests):  # the usual choice: estimates with no recent error, so no fleet rule (plain's limit is 5%)
        return tuple(e.model_copy(update={"uncertainty": 0.0}) for e in ests)

    if u > limit:
        fleet = max((e.num_actors for e in est if not e.burst), default=0)
        assert chosen >= fleet
        assert chosen == plain.choose(sure(e for e in est if e.num_actors >= fleet))
    else:
        assert chosen == plain.choose(sure(est))


@given(est=estimates, deadline=st.floats(0.001, 2e4))
def test_deadline_with_an_explicit_deadline(est, deadline):
    scaler = REG.create("scaler", {"name": "deadline", "params": {"deadline_s": deadline}})
    chosen = next(e for e in est if e.num_actors == scaler.choose(est))
    feasible = [e for e in est if e.time_s <= deadline * (1 + 1e-12)]
    if feasible:  # feasible whenever any candidate is, and the cheapest of those
        assert chosen in feasible and chosen.gpu_seconds == min(e.gpu_seconds for e in feasible)
    else:  # none can meet it: the fastest
        assert chosen.time_s == min(e.time_s for e in est)


# a step's time falls (or stays) and its GPU-seconds grow with the engine count: what the deadline scaler's search
# counts on
monotone = (
    st.integers(1, 64)
    .flatmap(
        lambda n: st.tuples(
            st.lists(st.floats(0, 100), min_size=n, max_size=n), st.lists(st.floats(0.01, 100), min_size=n, max_size=n)
        )
    )
    .map(
        lambda tc: [
            CandidateEstimate(num_actors=i + 1, time_s=1e4 - t, gpu_seconds=c)
            for i, (t, c) in enumerate(zip(np.cumsum(tc[0]).tolist(), np.cumsum(tc[1]).tolist(), strict=True))
        ]
    )
)


def searched(scaler, est, fleet, u=0.0):
    est = [e.model_copy(update={"uncertainty": u, "burst": e.num_actors > fleet}) for e in est]
    by_n = {e.num_actors: e for e in est}
    space = CandidateSearch([e.num_actors for e in est], by_n.__getitem__, fleet, u)
    return space, scaler.search(space), est


@given(
    steps=st.lists(monotone, min_size=1, max_size=3), slack=st.floats(0, 0.5), deadline=st.none() | st.floats(1, 2e4)
)
def test_deadline_search_finds_the_argmin_of_every_count_where_time_falls_and_cost_grows(steps, slack, deadline):
    """Where a step's time falls (ties included) and its cost grows with the count, the search's pick is the one
    ``choose`` makes over every count, step after step (each search starts from the last pick), after at most
    about twice log2(counts) estimates; three when the pick holds."""
    scaler = REG.create("scaler", {"name": "deadline", "params": {"slack": slack, "deadline_s": deadline}})
    last = None
    for est in steps:
        space, chosen, est = searched(scaler, est, fleet=len(est))
        assert chosen == scaler.choose(est)
        assert len(space.estimated) <= 2 * int(np.ceil(np.log2(len(est)))) + 3
        if chosen == last and 1 < chosen < len(est):
            assert len(space.estimated) == 3  # the top, the last pick, and the count below it
        last = chosen


@given(est=estimates, slack=st.floats(0, 0.5), u=st.floats(0, 2), limit=st.floats(0, 0.5), data=st.data())
def test_deadline_search_is_choose_over_what_it_estimated(est, slack, u, limit, data):
    """On any estimates (time and cost in any order): the pick is ``choose``'s over the counts the search estimated,
    so it meets the deadline of those; with the slack untrusted it estimates only the fleet and the counts above it."""
    scaler = REG.create("scaler", {"name": "deadline", "params": {"slack": slack, "max_uncertainty": limit}})
    fleet = data.draw(st.integers(1, len(est)))
    space, chosen, est = searched(scaler, est, fleet, u)
    assert chosen in {e.num_actors for e in space.estimated}
    assert chosen == scaler.choose(space.estimated)
    if u > limit:
        assert {e.num_actors for e in space.estimated} == {e.num_actors for e in est if e.num_actors >= fleet}
        assert chosen == scaler.choose(est)


def test_the_planner_searches_a_few_counts_and_picks_what_checking_every_count_picks(registry):
    """The default scheduler's plan of 1,024 x 8 on 64 engines with trusted estimates: the deadline scaler's search
    estimates a few counts (not all 64) and picks the count that estimating every one picks."""
    config = registry.resolve("rlhfless").model_copy(update={"max_actors": 64})
    planner = planner_for(config, load_profile("qwen2.5-7b-l40s"), S.Cluster.uniform(8, 8), registry)
    history, lengths = SyntheticWorkload(1024, 8, seed=0, step=0).batch()
    planner.observe(finished_samples(history, lengths))
    planner.estimate_errors.extend([0.01, 0.02])  # the estimates were good: the slack is trusted
    batch, _ = SyntheticWorkload(1024, 8, seed=0, step=1).batch()
    plan = planner.plan(batch)
    assert 2 <= len(plan.candidates) <= 8
    every = [
        planner.checked_estimate(
            batch,
            np.asarray(plan.predicted_lengths),
            planner.policies["assigner"].assign(batch, np.asarray(plan.predicted_lengths), n),
            n,
            plan.prefill,
        ).model_copy(update={"uncertainty": 0.015})
        for n in range(1, 65)
    ]
    assert plan.num_actors == planner.policies["scaler"].choose(every)


@given(n=st.integers(1, 80), data=st.data())
def test_first_meeting_finds_the_first_count_that_meets_from_any_hint(n, data):
    first = data.draw(st.integers(0, n))  # counts from ``first`` on meet (n: none does)
    hint = data.draw(st.none() | st.integers(-3, n + 3))
    asked: list[int] = []

    def meets(c: int) -> bool:
        asked.append(c)
        return c >= first

    assert first_meeting(list(range(n)), meets, hint) == min(first, n - 1)
    assert len(asked) <= 2 * int(np.ceil(np.log2(n + 1))) + 2
