"""``rlhfless bench``: the median wall time of a full step plan on a synthetic batch, of a predictor's predict, and
the wall time of simulated steps at scale. A scheduler is a registered name or a YAML file, as everywhere."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import click

from rlhfless_sdk.api.history import isolated_history
from rlhfless_sdk.api.plugins import get_plugin_manager
from rlhfless_sdk.api.profiles import load_profile
from rlhfless_sdk.api.records import Cluster, dumps
from rlhfless_sdk.cli.args import BYTES_PER_PLANNED_SAMPLE, GPUS, POSITIVE, check_samples
from rlhfless_sdk.planning.planner import planner_for
from rlhfless_sdk.rollout.modes import mode_for
from rlhfless_sdk.workloads.synthetic import SyntheticWorkload, finished_samples

#: Most timed runs a benchmark repeats (each a whole plan or predict).
REPEATS = click.IntRange(min=1, max=1000)


#: The two states a planner plans in: before any checked estimate was measured against a step (the first steps:
#: a deadline scaler does not trust its slack) and after several were measured within 2% (the steady state).
REGIMES = ("first steps", "steady")


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
    regime: str = "first steps",
) -> dict[str, Any]:
    """Plan ``repeat`` fresh batches (after one warm-up plan) for a cluster with room for ``actors`` decode actors,
    in ``regime`` (``REGIMES``): the planner has observed one step, and in ``steady`` its last estimates were within
    2% of the steps they planned."""
    if regime not in REGIMES:
        raise ValueError(f"regime {regime!r} is not one of {REGIMES}")
    registry = get_plugin_manager().registry
    config = registry.resolve(scheduler).model_copy(update={"max_actors": actors})
    prof = load_profile(profile)
    gpus = (actors + 1) * prof.gpus_per_actor  # a prefill actor beside the decode actors (the learner colocated)
    nodes = -(-gpus // gpus_per_node)
    cluster = Cluster.uniform(nodes, gpus_per_node)
    with isolated_history():  # a history file's earlier runs are not this benchmark's history
        planner = planner_for(config, prof, cluster, registry)
    history, history_lengths = SyntheticWorkload(prompts, samples, seed=seed, step=0).batch()
    # one earlier step, planned and observed: the predictor has a history, the planner a learned length spread
    predicted = planner.plan(history).predicted_lengths
    done = finished_samples(history, history_lengths)
    prompt_of = history.sample_prompt_index().tolist()
    planner.observe(
        [f.model_copy(update={"predicted_length": predicted[i]}) for f, i in zip(done, prompt_of, strict=True)]
    )
    batches = [SyntheticWorkload(prompts, samples, seed=seed, step=k).batch()[0] for k in range(1, repeat + 2)]
    planner.plan(batches[0])  # the warm-up
    if regime == "steady":
        for error in (0.01, 0.02, 0.01):  # the last steps' estimates were good: a deadline scaler trusts its slack
            planner.note_error(error)
        planner.plan(batches[0])  # a search starts from the last trusted pick, as from the step before
    times, plans = [], []
    for batch in batches[1:]:
        t0 = time.perf_counter()
        plans.append(planner.plan(batch))
        times.append((time.perf_counter() - t0) * 1000.0)
    return {
        "scheduler": config.name,
        "regime": regime,
        "prompts": prompts,
        "samples_per_prompt": samples,
        "max_actors": actors,
        "candidates": statistics.median(len(p.candidates) for p in plans),
        "chosen_actors": plans[-1].num_actors,
        "prefill_tokens_saved": plans[-1].prefill.tokens_saved,
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "repeat": repeat,
    }


def bench_plans(
    prompts: int, samples: int, actors: int, schedulers: Sequence[str], *, baseline: str, **kw: Any
) -> dict[str, Any]:
    """``bench_plan`` of each scheduler and ``baseline`` in both regimes, in one run; each row's ``ratio`` is its
    median over the baseline's in the same regime."""
    names = list(dict.fromkeys([*schedulers, baseline]))
    rows = [bench_plan(prompts, samples, actors, scheduler=n, regime=r, **kw) for r in REGIMES for n in names]
    base = {r["regime"]: r["median_ms"] for r in rows if r["scheduler"] == rows[names.index(baseline)]["scheduler"]}
    for r in rows:
        r["ratio"] = r["median_ms"] / base[r["regime"]] if base[r["regime"]] > 0 else float("nan")
    return {"prompts": prompts, "samples_per_prompt": samples, "max_actors": actors, "baseline": baseline, "rows": rows}


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


@click.group("bench")
def bench_group() -> None:
    """Benchmarks (medians of repeated runs; compare figures from one machine only)."""


@bench_group.command("plan")
@click.option("--prompts", default=1024, type=POSITIVE, show_default=True, help="Prompts in the batch.")
@click.option("--samples", default=8, type=POSITIVE, show_default=True, help="Samples per prompt (n).")
@click.option("--actors", default=64, type=GPUS, show_default=True, help="Most decode actors the scaler may choose.")
@click.option(
    "--scheduler",
    "schedulers",
    multiple=True,
    default=("rlhfless",),
    show_default=True,
    help="Scheduler name or YAML file; repeat the flag for several.",
)
@click.option(
    "--baseline",
    default="rlhfless-paper",
    show_default=True,
    help="The scheduler every figure is a ratio of (planned in the same run).",
)
@click.option("--profile", default="qwen2.5-7b-l40s", show_default=True)
@click.option("--repeat", default=5, type=REPEATS, show_default=True, help="Timed plans after one warm-up.")
@click.option("--json", "as_json", is_flag=True)
def bench_plan_cmd(
    prompts: int,
    samples: int,
    actors: int,
    schedulers: tuple[str, ...],
    baseline: str,
    profile: str,
    repeat: int,
    as_json: bool,
) -> None:
    """Median milliseconds of a full plan (predict, dedup, assign, scale, place) of fresh batches, each scheduler
    against the baseline in one run: in the first steps (no estimate measured yet) and in the steady state."""
    check_samples(prompts, samples, 2, bytes_per_sample=BYTES_PER_PLANNED_SAMPLE)  # an observed step, a planned one
    res = bench_plans(prompts, samples, actors, schedulers, baseline=baseline, profile=profile, repeat=repeat)
    if as_json:
        click.echo(dumps(res))
        return
    click.echo(
        f"{prompts} prompts x {samples} samples, up to {actors} engines ({profile}), {repeat} plans each; "
        f"x: the median over {baseline}'s in the same regime"
    )
    click.echo(
        f"{'scheduler':<22} {'regime':<12} {'counts estimated':>16} {'N':>4} {'median ms':>10} {'min ms':>8} {'x':>7}"
    )
    for r in res["rows"]:
        click.echo(
            f"{r['scheduler']:<22} {r['regime']:<12} {r['candidates']:>16g} {r['chosen_actors']:>4} "
            f"{r['median_ms']:>10.1f} {r['min_ms']:>8.1f} {r['ratio']:>6.2f}x"
        )


@bench_group.command("predict")
@click.option("--predictor", default="model", show_default=True)
@click.option("--prompts", default=1024, type=POSITIVE, show_default=True)
@click.option("--samples", default=8, type=POSITIVE, show_default=True)
@click.option("--repeat", default=20, type=REPEATS, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def bench_predict_cmd(predictor: str, prompts: int, samples: int, repeat: int, as_json: bool) -> None:
    """Median milliseconds of one predict() on a batch, after the predictor has observed one step."""
    check_samples(prompts, samples, 2, bytes_per_sample=BYTES_PER_PLANNED_SAMPLE)  # observed, then predicted
    res = bench_predict(predictor, prompts, samples, repeat=repeat)
    if as_json:
        click.echo(dumps(res))
    else:
        click.echo(
            f"{predictor}: predict {prompts} prompts: median {res['median_ms']:.2f} ms "
            f"(min {res['min_ms']:.2f} ms, {repeat} runs)"
        )


@bench_group.command("simulate")
@click.option("--prompts", default=8192, type=POSITIVE, show_default=True)
@click.option("--samples", default=8, type=POSITIVE, show_default=True)
@click.option("--gpus", default=160, type=GPUS, show_default=True)
@click.option("--gpus-per-node", default=8, type=GPUS, show_default=True)
@click.option(
    "--scheduler",
    default="rlhfless-paper",
    show_default=True,
    help="Scheduler name or YAML file; an async one is simulated as `simulate` runs it (the whole pipeline).",
)
@click.option("--profile", default="llama-70b-8xh100", show_default=True)
@click.option("--steps", default=2, type=POSITIVE, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def bench_simulate_cmd(
    prompts: int,
    samples: int,
    gpus: int,
    gpus_per_node: int,
    scheduler: str,
    profile: str,
    steps: int,
    as_json: bool,
) -> None:
    """Wall time of one simulated step at scale (default: 20 nodes x 8 H100, Llama-70B, 8,192 x 8 samples)."""
    check_samples(prompts, samples, steps)
    res = bench_simulate(
        prompts, samples, gpus, scheduler=scheduler, profile=profile, steps=steps, gpus_per_node=gpus_per_node
    )
    if as_json:
        click.echo(dumps(res))
    else:
        walls = ", ".join(f"{w:.2f}" for w in res["step_wall_s"])
        if res["rollout_gpus"] is not None:
            click.echo(
                f"{res['scheduler']} on {gpus} GPUs ({profile}), {prompts} prompts x {samples} samples, async at "
                f"{res['rollout_gpus']} rollout GPUs: wall seconds of the whole run {sum(res['step_wall_s']):.2f} "
                f"({len(res['step_wall_s'])} pipelined steps, the split search included)"
            )
            return
        click.echo(
            f"{res['scheduler']} on {gpus} GPUs ({profile}), {prompts} prompts x {samples} samples: "
            f"wall seconds per simulated step: {walls} (max {res['max_step_wall_s']:.2f})"
        )
