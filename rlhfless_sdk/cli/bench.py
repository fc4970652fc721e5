"""``rlhfless bench``: the median wall time of a full step plan on a synthetic batch, of a predictor's predict, and
the wall time of simulated steps at scale. A scheduler is a registered name or a YAML file, as everywhere."""

from __future__ import annotations

import statistics
import time
from typing import Any

from rlhfless_sdk.api.history import isolated_history
from rlhfless_sdk.api.plugins import get_plugin_manager
from rlhfless_sdk.api.profiles import load_profile
from rlhfless_sdk.api.records import Cluster
from rlhfless_sdk.planning.planner import planner_for
from rlhfless_sdk.rollout.modes import mode_for
from rlhfless_sdk.workloads.synthetic import SyntheticWorkload, finished_samples


def bench_plan(
    prompts: int,
    samples: int,
    actors: int,
    *,
    scheduler: str = "rlhfless-paper",
    profile: str = "qwen2.5-7b-l40s",
    repeat: int = 5,
    gpus_per_node: int = 8,
    seed: int = 0,
) -> dict[str, Any]:
    """Plan ``repeat`` times (after one warm-up) for a cluster with room for ``actors`` decode actors."""
    registry = get_plugin_manager().registry
    config = registry.resolve(scheduler).model_copy(update={"max_actors": actors})
    prof = load_profile(profile)
    gpus = (actors + 1) * prof.gpus_per_actor  # a prefill actor beside the decode actors (the learner colocated)
    nodes = -(-gpus // gpus_per_node)
    cluster = Cluster.uniform(nodes, gpus_per_node)
    with isolated_history():  # a history file's earlier runs are not this benchmark's history
        planner = planner_for(config, prof, cluster, registry)
    history, history_lengths = SyntheticWorkload(prompts, samples, seed=seed, step=0).batch()
    planner.observe(finished_samples(history, history_lengths))  # one earlier step: EWMA has a history
    batch, _ = SyntheticWorkload(prompts, samples, seed=seed, step=1).batch()
    planner.plan(batch)
    times, plan = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        plan = planner.plan(batch)
        times.append((time.perf_counter() - t0) * 1000.0)
    assert plan is not None
    return {
        "scheduler": config.name,
        "prompts": prompts,
        "samples_per_prompt": samples,
        "max_actors": actors,
        "candidates": len(plan.candidates),
        "chosen_actors": plan.num_actors,
        "prefill_tokens_saved": plan.prefill.tokens_saved,
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "repeat": repeat,
    }


def bench_simulate(
    prompts: int = 8192,
    samples: int = 8,
    gpus: int = 160,
    *,
    scheduler: str = "rlhfless-paper",
    profile: str = "llama-70b-8xh100",
    steps: int = 2,
    gpus_per_node: int = 8,
    seed: int = 0,
) -> dict[str, Any]:
    """Wall time of each simulated step (planning included) of a synthetic workload at cluster scale. An async
    scheduler's steps overlap (a pipeline): its whole run is simulated as `simulate` runs it (at its preset's
    split, or the fastest split tried on the first 3 steps) and ``step_wall_s`` holds the run's wall time spread
    over its steps, the split search included."""
    from rlhfless_sdk.cli.simulate import make_cluster
    from rlhfless_sdk.simulation.simulator import Simulator
    from rlhfless_sdk.workloads.traces import synthetic_workload

    registry = get_plugin_manager().registry
    config = registry.resolve(scheduler)
    sim = Simulator(load_profile(profile), make_cluster(gpus, gpus_per_node), registry=registry)
    workload = synthetic_workload(SyntheticWorkload(prompts, samples, seed=seed), steps)
    walls: list[float] = []
    rollout_gpus = None
    if mode_for(config, registry).pipelined:
        t0 = time.perf_counter()
        result = sim.run(config, workload)
        wall = time.perf_counter() - t0
        reports, rollout_gpus = result.reports, result.rollout_gpus
        walls = [wall / max(len(reports), 1)] * len(reports)
    else:
        with isolated_history():  # as in a simulator's run: a history file's earlier runs are not seen
            planner = sim.planner(config)
        reports = []
        for ws in workload.steps:
            t0 = time.perf_counter()
            reports.append(sim.step(planner, ws).report)
            walls.append(time.perf_counter() - t0)
    return {
        "scheduler": config.name,
        "profile": profile,
        "gpus": gpus,
        "prompts": prompts,
        "samples_per_prompt": samples,
        "rollout_gpus": rollout_gpus,
        "step_wall_s": walls,
        "max_step_wall_s": max(walls, default=0.0),
        "actors": [r.num_actors for r in reports],
        "migrations": [r.migrations for r in reports],
        "simulated_step_s": [r.time_s for r in reports],
    }


def bench_predict(predictor: str, prompts: int, samples: int, *, repeat: int = 20, seed: int = 0) -> dict[str, Any]:
    """Time ``predict`` on a fresh batch after one observed step (so a model is trained)."""
    registry = get_plugin_manager().registry
    with isolated_history():
        pred = registry.create("predictor", predictor)
    history, lengths = SyntheticWorkload(prompts, samples, seed=seed, step=0).batch()
    pred.predict(history)
    pred.observe(finished_samples(history, lengths))
    batch, _ = SyntheticWorkload(prompts, samples, seed=seed + 1, step=1).batch()  # unseen prompts too
    pred.predict(batch)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        pred.predict(batch)
        times.append((time.perf_counter() - t0) * 1000.0)
    return {"predictor": predictor, "prompts": prompts, "median_ms": statistics.median(times), "min_ms": min(times)}
