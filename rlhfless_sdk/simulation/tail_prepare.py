"""Scoring in the generation tail (``pipeline: {mode: sync, tail_prepare: true}``; simulator only).

A synchronous step generates on every GPU, then scores (reference and reward forwards; PPO's critic too) and learns
on every GPU. Near its end only a few engines still decode; the others have finished every sample they will get.
Such a GPU may score groups that are already complete while the tail decodes: the sample's weights and the
scoring models' weights are the same in the tail and after it, so every token stays on-policy. The learning itself
(the optimizer step) still waits for the whole batch.

The model, per step:

- a GPU is free once its engine has decoded its last token of the step (a GPU no engine used: from the start);
- it starts scoring ``switch_s`` later (``scoring_switch_s``: its engine's weights out to host memory and the
  scoring weights in over the host link, plus a fixed start). A GPU that would start after generation ends does
  not switch: it scores with the others, as without this option;
- a group can be scored once its last sample has finished; scoring work (GPU-seconds) is spread over the free GPUs
  as a fluid, as many at once as are free, and no GPU that still decodes takes any (no contention with decode);
- what is not scored when generation ends is scored on every GPU after it, as without this option.

The step then takes generation + the scoring left / GPUs + learning + the weight sync; a GPU that switched is
billed from its switch to the end of generation (its switch, its scoring and its waits for complete groups).

Real frameworks score on their whole actor group at once (OpenRLHF's reference and reward groups, ZeRO-sharded over
every GPU), so this needs a scorer that can run on part of the GPUs; the OpenRLHF adapter does not do it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from rlhfless_sdk.api.records import (
    TimePerTokenProfile,
)
from rlhfless_sdk.planning.planner import StepPlanner
from rlhfless_sdk.rollout.billing import EngineUsage, StepUsage
from rlhfless_sdk.rollout.drivers import Driven
from rlhfless_sdk.rollout.modes import tail_of

#: seconds an engine GPU takes to become a scorer on top of moving the weights (the engine's sleep, the scorer's
#: start): a round figure, not measured
SWITCH_FIXED_S = 5.0


def scoring_switch_s(profile: TimePerTokenProfile) -> float:
    """An engine GPU's switch to scoring: its engine's weights out to host memory and the scoring model's in, over
    the host link (``intra_node_gbps``), plus ``SWITCH_FIXED_S`` (``weights_gb``, a GPU's share of them)."""
    return 2.0 * weights_gb(profile) / profile.gpus_per_actor / profile.intra_node_gbps + SWITCH_FIXED_S


@dataclass(frozen=True)
class TailScoring:
    """What scoring in the tail did in one step."""

    done_gpu_s: float  # scoring GPU-seconds done before generation ended
    held_gpu_s: float  # GPU-seconds the scorers were held, from their switch to the end of generation (billed)
    left_gpu_s: float  # scoring GPU-seconds left for every GPU after generation
    scorers: int  # GPUs that switched


def score_in_tail(
    free_s: Sequence[float],
    ready: Sequence[tuple[float, float]],
    end_s: float,
    switch_s: float,
) -> TailScoring:
    """Scoring in the tail of a step whose generation ends at ``end_s``. ``free_s``: when each GPU's engine decoded
    its last token (0: it had none); ``ready``: (when a group was complete, its scoring GPU-seconds), for every group
    that trains. Returns what was done by ``end_s`` and what is left."""
    total = float(sum(w for _, w in ready))
    joins = sorted(f + switch_s for f in free_s if f + switch_s < end_s)
    arrivals = sorted((c, w) for c, w in ready if c < end_s)
    events = sorted({*joins, *(c for c, _ in arrivals), end_s})
    backlog, done, scorers = 0.0, 0.0, 0
    ji = ai = 0
    t = 0.0
    for nxt in events:
        if nxt > t and scorers and backlog > 0:  # the free GPUs score what is complete
            work = min(backlog, scorers * (nxt - t))
            backlog -= work
            done += work
        t = nxt
        if t >= end_s:
            break
        while ji < len(joins) and joins[ji] <= t:
            scorers += 1
            ji += 1
        while ai < len(arrivals) and arrivals[ai][0] <= t:
            backlog += arrivals[ai][1]
            ai += 1
    return TailScoring(
        done_gpu_s=done,
        held_gpu_s=float(sum(end_s - f for f in free_s if f + switch_s < end_s)),
        left_gpu_s=max(total - done, 0.0),
        scorers=len(joins),
    )


# -- learning in the tail (``tail_learn``) ----------------------------------------------------------------------
#: models a gradient group holds, in multiples of the policy's bf16 weights: the policy (bf16 weights, fp32
#: gradients: 3x) and the reference (1x) for GRPO; PPO adds the critic (3x) and the reward model (1x)
GROUP_MODELS = {"grpo": 4.0, "ppo": 8.0}
#: GB per GPU a gradient group keeps for activations (checkpointed) and buffers, as the profiles' engines do
GROUP_ACTIVATIONS_GB = 2.0


def weights_gb(profile: TimePerTokenProfile) -> float:
    """The policy's bf16 weights in GB: 2 bytes a parameter (the profile's ``learner``), else its
    ``tensor_parallel`` block's, else what a weight sync moves at the inter-node bandwidth (a profile that says
    nothing else of its model; an upper bound where its sync time includes per-tensor latency)."""
    if profile.learner is not None:
        return 2.0 * profile.learner.params_b
    if profile.tensor_parallel is not None:
        return profile.tensor_parallel.weights_gb
    return profile.weight_sync_s * profile.inter_node_gbps


def gpu_memory_gb(dedicated: TimePerTokenProfile) -> float:
    """One GPU's memory: the profile's ``learner`` says it; else from a dedicated profile's KV capacity as every
    shipped profile derives it (the KV cache gets 90% of memory less the weights and 2 GB of activations per GPU)."""
    if dedicated.learner is not None:
        return dedicated.learner.gpu_memory_gb
    kv_gb = dedicated.kv_capacity_tokens * dedicated.kv_bytes_per_token / 1e9
    return (kv_gb + weights_gb(dedicated) + 2.0 * dedicated.gpus_per_actor) / 0.9 / dedicated.gpus_per_actor


def group_gpus(dedicated: TimePerTokenProfile, algo: str) -> int:
    """The fewest GPUs of one gradient group: its models (``GROUP_MODELS``) ZeRO-3-sharded over them fit in 90% of
    each GPU's memory beside ``GROUP_ACTIVATIONS_GB``."""
    room = 0.9 * gpu_memory_gb(dedicated) - GROUP_ACTIVATIONS_GB
    need = GROUP_MODELS[algo] * weights_gb(dedicated)
    if room <= 0:
        raise ValueError(f"profile {dedicated.name!r}: no room on a GPU for a gradient group")
    return max(1, math.ceil(need / room))


def learning_switch_s(dedicated: TimePerTokenProfile, algo: str, size: int) -> float:
    """A freed GPU's switch into a gradient group of ``size``: the scoring switch (``scoring_switch_s``) plus its
    shard of the group's models in over the host link."""
    shard_gb = GROUP_MODELS[algo] * weights_gb(dedicated) / size
    return scoring_switch_s(dedicated) + shard_gb / dedicated.intra_node_gbps


def gradient_reduce_s(profile: TimePerTokenProfile) -> float:
    """The tail groups' fp32 gradients reduced into the learner's before its optimizer step: twice the weights'
    bytes at the inter-node bandwidth."""
    return 2.0 * weights_gb(profile) / profile.inter_node_gbps


def in_groups(free_s: Sequence[float], size: int, never: float) -> list[float]:
    """When each GPU can start in a gradient group: GPUs form groups of ``size`` in the order they free, a group
    once its last member is free (a ZeRO group's members are fixed once it forms); GPUs of an incomplete last
    group get ``never``. Same order as ``free_s``."""
    order = sorted(range(len(free_s)), key=lambda i: free_s[i])
    out = [never] * len(free_s)
    for k in range(len(order) // size):
        members = order[k * size : (k + 1) * size]
        formed = free_s[members[-1]]
        for i in members:
            out[i] = formed
    return out


# -- a step's usage with the tail's work -----------------------------------------------------------------------------
class TailUsage:
    """The ``Simulator``'s tail scoring and learning on a finished synchronous step (a mixin)."""

    def _score_in_tail(self, planner: StepPlanner, usage: StepUsage, driven: Driven) -> StepUsage:
        """``usage`` of a synchronous step with ``tail_prepare``: the fleet's GPUs whose engines are done score the
        complete groups that train while the others generate (``score_in_tail``); the scoring left is spread over
        every GPU after generation, and the GPUs that switched are billed from their switch to its end. Burst
        engines' GPUs are not the learner's: they never score. With ``tail_learn`` they also learn, in gradient
        groups (``group_gpus``, formed as GPUs free: ``in_groups``), the first optimizer step's share of each group;
        the gradient reduce is charged once any did. Without ``tail_prepare``: ``usage`` as it is."""
        tail = tail_of(planner.config)
        if not tail or driven.ran.finish_s is None:
            return usage
        g, gpa = usage.gpus, usage.gpus_per_engine
        learn = tail == "learn"
        # with tail_learn only a consolidated tail is worth joining: a GPU joins if its engine was cut by the
        # consolidation or freed after the step's first cut; GPUs freed before it were released (a short tail
        # never consolidates, and then nothing joins)
        cut, cut_from = usage.extra.get("first_cut_s", math.inf), set(usage.extra.get("cut_engines", ()))

        def freed(i: int, e: EngineUsage) -> float:
            f = e.last_s if e.first_s is not None else 0.0
            return f if not learn or i in cut_from or f >= cut else usage.generation_s

        free = [freed(i, e) for i, e in enumerate(usage.engines) if not e.burst for _ in range(gpa)]
        free = (free + [usage.generation_s if learn else 0.0] * g)[:g]
        prepare, learning = self.profile.learner_rates(self.run_algo)
        # of k optimizer steps on the batch, only the first's learning can run before the batch is complete: the
        # tail learns 1/k of every group (a fluid stand-in for the first update's groups, the earliest complete)
        rate = prepare + learning / planner.config.pipeline.updates_per_batch if learn else prepare
        switch = scoring_switch_s(self.profile)
        if learn:
            size = group_gpus(self.dedicated, self.run_algo)
            free = in_groups(free, size, usage.generation_s)
            switch = learning_switch_s(self.dedicated, self.run_algo, size)
        batch, samples, finish = driven.batch, driven.outcome.samples, driven.ran.finish_s
        starts = np.concatenate([[0], np.cumsum(batch.n_samples)])
        ready = []
        for row in driven.trained_rows:
            sids = range(int(starts[row]), int(starts[row + 1]))
            tokens = sum(samples[i].prompt_length + samples[i].response_length for i in sids)
            ready.append((max(float(finish[i]) for i in sids), tokens * rate))
        scored = score_in_tail(free, ready, usage.generation_s, switch)
        extra = {**usage.extra, "tail_scored_gpu_s": scored.done_gpu_s, "tail_scorers": scored.scorers}
        if not learn:
            return replace(usage, prepare_s=scored.left_gpu_s / g, tail_scoring_gpu_s=scored.held_gpu_s, extra=extra)
        # what the tail did is scoring and learning in proportion; the rest of both is left for every GPU, and the
        # tail groups' gradients join the learner's before its first optimizer step
        prep_done = scored.done_gpu_s * prepare / rate
        reduce_s = gradient_reduce_s(self.profile) if scored.done_gpu_s > 0 else 0.0
        return replace(
            usage,
            prepare_s=usage.prepare_s - prep_done / g,
            learn_s=usage.learn_s - (scored.done_gpu_s - prep_done) / g + reduce_s,
            tail_scoring_gpu_s=scored.held_gpu_s,
            extra=extra,
        )
