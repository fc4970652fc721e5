"""Prefill planners: deduplicated prefill (the paper) and ``none`` (every sample prefills its whole prompt)."""

from __future__ import annotations

import numpy as np
from pydantic import Field, PositiveInt
from rlhfless_policies._base import Parameterless

from rlhfless_sdk import PrefillPlan, PromptBatch, Record

_B = 0x9E3779B97F4A7C15  # odd, hence invertible modulo 2**64
_B_INV = pow(_B, -1, 2**64)
_LEN_MIX = np.uint64(0x632BE59BD9B4E019)


class _PrefixHasher:
    """64-bit polynomial hash of any prompt prefix in O(1), after one O(total tokens) pass.

    With r the position of a token within its prompt, C = cumsum(t * B**-r) over the flat tokens, the first L
    tokens of prompt i hash to B**(L-1) * (C[off+L] - C[off]) = sum_r t_r * B**(L-1-r): the same value wherever
    the prompt sits in the batch. Arithmetic wraps modulo 2**64; the powers come from tables of the longest prompt.
    """

    def __init__(self, batch: PromptBatch) -> None:
        assert batch.token_flat is not None
        lengths = batch.prompt_lengths
        longest = int(lengths.max()) if len(lengths) else 0
        self.off = batch.token_offsets[:-1]
        with np.errstate(over="ignore"):
            self.pow = np.cumprod(np.full(max(longest, 1), _B, dtype=np.uint64)) * np.uint64(_B_INV)  # B**r
            inv = np.cumprod(np.full(max(longest, 1), _B_INV, dtype=np.uint64)) * np.uint64(_B)  # B**-r
            rel = np.arange(batch.token_flat.shape[0], dtype=np.int64) - np.repeat(self.off, lengths)
            t = batch.token_flat.astype(np.uint64) + np.uint64(1)
            self.sums = np.zeros(t.shape[0] + 1, dtype=np.uint64)
            np.cumsum(t * inv[rel], out=self.sums[1:])

    def __call__(self, cut: np.ndarray, prompts: np.ndarray | None = None) -> np.ndarray:
        """Hash of the first ``cut[j]`` tokens of prompt ``prompts[j]`` (default: prompt j), mixed with the cut."""
        off = self.off if prompts is None else self.off[prompts]
        with np.errstate(over="ignore"):
            h = self.pow[np.maximum(cut - 1, 0)] * (self.sums[off + cut] - self.sums[off])
            return np.where(cut > 0, h, 0).astype(np.uint64) ^ (cut.astype(np.uint64) * _LEN_MIX)


class DedupParams(Record):
    block_size: PositiveInt = Field(default=16, description="KV block size: prefixes are shared in whole blocks.")


class DedupPrefillPlanner:
    """Deduplicated prefill: each distinct shared prefix is prefilled once by the prefill actor.

    All n samples of a prompt share the whole prompt, and prompts that share a template share its first
    blocks. For a shared-prefix length L (a multiple of the KV block size) every prompt's first min(L, len)
    tokens go to the prefill actor, which computes them as a prefix cache does: each distinct full block
    prefix once (a prefix tree of blocks), plus each prompt's last partial block once for its n samples. Each
    sample then prefills only the rest of its prompt. The prefill actor's work D(L) grows with L and the total
    falls, so the planner takes the largest L whose work fits ``capacity_tokens`` (binary search). Without
    token ids, only the n samples of each prompt are deduplicated.
    """

    description = "prefill each shared prefix once; largest prefix length that fits (RLHFless)"

    name = "dedup"

    def __init__(self, params: DedupParams | None = None) -> None:
        self.block = (params or DedupParams()).block_size

    def plan(self, batch: PromptBatch, capacity_tokens: int) -> PrefillPlan:
        lengths = batch.prompt_lengths
        n = batch.n_samples
        before = int((lengths * n).sum())
        if len(batch) == 0 or before == 0:
            return PrefillPlan(planner=self.name, tokens_before=before, tokens_after=before)
        bs = self.block
        hasher = _PrefixHasher(batch) if batch.has_tokens else None
        block_depths = np.zeros(0, dtype=np.int64)
        if hasher is not None:  # the depth of every distinct full-block prefix in the batch (a block prefix tree)
            nblocks = lengths // bs
            owner = np.repeat(np.arange(len(batch)), nblocks)
            depth = (np.arange(owner.size) - np.repeat(np.cumsum(nblocks) - nblocks, nblocks) + 1) * bs
            _, first_of = np.unique(hasher(depth, owner), return_index=True)
            block_depths = np.sort(depth[first_of])

        def prefill_actor_tokens(L: int) -> int:
            cut = np.minimum(lengths, L)
            if hasher is None:  # no token ids: each prompt's prefix is shared only by its own n samples
                return int(cut.sum())
            tails = int((cut - (cut // bs) * bs).sum())  # partial last blocks, once per prompt
            return bs * int(np.searchsorted(block_depths, L, side="right")) + tails

        lo, hi = 0, -(-int(lengths.max()) // bs)
        while lo < hi:  # largest L = q * bs with prefill_actor_tokens(L) <= capacity
            mid = (lo + hi + 1) // 2
            if prefill_actor_tokens(mid * bs) <= capacity_tokens:
                lo = mid
            else:
                hi = mid - 1
        L = min(lo * bs, int(lengths.max()))
        if L == 0:
            return PrefillPlan(planner=self.name, tokens_before=before, tokens_after=before)
        cut = np.minimum(lengths, L)
        key = (
            hasher(cut)
            if hasher is not None
            else np.arange(len(batch), dtype=np.uint64) * _LEN_MIX ^ cut.astype(np.uint64)
        )
        _, first, group = np.unique(key, return_index=True, return_inverse=True)
        actor_tokens = prefill_actor_tokens(L)
        after = actor_tokens + int(((lengths - cut) * n).sum())
        return PrefillPlan.model_construct(
            planner=self.name,
            shared_prefix_length=L,
            prompt_group=group.reshape(-1).tolist(),
            group_prefix_tokens=cut[first].tolist(),
            prefill_actor_tokens=actor_tokens,
            tokens_before=before,
            tokens_after=min(after, before),
        )


class NoPrefillPlanner(Parameterless):
    """Baseline: no deduplication; every sample prefills its whole prompt on its decode actor."""

    description = "baseline: every sample prefills its whole prompt"
    reads_predictions = False  # consults no predicted length

    name = "none"

    def plan(self, batch: PromptBatch, capacity_tokens: int) -> PrefillPlan:
        before = int((batch.prompt_lengths * batch.n_samples).sum())
        return PrefillPlan(planner=self.name, tokens_before=before, tokens_after=before)
