"""A snapshot of the simulator's output for a refactoring to keep: ``python tests/sim_snapshot.py OUT.json`` runs
`rlhfless simulate --json --plan-time 0` (no plan's wall time charged: runs repeat to the last digit) for every
registered preset on four workloads (the real GPQA trace when it is there, the default synthetic workload, a
long-reasoning shape and a run with burst engines allowed) and writes the results with the wall-clock fields
dropped; ``python tests/sim_snapshot.py --compare A.json B.json`` names every difference."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from click.testing import CliRunner

from rlhfless_sdk import get_plugin_manager
from rlhfless_sdk.cli.main import main

GPQA = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "gpqa-qwen2.5-7b-ppo"
#: Fields that time this machine, not the simulated cluster.
WALL_CLOCK = {"planner_ms"}

WORKLOADS: dict[str, list[str]] = {
    "default": ["--steps", "3"],
    "long-reasoning": [
        *("--prompts", "128", "--samples", "8", "--median-length", "1500", "--sample-sigma", "0.5"),
        *("--max-length", "8192", "--runaway", "0.03", "--steps", "4"),
    ],
    "burst": ["--prompts", "128", "--samples", "8", "--steps", "3", "--gpus", "8", "--allow-burst"],
}
if GPQA.is_dir():
    WORKLOADS["gpqa"] = ["--trace", str(GPQA), "--steps", "4"]


def _drop_wall_clock(value):
    if isinstance(value, dict):
        return {k: _drop_wall_clock(v) for k, v in value.items() if k not in WALL_CLOCK}
    if isinstance(value, list):
        return [_drop_wall_clock(v) for v in value]
    return value


def snapshot() -> dict:
    out = {}
    names = get_plugin_manager().registry.names("scheduler")
    for workload, args in WORKLOADS.items():
        for name in names:
            cmd = ["simulate", *args, "--scheduler", name, "--json", "--no-frontier", "--plan-time", "0"]
            res = CliRunner().invoke(main, cmd)
            key = f"{workload}/{name}"
            out[key] = _drop_wall_clock(json.loads(res.output)) if res.exit_code == 0 else {"error": res.output}
            print(key, "ok" if res.exit_code == 0 else res.output.strip()[-200:], file=sys.stderr)
    return out


def differences(a, b, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: only in {'first' if k in a else 'second'}" for k in a.keys() ^ b.keys()]
        for k in a.keys() & b.keys():
            out += differences(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        first, second = (json.loads(Path(p).read_text()) for p in sys.argv[2:4])
        diffs = differences(first, second)
        print("\n".join(diffs[:50]) or f"identical: {len(first)} runs")
        sys.exit(1 if diffs else 0)
    Path(sys.argv[1]).write_text(json.dumps(snapshot(), indent=1, sort_keys=True))
