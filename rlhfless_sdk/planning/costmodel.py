"""The analytic cost model: a step's time and GPU-seconds for one candidate plan, from a time-per-token profile.

Per decode actor, with its samples' predicted lengths ``L`` and prompt lengths ``p``:

- decode steps   = max(max L, sum L / slots), slots = min(max_num_seqs, kv_capacity / mean(p + L))
- decode time    = decode_base_s * steps + decode_per_seq_s * sum L + decode_per_ctx_token_s * sum(p*L + L*(L-1)/2)
  (with ``decode_overlap``: overhead * steps + max(weights * steps + KV reads, decode_per_seq_s * sum L))
- prefill time   = prefill_per_new_token_s * (prompt tokens not covered by a deduplicated shared prefix)

Step time is the slowest actor plus the prefill actor's pass over the distinct shared prefixes
(``PrefillPlan.prefill_actor_tokens``), plus one start-up when any actor is cold (actors ``0..warm_actors-1``
ran the previous step and are warm); GPU-seconds bill each actor while it has work (serverless), plus the
start-up of each cold one. Everything is vectorised over samples.
"""

from __future__ import annotations

import numpy as np

from rlhfless_sdk.api.batch import PromptBatch
from rlhfless_sdk.api.protocols import Candidate
from rlhfless_sdk.api.records import CandidateEstimate, PrefillPlan, TimePerTokenProfile


def shared_prefix_per_prompt(batch: PromptBatch, prefill: PrefillPlan) -> np.ndarray:
    """Tokens of each prompt that the prefill actor computes (0 everywhere without deduplication)."""
    if not prefill.prompt_group or len(prefill.prompt_group) != len(batch):
        return np.zeros(len(batch), dtype=np.int64)
    return np.asarray(prefill.group_prefix_tokens, dtype=np.int64)[np.asarray(prefill.prompt_group, dtype=np.int64)]


def start_up_and_prefill(
    prof: TimePerTokenProfile, cold: int, prefill: PrefillPlan, warm_actors: int
) -> tuple[float, float, float]:
    """(start-up seconds added to the step, the prefill actor's seconds, GPU-seconds of both beyond the decode
    actors' work) for ``cold`` cold decode actors: one start-up in time when anything is cold, billed per cold
    actor; the prefill actor is cold when no actor is warm."""
    shared = float(prefill.prefill_actor_tokens) if prefill.prompt_group else 0.0
    prefill_actor_s = prof.prefill_per_new_token_s * shared if shared else 0.0
    prefill_cold = prof.cold_start_s if prefill_actor_s and not warm_actors else 0.0
    start_up = prof.cold_start_s if cold or prefill_cold else 0.0
    extra = prof.gpus_per_actor * cold * prof.cold_start_s
    if prefill_actor_s:
        extra += prefill_actor_s + prefill_cold
    return start_up, prefill_actor_s, extra


class AnalyticCostModel:
    """Closed-form estimate of a step under continuous batching; see the module docstring for the formulas."""

    def __init__(self, profile: TimePerTokenProfile) -> None:
        self.profile = profile

    def actor_busy_s(self, candidate: Candidate) -> np.ndarray:
        """Predicted busy seconds of each decode actor (prefill of its own tokens plus decode).

        ``predicted`` holds one length per prompt, or one per sample (samples in prompt order) to evaluate a
        plan against lengths that differ within a group (true lengths, in a simulator or a report).
        """
        prof = self.profile
        batch, predicted, num_actors, prefill = (
            candidate.batch,
            candidate.predicted,
            candidate.num_actors,
            candidate.prefill,
        )
        actor = np.asarray(candidate.sample_actor, dtype=np.int64)
        per_sample = np.shape(predicted)[0] == batch.total_samples != len(batch)
        first = actor[batch.sample_offsets[:-1]] if len(batch) else actor[:0]
        if not per_sample and np.array_equal(np.repeat(first, batch.n_samples), actor):
            # Groups kept together (the usual case): sum per prompt, weighted by its n samples.
            weight = batch.n_samples.astype(np.float64)
            actor, lengths = first, np.asarray(predicted, dtype=np.float64)
            plen = batch.prompt_lengths.astype(np.float64)
            new_tokens = plen - shared_prefix_per_prompt(batch, prefill)
        else:
            prompt_of = batch.sample_prompt_index()
            weight = np.ones(actor.shape[0])
            lengths = np.asarray(predicted, dtype=np.float64)
            lengths = lengths if per_sample else lengths[prompt_of]
            plen = batch.prompt_lengths[prompt_of].astype(np.float64)
            new_tokens = plen - shared_prefix_per_prompt(batch, prefill)[prompt_of]

        def per_actor(x: np.ndarray) -> np.ndarray:
            return np.bincount(actor, weights=weight * x, minlength=num_actors)

        count = np.bincount(actor, weights=weight, minlength=num_actors)
        tokens = per_actor(lengths)
        ctx = per_actor(plen * lengths + lengths * (lengths - 1.0) / 2.0)
        seq_tokens = per_actor(plen + lengths)
        longest = np.zeros(num_actors)
        np.maximum.at(longest, actor, lengths)
        prefill_new = per_actor(new_tokens)

        with np.errstate(divide="ignore", invalid="ignore"):
            mean_seq = np.where(count > 0, seq_tokens / np.maximum(count, 1.0), 1.0)
        slots = np.clip(prof.kv_capacity_tokens / np.maximum(mean_seq, 1.0), 1.0, prof.max_num_seqs)
        steps = np.maximum(longest, tokens / slots)
        if prof.decode_overlap:  # memory reads and compute overlap: the larger of the two, summed per actor
            memory = (prof.decode_base_s - prof.decode_overhead_s) * steps + prof.decode_per_ctx_token_s * ctx
            decode = prof.decode_overhead_s * steps + np.maximum(memory, prof.decode_per_seq_s * tokens)
        else:
            decode = prof.decode_base_s * steps + prof.decode_per_seq_s * tokens + prof.decode_per_ctx_token_s * ctx
        decode = decode + prof.decode_per_seq_comm_s * tokens
        pre = np.where(count > 0, prof.prefill_base_s + prof.prefill_per_new_token_s * prefill_new, 0.0)
        return np.where(count > 0, decode + pre, 0.0)

    def estimate(self, candidate: Candidate, migrates: bool = False, warm_actors: int = 0) -> CandidateEstimate:
        """``migrates``: the scheduler cuts and migrates laggards, so the slowest actor sheds its tail down to
        the mean busy time, but no sample ends sooner than its own decode steps take. ``warm_actors``: actors
        ``0..warm_actors-1`` (and the prefill actor, when any is warm) need no start-up."""
        prof = self.profile
        busy = self.actor_busy_s(candidate)
        predicted, prefill = candidate.predicted, candidate.prefill
        used = int(np.count_nonzero(busy))
        cold = int(np.count_nonzero(busy[warm_actors:]))
        start_up, prefill_actor_s, extra = start_up_and_prefill(prof, cold, prefill, warm_actors)
        decode = float(busy.max(initial=0.0))
        if migrates and used:
            longest = float(np.max(predicted, initial=0.0)) * prof.decode_base_s
            decode = min(decode, max(float(busy[busy > 0].mean()), longest))
        time_s = start_up + prefill_actor_s + decode
        gpu_seconds = prof.gpus_per_actor * float(busy.sum()) + extra
        return CandidateEstimate(num_actors=candidate.num_actors, time_s=time_s, gpu_seconds=gpu_seconds)
