"""The launch-shape sweep: ``rlhfless simulate --launch both --rollout-gpus best`` on 52 launch shapes, and the ratio
of each ``rlhfless`` row to what it replaces (``rlhfless`` against ``openrlhf``; ``rlhfless.async`` against the
faster of ``openrlhf-async`` and ``openrlhf-async-partial``, each at its best split).

The grid: every shipped profile; 8-64 GPUs; 64-512 prompts x 4-16 samples; median responses of 300 / 1,500 / 4,000
tokens capped at 2k / 8k / 16k; lengths flat or doubling over the run. The four 3B/7B profiles each run the three
lengths, flat and growing, on two of six shapes (rotating), 48 shapes; the 70B profile runs on 64 GPUs at the two
shorter lengths, flat and growing, 4 shapes.

    python examples/launch_sweep.py --out /tmp/sweep.jsonl          # every shape (tens of minutes on 2 cores)
    python examples/launch_sweep.py --only 3 --only 17             # some shapes, by index
    python examples/launch_sweep.py --table /tmp/sweep.jsonl       # the table of a finished sweep

Each shape is one ``rlhfless simulate --json`` process; one JSON line a shape goes to ``--out`` as it finishes, so an
interrupted sweep keeps what it ran (``--resume`` skips the shapes already there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

SMALL = ["qwen2.5-3b-h100", "qwen2.5-3b-l40s", "qwen2.5-7b-h100", "qwen2.5-7b-l40s"]
LENGTHS = [(300, 2048), (1500, 8192), (4000, 16384)]
GROWTH = [1.0, 2.0]
SHAPES = [(8, 128, 8), (16, 512, 8), (16, 64, 16), (32, 256, 4), (64, 512, 16), (8, 64, 4)]  # GPUs, prompts, samples
BASELINES = ("openrlhf", "openrlhf-async", "openrlhf-async-partial")


def grid() -> list[dict]:
    out, turn = [], 0
    for profile in SMALL:
        for median, cap in LENGTHS:
            for growth in GROWTH:
                for _ in range(2):
                    gpus, prompts, samples = SHAPES[turn % len(SHAPES)]
                    turn += 1
                    out.append(dict(profile=profile, gpus=gpus, prompts=prompts, samples=samples, median=median,
                                    cap=cap, growth=growth))  # fmt: skip
    for median, cap in LENGTHS[:2]:
        for growth in GROWTH:
            out.append(dict(profile="llama-70b-8xh100", gpus=64, prompts=256, samples=8, median=median, cap=cap,
                            growth=growth))  # fmt: skip
    return out


def command(shape: dict) -> list[str]:
    cmd = [sys.executable, "-m", "rlhfless_sdk.cli.main", "simulate", "--json", "--launch", "both", "--rollout-gpus",
           "best", "--profile", shape["profile"], "--gpus", str(shape["gpus"]), "--prompts", str(shape["prompts"]),
           "--samples", str(shape["samples"]), "--median-length", str(shape["median"]), "--max-length",
           str(shape["cap"]), "--length-growth", str(shape["growth"])]  # fmt: skip
    for name in (*BASELINES, "rlhfless"):
        cmd += ["--scheduler", name]
    return cmd


def ratios(result: dict) -> dict:
    rows = {r["name"]: r["total_time_s"] for r in result["schedulers"]}
    best_async = min(rows["openrlhf-async"], rows["openrlhf-async-partial"])
    return {
        "sync": rows["openrlhf"] / rows["rlhfless"],
        "async": best_async / rows["rlhfless.async"],
        "times": rows,
    }


def label(shape: dict) -> str:
    grow = " grow" if shape["growth"] != 1.0 else ""
    return (f"{shape['profile']} {shape['gpus']} GPUs {shape['prompts']}x{shape['samples']} "
            f"median {shape['median']} cap {shape['cap']}{grow}")  # fmt: skip


def table(lines: list[dict]) -> str:
    out = [f"{'#':>3}  {'shape':<62} {'sync':>7} {'async':>7}"]
    for row in lines:
        out.append(f"{row['index']:>3}  {label(row['shape']):<62} {row['sync']:>6.3f}x {row['async']:>6.3f}x")
    for key in ("sync", "async"):
        values = [row[key] for row in lines]
        if values:
            low = sum(v < 0.98 for v in values)
            out.append(f"{key}: min {min(values):.3f}x, median {statistics.median(values):.3f}x, "
                       f"below 0.98x at {low} of {len(values)}")  # fmt: skip
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="JSON lines, one a shape (appended)")
    ap.add_argument("--only", type=int, action="append", help="run only these shape indices (repeat)")
    ap.add_argument("--resume", action="store_true", help="skip the shapes --out already holds")
    ap.add_argument("--table", type=Path, help="print the table of a finished sweep's JSON lines and exit")
    args = ap.parse_args()
    if args.table:
        print(table([json.loads(x) for x in args.table.read_text().splitlines() if x.strip()]))
        return
    shapes = list(enumerate(grid()))
    if args.only:
        shapes = [(i, s) for i, s in shapes if i in set(args.only)]
    done: set[int] = set()
    if args.resume and args.out and args.out.exists():
        done = {json.loads(x)["index"] for x in args.out.read_text().splitlines() if x.strip()}
    lines = []
    for n, (i, shape) in enumerate(shapes):
        if i in done:
            continue
        print(f"[{n + 1}/{len(shapes)}] {label(shape)}", file=sys.stderr, flush=True)
        run = subprocess.run(command(shape), capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"shape {i} ({label(shape)}) failed:\n{run.stderr[-2000:]}")
        row = {"index": i, "shape": shape, **ratios(json.loads(run.stdout))}
        lines.append(row)
        if args.out:
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")
    print(table(lines))


if __name__ == "__main__":
    main()
