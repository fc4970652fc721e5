"""Markdown table of ``rlhfless simulate --json`` results against a baseline (docs/results.md's tables).

    rlhfless simulate ... --scheduler openrlhf --scheduler verl ... --no-frontier --json > run.json
    python examples/baselines_table.py run.json [more.json ...] [--baseline openrlhf]

One row per scheduler of each file: peak GPUs (a row above the run's --gpus holds burst engines and says so),
total time, the steady step (the workload's steps but the first and the last), speedups against the baseline
(in total and per steady step), GPU-seconds billed serverless and serverful and their change against the
baseline's, the work bound's share of the run's time, the share of stale tokens with their largest age, and the
cost model's median absolute estimate error over the steps after the first. An async row gives its split.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def _x(a: float | None, b: float | None) -> str:
    return f"{a / b:.3f}x" if a and b else "-"


def rows(path: str, baseline: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        run = json.load(f)
    by_name = {s["name"]: s for s in run["schedulers"]}
    if baseline not in by_name:
        sys.exit(f"{path}: no scheduler {baseline!r} to compare with (has {', '.join(by_name)})")
    base = by_name[baseline]
    w = run["workload"]
    label = f"{w['name']} ({run['algo']}, {run['memory']} {run['kv_capacity_tokens'] // 1000}k KV)"
    out = []
    for s in run["schedulers"]:
        errors = [abs(x["estimate_error"]) for x in s["steps"][1:] if x.get("estimate_error") is not None]
        err = f"{statistics.median(errors):.0%}" if errors else "-"
        stale = f"{s['stale_token_fraction']:.0%} / {s['max_token_age_steps']}"
        name = s["name"] + (f" ({s['rollout_gpus']} gen.)" if s.get("rollout_gpus") else "")
        peak = f"{s['peak_gpus']}" + (" (burst)" if s["peak_gpus"] > run["gpus"] else "")
        steady = f"{s['steady_step_s']:.1f}" if s["steady_step_s"] is not None else "-"
        bound = f"{s['bound_fraction']:.0%}" if s["bound_fraction"] is not None else "-"
        out.append(
            f"| {label} | {name} | {peak} | {s['total_time_s']:.0f} | {steady} | "
            f"{_x(base['total_time_s'], s['total_time_s'])} | {_x(base['steady_step_s'], s['steady_step_s'])} | "
            f"{s['total_gpu_seconds']:.0f} | {s['total_gpu_seconds_serverful']:.0f} | "
            f"{s['total_gpu_seconds'] / base['total_gpu_seconds'] - 1:+.1%} | "
            f"{s['total_gpu_seconds_serverful'] / base['total_gpu_seconds_serverful'] - 1:+.1%} | {bound} | "
            f"{stale} | {err} |"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--baseline", default="openrlhf")
    args = parser.parse_args()
    print(
        "| workload | scheduler | peak GPUs | time s | steady step s | speedup | steady speedup | GPU-s | "
        "serverful GPU-s | GPU-s vs base | serverful vs base | bound | stale / age | est. err |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for path in args.files:
        print("\n".join(rows(path, args.baseline)))


if __name__ == "__main__":
    main()
