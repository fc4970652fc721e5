"""Partial rollouts across steps: the carry book (property-tested) and the simulator's partial-rollout runs."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfless_sdk.api.batch import PromptBatch
from rlhfless_sdk.api.profiles import load_profile
from rlhfless_sdk.api.records import Cluster
from rlhfless_sdk.rollout.carry import CarryBook, CarryError, batch_cut
from rlhfless_sdk.simulation.simulator import Simulator
from rlhfless_sdk.workloads.synthetic import SyntheticWorkload
from rlhfless_sdk.workloads.traces import synthetic_workload


def with_straggler(registry, name: str, **params):
    """OpenRLHF's scheduler with one straggler policy: what each straggler test runs, beside the shipped presets."""
    return registry.scheduler("openrlhf").derive(name=f"{name}-test", straggler={"name": name, "params": params})


step_groups = st.lists(st.lists(st.integers(1, 300), min_size=1, max_size=4), max_size=5)


@given(
    steps=st.lists(step_groups, min_size=1, max_size=5), budgets=st.lists(st.none() | st.integers(1, 200), min_size=6)
)
def test_every_sample_trains_once_with_all_its_tokens(steps, budgets):
    """Across steps: no carried sample is lost or duplicated, every group trains exactly once with all n samples
    in order, the tokens of a sample's pieces add up to its length, and no token is more than one step old."""
    book = CarryBook()
    truth: dict[tuple[int, int], int] = {}
    launched: list[tuple[str, list[int]]] = []
    trained = []
    for k, groups in enumerate([*steps, []]):  # one more step finishes what is carried
        budget = budgets[k]
        uids = [f"s{k}p{i}" for i in range(len(groups))]
        new = None
        if groups:
            new = PromptBatch(
                uids=uids, prompt_lengths=np.full(len(groups), 7), n_samples=np.array([len(g) for g in groups])
            )
            launched += list(zip(uids, groups, strict=True))
        n_carried = len(book.carried)
        batch, _pred, caps = book.pieces(new, np.full(len(groups), 50.0), budget=budget)
        assert batch.total_samples == n_carried + sum(len(g) for g in groups)
        assert (caps[:n_carried] == np.inf).all()
        pieces = book.step_pieces
        for p, length in zip(pieces[n_carried:], [x for g in groups for x in g], strict=True):
            truth[(p.group, p.sample_index)] = length
        made, ended = [], []
        for i, p in enumerate(pieces):
            left = truth[(p.group, p.sample_index)] - p.generated
            tokens = left if (i < n_carried or budget is None) else min(left, budget)
            made.append(tokens)
            ended.append(tokens == left)
        settled = book.settle(k, made, ended)
        assert settled.carried == len(book.carried)
        assert all(p.generated != 0 for p in book.carried)  # a carried sample has tokens to continue from
        assert settled.max_age <= 1  # carried samples finish in the next step
        trained += settled.trained
    assert not book.carried and not book.groups  # nothing left behind
    assert sorted((g.uid, g.lengths) for g in trained) == sorted(launched)  # each group once, samples in order
    for g in trained:
        for length, pieces in zip(g.lengths, g.steps, strict=True):
            assert sum(t for _, t in pieces) == length  # tokens conserved across the carry


def test_a_backend_that_misreports_is_refused():
    book = CarryBook()
    new = PromptBatch(uids=["a"], prompt_lengths=np.array([3]), n_samples=np.array([2]))
    book.pieces(new, np.array([10.0]))
    with pytest.raises(CarryError, match="had 2 samples"):
        book.settle(0, [5], [True])


def test_partial_rollouts_in_the_simulator_train_every_group_once(registry):
    work = synthetic_workload(SyntheticWorkload(24, 4, seed=2, median_length=300, max_length=2048), 3)
    config = with_straggler(registry, "partial", segment_tokens=256)
    sim = Simulator(load_profile("qwen2.5-7b-l40s"), Cluster.uniform(1, 4), registry=registry)
    res = sim.run(config, work)
    reports = res.reports
    assert len(reports) == len(work.steps) + 1  # one more step finishes what the last one carried
    assert sum(r.groups_trained for r in reports) == sum(len(ws.batch) for ws in work.steps)
    assert sum(r.response_tokens for r in reports) == sum(int(ws.lengths.sum()) for ws in work.steps)
    assert reports[-1].carried_samples == 0
    assert reports[0].stale_token_fraction == 0 and max(r.max_token_age_steps for r in reports) == 1
    assert any(r.carried_samples for r in reports[:-1])  # some samples were longer than 256 tokens
    assert 0 < res.totals()["stale_token_fraction"] < 1


# -- tail batching --------------------------------------------------------------------------------------------
@given(
    prompts=st.integers(0, 60),
    b=st.integers(1, 12),
    over=st.lists(st.floats(0.0, 1.5), min_size=1, max_size=8),
    data=st.data(),
)
def test_tail_rounds_train_every_prompt_exactly_once_b_at_a_time(prompts, b, over, data):
    from rlhfless_sdk.rollout.tail import TailRounds

    drawn: list[int] = []

    def stream():  # lazy, like a dataloader: TailRounds draws only what a round starts (and one to see the end)
        for p in range(prompts):
            drawn.append(p)
            yield p

    rounds = TailRounds(b, stream())
    trained: list[int] = []
    sizes = []
    r = 0
    while not rounds.done():
        rnd = rounds.next(over[r % len(over)])
        held = [*trained, *rnd.prompts, *rounds.deferred, *rounds.fresh]
        assert sorted(held) == sorted(drawn)  # every prompt drawn is trained, started, deferred or waiting: once
        assert len(rounds.fresh) <= math.ceil((1 + over[r % len(over)]) * b)  # draws no more than a round starts
        assert len(set(rnd.prompts)) == len(rnd.prompts)
        # any order of finishing: the backend decides which B come first (a long round trains all)
        first = list(rnd.prompts) if rnd.long else data.draw(st.permutations(rnd.prompts))[: rnd.train]
        rounds.settle(first)
        trained += first
        sizes.append(len(first))
        r += 1
        assert r <= 4 * prompts + 2  # always progresses
    assert sorted(trained) == list(range(prompts))  # each prompt once: none lost, none twice
    assert all(s == b for s in sizes[:-1]) or prompts < b  # exactly B a round, but for the stream's end
    assert all(s <= b for s in sizes)


def test_tail_rounds_refuse_a_wrong_account():
    from rlhfless_sdk.rollout.tail import TailError, TailRounds

    rounds = TailRounds(2, ["a", "b", "c", "d"])
    rounds.next(0.5)  # starts a, b, c
    with pytest.raises(TailError):
        rounds.settle(["a", "x"])  # x was never started
    with pytest.raises(TailError):
        rounds.settle(["a"])  # must train 2


def simulate_over_provisioned(registry, preset: str | None, straggler: str, seed: int):
    """4 steps of B = 20 prompts x 4 samples on 4 GPUs, under a shipped ``preset`` or (None) OpenRLHF's scheduler
    with the ``straggler`` policy at over_provision 0.5; checks that every response token trains, once."""
    work = synthetic_workload(SyntheticWorkload(20, 4, seed=seed, median_length=300, max_length=2048), 4)
    config = registry.scheduler(preset) if preset else with_straggler(registry, straggler, over_provision=0.5)
    res = Simulator(load_profile("qwen2.5-7b-l40s"), Cluster.uniform(1, 4), registry=registry).run(config, work)
    assert sum(r.response_tokens for r in res.reports) == sum(int(ws.lengths.sum()) for ws in work.steps)
    return work, res


@pytest.mark.parametrize("preset", [None, "rlhfless-onpolicy"])
def test_tail_batching_in_the_simulator_is_on_policy_and_trains_every_group_once(registry, preset):
    # the shipped on-policy preset: per-sample dispatch, deadline scaler with burst actors beyond the fleet
    work, res = simulate_over_provisioned(registry, preset, "tail-batch", seed=7)
    reports = res.reports
    assert sum(r.groups_trained for r in reports) == sum(len(ws.batch) for ws in work.steps)
    assert all(r.groups_trained == 20 for r in reports)  # exactly B groups a round here (80 prompts, B = 20)
    assert all(r.stale_token_fraction == 0 and r.max_token_age_steps == 0 for r in reports)
    assert any(r.deferred_prompts for r in reports)  # short rounds deferred their slowest groups
    assert reports[-1].deferred_prompts == 0


# -- partial rollouts cut when B groups are done (APRIL) ------------------------------------------------------
@given(
    groups=st.lists(st.lists(st.integers(1, 300), min_size=1, max_size=4), max_size=40),
    b=st.integers(1, 8),
    over=st.floats(0.0, 1.0),
    data=st.data(),
)
def test_batch_cut_trains_exactly_b_groups_a_step_and_loses_no_token(groups, b, over, data):
    """The batch-cut rule on the carry book, whatever finishes first and however far the others got: every step
    but the last trains exactly B groups (all carried ones, then fresh ones), every group trains once with all
    n samples in order, each sample's pieces add up to its length, and no token is more than one step old."""
    book = CarryBook()
    stream = list(enumerate(groups))
    truth: dict[tuple[int, int], int] = {}
    trained, sizes = [], []
    k = 0
    while stream or book.groups:
        held = book.open_group_ids()
        assert len(held) <= b  # what a step does not train is at most over_provision x B <= B
        fresh = stream[: max(math.ceil((1 + over) * b) - len(held), 0)]
        stream = stream[len(fresh) :]
        new = None
        if fresh:
            new = PromptBatch(
                uids=[f"p{i}" for i, _ in fresh],
                prompt_lengths=np.full(len(fresh), 5),
                n_samples=np.array([len(g) for _, g in fresh]),
            )
        n_carried = len(book.carried)
        book.pieces(new, np.full(len(fresh), 50.0))
        pieces = book.step_pieces
        for p, length in zip(pieces[n_carried:], [x for _, g in fresh for x in g], strict=True):
            truth[(p.group, p.sample_index)] = length
        fresh_groups = sorted({p.group for p in pieces[n_carried:]})
        order = data.draw(st.permutations(fresh_groups))  # the order fresh groups would complete in
        done_at = {g: float(rank) for rank, g in enumerate(order)} | dict.fromkeys(held, 0.0)
        train, stop = batch_cut(held, fresh_groups, done_at, b)
        assert set(held) <= train and len(train) == min(len(held) + len(fresh_groups), b)
        if len(held) + len(fresh_groups) > b:  # the first fresh groups to complete fill the batch
            assert train - set(held) == set(order[: b - len(held)])
        assert stop == (math.inf if len(held) + len(fresh_groups) <= b else max(done_at[g] for g in train))
        made, ended = [], []
        for p in pieces:
            left = truth[(p.group, p.sample_index)] - p.generated
            tokens = left if p.group in train else data.draw(st.integers(0, left))  # cut wherever it was
            made.append(tokens)
            ended.append(tokens == left)
        settled = book.settle(k, made, ended, train=train)
        assert settled.max_age <= 1
        sizes.append(len(settled.trained))
        trained += settled.trained
        k += 1
        assert k <= len(groups) + 2
    assert all(s == b for s in sizes[:-1]) and all(s <= b for s in sizes)
    assert sorted((g.uid, g.lengths) for g in trained) == sorted((f"p{i}", g) for i, g in enumerate(groups))
    for g in trained:
        for length, pieces in zip(g.lengths, g.steps, strict=True):
            assert sum(t for _, t in pieces) == length


def test_the_carry_book_refuses_to_train_an_open_group():
    book = CarryBook()
    book.pieces(PromptBatch(uids=["a", "b"], prompt_lengths=np.array([3, 3]), n_samples=np.array([2, 1])))
    with pytest.raises(CarryError, match="may not train"):
        book.settle(0, [5, 2, 4], [True, False, True], train={0})  # group 0's second sample was cut


@pytest.mark.parametrize("preset", [None, "rlhfless-fast"])
def test_batch_cut_partial_rollouts_in_the_simulator_train_b_groups_a_step(registry, preset):
    _, res = simulate_over_provisioned(registry, preset, "partial-batch", seed=3)
    reports = res.reports
    assert [r.groups_trained for r in reports] == [20] * len(reports)  # 80 prompts, B = 20: exactly B a step
    assert reports[0].stale_token_fraction == 0 and max(r.max_token_age_steps for r in reports) == 1
    assert any(r.carried_samples for r in reports[:-1]) and reports[-1].carried_samples == 0
    assert 0 < res.totals()["stale_token_fraction"] < 1


@settings(max_examples=15, deadline=None)
@given(
    prompts=st.integers(1, 30),
    n=st.integers(1, 4),
    steps=st.integers(1, 3),
    seed=st.integers(0, 10_000),
    over=st.sampled_from([0.0, 0.3, 1.0]),
    keeps=st.booleans(),
)
def test_over_provisioning_runs_train_every_group_once_b_a_step(registry_with, prompts, n, steps, seed, over, keeps):
    """Batch-cut partial rollouts and tail batching on random workloads: B groups a step (the last: what is left),
    every prompt's response tokens trained once, partial ones at most one update stale, tail batching never."""
    registry = registry_with()
    work = synthetic_workload(SyntheticWorkload(prompts, n, seed=seed, median_length=200, max_length=1024), steps)
    config = with_straggler(registry, "partial-batch" if keeps else "tail-batch", over_provision=over)
    reports = (
        Simulator(load_profile("qwen2.5-7b-l40s"), Cluster.uniform(1, 2), registry=registry).run(config, work).reports
    )
    trained = [r.groups_trained for r in reports]
    assert all(t == prompts for t in trained[:-1]) and 0 < trained[-1] <= prompts
    assert sum(trained) == prompts * steps
    assert sum(r.response_tokens for r in reports) == sum(int(ws.lengths.sum()) for ws in work.steps)
    assert max(r.max_token_age_steps for r in reports) <= (1 if keeps else 0)


def test_a_step_with_nothing_to_generate_is_reported(tmp_path):
    """Every sample the same length: all groups of a step complete at one instant, the ones beyond B are held
    complete, and the next step trains them at once, generating nothing. Its time is 0 without learner costs;
    the per-step table shows no speedup for it instead of dividing by zero."""
    import json

    import yaml
    from click.testing import CliRunner

    from rlhfless_sdk.cli.main import main

    rows = [
        {"uid": f"q{k}-{p}", "step": k, "sample_idx": j, "prompt_length": 20, "response_length": 64}
        for k in range(3)
        for p in range(4)
        for j in range(2)
    ]
    trace = tmp_path / "flat.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    learner_free = load_profile("qwen2.5-7b-l40s").model_copy(
        update={
            "name": "no-learner",
            "prepare_gpu_s_per_token": 0.0,
            "learn_gpu_s_per_token": 0.0,
            "grpo_prepare_gpu_s_per_token": None,
            "grpo_learn_gpu_s_per_token": None,
            "weight_sync_s": 0.0,
        }
    )
    profile = tmp_path / "profile.yaml"
    profile.write_text(yaml.safe_dump(learner_free.model_dump(mode="json")))
    config = tmp_path / "fast.yaml"
    config.write_text(
        "name: fast-double\npredictor: ewma\nprefill_planner: none\nassigner: work\nmigrator: none\n"
        "scaler: fixed\nplacer: pack\nstraggler: {name: partial-batch, params: {over_provision: 1.0}}\n"
    )
    args = ["simulate", "--trace", str(trace), "--scheduler", "openrlhf", "--scheduler", str(config)]
    args += ["--profile", str(profile), "--gpus", "2", "--gpus-per-node", "2", "--no-frontier"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, [*args, "--json"])
    steps = json.loads(res.output)["schedulers"][1]["steps"]
    assert steps[1]["time_s"] == 0.0 and steps[1]["groups_trained"] == 4  # the held groups, complete already
    assert [s["groups_trained"] for s in steps] == [4, 4, 4]


@settings(max_examples=40, deadline=None)
@given(groups=st.integers(1, 9), n=st.integers(1, 3), b=st.integers(1, 6), data=st.data())
def test_the_batch_cut_end_rule_stops_at_the_b_th_complete_group(registry_with, groups, n, b, data):
    """``BatchCutStep``'s end rule, as the step controller asks it after every poll of a real backend: samples
    finish in any order, a few per poll; the rule says stop at the first poll after which B groups are complete
    (never before), and the groups that train are the first B to complete, ties at one poll in launch order."""
    from types import SimpleNamespace

    from rlhfless_sdk.rollout.drivers import BatchCutStep

    registry = registry_with()
    config = with_straggler(registry, "partial-batch", over_provision=1.0)
    planner = Simulator(load_profile("qwen2.5-7b-l40s"), Cluster.uniform(1, 2), registry=registry).planner(config)
    step = BatchCutStep(planner, CarryBook(), b, 0)
    new = PromptBatch(
        uids=[f"p{i}" for i in range(groups)],
        prompt_lengths=np.full(groups, 10),
        n_samples=np.full(groups, n),
    )
    batch, plan = step.plan(new)
    assert len(batch) == groups and len(plan.assignment) == groups * n and step.fresh == sorted(step.fresh)
    order = data.draw(st.permutations(range(groups * n)))
    done: set[int] = set()
    complete_at: dict[int, int] = {}  # group (its prompt here) -> the poll it completed in
    stopped, polls = False, 0
    while order and not stopped:
        k = data.draw(st.integers(1, 3))
        done |= set(order[:k])
        order = order[k:]
        finished = [p for p in range(groups) if all(s in done for s in range(p * n, (p + 1) * n))]
        for p in finished:
            complete_at.setdefault(p, polls)
        stopped = step.stop(SimpleNamespace(done_prompts=lambda f=finished: f))
        assert stopped == (len(finished) >= b)  # stops once B are complete, never before
        polls += 1
    train, end = step.end()
    if step.cuts():
        expected = sorted(complete_at, key=lambda p: (complete_at[p], p))[:b]
        assert {step.pieces[p * n].group for p in expected} == train and end < math.inf
    else:  # B or fewer in flight: every group trains, nothing is cut
        assert groups <= b and len(train) == groups and end == math.inf
