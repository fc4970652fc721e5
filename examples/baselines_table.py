"""Markdown table of ``rlhfless simulate --json`` results against a baseline (docs/results.md's baselines table).

    rlhfless simulate ... --scheduler openrlhf --scheduler verl ... --no-frontier --json > run.json
    python examples/baselines_table.py run.json [more.json ...] [--baseline openrlhf]

One row per scheduler of each file: total time, mean step after the first, GPU-seconds (serverless) and
serverful, speedups against the baseline (in total, and per step after the first: a long run's pace),
GPU-seconds change, the share of stale tokens with their largest age, and the cost model's median absolute
estimate error over the steps after the first (the planner has no history in the first).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def rows(path: str, baseline: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        run = json.load(f)
    by_name = {s["name"]: s for s in run["schedulers"]}
    if baseline not in by_name:
        sys.exit(f"{path}: no scheduler {baseline!r} to compare with (has {', '.join(by_name)})")
    base = by_name[baseline]
    w = run["workload"]
    label = f"{w['name']} ({run['algo']}, {run['kv_capacity_tokens'] // 1000}k KV)"
    out = []
    for s in run["schedulers"]:
        errors = [abs(x["estimate_error"]) for x in s["steps"][1:] if x.get("estimate_error") is not None]
        err = f"{statistics.median(errors):.0%}" if errors else "-"
        stale = f"{s['stale_token_fraction']:.0%} / {s['max_token_age_steps']}"
        out.append(
            f"| {label} | {s['name']} | {s['total_time_s']:.0f} | {s['mean_step_time_after_first_s']:.1f} | "
            f"{s['total_gpu_seconds']:.0f} | {s['total_gpu_seconds_serverful']:.0f} | "
            f"{base['total_time_s'] / s['total_time_s']:.3f}x | "
            f"{base['mean_step_time_after_first_s'] / s['mean_step_time_after_first_s']:.3f}x | "
            f"{s['total_gpu_seconds'] / base['total_gpu_seconds'] - 1:+.1%} | {stale} | {err} |"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--baseline", default="openrlhf")
    args = parser.parse_args()
    print(
        "| workload | scheduler | time s | step 2+ s | GPU-s | serverful GPU-s | speedup | speedup 2+ | "
        "GPU-s vs base | stale / age | est. err |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for path in args.files:
        print("\n".join(rows(path, args.baseline)))


if __name__ == "__main__":
    main()
