"""The planner: a policy that raises or returns an invalid plan is replaced by its kind's baseline for the step."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import rlhfless_test_helpers as H  # registered by conftest.py

from rlhfless_sdk import PolicySpec
from rlhfless_sdk.api.kinds import KIND
from rlhfless_sdk.api.profiles import load_profile
from rlhfless_sdk.api.records import ActorPlacement, ActorProgress, Cluster, SampleProgress, StepProgress
from rlhfless_sdk.cli.bench import bench_plan
from rlhfless_sdk.planning.costmodel import AnalyticCostModel
from rlhfless_sdk.planning.planner import StepPlanner, check_placement
from rlhfless_sdk.workloads.synthetic import SyntheticWorkload

PROFILE = load_profile("qwen2.5-7b-l40s")


class Raising:
    def __init__(self, params=None):
        pass

    def assign(self, batch, predicted, num_actors):
        raise RuntimeError("assigner exploded")

    def predict(self, batch):
        raise RuntimeError("predictor exploded")

    def observe(self, samples):
        raise RuntimeError("observe exploded")

    def plan(self, batch, capacity_tokens):
        raise RuntimeError("prefill exploded")

    def decide(self, progress):
        raise RuntimeError("migrator exploded")

    def candidates(self, lo, hi):
        raise RuntimeError("scaler exploded")

    def choose(self, estimates):
        raise RuntimeError("scaler exploded")

    def place(self, loads, cluster, gpus_per_actor, extra):
        raise RuntimeError("placer exploded")


class Invalid:
    """Every method returns something its protocol forbids."""

    def __init__(self, params=None):
        pass

    def assign(self, batch, predicted, num_actors):
        return np.zeros(max(len(batch) - 1, 0), dtype=np.int64)  # loses a prompt

    def predict(self, batch):
        return np.full(len(batch), np.nan)

    def observe(self, samples):
        pass

    def plan(self, batch, capacity_tokens):
        from rlhfless_sdk.api.records import PrefillPlan

        return PrefillPlan(prompt_group=[0] * (len(batch) + 1), group_prefix_tokens=[0])  # one prompt too many

    def decide(self, progress):
        s = progress.unfinished[0]
        from rlhfless_sdk.api.records import MigrationDecision

        twice = MigrationDecision(
            uid=s.uid,
            sample_index=s.sample_index,
            from_actor=s.actor_id,
            to_actor=1 - s.actor_id,
            tokens_generated=s.tokens_generated,
        )
        return [twice, twice]  # the same sample moved twice: it would be duplicated

    def candidates(self, lo, hi):
        return [lo]

    def choose(self, estimates):
        return 10_000  # not a candidate

    def place(self, loads, cluster, gpus_per_actor, extra):
        node = cluster.nodes[0].name
        from rlhfless_sdk.api.records import Actor

        return [ActorPlacement(actor=Actor(actor_id=i), node=node, gpu_indices=[0]) for i in range(len(loads))]


#: What the faulty plugin registers for every kind it serves: a policy that raises and one that answers wrong.
FAULTY = [PolicySpec(name="raising", factory=Raising), PolicySpec(name="invalid", factory=Invalid)]
FAULTY_KINDS = ("predictor", "prefill_planner", "assigner", "migrator", "scaler", "placer")


@pytest.fixture(scope="module")
def faulty_registry(registry_with):
    return registry_with(**{"faulty-plugin": H.policy_plugin(**dict.fromkeys(FAULTY_KINDS, FAULTY))})


def make_planner(registry, **policies):
    config = registry.scheduler("rlhfless-paper").model_copy(
        update={
            k: registry.scheduler("rlhfless-paper").policy_refs()[k].model_copy(update={"name": v, "params": {}})
            for k, v in policies.items()
        }
    )
    return StepPlanner(config, cluster=Cluster.uniform(2, 4), cost_model=AnalyticCostModel(PROFILE), registry=registry)


KINDS = ["predictor", "prefill_planner", "assigner", "scaler", "placer"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fault", ["raising", "invalid"])
def test_faulty_policy_falls_back_for_the_step(faulty_registry, caplog, kind, fault):
    planner = make_planner(faulty_registry, **{kind: fault})
    batch, _ = SyntheticWorkload(40, 4, seed=3).batch()
    with caplog.at_level(logging.WARNING, logger="rlhfless.planner"):
        plan = planner.plan(batch)
    assert plan.fallbacks == [f"{kind}:{fault}"]
    assert "plugin 'faulty-plugin'" in caplog.text and KIND[kind].baseline in caplog.text
    # still a valid plan: every sample exactly once, actors and placement in range
    assert len(plan.assignment) == batch.total_samples
    assert max(plan.assignment) < plan.num_actors
    check_placement(plan.placement, planner.cluster, plan.num_actors, 1, planner.extra_actors(plan.prefill))
    # the next step tries the configured policy again (the fallback is for one step)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlhfless.planner"):
        assert planner.plan(batch).fallbacks == [f"{kind}:{fault}"]
    assert "faulty-plugin" in caplog.text


@pytest.mark.parametrize("fault", ["raising", "invalid"])
def test_faulty_migrator_falls_back_to_none(faulty_registry, caplog, fault):
    planner = make_planner(faulty_registry, migrator=fault)
    progress = StepProgress(
        total_samples=2,
        actors=[
            ActorProgress(actor_id=0, planned_tokens=10, generated_tokens=10, running=1, free_slots=4),
            ActorProgress(actor_id=1, planned_tokens=10, generated_tokens=10, running=0, free_slots=4),
        ],
        unfinished=[
            SampleProgress(uid="a", sample_index=0, actor_id=0, tokens_generated=50, predicted_length=5, max_tokens=100)
        ],
    )
    with caplog.at_level(logging.WARNING, logger="rlhfless.planner"):
        assert planner.migration.decide(progress) == []
    assert planner.migration.fallbacks == [f"migrator:{fault}"]
    assert "faulty-plugin" in caplog.text


def test_observe_failure_is_logged_not_raised(faulty_registry, caplog):
    planner = make_planner(faulty_registry, predictor="raising")
    with caplog.at_level(logging.WARNING, logger="rlhfless.planner"):
        planner.observe([])
    assert "observe exploded" in caplog.text


def test_a_failing_baseline_is_not_hidden(faulty_registry):
    planner = make_planner(faulty_registry, assigner="round-robin")
    planner.policies["assigner"] = Raising()
    batch, _ = SyntheticWorkload(4, 2).batch()
    with pytest.raises(RuntimeError, match="assigner exploded"):
        planner.plan(batch)


def test_too_small_a_cluster_is_a_clear_error(registry):
    config = registry.scheduler("rlhfless").model_copy(update={"min_actors": 8})
    planner = StepPlanner(
        config, cluster=Cluster.uniform(1, 4), cost_model=AnalyticCostModel(PROFILE), registry=registry
    )
    batch, _ = SyntheticWorkload(4, 2).batch()
    with pytest.raises(Exception, match="below min_actors=8"):
        planner.plan(batch)


def test_cost_aware_plan_is_the_argmin_of_its_candidates(registry):
    """The planner hands the scaler every candidate it estimated and keeps its argmin."""
    batch, _ = SyntheticWorkload(256, 8, seed=1).batch()
    plan = StepPlanner(
        registry.scheduler("rlhfless-paper"),
        cluster=Cluster.uniform(2, 8),
        cost_model=AnalyticCostModel(PROFILE),
        registry=registry,
    ).plan(batch)
    scaler = registry.create("scaler", registry.scheduler("rlhfless-paper").scaler)
    scores = scaler.scores(plan.candidates)
    chosen = [e.num_actors for e in plan.candidates].index(plan.num_actors)
    assert scores[chosen] == scores.min()
    assert plan.prefill.tokens_saved > 0


def test_bench_plan_reports_a_median():
    res = bench_plan(64, 4, 8, repeat=2)
    assert res["median_ms"] > 0 and res["prompts"] == 64 and 1 <= res["chosen_actors"] <= 8
    assert res["candidates"] == 8 and res["prefill_tokens_saved"] > 0
