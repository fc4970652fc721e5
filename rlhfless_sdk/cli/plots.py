"""The plots of `rlhfless simulate`: cost against time per step (``--plot``) and run time against GPU-seconds with the
baselines at several cluster sizes (``--frontier-plot``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click


def _pyplot(flag: str) -> Any:
    """matplotlib's pyplot on the Agg backend; a usage error naming ``flag`` where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise click.ClickException(f"{flag} needs matplotlib: pip install 'rlhfless[plot]'") from exc
    return plt


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """``--plot``: each step's GPU-seconds against its time, a scheduler a colour (stars: its mean step); beside it,
    the last step's time-cost frontier of each scheduler that simulated one."""
    plt = _pyplot("--plot")
    fronts = [r for r in rows if len(r["steps"][0].get("frontier") or []) > 1]
    if fronts:
        fig, (ax, fx) = plt.subplots(1, 2, figsize=(13, 5))
        _plot_fronts(fx, fronts)
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
    ax.set_xlabel("step time (s)")
    ax.set_ylabel("GPU-seconds per step (serverless billing)")
    ax.set_title(title + "\nstars: mean step; lower-left is better")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_fronts(fx: Any, fronts: list[dict[str, Any]]) -> None:
    """The last step's frontier of each row: simulated and predicted, a point per actor count, the chosen starred."""
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


def plot_frontier(rows: list[dict[str, Any]], front: list[dict[str, Any]], path: Path, title: str) -> None:
    """Run time against GPU-seconds (serverful: every GPU held, burst engines as held): each baseline a line
    through its cluster sizes, each scheduler of the run a point labelled with its peak GPUs. A point is a win
    only where it is left of and below the baselines' line at its own peak."""
    plt = _pyplot("--frontier-plot")
    fig, ax = plt.subplots(figsize=(11, 5.5))
    for name in dict.fromkeys(r["name"] for r in front):
        pts = sorted((r for r in front if r["name"] == name), key=lambda r: r["gpus"])
        xs = [p["total_gpu_seconds_serverful"] for p in pts]
        ys = [p["total_time_s"] for p in pts]
        (line,) = ax.plot(xs, ys, "o-", alpha=0.7, label=f"{name} at {', '.join(str(p['gpus']) for p in pts)} GPUs")
        for p, x, y in zip(pts, xs, ys, strict=True):
            ax.annotate(
                f"{p['gpus']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7, color=line.get_color()
            )
    baseline_names = {r["name"] for r in front}
    for row in rows:
        if row["name"] in baseline_names:  # already on its line
            continue
        x, y = row["total_gpu_seconds_serverful"], row["total_time_s"]
        (pt,) = ax.plot(
            [x], [y], "*", ms=14, markeredgecolor="black", label=f"{row['name']} (peak {row['peak_gpus']} GPUs)"
        )
        ax.annotate(
            f"{row['peak_gpus']}", (x, y), textcoords="offset points", xytext=(6, -10), fontsize=7, color=pt.get_color()
        )
    ax.set_xlabel("GPU-seconds of the run (serverful: every GPU held, burst engines while held)")
    ax.set_ylabel("run time (s)")
    ax.set_title(
        title + "\nlines: baselines at each cluster size (GPUs beside each point); stars: the others, at their peak"
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
