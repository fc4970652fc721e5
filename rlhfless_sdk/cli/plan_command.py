"""``rlhfless plan`` in two parts: the plans (each scheduler plans one step of a synthetic workload after the steps
its predictor has seen; a stream with no split set also gets the split a launch picks) and their table."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import click

from rlhfless_sdk.api.config import SchedulerConfig
from rlhfless_sdk.api.plugins import Registry
from rlhfless_sdk.api.records import Cluster, TimePerTokenProfile, dumps
from rlhfless_sdk.cli.args import BYTES_PER_PLANNED_SAMPLE, check_samples, engine_profiles
from rlhfless_sdk.cli.plan_report import pick_split, plan_synthetic, summary
from rlhfless_sdk.cli.simulate import check_capacity, comparable_configs, kv_flag
from rlhfless_sdk.planning.planner import StepPlanner, planner_for, rollout_planner_for
from rlhfless_sdk.rollout.modes import STREAM, Mode, mode_for
from rlhfless_sdk.workloads.synthetic import SyntheticWorkload
from rlhfless_sdk.workloads.traces import Workload, WorkloadStep


@dataclass(frozen=True)
class PlanRequest:
    """``rlhfless plan``'s options (its parameters, by name)."""

    schedulers: tuple[str, ...]
    prompts: int
    samples: int
    gpus: int
    gpus_per_node: int
    profile: str
    history: int
    seed: int
    memory: str
    dedicated_kv_tokens: int | None
    colocated_kv_tokens: int | None
    max_actors: int | None
    allow_burst_engines: bool
    rollout_gpus: int | None
    launch: str
    trace: str | None
    split_steps: int
    as_json: bool

    def profiles(self) -> tuple[TimePerTokenProfile, TimePerTokenProfile]:
        """The profile on engines of their own (dedicated memory), and a synchronous engine's (``memory``)."""
        return engine_profiles(self.profile, self.dedicated_kv_tokens, self.colocated_kv_tokens, self.memory)


def plan_results(registry: Registry, request: PlanRequest) -> list[dict[str, Any]]:
    """Each scheduler's plan of the step after ``history`` steps, summarised (``plan_report.summary``)."""
    r = request
    dedicated, prof = r.profiles()
    configs = comparable_configs(
        r.schedulers, registry, r.max_actors, r.allow_burst_engines, r.gpus, prof.gpus_per_actor, r.launch
    )
    cluster = Cluster.of_gpus(r.gpus, r.gpus_per_node)
    picked, splits = step_splits(registry, request, configs, dedicated, cluster)
    workload = SyntheticWorkload(r.prompts, r.samples, seed=r.seed)
    check_samples(
        r.prompts, r.samples, r.history + 1, steps_flag="--history", bytes_per_sample=BYTES_PER_PLANNED_SAMPLE
    )
    batch, lengths = replace(workload, step=r.history).batch()
    planned_step = Workload(f"synthetic-{r.prompts}x{r.samples}", [WorkloadStep(r.history, batch, lengths)])
    if any(s is None for s in splits.values()):
        check_capacity(planned_step, prof.kv_capacity_tokens, kv_flag(r.memory))
    else:
        check_capacity(planned_step, dedicated.kv_capacity_tokens, "--dedicated-kv-tokens")

    def planner_of(config: SchedulerConfig) -> tuple[StepPlanner, int | None]:
        split = splits[config.name]
        if split is not None:  # as the simulator runs an async pipeline: its engines alone on r GPUs, dedicated memory
            return rollout_planner_for(config, dedicated, split, r.gpus_per_node, registry), split
        return planner_for(config, prof, cluster, registry), None

    results = [summary(p) for p in plan_synthetic(configs, workload, planner_of, r.history)]
    for result in results:
        if result["scheduler"] in picked:
            result["split_plan"] = picked[result["scheduler"]].as_dict()
    return results


def step_splits(
    registry: Registry,
    request: PlanRequest,
    configs: list[SchedulerConfig],
    dedicated: TimePerTokenProfile,
    cluster: Cluster,
) -> tuple[dict[str, Any], dict[str, int | None]]:
    """Where each scheduler's step is planned: the splits a launch picks for the streams with none set (by name),
    and every scheduler's rollout GPUs (None: synchronous, on the whole cluster)."""
    r, gpa = request, dedicated.gpus_per_actor
    modes = {c.name: mode_for(c, registry) for c in configs}
    if r.rollout_gpus is not None and not any(m.pipelined for m in modes.values()):
        raise click.BadParameter(
            f"{r.rollout_gpus}: plans a pipeline's step on its rollout GPUs, and every scheduler here is synchronous "
            f"({', '.join(c.name for c in configs)}): drop it, or add an async or stream scheduler",
            param_hint="'--rollout-gpus'",
        )
    picks = [
        c
        for c in configs
        if modes[c.name].pipeline == STREAM
        and not modes[c.name].elastic
        and r.rollout_gpus is None
        and c.pipeline.rollout_gpus is None
    ]
    picked = {
        c.name: pick_split(
            c,
            registry,
            dedicated,
            cluster,
            trace=r.trace,
            prompts=r.prompts,
            samples=r.samples,
            steps=r.split_steps,
            seed=r.seed,
        )
        for c in picks
    }
    splits = {
        c.name: picked[c.name].rollout_gpus
        if c.name in picked
        else rollout_split(c, modes[c.name], r.rollout_gpus, r.gpus, gpa)
        for c in configs
    }
    return picked, splits


def print_plans(request: PlanRequest, results: list[dict[str, Any]]) -> None:
    """The plans as JSON, or as a table against the first scheduler, each with its split and its fallbacks."""
    r = request
    if r.as_json:
        click.echo(dumps({"profile": r.profile, "gpus": r.gpus, "schedulers": results}, indent=2))
        return
    click.echo(
        f"{r.prompts} prompts x {r.samples} samples, {r.gpus} GPUs ({r.gpus_per_node}/node), profile {r.profile}; "
        "cost-model estimates: planned (own predictions) and at the true lengths; "
        "speedup and GPU-s change vs the first scheduler, at the true lengths"
    )
    base = results[0]
    click.echo(f"{'':<20}{'planned':^14}{'at true lengths':^28}")
    click.echo(
        f"{'scheduler':<16}{'N':>4}{'time s':>7}{'GPU-s':>7}{'time s':>8}{'GPU-s':>7}{'speedup GPU-s':>15}"
        f"{'prefill tokens':>20}{'MAE':>6}{'plan ms':>9}"
    )
    for row in results:
        speed = base["est_time_s"] / row["est_time_s"] if row["est_time_s"] else float("nan")
        cost = 1 - row["est_gpu_seconds"] / base["est_gpu_seconds"] if base["est_gpu_seconds"] else 0.0
        click.echo(
            f"{row['scheduler']:<16}{row['num_actors']:>4}{row['planned_time_s']:>7.1f}"
            f"{row['planned_gpu_seconds']:>7.0f}{row['est_time_s']:>8.1f}{row['est_gpu_seconds']:>7.0f}"
            f"{f'{speed:.2f}x {-cost:+.0%}':>15}{row['prefill_tokens_before']:>12}->{row['prefill_tokens_after']:<6}"
            f"{row['prediction_mae']:>6.0f}{row['planner_ms']:>9.1f}"
        )
        if row.get("split_plan"):
            click.echo(f"  {row['split_plan']['line']}")
        if row["rollout_gpus"]:
            click.echo(
                f"  async: its engines' step on {row['rollout_gpus']} rollout GPUs (dedicated memory); the other "
                f"{r.gpus - row['rollout_gpus']} learn the batch before, beside it"
            )
        if row["fallbacks"]:
            click.echo(f"  fell back: {', '.join(row['fallbacks'])}")


def rollout_split(config: Any, mode: Mode, rollout_gpus: int | None, gpus: int, gpa: int) -> int | None:
    """Where `plan` plans an async scheduler's step: ``--rollout-gpus`` or its preset's ``rollout_gpus`` (checked
    as the simulator does); None for a synchronous one. An async one with neither is refused: its split is
    what `simulate` searches for."""
    if not mode.pipelined:
        return None
    r = rollout_gpus if rollout_gpus is not None else config.pipeline.rollout_gpus
    if r is None:
        raise click.BadParameter(
            f"scheduler {config.name!r} is {'an' if mode.pipeline == 'async' else 'a'} {mode.pipeline} "
            "pipeline (its engines on GPUs of their own, "
            "the rest learning): say how many of the --gpus generate, or run `rlhfless simulate`, which finds the "
            "fastest split",
            param_hint="'--rollout-gpus'",
        )
    if r % gpa or not gpa <= r <= gpus - 1:
        raise click.BadParameter(
            f"{r} must be a multiple of {gpa} (GPUs per engine) and leave at least one of the {gpus} GPUs to learn "
            f"(scheduler {config.name!r})",
            param_hint="'--rollout-gpus'",
        )
    return r
