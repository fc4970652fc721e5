"""Compare length predictors (EWMA vs the model-based one, and any installed plugin) through the Python API.

    python examples/compare_predictors.py                                    # synthetic GSM8K-style workload
    python examples/compare_predictors.py ../shared/data/traces/gpqa-qwen2.5-7b-ppo
    python examples/compare_predictors.py TRACE --predictors ewma,model,max-recent

The same comparison is `rlhfless compare-predictors`; this script shows the pieces it is made of.
"""

from __future__ import annotations

import argparse

from rlhfless_sdk import PolicyRef, get_plugin_manager
from rlhfless_sdk.api.profiles import load_profile
from rlhfless_sdk.cli.compare import compare_predictors
from rlhfless_sdk.cli.simulate import load_workload, make_cluster
from rlhfless_sdk.simulation.simulator import Simulator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", nargs="?", help="trace file or folder; default: a synthetic workload")
    parser.add_argument("--predictors", default="ewma,model")
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--gpus", type=int, default=16)
    args = parser.parse_args()

    registry = get_plugin_manager().registry  # built-in policies and every installed plugin
    workload = load_workload(args.trace, prompts=128, samples=8, steps=args.steps, seed=0)
    simulator = Simulator(load_profile("qwen2.5-7b-l40s"), make_cluster(args.gpus, 8), registry=registry)
    refs = [PolicyRef(name=n) for n in args.predictors.split(",")]
    rows = compare_predictors(registry, refs, workload, simulator, registry.scheduler("rlhfless-paper"))

    print(f"{'predictor':<14}{'MAE':>8}{'Acc@100':>9}{'Kendall':>9}{'time s':>9}{'GPU-s':>8}")
    for r in rows:
        print(
            f"{r['name']:<14}{r['mae']:>8.1f}{r['acc100']:>9.1%}{r['kendall_tau']:>9.3f}"
            f"{r['sim_time_s']:>9.1f}{r['sim_gpu_seconds']:>8.0f}"
        )


if __name__ == "__main__":
    main()
