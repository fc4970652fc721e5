"""``rlhfless simulate``: replay a workload under several schedulers and compare time and cost."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from rlhfless_sdk.api.config import SchedulerConfig
from rlhfless_sdk.api.plugins import Registry
from rlhfless_sdk.api.records import Cluster
from rlhfless_sdk.cli.args import dumps, run_profile
from rlhfless_sdk.cli.plan_report import resolve_scheduler
from rlhfless_sdk.simulation.simulator import SimulationResult, Simulator
from rlhfless_sdk.simulation.traces import MAX_TOKENS, Workload, load_trace, synthetic_workload, workload_summary
from rlhfless_sdk.simulation.workloads import SyntheticWorkload

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
        out.append(
            {
                "name": r.scheduler,
                **tot,
                "speedup": _ratio(base["total_time_s"], tot["total_time_s"]),
                "speedup_after_first": _ratio(
                    base["mean_step_time_after_first_s"], tot["mean_step_time_after_first_s"]
                ),
                "cost_reduction": 1.0 - _ratio(tot["total_gpu_seconds"], base["total_gpu_seconds"]),
                "cost_reduction_vs_serverful": 1.0
                - _ratio(tot["total_gpu_seconds"], base["total_gpu_seconds_serverful"]),
                "steps": [
                    {**s.report.model_dump(), **({"frontier": s.frontier} if s.frontier is not None else {})}
                    for s in r.steps
                ],
            }
        )
    return out


def run_simulation(
    configs: list[SchedulerConfig],
    workload: Workload,
    simulator: Simulator,
    progress: bool = True,
    frontier: bool = False,
) -> list[SimulationResult]:
    results = []
    total = len(configs) * len(workload.steps)
    with click.progressbar(length=total, label="simulating", file=sys.stderr, hidden=not progress) as bar:
        for config in configs:
            results.append(simulator.run(config, workload, on_step=lambda _r: bar.update(1), frontier=frontier))
    return results


def print_tables(rows: list[dict[str, Any]]) -> None:
    base_steps = rows[0]["steps"]
    click.echo(
        "per step: 'est err' compares the cost model's generation time, estimated before the step, with the "
        "simulated one; 'stale': share of tokens from weights older than those trained"
    )
    for row in rows:
        click.secho(f"\n{row['name']}", bold=True)
        click.echo(
            f"{'step':>5}{'N':>4}{'time s':>9}{'gen s':>8}{'GPU-s':>9}{'srvful':>9}{'speedup':>9}{'cost':>7}"
            f"{'idle':>6}{'migr':>6}{'prefill saved':>15}{'MAE':>6}{'est err':>8}{'stale':>7}"
        )
        for i, st in enumerate(row["steps"]):
            # a partial-rollout run has one more step (it finishes what is carried): nothing to compare it with
            b = base_steps[i] if i < len(base_steps) else None
            # a step can take no time (partial rollouts whose held groups were all complete at its start)
            speed = f"{b['time_s'] / st['time_s']:>8.2f}x" if b and st["time_s"] > 0 else f"{'-':>9}"
            cost = f"{st['gpu_seconds'] / b['gpu_seconds'] - 1:>+7.0%}" if b and b["gpu_seconds"] > 0 else f"{'-':>7}"
            click.echo(
                f"{st['step']:>5}{st['num_actors']:>4}{st['time_s']:>9.1f}{st['generation_s']:>8.1f}"
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
    click.secho(
        "\ntotals: speedup and GPU-seconds change against the first scheduler, both billed serverless; "
        "'vs srvful': against the first billed serverful; 'steps 2+': speedup of the mean step after the first "
        "(a long run's pace, without start-up or an async pipeline's fill)",
        bold=True,
    )
    click.echo(
        f"{'scheduler':<18}{'time s':>9}{'GPU-s':>9}{'srvful':>9}{'speedup':>9}{'cost':>7}{'vs srvful':>10}"
        f"{'idle':>6}{'migr':>6}{'stale':>7}{'age':>5}{'steps 2+':>10}"
    )
    for row in rows:
        click.echo(
            f"{row['name']:<18}{row['total_time_s']:>9.1f}{row['total_gpu_seconds']:>9.0f}"
            f"{row['total_gpu_seconds_serverful']:>9.0f}{row['speedup']:>8.2f}x{-row['cost_reduction']:>+7.0%}"
            f"{-row['cost_reduction_vs_serverful']:>+10.0%}{row['mean_idle_fraction']:>6.2f}{row['migrations']:>6}"
            f"{row['stale_token_fraction']:>7.0%}{row['max_token_age_steps']:>5}{row['speedup_after_first']:>9.2f}x"
        )
        if row.get("rollout_gpus"):
            click.echo(f"{'':<18}(async: {row['rollout_gpus']} GPUs generate, the rest learn)")


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise click.ClickException("--plot needs matplotlib: pip install 'rlhfless[plot]'") from exc
    fronts = [r for r in rows if len(r["steps"][0].get("frontier") or []) > 1]
    if fronts:
        fig, (ax, fx) = plt.subplots(1, 2, figsize=(13, 5))
    else:
        fig, ax = plt.subplots(figsize=(7, 5))
    first = rows[0]
    ax.plot(
        [s["time_s"] for s in first["steps"]],
        [s["gpu_seconds_serverful"] for s in first["steps"]],
        "x",
        color="gray",
        label=f"{first['name']} billed serverful (per step)",
    )
    for row in rows:
        t = [s["time_s"] for s in row["steps"]]
        c = [s["gpu_seconds"] for s in row["steps"]]
        (pts,) = ax.plot(t, c, "o", alpha=0.45, label=f"{row['name']} (per step)")
        ax.plot([sum(t) / len(t)], [sum(c) / len(c)], "*", ms=16, color=pts.get_color(), markeredgecolor="black")
    if fronts:
        for row in fronts:
            f = row["steps"][-1]["frontier"]
            (line,) = fx.plot(
                [p["simulated_generation_s"] for p in f],
                [p["simulated_generation_gpu_seconds"] for p in f],
                "o-",
                ms=4,
                label=f"{row['name']} simulated",
            )
            fx.plot(
                [p["predicted_time_s"] for p in f],
                [p["predicted_gpu_seconds"] for p in f],
                "x:",
                color=line.get_color(),
                alpha=0.6,
                label=f"{row['name']} predicted",
            )
            c = next(p for p in f if p["chosen"])
            fx.plot(
                [c["simulated_generation_s"]],
                [c["simulated_generation_gpu_seconds"]],
                "*",
                ms=16,
                color=line.get_color(),
                markeredgecolor="black",
            )
        fx.set_xlabel("generation time (s)")
        fx.set_ylabel("generation GPU-seconds (serverless)")
        fx.set_title("last step's frontier: a point per actor count N (star: chosen)")
        fx.grid(alpha=0.3)
        fx.legend(fontsize=7)
    ax.set_xlabel("step time (s)")
    ax.set_ylabel("GPU-seconds per step (serverless billing)")
    ax.set_title(title + "\nstars: mean step; lower-left is better")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def load_workload(
    trace: str | None, prompts: int, samples: int, steps: int, seed: int, *, max_tokens: int = MAX_TOKENS, **shape: Any
) -> Workload:
    """A trace (no sample over ``max_tokens``: give the profile's KV capacity), or the embedded synthetic
    GSM8K-style workload with the given length distribution."""
    if trace:
        return load_trace(trace, max_steps=steps or None, max_tokens=max_tokens)
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
    return synthetic_workload(synthetic, steps or 5)


def simulate_main(
    registry: Registry,
    *,
    trace: str | None,
    prompts: int,
    samples: int,
    steps: int,
    seed: int,
    median_length: float = 300.0,
    length_sigma: float = 0.6,
    sample_sigma: float = 0.35,
    max_length: int = 1024,
    runaway: float = 0.0,
    schedulers: tuple[str, ...] = (),
    ablation: bool = False,
    profile: str = "qwen2.5-7b-l40s",
    gpus: int = 16,
    gpus_per_node: int = 8,
    kv_tokens: int | None = None,
    algo: str = "auto",
    rollout_gpus: int | None = None,
    max_actors: int | None = None,
    as_json: bool = False,
    plot_path: Path | None = None,
    frontier: bool = True,
) -> None:
    names = list(schedulers) or (ABLATION if ablation else ["openrlhf", "rlhfless"])
    if ablation and schedulers:
        names = list(schedulers) + [n for n in ABLATION if n not in schedulers]
    configs = [resolve_scheduler(n, registry) for n in names]
    configs = [allow_burst(c, max_actors) for c in configs]
    if rollout_gpus is not None:
        configs = [
            c.derive(pipeline={**c.pipeline.model_dump(), "rollout_gpus": rollout_gpus})
            if c.pipeline.mode == "async"
            else c
            for c in configs
        ]
    shape = {
        "median_length": median_length,
        "length_sigma": length_sigma,
        "sample_sigma": sample_sigma,
        "max_length": max_length,
        "runaway": runaway,
    }
    prof = run_profile(profile, kv_tokens)
    workload = load_workload(trace, prompts, samples, steps, seed, max_tokens=prof.kv_capacity_tokens, **shape)
    if gpus < prof.gpus_per_actor:
        raise click.ClickException(f"--gpus {gpus} is fewer than one actor of profile {profile} needs")
    run_algo = workload.algo if algo == "auto" else algo
    sim = Simulator(prof, make_cluster(gpus, gpus_per_node), registry=registry, algo=run_algo)
    results = run_simulation(configs, workload, sim, progress=not as_json, frontier=frontier)
    rows = compare(results)
    meta = {
        "workload": workload_summary(workload),
        "profile": prof.name,
        "kv_capacity_tokens": prof.kv_capacity_tokens,
        "algo": run_algo,
        "gpus": gpus,
    }
    if as_json:
        click.echo(dumps({**meta, "schedulers": rows}, indent=2))
    else:
        w = meta["workload"]
        click.echo(
            f"workload {w['name']}: {w['steps']} steps x {w['prompts_per_step']} prompts, {w['samples']} samples, "
            f"response length {w['response_length']['min']}-{w['response_length']['max']} "
            f"(median {w['response_length']['median']:.0f}); profile {prof.name} ({prof.kv_capacity_tokens:,} KV "
            f"tokens per engine); {run_algo} learner; {gpus} GPUs"
        )
        print_tables(rows)
    if plot_path is not None:
        plot(rows, plot_path, f"{workload.name}, {prof.name}, {gpus} GPUs")
        if not as_json:
            click.echo(f"\nplot: {plot_path}")
