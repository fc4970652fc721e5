"""Can sharding the generation tail make an on-policy step faster? One synchronous step's generation on 16 L40S:
one-GPU engines (OpenRLHF's default), engines tensor-parallel from the start, and one-GPU engines whose last
samples move onto tensor-parallel engines once only ``R`` samples are left (the tail is latency-bound: a sharded
engine reads 1/k of the weights a step).

Engines are the simulator's (``EngineModel``: vLLM-like admission, KV limits, recompute preemption) on the shipped
L40S profile and its ``sharded(k)`` form (all-reduces over PCIe: no NVLink on L40S). Samples are the long-reasoning
workload's (512 prompts x 8, median 1,500 tokens, cap 8,192, 3% runaways), each prompt's group to the next engine
in turn. A re-shard is charged honestly: the moved samples recompute their prompt and tokens on the new engine;
the new engine is woken from vLLM's sleep mode and loads the step's weights (``weight_sync_s`` + ``--wake-s``); and
every GPU keeps ``--resident-gb`` of memory for the engine that sleeps beside it, so the one-GPU engines' KV cache
shrinks by that much for the whole step.

    python examples/tensor_parallel_tail.py [--steps 3]
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace

import numpy as np

from rlhfless_sdk.api.profiles import load_profile
from rlhfless_sdk.api.records import TimePerTokenProfile
from rlhfless_sdk.planning.engine_model import EngineModel, EngineSamples, run_engines
from rlhfless_sdk.workloads.synthetic import SyntheticWorkload

GPUS = 16


@dataclass
class Step:
    prompt: list[int]
    length: list[int]

    @classmethod
    def of(cls, step: int) -> Step:
        shape = SyntheticWorkload(512, 8, median_length=1500, sample_sigma=0.5, max_length=8192, runaway=0.03)
        batch, lengths = replace(shape, step=step).batch()
        return cls(np.repeat(batch.prompt_lengths, 8).tolist(), lengths.tolist())

    def samples(self, engines: int) -> EngineSamples:
        n = len(self.length)
        actor = [(i // 8) % engines for i in range(n)]  # group by group, engine after engine
        return EngineSamples(range(n), [0] * n, self.prompt, [0] * n, self.length, [], actor)


def generate(step: Step, prof: TimePerTokenProfile) -> float:
    """Seconds to the last token with every engine of ``prof`` from the start."""
    engines = GPUS // prof.gpus_per_actor
    s = step.samples(engines)
    return finished(s, run_engines(prof, s, engines, range(len(s.target))))


def finished(s: EngineSamples, models: list[EngineModel]) -> float:
    """The last token's time, once every sample is checked to have all its tokens (none lost in a move)."""
    if s.generated != s.target or any(m.B or m.waiting for m in models):
        raise RuntimeError("a sample did not finish with all its tokens")
    return max(m.last_token for m in models if m.used)


def reshard(step: Step, one: TimePerTokenProfile, tp: TimePerTokenProfile, left: int, switch_s: float) -> float:
    """Seconds to the last token when the one-GPU engines hand their samples to tensor-parallel engines once at
    most ``left`` are unfinished (and none waits for admission); ``switch_s``: the hand-over's wake-up."""
    s = step.samples(GPUS)
    models = [EngineModel(a, one, "", 0.0) for a in range(GPUS)]
    for sid, a in enumerate(s.actor):
        models[a].waiting.append(sid)
    t = 0.0
    while True:
        t += 0.5
        for m in models:
            m.run_until(s, t)
        if all(m.idle() for m in models):
            return finished(s, models)
        if sum(m.B for m in models) <= left and not any(m.waiting for m in models):
            break
    moved = [sid for m in models for sid in list(m.stack)]
    for m in models:
        for sid in list(m.stack):
            m._remove_running(s, sid)  # its tokens so far are kept; the new engine recomputes them
    sharded = [EngineModel(GPUS + j, tp, "", t + switch_s) for j in range(GPUS // tp.gpus_per_actor)]
    for i, sid in enumerate(sorted(moved, key=lambda x: -s.generated[x])):  # longest so far first, dealt in turn
        sharded[i % len(sharded)].waiting.append(sid)
    for m in sharded:
        m.run_until(s, math.inf)
    return finished(s, models + sharded)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="workload steps (4,096 samples each) averaged")
    parser.add_argument("--profile", default="qwen2.5-7b-l40s")
    parser.add_argument("--wake-s", type=float, default=2.0, help="vLLM wake-up of the sharded engines, seconds")
    parser.add_argument("--resident-gb", type=float, default=1.5, help="memory a sleeping engine keeps per GPU")
    args = parser.parse_args()

    base = load_profile(args.profile)
    one = base.model_copy(
        update={"kv_capacity_tokens": int(base.kv_capacity_tokens - args.resident_gb * 1e9 / base.kv_bytes_per_token)}
    )
    steps = [Step.of(i) for i in range(args.steps)]
    prepare, learn = base.learner_rates("grpo")  # 8 samples a prompt: the simulator's GRPO learner
    learner_s = float(
        np.mean([(sum(st.prompt) + sum(st.length)) * (prepare + learn) / GPUS + base.weight_sync_s for st in steps])
    )
    rows: list[tuple[str, float]] = [("16 one-GPU engines (OpenRLHF)", np.mean([generate(st, base) for st in steps]))]
    for k in (2, 4):
        for seqs in (base.max_num_seqs, base.max_num_seqs * k):  # vLLM's default, or k times it (a user's flag)
            tp = base.sharded(k).model_copy(update={"max_num_seqs": seqs})
            rows.append((f"TP{k} from the start, {seqs} seqs", np.mean([generate(st, tp) for st in steps])))
    for k in (2, 4):
        tp = one.sharded(k)  # each of its GPUs also keeps the resident memory of the one-GPU engine asleep
        for left in (256, 512, 768):
            switch = base.weight_sync_s + args.wake_s
            rows.append(
                (
                    f"one-GPU, then TP{k} at {left} left",
                    np.mean([reshard(st, one, tp, left, switch) for st in steps]),
                )
            )
    first = rows[0][1]
    print(f"generation of one on-policy step, mean of {args.steps} steps; learning after it: {learner_s:.1f} s")
    print(f"{'engines':<34}{'gen s':>8}{'x gen':>8}{'x step':>8}")
    for name, gen in rows:
        print(f"{name:<34}{gen:>8.1f}{first / gen:>8.3f}{(first + learner_s) / (gen + learner_s):>8.3f}")


if __name__ == "__main__":
    main()
