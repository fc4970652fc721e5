"""Compare length predictors on a workload: accuracy in step order, and what each does to a simulated run.

Each predictor replays the workload step by step and sees only earlier steps (``observe`` after each step's
prediction). Accuracy is per sample (|prediction of its prompt - its length|) over every step but the first,
where no history exists yet; Kendall's tau is between predicted and true per-prompt mean lengths, per step,
then averaged. The simulated figures come from the ``rlhfless-paper`` scheduler (the paper's configuration,
whose sorted assignment and cut-and-migrate act on the predictions; or another base) with the predictor
swapped in.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click
import numpy as np

from rlhfless_sdk.api.config import PolicyRef, SchedulerConfig
from rlhfless_sdk.api.history import isolated_history
from rlhfless_sdk.api.plugins import Registry
from rlhfless_sdk.api.records import dumps
from rlhfless_sdk.cli.args import run_profile
from rlhfless_sdk.simulation.simulator import Simulator
from rlhfless_sdk.workloads.synthetic import finished_samples
from rlhfless_sdk.workloads.traces import Workload


def kendall_tau(x: np.ndarray, y: np.ndarray) -> float:
    """Kendall's tau-b (ties handled), O(n^2) with numpy; 0 when either side is constant."""
    n = len(x)
    if n < 2:
        return 0.0
    dx = np.sign(x[:, None] - x[None, :])
    dy = np.sign(y[:, None] - y[None, :])
    iu = np.triu_indices(n, 1)
    dx, dy = dx[iu], dy[iu]
    concord = float((dx * dy).sum())
    denom = np.sqrt(float((dx != 0).sum()) * float((dy != 0).sum()))
    return concord / denom if denom > 0 else 0.0


def accuracy(registry: Registry, ref: PolicyRef, workload: Workload) -> dict[str, Any]:
    with isolated_history():  # its history reads only what this replay observes
        return _accuracy(registry.create("predictor", ref), workload)


def _accuracy(predictor: Any, workload: Workload) -> dict[str, Any]:
    errors, taus = [], []
    for k, step in enumerate(workload.steps):
        pred = np.asarray(predictor.predict(step.batch), dtype=np.float64)
        if k > 0:
            per_sample = pred[step.batch.sample_prompt_index()]
            errors.append(np.abs(per_sample - step.lengths))
            assert step.batch.true_lengths is not None
            taus.append(kendall_tau(pred, step.batch.true_lengths))
        predictor.observe(finished_samples(step.batch, step.lengths))
    err = np.concatenate(errors) if errors else np.zeros(0)
    return {
        "mae": float(err.mean()) if err.size else 0.0,
        "acc50": float((err <= 50).mean()) if err.size else 0.0,
        "acc100": float((err <= 100).mean()) if err.size else 0.0,
        "kendall_tau": float(np.mean(taus)) if taus else 0.0,
        "scored_samples": int(err.size),
    }


def with_predictor(base: SchedulerConfig, ref: PolicyRef) -> SchedulerConfig:
    return base.derive(name=f"{base.name}.{ref.name}", predictor=ref.model_dump())


def compare_predictors(
    registry: Registry,
    refs: Sequence[PolicyRef],
    workload: Workload,
    simulator: Simulator | None,
    base: SchedulerConfig,
    on_done: Callable[[str], Any] | None = None,
) -> list[dict[str, Any]]:
    rows = []
    for ref in refs:
        row: dict[str, Any] = {"name": ref.name, **accuracy(registry, ref, workload)}
        if simulator is not None:
            totals = simulator.run(with_predictor(base, ref), workload).totals()
            row["sim_time_s"] = totals["total_time_s"]
            row["sim_gpu_seconds"] = totals["total_gpu_seconds"]
            row["sim_migrations"] = totals["migrations"]
        rows.append(row)
        if on_done is not None:
            on_done(ref.name)
    return rows


def plot_comparison(rows: list[dict[str, Any]], path: Any, title: str) -> None:
    """Left: MAE and Acc@100 per predictor; right: simulated time against GPU-seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sim = all("sim_time_s" in r for r in rows)
    fig, axes = plt.subplots(1, 2 if sim else 1, figsize=(11 if sim else 6, 4.5))
    ax = axes[0] if sim else axes
    names = [r["name"] for r in rows]
    ax.bar(names, [r["mae"] for r in rows], color="tab:blue")
    ax.set_ylabel("MAE (tokens)")
    ax2 = ax.twinx()
    ax2.plot(names, [100 * r["acc100"] for r in rows], "o-", color="tab:orange")
    ax2.set_ylabel("Acc@100 (%)", color="tab:orange")
    ax.set_title("accuracy (bars: MAE, line: Acc@100)")
    ax.tick_params(axis="x", rotation=30)
    if sim:
        bx = axes[1]
        for r in rows:
            bx.plot(r["sim_time_s"], r["sim_gpu_seconds"], "o", ms=9, label=r["name"])
        bx.set_xlabel("simulated total time (s)")
        bx.set_ylabel("simulated GPU-seconds")
        bx.set_title("in the scheduler (lower-left is better)")
        bx.grid(alpha=0.3)
        bx.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- the command -----------------------------------------------------------------------------------------------
def compare_main(
    registry: Registry,
    *,
    trace: str | None,
    predictors: str,
    steps: int | None,
    scheduler: str,
    simulate: bool,
    as_json: bool,
    plot_path: Path | None,
    **options: Any,
) -> None:
    """``rlhfless compare-predictors``: each predictor scored (and simulated in ``scheduler`` where ``simulate``) on
    the workload; ``options``: the workload's, the cluster's and the profile's."""
    from rlhfless_sdk.cli.simulate import check_workload_flags, engine_workload, make_cluster
    from rlhfless_sdk.workloads.traces import workload_summary

    refs = predictor_refs(registry, predictors)
    if steps == 1:
        raise click.BadParameter(
            "1 step leaves nothing to score: each predictor is scored on the steps after the first (it sees only "
            "earlier ones); give at least 2",
            param_hint="'--steps'",
        )
    shape = {k: options.pop(k) for k in list(options) if k in SHAPE}
    check_workload_flags(trace, steps, shape.get("length_growth", 1.0))
    base = registry.resolve(scheduler)
    if simulate:
        check_consults_predictor(registry, base)
    o = options
    prof = run_profile(o["profile"], o["dedicated_kv_tokens"], o["colocated_kv_tokens"], o["memory"])
    workload = engine_workload(trace, o["prompts"], o["samples"], steps, o["seed"], prof, o["memory"], shape)
    if len(workload.steps) < 2:
        raise click.BadParameter(
            f"trace {trace} holds 1 step: nothing to score (each predictor is scored on the steps after the "
            "first); give a trace of at least 2 steps",
            param_hint="'--trace' / '--steps'",
        )
    sim = None
    if simulate:
        algo = None if o["algo"] == "auto" else o["algo"]
        sim = Simulator(prof, make_cluster(o["gpus"], o["gpus_per_node"]), registry=registry, algo=algo)
        if (refused := sim.refusal(base)) is not None:
            raise click.BadParameter(refused, param_hint="'--scheduler'")
    with click.progressbar(length=len(refs), label="predictors", file=sys.stderr, hidden=as_json) as bar:
        rows = compare_predictors(registry, refs, workload, sim, base, on_done=lambda _n: bar.update(1))
    meta = {"workload": workload_summary(workload), "scheduler": base.name, "profile": o["profile"], "gpus": o["gpus"]}
    print_predictors(rows, meta, simulate, as_json)
    if plot_path is not None:
        plot_comparison(rows, plot_path, f"{workload.name}: predictors in the {base.name} scheduler")


#: The synthetic workload's length-shape options the command takes (``synthetic_shape_options``).
SHAPE = ("median_length", "length_sigma", "sample_sigma", "max_length", "runaway", "length_growth")


def predictor_refs(registry: Registry, predictors: str) -> list[PolicyRef]:
    """``--predictors``' comma-separated names, each checked registered before any work."""
    refs = [PolicyRef(name=n.strip()) for n in predictors.split(",") if n.strip()]
    if not refs:
        raise click.BadParameter(
            f"{predictors!r} names no predictor; give one or more, comma-separated (e.g. ewma,model)",
            param_hint="'--predictors'",
        )
    for ref in refs:
        registry.policy("predictor", ref.name)  # fail before any work on an unknown name
    return refs


def check_consults_predictor(registry: Registry, base: SchedulerConfig) -> None:
    """Refuse to simulate predictors in a scheduler that reads none (every predictor would simulate alike)."""
    from rlhfless_sdk.rollout.modes import consults_predictor, mode_for

    if consults_predictor(base, registry):
        return
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


def print_predictors(rows: list[dict[str, Any]], meta: dict[str, Any], simulate: bool, as_json: bool) -> None:
    """The scores as JSON, or a table of a predictor a row (its simulated run's figures too where simulated)."""
    if as_json:
        click.echo(dumps({**meta, "predictors": rows}, indent=2))
        return
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
