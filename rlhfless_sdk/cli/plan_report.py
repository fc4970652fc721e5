"""``rlhfless plan``: plan one step of a workload with several schedulers and show what each decided."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from rlhfless_sdk.api.config import SchedulerConfig
from rlhfless_sdk.api.history import isolated_history
from rlhfless_sdk.api.protocols import Candidate
from rlhfless_sdk.api.records import CandidateEstimate, StepPlan
from rlhfless_sdk.planning.planner import StepPlanner
from rlhfless_sdk.workloads.synthetic import SyntheticWorkload, finished_samples


@dataclass
class PlannedStep:
    scheduler: str
    plan: StepPlan
    true_mae: float
    at_true_lengths: CandidateEstimate
    rollout_gpus: int | None = None


def plan_synthetic(
    schedulers: list[SchedulerConfig],
    workload: SyntheticWorkload,
    planner_of: Callable[[SchedulerConfig], tuple[StepPlanner, int | None]],
    history_steps: int = 1,
) -> list[PlannedStep]:
    """Each scheduler observes ``history_steps`` earlier steps of the workload, then plans the next one;
    ``planner_of(config)`` gives its planner (``planner_for``, on the cluster the simulator runs it on) and an
    async pipeline's rollout GPUs (None: synchronous). Its predictor's history reads only what it observed here
    (``isolated_history``)."""
    out = []
    for config in schedulers:
        with isolated_history():
            planner, rollout_gpus = planner_of(config)
            for step in range(history_steps):
                batch, lengths = replace(workload, step=step).batch()
                planner.observe(finished_samples(batch, lengths))
            batch, true = replace(workload, step=history_steps).batch()
            plan = planner.plan(batch, step=history_steps)
        assert batch.true_lengths is not None
        mae = float(np.abs(np.asarray(plan.predicted_lengths) - batch.true_lengths).mean()) if len(batch) else 0.0
        candidate = Candidate(batch, true, np.asarray(plan.assignment), plan.num_actors, plan.prefill)
        actual = planner.cost_model.estimate(candidate)
        out.append(PlannedStep(config.name, plan, mae, actual, rollout_gpus))
    return out


def summary(p: PlannedStep) -> dict[str, Any]:
    plan = p.plan
    chosen = next(e for e in plan.candidates if e.num_actors == plan.num_actors)
    loads = np.bincount(np.asarray(plan.assignment, dtype=np.int64), minlength=plan.num_actors)
    return {
        "scheduler": p.scheduler,
        "num_actors": plan.num_actors,
        "rollout_gpus": p.rollout_gpus,
        "planned_time_s": chosen.time_s,
        "planned_gpu_seconds": chosen.gpu_seconds,
        "est_time_s": p.at_true_lengths.time_s,
        "est_gpu_seconds": p.at_true_lengths.gpu_seconds,
        "prefill_tokens_before": plan.prefill.tokens_before,
        "prefill_tokens_after": plan.prefill.tokens_after,
        "shared_prefix_length": plan.prefill.shared_prefix_length,
        "samples_per_actor_min": int(loads.min()) if loads.size else 0,
        "samples_per_actor_max": int(loads.max()) if loads.size else 0,
        "prediction_mae": p.true_mae,
        "nodes_used": sorted({pl.node for pl in plan.placement}),
        "planner_ms": plan.planner_ms,
        "fallbacks": plan.fallbacks,
        "candidates": [e.model_dump() for e in plan.candidates],
    }


def pick_split(
    config: SchedulerConfig,
    registry: Any,
    profile: Any,
    cluster: Any,
    *,
    trace: str | None,
    prompts: int,
    samples: int,
    steps: int,
    seed: int,
) -> Any:
    """The split a launch picks for ``config``'s pipeline (``rlhfless_sdk.simulation.split``): on ``trace`` (a run
    of the user's own), or on ``steps`` steps of the synthetic workload of ``prompts`` x ``samples``."""
    from rlhfless_sdk.simulation.simulator import Simulator
    from rlhfless_sdk.simulation.split import choose_split
    from rlhfless_sdk.workloads.traces import load_trace, synthetic_workload

    if trace is not None:
        workload, source = load_trace(trace, max_tokens=profile.kv_capacity_tokens), f"trace {trace}"
    else:
        workload = synthetic_workload(SyntheticWorkload(prompts, samples, seed=seed), steps)
        source = f"{steps} steps of the synthetic {prompts}x{samples} workload"
    sim = Simulator(profile, cluster, registry=registry, memory="dedicated")
    with isolated_history():
        return choose_split(sim, config, workload, source)
