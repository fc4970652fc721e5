"""The work bound: the GPU work a workload needs on the engine model, whatever the schedule.

No schedule of a workload on G GPUs can finish before ``work / G``, where ``work`` is the GPU-seconds that
every schedule must spend:

- **decode**: every response token is decoded once. On the engine model a decode step of B running sequences
  holding ``ctx`` KV tokens takes ``o + max(w + c * ctx, s * B)`` (overlapped roofline; additive: ``base +
  s * B + c * ctx``). Summed over any schedule's S decode steps, the context term is fixed (a sample of prompt p
  and response L reads ``p + j`` tokens at its j-th step: ``p * L + L * (L - 1) / 2`` in all), the per-sequence
  term is ``s * tokens``, and since a sum of maxima is at least the maximum of the sums, the steps cost at least
  ``S * o + max(S * w + c * CTX, s * TOKENS)``. That grows with S, and S is at least
  ``TOKENS / max_num_seqs`` (a step decodes at most ``max_num_seqs`` tokens) and ``CTX / kv`` (a step reads at
  most the KV capacity, or one sample's whole context when a lone sequence outgrows it). Engines with the most
  memory (dedicated) give the smallest S, so the bound holds for every memory mode.
- **speculative decoding** (a profile with ``speculation``): a verification step yields at most ``tau`` tokens a
  sequence (the drafter's best under its budget, at its measured acceptance) and computes at least one position a
  token, so the step count and the context read shrink by ``tau`` while the per-sequence compute ``s * TOKENS``
  stays: the bound at that acceptance. The plain bound is the same sum with ``tau = 1``.
- **prefill**: each distinct prompt-prefix token once per step (the prefix tree of the step's prompts: shared
  templates and a prompt's n samples are prefilled once), at the profile's new-token rate.
- **learning**: scoring and the update of every trained token (prompt + response of each sample), at the
  algorithm's rates, as every scheduler here trains every sample of the workload once.

Carried samples' re-prefill, aborted tokens, preemption, idle engines, start-ups and weight syncs only add
to a real schedule, so ``bound_s`` is a floor, not an estimate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from rlhfless_sdk.api.batch import PromptBatch
from rlhfless_sdk.api.records import TimePerTokenProfile
from rlhfless_sdk.workloads.traces import Workload


@dataclass(frozen=True)
class WorkBound:
    """GPU-seconds every schedule of the workload must spend (see the module docstring)."""

    decode_gpu_s: float
    prefill_gpu_s: float
    learn_gpu_s: float

    @property
    def gpu_s(self) -> float:
        return self.decode_gpu_s + self.prefill_gpu_s + self.learn_gpu_s

    def bound_s(self, gpus: int) -> float:
        """The shortest time any schedule can take on ``gpus`` GPUs."""
        return self.gpu_s / gpus if gpus > 0 else math.inf


def distinct_prefix_tokens(batch: PromptBatch) -> int:
    """Tokens of the prefix tree of the batch's prompts (each distinct prefix once); without token ids, the
    prompts' lengths (each prompt once)."""
    if batch.token_flat is None:
        return int(batch.prompt_lengths.sum())
    root: dict = {}
    nodes = 0
    for i in range(len(batch)):
        node = root
        for t in batch.tokens(i).tolist():
            nxt = node.get(t)
            if nxt is None:
                nxt = node[t] = {}
                nodes += 1
            node = nxt
    return nodes


def decode_engine_s(profile: TimePerTokenProfile, prompt: np.ndarray, response: np.ndarray) -> float:
    """The fewest engine-seconds that decode ``response[i]`` tokens after ``prompt[i]`` for every sample i."""
    p = np.asarray(prompt, dtype=np.float64)
    length = np.asarray(response, dtype=np.float64)
    tokens = float(length.sum())
    if tokens <= 0:
        return 0.0
    # speculative decoding: a step yields at most tau tokens a sequence and reads the KV once for them
    tau = profile.speculation.best_tokens_per_step() if profile.speculation is not None else 1.0
    ctx = float((p * length + length * (length - 1.0) / 2.0).sum()) / tau
    kv = max(float(profile.kv_capacity_tokens), float((p + length).max(initial=0.0)))
    steps = max(math.ceil(tokens / (profile.max_num_seqs * tau)), ctx / kv)
    c, s = profile.decode_per_ctx_token_s, profile.decode_per_seq_s
    comm = profile.decode_per_seq_comm_s * tokens / tau
    if profile.decode_overlap:
        o = profile.decode_overhead_s
        w = profile.decode_base_s - o
        return steps * o + comm + max(steps * w + c * ctx, s * tokens)
    return steps * profile.decode_base_s + comm + s * tokens + c * ctx


def work_bound(workload: Workload, profile: TimePerTokenProfile, algo: str) -> WorkBound:
    """The GPU work of ``workload`` on engines of ``profile`` (give the dedicated one: the most KV) with the
    ``algo`` learner's rates."""
    gpa = profile.gpus_per_actor
    prepare, learn = profile.learner_rates(algo)
    decode = prefill = learning = 0.0
    for ws in workload.steps:
        b = ws.batch
        if not len(b):
            continue
        prompt = np.repeat(b.prompt_lengths, b.n_samples)
        decode += decode_engine_s(profile, prompt, ws.lengths) * gpa
        prefill += distinct_prefix_tokens(b) * profile.prefill_per_new_token_s * gpa
        trained = float(b.prompt_lengths @ b.n_samples + ws.lengths.sum())
        learning += trained * (prepare + learn)
    return WorkBound(decode, prefill, learning)
