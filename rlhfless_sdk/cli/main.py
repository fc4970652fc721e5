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
    GPUS,
    MAX_HISTORY,
    NON_NEGATIVE,
    POSITIVE,
    launch_option,
    model_options,
    plot_option,
    synthetic_shape_options,
)
from rlhfless_sdk.cli.args import (
    plot_path as plot_path_check,
)
from rlhfless_sdk.cli.bench import bench_group
from rlhfless_sdk.cli.drafting import drafter_options
from rlhfless_sdk.cli.report import report_cmd


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
    loaded = [f"{name} ({pm.distribution(name) or 'in-process'})" for name in pm.plugin_names()]
    click.echo(f"plugins loaded, in the order their hooks run: {', '.join(loaded)}")


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
def plan_cmd(**options: Any) -> None:
    """Plan one step of an embedded synthetic workload with each scheduler and compare the plans; for a stream
    with no split set, also the rollout/learner split a launch picks and its expected gain.

    "planned" is what each scheduler expected from its own predictions; "at true lengths" is the cost model
    applied to the plan with the samples' true lengths (an estimate; the simulator measures the step). An async
    scheduler's step is planned where the simulator runs it: on its rollout GPUs, with dedicated memory.
    """
    from rlhfless_sdk.cli.plan_command import PlanRequest, plan_results, print_plans

    request = PlanRequest(**options)
    print_plans(request, plan_results(get_plugin_manager().registry, request))


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
    from rlhfless_sdk.cli.simulate_command import simulate_main

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
def compare_predictors_cmd(**options: Any) -> None:
    """Replay a workload in step order and score each length predictor (MAE, Acc@50/100, Kendall tau)."""
    from rlhfless_sdk.cli.compare import compare_main

    compare_main(get_plugin_manager().registry, **options)


main.add_command(bench_group)
main.add_command(report_cmd)

if __name__ == "__main__":
    main()
