"""Compare length predictors on a workload: accuracy in step order, and what each does to a simulated run.

Each predictor replays the workload step by step and sees only earlier steps (``observe`` after each step's
prediction). Accuracy is per sample (|prediction of its prompt - its length|) over every step but the first,
where no history exists yet; Kendall's tau is between predicted and true per-prompt mean lengths, per step,
then averaged. The simulated figures come from the ``rlhfless-paper`` scheduler (the paper's configuration,
whose sorted assignment and cut-and-migrate act on the predictions; or another base) with the predictor
swapped in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rlhfless_sdk.api.config import PolicyRef, SchedulerConfig
from rlhfless_sdk.api.history import isolated_history
from rlhfless_sdk.api.plugins import Registry
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
