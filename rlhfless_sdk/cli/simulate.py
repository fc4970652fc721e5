"""``rlhfless simulate``: replay a workload under several schedulers and compare time and cost."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click
import numpy as np

from rlhfless_sdk.api.config import SchedulerConfig
from rlhfless_sdk.api.options import distinct
from rlhfless_sdk.api.plugins import Registry
from rlhfless_sdk.api.records import Cluster
from rlhfless_sdk.cli.args import MAX_GPUS, check_samples
from rlhfless_sdk.cli.progress import progress as progress_bar
from rlhfless_sdk.rollout.modes import Mode
from rlhfless_sdk.simulation.results import SimulationResult
from rlhfless_sdk.simulation.simulator import Simulator, equal_peak
from rlhfless_sdk.workloads.synthetic import SyntheticWorkload
from rlhfless_sdk.workloads.traces import (
    MAX_TOKENS,
    Workload,
    capacity_words,
    load_trace,
    synthetic_workload,
)

#: The paper's ablation points, then the bound.
ABLATION = ["ablation-raw", "ablation-dedup", "ablation-assign", "ablation-scale", "oracle"]


def allow_burst(config: SchedulerConfig, max_actors: int | None) -> SchedulerConfig:
    """``--max-actors``: a scheduler that scales may run up to that many decode actors (beyond the fleet: burst
    actors); one with a fixed engine count (the baselines) keeps the fleet, as OpenRLHF and verl do."""
    if max_actors is None or config.policy("scaler").name == "fixed":
        return config
    return config.derive(max_actors=max(max_actors, config.min_actors))


def make_cluster(gpus: int, gpus_per_node: int) -> Cluster:
    return Cluster.of_gpus(gpus, gpus_per_node)


def _ratio(a: float, b: float) -> float:
    return a / b if b else (1.0 if a == b else float("nan"))  # nan: shown as null in JSON


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.0%}"


def compare(results: list[SimulationResult]) -> list[dict[str, Any]]:
    """Totals per scheduler, with speedup and cost reduction against the first one."""
    base = results[0].totals()
    out = []
    for r in results:
        tot = r.totals()
        steady = tot["steady_step_s"]
        out.append(
            {
                "name": r.scheduler,
                **tot,
                "speedup": _ratio(base["total_time_s"], tot["total_time_s"]),
                # undefined (None) with fewer than 3 steps
                "speedup_steady": _ratio(base["steady_step_s"], steady)
                if steady is not None and base["steady_step_s"] is not None
                else None,
                "cost_reduction": 1.0 - _ratio(tot["total_gpu_seconds"], base["total_gpu_seconds"]),
                "cost_reduction_vs_serverful": 1.0
                - _ratio(tot["total_gpu_seconds"], base["total_gpu_seconds_serverful"]),
                "split_search": r.split_search,
                "split_plan": r.split_plan,
                "stream": r.stream,
                "drafter": r.drafter,
                "steps": [
                    {**s.report.model_dump(), **({"frontier": s.frontier} if s.frontier is not None else {})}
                    for s in r.steps
                ],
            }
        )
    return out


def comparable_configs(
    names: Sequence[str],
    registry: Registry,
    max_actors: int | None,
    allow_burst_engines: bool,
    gpus: int,
    gpus_per_actor: int,
    launch: str = "sync",
) -> list[SchedulerConfig]:
    """The schedulers ``names`` as `simulate` and `plan` run them: on the fleet's peak GPUs (``equal_peak``) unless
    burst engines are allowed, ``--max-actors`` applied to the ones that scale (beyond the fleet only with
    ``--allow-burst``); ``launch``: as a synchronous launch runs them, an async one (a scheduler with an
    ``async_launch`` form runs that, named ``NAME.async``), or both (the async form after each)."""
    if max_actors is not None and max_actors * gpus_per_actor > MAX_GPUS:
        raise click.BadParameter(
            f"{max_actors} actors of {gpus_per_actor} GPUs need {max_actors * gpus_per_actor:,} GPUs, more than the "
            f"{MAX_GPUS:,} a cluster may have",
            param_hint="'--max-actors'",
        )
    fleet_actors = gpus // gpus_per_actor
    if max_actors is not None and max_actors > fleet_actors and not allow_burst_engines:
        raise click.ClickException(
            f"--max-actors {max_actors} is beyond the fleet's {fleet_actors} engines on --gpus {gpus}: add "
            "--allow-burst to run burst engines (billed while held; the row is flagged as holding more GPUs)"
        )
    configs = launched(distinct([registry.resolve(n) for n in names], names), registry, launch)
    configs = [allow_burst(c, max_actors) for c in configs]
    if not allow_burst_engines:
        for c in configs:
            if c.min_actors > fleet_actors:
                raise click.ClickException(
                    f"scheduler {c.name!r} has min_actors {c.min_actors}, beyond the fleet's {fleet_actors} engines "
                    f"of {gpus_per_actor} GPU(s) on --gpus {gpus}: lower min_actors, give more --gpus, or add "
                    "--allow-burst to run the rest as burst engines (billed while held; the row is flagged as "
                    "holding more GPUs)"
                )
        configs = [equal_peak(c, fleet_actors) for c in configs]
    return configs


def launched(configs: Sequence[SchedulerConfig], registry: Registry, launch: str) -> list[SchedulerConfig]:
    """``configs`` as a ``launch`` (sync, async or both) runs them (see ``comparable_configs``)."""
    out: list[SchedulerConfig] = []
    for c in configs:
        form = c.launched(registry, True)
        if launch in ("sync", "both") or form is c:
            out.append(c)
        if launch in ("async", "both") and form is not c:
            out.append(form.derive(name=f"{c.name}.async", description=f"{c.name} in an async launch: {form.name}"))
    names = [c.name for c in out]
    if len(set(names)) != len(names):
        raise click.BadParameter(
            f"a scheduler is named twice once launched: {', '.join(names)}", param_hint="'--launch'"
        )
    return out


def run_simulation(
    configs: list[SchedulerConfig],
    workload: Workload,
    simulator: Simulator,
    progress: bool = True,
    frontier: bool = False,
) -> list[SimulationResult]:
    """Each scheduler's run, under a progress bar on stderr when it is a terminal and ``progress`` is on."""
    results = []
    with progress_bar(len(configs) * len(workload.steps), show=progress) as bar:
        for config in configs:
            bar.now(config.name)
            results.append(simulator.run(config, workload, on_step=lambda _r: bar.step(), frontier=frontier))
    return results


def print_tables(rows: list[dict[str, Any]], gpus: int = 0) -> None:
    """Per-step tables, then the totals; a row holding more than ``gpus`` GPUs at its peak is flagged."""
    click.echo(
        "per step: 'est err' compares the cost model's generation time, estimated before the step, with the "
        "simulated one; 'stale': share of tokens from weights older than those trained"
    )
    for row in rows:
        print_steps(row, rows[0]["steps"])
    print_totals(rows, gpus)


def print_steps(row: dict[str, Any], base_steps: list[dict[str, Any]]) -> None:
    """One scheduler's steps, each against the first scheduler's step of the same number (``base_steps``)."""
    click.secho(f"\n{row['name']}", bold=True)
    click.echo(
        f"{'step':>5}{'N':>4}{'peak':>5}{'time s':>9}{'gen s':>8}{'GPU-s':>9}{'srvful':>9}{'speedup':>9}{'cost':>7}"
        f"{'idle':>6}{'migr':>6}{'prefill saved':>15}{'MAE':>6}{'est err':>8}{'stale':>7}"
    )
    for i, st in enumerate(row["steps"]):
        # a partial-rollout run has one more step (it finishes what is carried): nothing to compare it with
        b = base_steps[i] if i < len(base_steps) else None
        # a step can take no time (partial rollouts whose held groups were all complete at its start)
        speed = f"{b['time_s'] / st['time_s']:>8.2f}x" if b and st["time_s"] > 0 else f"{'-':>9}"
        cost = f"{st['gpu_seconds'] / b['gpu_seconds'] - 1:>+7.0%}" if b and b["gpu_seconds"] > 0 else f"{'-':>7}"
        click.echo(
            f"{st['step']:>5}{st['num_actors']:>4}{st['peak_gpus']:>5}{st['time_s']:>9.1f}{st['generation_s']:>8.1f}"
            f"{st['gpu_seconds']:>9.0f}{st['gpu_seconds_serverful']:>9.0f}{speed}"
            f"{cost}{st['idle_fraction']:>6.2f}{st['migrations']:>6}"
            f"{st['prefill_tokens_saved']:>15}{st['prediction_mae'] or 0:>6.0f}"
            f"{_pct(st['estimate_error']):>8}{st['stale_token_fraction']:>7.0%}"
        )
        if len(st.get("frontier") or []) > 1:  # N: simulated time s / GPU-s, * = chosen
            points = "  ".join(
                f"{f['num_actors']}{'*' if f['chosen'] else ''}:"
                f"{f['simulated_time_s']:.0f}/{f['simulated_gpu_seconds']:.0f}"
                for f in st["frontier"]
            )
            click.echo(f"{'':>9}frontier (N: time s/GPU-s, * chosen): {points}")


def print_totals(rows: list[dict[str, Any]], gpus: int) -> None:
    """The totals table, a row a scheduler with its split below it; a row over ``gpus`` at its peak is flagged."""
    click.secho(
        "\ntotals: speedup and GPU-seconds change against the first scheduler, both billed serverless; 'vs srvful': "
        "against the first billed serverful; 'peak': most GPUs held at once; 'steady s': mean step time of the "
        "workload's steps but the first and the last (a long run's pace; '-' with fewer than 3 steps), 'x': its "
        "speedup; 'bound': the work bound (GPU work / peak GPUs) over the run's time",
        bold=True,
    )
    click.echo(
        f"{'scheduler':<24}{'peak':>5}{'time s':>9}{'steady s':>9}{'x':>7}{'GPU-s':>9}{'srvful':>9}{'speedup':>9}"
        f"{'cost':>7}{'vs srvful':>10}{'bound':>7}{'idle':>6}{'migr':>6}{'stale':>7}{'age':>5}"
    )
    over = False
    for row in rows:
        flag = " !" if gpus and row["peak_gpus"] > gpus else ""
        over = over or bool(flag)
        steady = f"{row['steady_step_s']:>9.1f}" if row["steady_step_s"] is not None else f"{'-':>9}"
        x = f"{row['speedup_steady']:>6.2f}x" if row["speedup_steady"] is not None else f"{'-':>7}"
        bound = f"{row['bound_fraction']:>7.0%}" if row["bound_fraction"] is not None else f"{'-':>7}"
        click.echo(
            f"{row['name'] + flag:<24}{row['peak_gpus']:>5}{row['total_time_s']:>9.1f}{steady}{x}"
            f"{row['total_gpu_seconds']:>9.0f}{row['total_gpu_seconds_serverful']:>9.0f}{row['speedup']:>8.2f}x"
            f"{-row['cost_reduction']:>+7.0%}{-row['cost_reduction_vs_serverful']:>+10.0%}{bound}"
            f"{row['mean_idle_fraction']:>6.2f}{row['migrations']:>6}{row['stale_token_fraction']:>7.0%}"
            f"{row['max_token_age_steps']:>5}"
        )
        line = split_line(row)
        if line is not None:
            click.echo(f"{'':<24}({line})")
    if over:
        click.secho(
            f"! holds more than the {gpus} GPUs of --gpus at its peak (burst engines): not comparable with the rows "
            "above at equal hardware; compare it with the baselines run on its peak (--frontier-plot)",
            fg="yellow",
        )


def split_line(row: dict[str, Any]) -> str | None:
    """How a pipelined row split its GPUs (the plan's line, the stream's splits, the async split), or None."""
    if row.get("split_plan") is not None:
        return row["split_plan"]["line"]
    if row.get("stream") is not None:
        splits = ",".join(str(x) for x in row["stream"]["splits"])
        return f"stream: rollout GPUs batch by batch {splits}; the rest learn"
    if row.get("rollout_gpus"):
        tried = row.get("split_search")
        how = f"the fastest of {len(tried)} splits {row.get('split_tried_on', 'tried')}" if tried else "as set"
        return f"async: {row['rollout_gpus']} GPUs generate, the rest learn; {how}"
    return None


def kv_flag(memory: str) -> str:
    """The option that sets the KV capacity of a synchronous engine with this memory."""
    return "--colocated-kv-tokens" if memory == "colocated" else "--dedicated-kv-tokens"


def check_capacity(workload: Workload, max_tokens: int, flag: str) -> None:
    """Every sample of ``workload`` fits an engine's KV capacity (``max_tokens``): else a usage error naming the
    capacity's ``flag`` and the size of the largest sample, which it must hold."""
    for ws in workload.steps:
        if not ws.lengths.size:
            continue
        size = ws.batch.prompt_lengths[ws.batch.sample_prompt_index()] + ws.lengths
        i = int(np.argmax(size))
        if int(size[i]) > max_tokens:
            prompt = int(size[i] - ws.lengths[i])
            raise click.BadParameter(
                f"step {ws.step} of workload {workload.name} has a sample of {int(size[i]):,} tokens (prompt "
                f"{prompt:,} + response {int(ws.lengths[i]):,}), more than {capacity_words(max_tokens, flag)}; "
                f"give at least {int(size[i]):,}, or shorter responses (--max-length)",
                param_hint=f"'{flag}'",
            )


def load_workload(
    trace: str | None,
    prompts: int,
    samples: int,
    steps: int | None,
    seed: int,
    *,
    max_tokens: int = MAX_TOKENS,
    capacity_flag: str | None = None,
    **shape: Any,
) -> Workload:
    """A trace, or the embedded synthetic GSM8K-style workload with the given length distribution; no sample of
    either may be longer (prompt + response) than ``max_tokens``: give the engines' KV capacity, and
    ``capacity_flag``, the option that sets it, for the error to name."""
    if trace:
        return load_trace(trace, max_steps=steps or None, max_tokens=max_tokens, capacity_flag=capacity_flag)
    check_samples(prompts, samples, steps or 5)
    synthetic = SyntheticWorkload(
        prompts,
        samples,
        seed=seed,
        median_length=shape.get("median_length", 300.0),
        prompt_sigma=shape.get("length_sigma", 0.6),
        sample_sigma=shape.get("sample_sigma", 0.35),
        max_length=shape.get("max_length", 1024),
        runaway=shape.get("runaway", 0.0),
    )
    workload = synthetic_workload(synthetic, steps or 5, shape.get("length_growth", 1.0))
    if capacity_flag is not None:
        check_capacity(workload, max_tokens, capacity_flag)
    return workload


def engine_workload(
    trace: str | None,
    prompts: int,
    samples: int,
    steps: int | None,
    seed: int,
    prof: Any,
    memory: str,
    shape: dict[str, Any],
) -> Workload:
    """``load_workload`` for engines of profile ``prof`` with ``memory``: no sample beyond their KV capacity, the
    error naming the flag that sets it."""
    return load_workload(
        trace,
        prompts,
        samples,
        steps,
        seed,
        max_tokens=prof.kv_capacity_tokens,
        capacity_flag=kv_flag(memory),
        **shape,
    )


#: The synthetic workload's options (``--trace`` replays a trace's own prompts and lengths instead).
SYNTHETIC_FLAGS = (
    "prompts",
    "samples",
    "seed",
    "median_length",
    "length_sigma",
    "sample_sigma",
    "max_length",
    "runaway",
    "length_growth",
)


def given_flags(names: Sequence[str]) -> list[str]:
    """The options among ``names`` (parameter names) typed on this command line, as flags."""
    from click.core import ParameterSource

    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return []
    return [
        f"--{n.replace('_', '-')}"
        for n in names
        if n in ctx.params and ctx.get_parameter_source(n) == ParameterSource.COMMANDLINE
    ]


def check_workload_flags(trace: str | None, steps: int | None, length_growth: float = 1.0) -> None:
    """No option of the synthetic workload with ``--trace`` (it would change nothing), and no ``--length-growth``
    over a single step (growth is from the first step to the last)."""
    if trace is not None:
        unused = given_flags(SYNTHETIC_FLAGS)
        if unused:
            raise click.BadParameter(
                f"{', '.join(unused)} shape{'s' if len(unused) == 1 else ''} the synthetic workload; a trace "
                f"replays its own prompts and lengths ({trace}): drop {'it' if len(unused) == 1 else 'them'}",
                param_hint="'--trace'",
            )
    elif steps == 1 and length_growth != 1.0:
        raise click.BadParameter(
            f"{length_growth:g}: lengths grow from the first step to the last, and --steps 1 is one step; give more "
            "steps or drop --length-growth",
            param_hint="'--length-growth'",
        )


def check_split_takers(value: str, configs: Sequence[SchedulerConfig], modes: Sequence[Mode]) -> None:
    """``--rollout-gpus`` sets the split of an async pipeline or a stream at a fixed split: refused when no
    scheduler of the run (``configs``, their ``modes``) has one (a synchronous one has no split; an elastic stream
    re-plans its own)."""
    if any(m.fixed_split for m in modes):
        return
    what = ", ".join(
        f"{c.name} ({'an elastic stream, which re-plans its split' if m.pipelined else 'synchronous'})"
        for c, m in zip(configs, modes, strict=True)
    )
    raise click.BadParameter(
        f"{value}: sets the rollout/learner split of an async pipeline or a stream at a fixed split, and no "
        f"scheduler here has one: {what}",
        param_hint="'--rollout-gpus'",
    )


def parse_rollout_gpus(value: str | None) -> int | str | None:
    """``--rollout-gpus``: a number of GPUs, ``best`` (every split run on the whole workload, the fastest kept),
    or None (every split tried on the first 3 steps, the fastest run on the whole workload)."""
    if value is None or value == "best":
        return value
    try:
        n = int(value)
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is neither a number of GPUs nor 'best'", param_hint="--rollout-gpus"
        ) from None
    if n < 1:
        raise click.BadParameter(f"{n} must be at least 1", param_hint="--rollout-gpus")
    return n


def frontier_sizes(value: str | None, gpus: int, gpa: int) -> list[int]:
    """``--frontier-gpus``: comma-separated cluster sizes (default: --gpus, 1.25x and 1.5x it, in whole
    engines); each a multiple of the GPUs an engine needs."""
    if value is None:
        sizes = sorted({gpus, *(max(gpa, round(gpus * f / gpa) * gpa) for f in (1.25, 1.5))})
    else:
        try:
            sizes = sorted({int(v) for v in value.split(",") if v.strip()})
        except ValueError:
            raise click.BadParameter(
                f"{value!r}: expected GPU counts like 16,20,24", param_hint="--frontier-gpus"
            ) from None
    bad = [n for n in sizes if n < 2 * gpa or n % gpa or n > MAX_GPUS]
    if not sizes or bad:
        raise click.BadParameter(
            f"{bad or value}: each size must be a multiple of {gpa} GPUs, hold an engine and a learner, and be at "
            f"most {MAX_GPUS:,} GPUs",
            param_hint="--frontier-gpus",
        )
    return sizes
