"""Prompt assigners: map each prompt (all n samples together) to a decode actor."""

from __future__ import annotations

import heapq
from typing import Literal

import numpy as np
from pydantic import Field
from rlhfless_policies._base import Parameterless

from rlhfless_sdk import PromptBatch, Record


class SortedParams(Record):
    split: Literal["work", "count"] = Field(
        default="work",
        description="Cut the sorted order into ranges of equal predicted tokens (work) or equal sample counts.",
    )


class SortedAssigner:
    """The paper's assignment: sort prompts by predicted length and give each actor a contiguous range.

    Actor 0 gets the longest prompts, actor N-1 the shortest, so no actor mixes short and long responses
    (predicted-length ranges of different actors do not overlap). ``split=work`` cuts the sorted order where
    the running predicted tokens (n * length) cross multiples of total/N, so the actor holding the long
    prompts gets fewer of them; ``split=count`` gives each actor the same number of samples.
    """

    description = "sort by predicted length, contiguous length ranges per actor (RLHFless)"

    def __init__(self, params: SortedParams | None = None) -> None:
        self.split = (params or SortedParams()).split
        self._memo: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None

    def _sorted(self, batch: PromptBatch, predicted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Prompts longest first, and the predicted work before each of them in that order."""
        memo = self._memo  # the planner asks once per candidate N with the same arrays: sort once
        if memo is not None and memo[0] is predicted and memo[1] is batch.n_samples:
            return memo[2], memo[3]
        order = np.argsort(-predicted, kind="stable")
        n = batch.n_samples[order]
        weight = n * np.maximum(predicted[order], 1e-9) if self.split == "work" else n.astype(np.float64)
        before = np.cumsum(weight) - weight
        before /= before[-1] + weight[-1]
        self._memo = (predicted, batch.n_samples, order, before)
        return order, before

    def assign(self, batch: PromptBatch, predicted: np.ndarray, num_actors: int) -> np.ndarray:
        out = np.zeros(len(batch), dtype=np.int64)
        if len(batch) == 0:
            return out
        order, before = self._sorted(batch, predicted)
        out[order] = np.minimum((before * num_actors).astype(np.int64), num_actors - 1)
        return out


class LeastPendingAssigner(Parameterless):
    """OpenRLHF 0.11.2's dispatch: each prompt, in order, to the engine with the fewest unfinished samples.

    At plan time nothing has finished yet, so the count is the samples assigned so far (ties: lowest index).
    """

    description = "OpenRLHF 0.11.2: engine with the fewest unfinished samples"
    reads_predictions = False  # consults no predicted length

    def assign(self, batch: PromptBatch, predicted: np.ndarray, num_actors: int) -> np.ndarray:
        p = len(batch)
        if p == 0:
            return np.zeros(0, dtype=np.int64)
        n = batch.n_samples
        if (n == n[0]).all():  # equal group sizes: exactly round-robin
            return np.arange(p, dtype=np.int64) % num_actors
        heap = [(0, a) for a in range(num_actors)]
        out = np.empty(p, dtype=np.int64)
        for i, k in enumerate(n.tolist()):
            pending, a = heapq.heappop(heap)
            out[i] = a
            heapq.heappush(heap, (pending + k, a))
        return out


class RoundRobinAssigner(Parameterless):
    """Prompt i goes to actor i mod N."""

    description = "prompt i to actor i mod N"
    reads_predictions = False  # consults no predicted length

    def assign(self, batch: PromptBatch, predicted: np.ndarray, num_actors: int) -> np.ndarray:
        return np.arange(len(batch), dtype=np.int64) % num_actors


class StaticChunksAssigner(Parameterless):
    """verl's synchronous rollout: the batch's samples (each prompt repeated n times, interleaved, so a group's
    samples are adjacent) are split into equal contiguous chunks, one per engine, whatever their lengths.

    Per sample: sample j of S goes to engine ``j * N // S``, so chunk sizes differ by at most one and a group
    may straddle two engines at a chunk boundary (the controller regroups its samples afterwards).
    """

    description = "verl (synchronous): the samples in equal contiguous chunks, one per engine"
    reads_predictions = False  # consults no predicted length

    def assign(self, batch: PromptBatch, predicted: np.ndarray, num_actors: int) -> np.ndarray:
        s = batch.total_samples
        return np.arange(s, dtype=np.int64) * num_actors // max(s, 1)


class BalancedAssigner(Parameterless):
    """Beyond the paper: longest-processing-time-first on predicted work (n * length).

    Prompts in decreasing predicted work each go to the actor with the least predicted work so far, which
    equalises the actors' total tokens (within the largest single prompt) instead of their length ranges.
    """

    description = "longest-processing-time-first on predicted tokens (beyond the paper)"

    def assign(self, batch: PromptBatch, predicted: np.ndarray, num_actors: int) -> np.ndarray:
        p = len(batch)
        out = np.zeros(p, dtype=np.int64)
        if p == 0:
            return out
        work = batch.n_samples * np.maximum(predicted, 0.0)
        order = np.argsort(-work, kind="stable")
        heap = [(0.0, a) for a in range(num_actors)]
        w = work[order].tolist()
        for rank, i in enumerate(order.tolist()):
            load, a = heapq.heappop(heap)
            out[i] = a
            heapq.heappush(heap, (load + w[rank], a))
        return out


class WorkParams(Record):
    kv_weight: float = Field(
        default=3.5e-6,
        ge=0.0,
        description="Weight of a token of context against a decoded token (KV read per step over the step's "
        "fixed cost; 3.5e-6 for a 7B model on an L40S).",
    )


class WorkAssigner:
    """Beyond the paper: per-sample, work-aware dispatch.

    Each sample's work is its predicted length L plus ``kv_weight * (p * L + L**2 / 2)`` (the KV it reads while
    decoding, p its prompt length). Samples go longest-first, each to the engine with the least work so far
    (LPT), so a prompt's n samples may land on different engines when that balances the work (the controller
    regroups them afterwards). ``order`` dispatches them longest-first, so each engine admits its longest
    samples first and its shortest fill in at the end instead of starting a long one last.
    """

    description = "per-sample LPT on predicted work, groups split, longest dispatched first (beyond the paper)"

    def __init__(self, params: WorkParams | None = None) -> None:
        self.kv_weight = (params or WorkParams()).kv_weight

    def work(self, batch: PromptBatch, predicted: np.ndarray) -> np.ndarray:
        prompt_of = batch.sample_prompt_index()
        length = np.maximum(np.asarray(predicted, dtype=np.float64), 0.0)[prompt_of]
        p = batch.prompt_lengths[prompt_of].astype(np.float64)
        return length + self.kv_weight * (p * length + length * length / 2.0)

    def order(self, batch: PromptBatch, predicted: np.ndarray, assignment: np.ndarray) -> np.ndarray:
        """The samples longest-first (ties: batch order)."""
        return np.argsort(-self.work(batch, predicted), kind="stable")

    def assign(self, batch: PromptBatch, predicted: np.ndarray, num_actors: int) -> np.ndarray:
        s = batch.total_samples
        out = np.zeros(s, dtype=np.int64)
        if s == 0:
            return out
        work = self.work(batch, predicted)
        order = np.argsort(-work, kind="stable")
        heap = [(0.0, 0, a) for a in range(num_actors)]  # (work, samples, actor): equal work -> fewer samples
        w = work[order].tolist()
        for rank, i in enumerate(order.tolist()):
            load, count, a = heapq.heappop(heap)
            out[i] = a
            heapq.heappush(heap, (load + w[rank], count + 1, a))
        return out


class PullParams(WorkParams):
    buffer: int = Field(
        default=4,
        ge=1,
        description="Samples kept waiting on an engine beyond what it runs; the rest wait in the "
        "shared queue for whichever engine frees first.",
    )


class PullAssigner(WorkAssigner):
    """Beyond the paper: a shared pull queue over per-sample work.

    The samples wait in one queue, longest predicted work first; an engine takes the next ones whenever fewer
    than ``buffer`` of its own wait (it runs what it has room for), so work goes to whichever engine frees
    first instead of being fixed to an engine at the start. ``assign`` (the same LPT as ``work``) is what the
    cost model estimates; the step controller dispatches from the queue.
    """

    description = "shared queue, longest work first: each engine pulls when it has room (beyond the paper)"

    def __init__(self, params: PullParams | None = None) -> None:
        params = params or PullParams()
        super().__init__(params)
        self.pull_buffer = params.buffer
