"""The ``rlhfless`` command line."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from rlhfless_sdk import __version__
from rlhfless_sdk.api.config import config_json_schema, read_scheduler_config
from rlhfless_sdk.api.errors import ConfigError, RlhflessError
from rlhfless_sdk.api.kinds import POLICY_KINDS
from rlhfless_sdk.api.plugins import get_plugin_manager
from rlhfless_sdk.api.records import dumps
from rlhfless_sdk.cli.args import (
    BYTES_PER_PLANNED_SAMPLE,
    GPUS,
    MAX_HISTORY,
    NON_NEGATIVE,
    POSITIVE,
    check_samples,
    launch_option,
    model_options,
    plot_option,
    run_profile,
    synthetic_shape_options,
)
from rlhfless_sdk.cli.args import (
    plot_path as plot_path_check,
)
from rlhfless_sdk.cli.bench import bench_group
from rlhfless_sdk.cli.drafting import drafter_options
from rlhfless_sdk.cli.report import report_cmd
from rlhfless_sdk.rollout.modes import STREAM, Mode, consults_predictor, mode_for


class _Group(click.Group):
    """Turns any RlhflessError into one clear line on stderr and exit status 2 (Ctrl-C into exit status 130),
    and adds the commands that
    plugins register (``rlhfless_register_commands``: the OpenRLHF adapter's ``demo`` and ``profile``)."""

    def _plugin_commands(self) -> dict[str, click.Command]:
        try:
            commands = get_plugin_manager().registry.commands
        except RlhflessError as exc:  # a broken plugin must not take the core commands down with it
            click.echo(f"warning: plugin commands unavailable: {exc}", err=True)
            return {}
        return {name: cmd for name, (cmd, _plugin) in commands.items() if name not in self.commands}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self._plugin_commands()})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return super().get_command(ctx, cmd_name) or self._plugin_commands().get(cmd_name)

    def resolve_command(self, ctx: click.Context, args: list[str]):  # type: ignore[override]
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as exc:
            note = get_plugin_manager().registry.autoload_note
            if note and args and not args[0].startswith("-"):  # e.g. `demo` comes from the adapter's plugin
                raise click.UsageError(f"{exc.message} Plugin commands may be missing: {note}.", ctx) from None
            raise

    def invoke(self, ctx: click.Context):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except RlhflessError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("\ninterrupted", err=True)
            sys.exit(130)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="rlhfless")
def main() -> None:
    """RLHFless: plan and simulate RLHF rollout scheduling, and drive OpenRLHF with it."""


@main.command("plugins")
@click.option(
    "--json", "as_json", is_flag=True, help="Print a JSON list of {kind, name, plugin, distribution, description}."
)
def plugins_cmd(as_json: bool) -> None:
    """List every registered policy, scheduler and plugin command, by kind, with the plugin providing it."""
    pm = get_plugin_manager()
    reg = pm.registry
    rows = []
    for kind in POLICY_KINDS:
        for name in reg.names(kind):
            spec = reg.policy(kind, name)
            rows.append({"kind": kind, "name": name, "plugin": spec.plugin, "description": spec.description})
    for name in reg.names("scheduler"):
        preset = reg.schedulers[name]
        group = preset.config.group
        rows.append(
            {
                "kind": "scheduler",
                "name": name,
                "plugin": preset.plugin,
                "description": preset.config.description,
                "group": group,
            }
        )
    for name, (cmd, plugin) in sorted(reg.commands.items()):
        rows.append({"kind": "command", "name": name, "plugin": plugin, "description": cmd.get_short_help_str(60)})
    for row in rows:
        row["distribution"] = pm.distribution(row["plugin"])
    if as_json:
        click.echo(dumps(rows, indent=2))
        return
    if not rows:
        click.echo(f"no policies registered. {reg.autoload_note}".strip())
        return
    width = max(len(r["name"]) for r in rows)
    pwidth = max(len(r["plugin"]) for r in rows)
    titles = {
        "scheduler": "scheduler (presets: what OpenRLHF runs, `--scheduler NAME`)",
        "scheduler (baseline)": "scheduler (baselines: frameworks' own behaviour, measured against)",
        "scheduler (research)": "scheduler (research set: simulated only, no OpenRLHF learner runs it)",
    }
    for kind in (*POLICY_KINDS, *titles, "command"):
        kind_rows = [r for r in rows if _listed_as(r) == kind]
        if not kind_rows:
            continue
        click.secho(f"{titles.get(kind, kind)}:", bold=True)
        for r in kind_rows:
            click.echo(f"  {r['name']:<{width}}  {r['plugin']:<{pwidth}}  {r['description']}")


def _listed_as(row: dict) -> str:
    """The heading a ``plugins`` row is listed under: its kind, a scheduler's group beside it."""
    group = row.get("group", "preset")
    return row["kind"] if group == "preset" else f"{row['kind']} ({group})"


@main.group("config")
def config_group() -> None:
    """Validate scheduler configs and print their schema."""


@config_group.command("validate")
@click.argument("files", nargs=-1, required=True, type=click.Path(path_type=Path))
def config_validate(files: tuple[Path, ...]) -> None:
    """Check scheduler config FILES; exit 1 naming the YAML path of each bad field."""
    registry = get_plugin_manager().registry
    bad = 0
    for path in files:
        try:
            cfg = read_scheduler_config(path, registry)
        except ConfigError as exc:
            bad += 1
            click.echo(str(exc), err=True)
        else:
            click.echo(f"{path}: ok (scheduler {cfg.name!r})")
    if bad:
        sys.exit(1)


@config_group.command("schema")
def config_schema() -> None:
    """Print the JSON Schema of a scheduler config file."""
    click.echo(dumps(config_json_schema(), indent=2))


@config_group.command("show")
@click.argument("name")
def config_show(name: str) -> None:
    """Print the registered scheduler preset NAME as YAML."""
    import yaml

    cfg = get_plugin_manager().registry.scheduler(name)
    click.echo(yaml.safe_dump(cfg.model_dump(mode="json", exclude_defaults=False), sort_keys=False))


@main.command("plan")
@click.option(
    "--scheduler",
    "schedulers",
    multiple=True,
    default=("openrlhf", "rlhfless"),
    show_default=True,
    help="Scheduler name or YAML file; repeat to compare.",
)
@click.option(
    "--prompts", default=256, type=POSITIVE, show_default=True, help="Prompts per step (synthetic GSM8K-style)."
)
@click.option("--samples", default=8, type=POSITIVE, show_default=True, help="Samples per prompt (GRPO n).")
@click.option("--gpus", default=16, type=GPUS, show_default=True, help="GPUs in the cluster.")
@click.option("--gpus-per-node", default=8, type=GPUS, show_default=True)
@click.option("--profile", default="qwen2.5-7b-l40s", show_default=True, help="Profile name or YAML file.")
@click.option(
    "--history",
    default=1,
    type=click.IntRange(0, MAX_HISTORY),
    show_default=True,
    help="Earlier steps the predictor has seen.",
)
@click.option("--seed", default=0, type=NON_NEGATIVE, show_default=True)
@model_options(algo=False)
@click.option(
    "--max-actors",
    type=GPUS,
    default=None,
    help="Most decode actors a scheduler that scales may plan; beyond --gpus: serverless burst actors (needs "
    "--allow-burst).",
)
@click.option(
    "--allow-burst",
    "allow_burst_engines",
    is_flag=True,
    help="Let presets with `burst:` (or --max-actors) plan serverless engines beyond the fleet, as `simulate "
    "--allow-burst` runs them. Off: every scheduler plans on the fleet (--gpus), as `simulate` runs it.",
)
@click.option(
    "--rollout-gpus",
    type=GPUS,
    default=None,
    metavar="N",
    help="Async schedulers (openrlhf-async...): the GPUs that only generate, where their step is planned (default: "
    "the preset's rollout_gpus; `simulate` finds the fastest split).",
)
@launch_option
@click.option(
    "--trace",
    type=click.Path(exists=True),
    default=None,
    help="A trace of your own run (`--scheduler.trace` of an earlier launch): a stream's split is picked on it "
    "(default: the synthetic workload of --prompts and --samples, over --split-steps steps).",
)
@click.option(
    "--split-steps", default=5, type=POSITIVE, show_default=True, help="Steps of the workload a split is picked on."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per scheduler.")
def plan_cmd(
    schedulers: tuple[str, ...],
    prompts: int,
    samples: int,
    gpus: int,
    gpus_per_node: int,
    profile: str,
    history: int,
    seed: int,
    memory: str,
    dedicated_kv_tokens: int | None,
    colocated_kv_tokens: int | None,
    max_actors: int | None,
    allow_burst_engines: bool,
    rollout_gpus: int | None,
    launch: str,
    trace: str | None,
    split_steps: int,
    as_json: bool,
) -> None:
    """Plan one step of an embedded synthetic workload with each scheduler and compare the plans; for a stream
    with no split set, also the rollout/learner split a launch picks and its expected gain.

    "planned" is what each scheduler expected from its own predictions; "at true lengths" is the cost model
    applied to the plan with the samples' true lengths (an estimate; the simulator measures the step). An async
    scheduler's step is planned where the simulator runs it: on its rollout GPUs, with dedicated memory.
    """
    from dataclasses import replace

    from rlhfless_sdk.api.config import SchedulerConfig
    from rlhfless_sdk.api.records import Cluster
    from rlhfless_sdk.cli.plan_report import pick_split, plan_synthetic, summary
    from rlhfless_sdk.cli.simulate import check_capacity, comparable_configs, kv_flag
    from rlhfless_sdk.planning.planner import StepPlanner, planner_for, rollout_planner_for
    from rlhfless_sdk.workloads.synthetic import SyntheticWorkload
    from rlhfless_sdk.workloads.traces import Workload, WorkloadStep

    registry = get_plugin_manager().registry
    dedicated = run_profile(profile, dedicated_kv_tokens, colocated_kv_tokens)  # engines on GPUs of their own
    prof = run_profile(profile, dedicated_kv_tokens, colocated_kv_tokens, memory)  # a synchronous engine's
    gpa = prof.gpus_per_actor
    configs = comparable_configs(schedulers, registry, max_actors, allow_burst_engines, gpus, gpa, launch)
    modes = {c.name: mode_for(c, registry) for c in configs}
    if rollout_gpus is not None and not any(m.pipelined for m in modes.values()):
        raise click.BadParameter(
            f"{rollout_gpus}: plans a pipeline's step on its rollout GPUs, and every scheduler here is synchronous "
            f"({', '.join(c.name for c in configs)}): drop it, or add an async or stream scheduler",
            param_hint="'--rollout-gpus'",
        )
    cluster = Cluster.of_gpus(gpus, gpus_per_node)
    picked = {
        c.name: pick_split(
            c, registry, dedicated, cluster, trace=trace, prompts=prompts, samples=samples, steps=split_steps, seed=seed
        )
        for c in configs
        if modes[c.name].pipeline == STREAM
        and not modes[c.name].elastic
        and rollout_gpus is None
        and c.pipeline.rollout_gpus is None
    }
    splits = {
        c.name: picked[c.name].rollout_gpus
        if c.name in picked
        else rollout_split(c, modes[c.name], rollout_gpus, gpus, gpa)
        for c in configs
    }
    workload = SyntheticWorkload(prompts, samples, seed=seed)
    check_samples(prompts, samples, history + 1, steps_flag="--history", bytes_per_sample=BYTES_PER_PLANNED_SAMPLE)
    batch, lengths = replace(workload, step=history).batch()
    planned_step = Workload(f"synthetic-{prompts}x{samples}", [WorkloadStep(history, batch, lengths)])
    if any(r is None for r in splits.values()):
        check_capacity(planned_step, prof.kv_capacity_tokens, kv_flag(memory))
    else:
        check_capacity(planned_step, dedicated.kv_capacity_tokens, "--dedicated-kv-tokens")

    def planner_of(config: SchedulerConfig) -> tuple[StepPlanner, int | None]:
        r = splits[config.name]
        if r is not None:  # as the simulator runs an async pipeline: its engines alone on r GPUs, dedicated memory
            return rollout_planner_for(config, dedicated, r, gpus_per_node, registry), r
        return planner_for(config, prof, cluster, registry), None

    planned = plan_synthetic(configs, workload, planner_of, history)
    results = [summary(p) for p in planned]
    for r in results:
        if r["scheduler"] in picked:
            r["split_plan"] = picked[r["scheduler"]].as_dict()
    if as_json:
        click.echo(dumps({"profile": profile, "gpus": gpus, "schedulers": results}, indent=2))
        return
    click.echo(
        f"{prompts} prompts x {samples} samples, {gpus} GPUs ({gpus_per_node}/node), profile {profile}; "
        "cost-model estimates: planned (own predictions) and at the true lengths; "
        "speedup and GPU-s change vs the first scheduler, at the true lengths"
    )
    base = results[0]
    click.echo(f"{'':<20}{'planned':^14}{'at true lengths':^28}")
    click.echo(
        f"{'scheduler':<16}{'N':>4}{'time s':>7}{'GPU-s':>7}{'time s':>8}{'GPU-s':>7}{'speedup GPU-s':>15}"
        f"{'prefill tokens':>20}{'MAE':>6}{'plan ms':>9}"
    )
    for r in results:
        speed = base["est_time_s"] / r["est_time_s"] if r["est_time_s"] else float("nan")
        cost = 1 - r["est_gpu_seconds"] / base["est_gpu_seconds"] if base["est_gpu_seconds"] else 0.0
        click.echo(
            f"{r['scheduler']:<16}{r['num_actors']:>4}{r['planned_time_s']:>7.1f}{r['planned_gpu_seconds']:>7.0f}"
            f"{r['est_time_s']:>8.1f}{r['est_gpu_seconds']:>7.0f}{f'{speed:.2f}x {-cost:+.0%}':>15}"
            f"{r['prefill_tokens_before']:>12}->{r['prefill_tokens_after']:<6}{r['prediction_mae']:>6.0f}"
            f"{r['planner_ms']:>9.1f}"
        )
        if r.get("split_plan"):
            click.echo(f"  {r['split_plan']['line']}")
        if r["rollout_gpus"]:
            click.echo(
                f"  async: its engines' step on {r['rollout_gpus']} rollout GPUs (dedicated memory); the other "
                f"{gpus - r['rollout_gpus']} learn the batch before, beside it"
            )
        if r["fallbacks"]:
            click.echo(f"  fell back: {', '.join(r['fallbacks'])}")


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


@main.command("simulate")
@click.option("--trace", type=click.Path(exists=True), help="Trace file or folder (CSV or JSONL).")
@click.option(
    "--prompts", default=256, type=POSITIVE, show_default=True, help="Synthetic workload (no --trace): prompts/step."
)
@click.option("--samples", default=8, type=POSITIVE, show_default=True, help="Synthetic workload: samples per prompt.")
@click.option("--steps", default=None, type=POSITIVE, help="Steps to replay (default: all of a trace, 5 synthetic).")
@synthetic_shape_options
@click.option("--seed", default=0, type=NON_NEGATIVE, show_default=True)
@click.option(
    "--scheduler", "schedulers", multiple=True, help="Name or YAML file; repeat. Default: openrlhf, rlhfless."
)
@click.option("--ablation", is_flag=True, help="Run the paper's ablation points and the oracle bound.")
@click.option("--profile", default="qwen2.5-7b-l40s", show_default=True, help="Profile name or YAML file.")
@click.option("--gpus", default=16, type=GPUS, show_default=True)
@click.option("--gpus-per-node", default=8, type=GPUS, show_default=True)
@model_options()
@click.option(
    "--max-actors",
    type=GPUS,
    default=None,
    help="Most decode actors a scheduler that scales may run; beyond the fleet (--gpus) they are serverless burst "
    "actors (needs --allow-burst). Schedulers with a fixed engine count keep the fleet. Default: the fleet.",
)
@click.option(
    "--allow-burst",
    "allow_burst_engines",
    is_flag=True,
    help="Let presets with `burst:` (or --max-actors) run serverless engines beyond the fleet, billed while held. "
    "Off: every scheduler runs on the same peak GPUs (--gpus).",
)
@click.option(
    "--rollout-gpus",
    default=None,
    metavar="N|best",
    help="Async schedulers (openrlhf-async...): GPUs that only generate; 'best': run the whole workload at every "
    "split and keep the fastest. Default: every split tried on the first 3 steps, the fastest run on all. A stream "
    "with no split set runs at the split a launch picks (on an earlier run: the same recipe, another seed).",
)
@launch_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object with a `schedulers` list.")
@plot_option("cost against time per step")
@click.option(
    "--frontier-plot",
    type=click.Path(path_type=Path),
    callback=plot_path_check,
    default=None,
    help="Draw run time against GPU-seconds: the baselines (fixed engine counts) at several cluster sizes as "
    "lines, this run's schedulers as points (PNG, PDF, SVG or JPEG).",
)
@click.option(
    "--frontier-gpus",
    default=None,
    metavar="N,N,...",
    help="Cluster sizes of the baselines on --frontier-plot (default: --gpus, 1.25x and 1.5x it).",
)
@click.option(
    "--frontier/--no-frontier",
    default=True,
    show_default=True,
    help="Also simulate every candidate actor count: the time-cost frontier of each step.",
)
@click.option(
    "--prefix-caching",
    is_flag=True,
    help="The engines run vLLM's prefix cache (OpenRLHF's --vllm.enable_prefix_caching; off by default, as in "
    "OpenRLHF): a sample whose prompt its engine prefilled before (a group-mate's) reads it from the cache.",
)
@click.option(
    "--tensor-parallel",
    default=1,
    type=POSITIVE,
    show_default=True,
    help="Every engine sharded over this many GPUs of a node (OpenRLHF's --vllm.tensor_parallel_size), derived from "
    "a one-GPU profile's tensor_parallel block: weights and KV heads split, all-reduces over the node's links.",
)
@click.option(
    "--plan-time",
    "plan_s",
    type=click.FloatRange(min=0.0),
    default=None,
    help="Seconds charged to each step for making its plan (its engines start after it). Default: the plan's own "
    "wall time on this machine, as a launch pays it; a fixed figure makes runs repeat to the last digit.",
)
@drafter_options[0]
@drafter_options[1]
def simulate_cmd(**kw) -> None:
    """Replay a workload step by step under each scheduler; time, GPU-seconds, speedup, cost reduction."""
    from rlhfless_sdk.cli.simulate import simulate_main

    simulate_main(get_plugin_manager().registry, **kw)


@main.command("compare-predictors")
@click.option("--trace", type=click.Path(exists=True), help="Trace file or folder (default: synthetic workload).")
@click.option(
    "--predictors",
    default="ewma,model,hybrid,group,prompt-length",
    show_default=True,
    help="Comma-separated predictor names.",
)
@click.option("--prompts", default=256, type=POSITIVE, show_default=True, help="Synthetic workload: prompts per step.")
@click.option("--samples", default=8, type=POSITIVE, show_default=True, help="Synthetic workload: samples per prompt.")
@click.option(
    "--steps",
    default=None,
    type=POSITIVE,
    help="Steps to replay, at least 2: the first is not scored (default: all of a trace, 5 synthetic).",
)
@click.option("--seed", default=0, type=NON_NEGATIVE, show_default=True)
@click.option(
    "--scheduler", default="rlhfless-paper", show_default=True, help="Scheduler the predictors are swapped into."
)
@click.option("--profile", default="qwen2.5-7b-l40s", show_default=True)
@click.option("--gpus", default=16, type=GPUS, show_default=True)
@click.option("--gpus-per-node", default=8, type=GPUS, show_default=True)
@click.option("--simulate/--no-simulate", default=True, show_default=True, help="Also simulate each predictor.")
@synthetic_shape_options
@model_options()
@click.option("--json", "as_json", is_flag=True, help="One JSON object with a `predictors` list.")
@plot_option("a comparison chart")
def compare_predictors_cmd(
    trace: str | None,
    predictors: str,
    prompts: int,
    samples: int,
    steps: int | None,
    seed: int,
    scheduler: str,
    profile: str,
    gpus: int,
    gpus_per_node: int,
    simulate: bool,
    memory: str,
    dedicated_kv_tokens: int | None,
    colocated_kv_tokens: int | None,
    algo: str,
    as_json: bool,
    plot_path: Path | None,
    **shape: Any,
) -> None:
    """Replay a workload in step order and score each length predictor (MAE, Acc@50/100, Kendall tau)."""
    from rlhfless_sdk.api.config import PolicyRef
    from rlhfless_sdk.cli.compare import compare_predictors
    from rlhfless_sdk.cli.simulate import check_workload_flags, engine_workload, make_cluster
    from rlhfless_sdk.simulation.simulator import Simulator
    from rlhfless_sdk.workloads.traces import workload_summary

    registry = get_plugin_manager().registry
    refs = [PolicyRef(name=n.strip()) for n in predictors.split(",") if n.strip()]
    if not refs:
        raise click.BadParameter(
            f"{predictors!r} names no predictor; give one or more, comma-separated (e.g. ewma,model)",
            param_hint="'--predictors'",
        )
    for ref in refs:
        registry.policy("predictor", ref.name)  # fail before any work on an unknown name
    if steps == 1:
        raise click.BadParameter(
            "1 step leaves nothing to score: each predictor is scored on the steps after the first (it sees only "
            "earlier ones); give at least 2",
            param_hint="'--steps'",
        )
    check_workload_flags(trace, steps, shape.get("length_growth", 1.0))
    base = registry.resolve(scheduler)
    if simulate and not consults_predictor(base, registry):
        why = (
            "a stream never plans a step: its engines take groups as they free up"
            if mode_for(base, registry).pipeline == "stream"
            else "none of its policies reads a predicted length"
        )
        raise click.BadParameter(
            f"scheduler {base.name!r} consults no predictor ({why}), so every predictor would simulate alike; "
            "choose one whose policies read predictions (rlhfless-paper, rlhfless), or pass --no-simulate to score "
            "the predictors' accuracy only",
            param_hint="'--scheduler'",
        )
    prof = run_profile(profile, dedicated_kv_tokens, colocated_kv_tokens, memory)
    workload = engine_workload(trace, prompts, samples, steps, seed, prof, memory, shape)
    if len(workload.steps) < 2:
        raise click.BadParameter(
            f"trace {trace} holds 1 step: nothing to score (each predictor is scored on the steps after the "
            "first); give a trace of at least 2 steps",
            param_hint="'--trace' / '--steps'",
        )
    run_algo = None if algo == "auto" else algo
    sim = Simulator(prof, make_cluster(gpus, gpus_per_node), registry=registry, algo=run_algo) if simulate else None
    if sim is not None and (refused := sim.refusal(base)) is not None:
        raise click.BadParameter(refused, param_hint="'--scheduler'")
    with click.progressbar(length=len(refs), label="predictors", file=sys.stderr, hidden=as_json) as bar:
        rows = compare_predictors(registry, refs, workload, sim, base, on_done=lambda _n: bar.update(1))
    meta = {"workload": workload_summary(workload), "scheduler": base.name, "profile": profile, "gpus": gpus}
    if as_json:
        click.echo(dumps({**meta, "predictors": rows}, indent=2))
    else:
        w = meta["workload"]
        click.echo(
            f"workload {w['name']}: {w['steps']} steps x {w['prompts_per_step']} prompts; accuracy over "
            f"steps 2-{w['steps']} (each predictor sees only earlier steps)"
        )
        head = f"{'predictor':<16}{'MAE':>8}{'Acc@50':>8}{'Acc@100':>9}{'Kendall':>9}"
        if simulate:
            head += f"{'sim time s':>12}{'sim GPU-s':>11}{'migr':>6}"
        click.echo(head)
        for r in rows:
            line = f"{r['name']:<16}{r['mae']:>8.1f}{r['acc50']:>8.1%}{r['acc100']:>9.1%}{r['kendall_tau']:>9.3f}"
            if simulate:
                line += f"{r['sim_time_s']:>12.1f}{r['sim_gpu_seconds']:>11.0f}{r['sim_migrations']:>6}"
            click.echo(line)
    if plot_path is not None:
        from rlhfless_sdk.cli.compare import plot_comparison

        plot_comparison(rows, plot_path, f"{workload.name}: predictors in the {base.name} scheduler")


main.add_command(bench_group)
main.add_command(report_cmd)

if __name__ == "__main__":
    main()
