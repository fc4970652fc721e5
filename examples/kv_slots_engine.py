"""One engine fed without pause: how fast it decodes at vLLM's own admission (``max_num_seqs``) and when the client
holds it to a share of the samples its KV cache holds in steady state (``KvSlots``' ``fill``).

The engine is the simulator's (``EngineModel``: vLLM-like admission, KV limits, recompute preemption) on the
shipped L40S profile, fed the long-reasoning workload's samples (median 1,500 tokens, cap 8,192, 3% runaways) at
1x and 5x their lengths. Each row is the engine's seconds per generated token between 10% and 80% of its run (no
start, no tail), against the work bound's for the same samples (``decode_engine_s``: every decode step reading a
full KV cache or running ``max_num_seqs``, nothing recomputed).

    python examples/kv_slots_engine.py [--steps 2]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np

from rlhfless_sdk.api.profiles import load_profile
from rlhfless_sdk.planning.engine_model import EngineModel, EngineSamples, steady_context
from rlhfless_sdk.simulation.bound import decode_engine_s
from rlhfless_sdk.workloads.synthetic import SyntheticWorkload


def samples(scale: float, steps: int) -> tuple[list[int], list[int]]:
    prompt: list[int] = []
    length: list[int] = []
    shape = SyntheticWorkload(512, 8, median_length=1500, sample_sigma=0.5, max_length=8192, runaway=0.03)
    for step in range(steps):
        batch, lengths = replace(shape, step=step, scale=scale).batch()
        prompt += np.repeat(batch.prompt_lengths, 8).tolist()
        length += lengths.tolist()
    order = np.random.default_rng(1).permutation(len(length))
    return [prompt[i] for i in order], [length[i] for i in order]


def window_cost(profile, prompt: list[int], length: list[int], slots: int) -> tuple[float, int]:
    """(seconds per token between 10% and 80% of the run, preemptions) with at most ``slots`` running."""
    n = len(length)

    def engine() -> tuple[EngineModel, EngineSamples]:
        s = EngineSamples(list(range(n)), [0] * n, prompt, [0] * n, length, [0.0] * n, [0] * n)
        e = EngineModel(0, profile, "", 0.0, slots=slots)
        e.waiting.extend(range(n))
        return e, s

    whole, s = engine()
    whole.run_until(s, np.inf)
    e, s = engine()
    e.run_until(s, 0.1 * whole.t)
    busy, tokens = e.busy, e.generated
    e.run_until(s, 0.8 * whole.t)
    return (e.busy - busy) / (e.generated - tokens), whole.preemptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="workload steps of 4,096 samples fed to the engine")
    parser.add_argument("--profile", default="qwen2.5-7b-l40s")
    args = parser.parse_args()
    profile = load_profile(args.profile)
    print("lengths  slots          s/token (ms)  x bound  preemptions")
    for scale in (1.0, 5.0):
        prompt, length = samples(scale, args.steps)
        bound = decode_engine_s(profile, np.array(prompt), np.array(length)) / sum(length)
        steady = profile.kv_capacity_tokens / steady_context(np.array(prompt), np.array(length))
        rows = [("max_num_seqs", profile.max_num_seqs)]
        rows += [(f"fill {f:.2f}", min(profile.max_num_seqs, int(f * steady))) for f in (0.85, 0.9, 0.95)]
        for name, slots in rows:
            cost, preempted = window_cost(profile, prompt, length, slots)
            print(f"{scale:>5.0f}x  {name:<12} {slots:>3}  {cost * 1e3:>10.4f}  {cost / bound:>7.3f}  {preempted:>11,}")


if __name__ == "__main__":
    main()
