"""Prefill planners: deduplicated prefill (the paper) and ``none`` (every sample prefills its whole prompt)."""

from __future__ import annotations

import numpy as np

from rlhfless_sdk.batch import PromptBatch
from rlhfless_sdk.records import NoParams, PrefillPlan

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

    def __call__(self, cut: np.ndarray) -> np.ndarray:
        """Hash of each prompt's first ``cut[i]`` tokens, mixed with ``cut[i]``."""
        with np.errstate(over="ignore"):
            h = self.pow[np.maximum(cut - 1, 0)] * (self.sums[self.off + cut] - self.sums[self.off])
            return np.where(cut > 0, h, 0).astype(np.uint64) ^ (cut.astype(np.uint64) * _LEN_MIX)


class DedupPrefillPlanner:
    """Deduplicated prefill: each distinct shared prefix is prefilled once by the prefill actor.

    All n samples of a prompt share the whole prompt, and prompts that share a template share its first tokens.
    For a shared-prefix length L every prompt's first min(L, len) tokens go to the prefill actor, deduplicated
    across the batch; each sample then prefills only the rest of its prompt. The prefill actor's work D(L)
    (distinct prefix tokens) grows with L while the total prefill work only falls, so the planner takes the
    largest L whose deduplicated batch fits ``capacity_tokens`` (binary search; D is monotone in L). Without
    token ids, only the n samples of each prompt are deduplicated.
    """

    name = "dedup"

    def __init__(self, params: NoParams | None = None) -> None:
        pass

    def plan(self, batch: PromptBatch, capacity_tokens: int) -> PrefillPlan:
        lengths = batch.prompt_lengths
        n = batch.n_samples
        before = int((lengths * n).sum())
        if len(batch) == 0 or before == 0:
            return PrefillPlan(planner=self.name, tokens_before=before, tokens_after=before)
        hasher = _PrefixHasher(batch) if batch.has_tokens else None
        idx = np.arange(len(batch), dtype=np.uint64)

        def keys(L: int) -> tuple[np.ndarray, np.ndarray]:
            cut = np.minimum(lengths, L)
            # Without token ids, only a prompt's own samples share its prefix: key by prompt index.
            return (hasher(cut) if hasher is not None else idx * _LEN_MIX ^ cut.astype(np.uint64)), cut

        def distinct_tokens(L: int) -> int:
            k, cut = keys(L)
            _, first = np.unique(k, return_index=True)
            return int(cut[first].sum())

        lo, hi = 0, int(lengths.max())
        while lo < hi:  # largest L with distinct_tokens(L) <= capacity
            mid = (lo + hi + 1) // 2
            if distinct_tokens(mid) <= capacity_tokens:
                lo = mid
            else:
                hi = mid - 1
        L = lo
        if L == 0:
            return PrefillPlan(planner=self.name, tokens_before=before, tokens_after=before)
        k, cut = keys(L)
        _, first, group = np.unique(k, return_index=True, return_inverse=True)
        prefix = cut[first]
        after = int(prefix.sum()) + int((np.maximum(lengths - L, 0) * n).sum())
        return PrefillPlan.model_construct(
            planner=self.name,
            shared_prefix_length=L,
            prompt_group=group.reshape(-1).tolist(),
            group_prefix_tokens=prefix.tolist(),
            tokens_before=before,
            tokens_after=after,
        )


class NoPrefillPlanner:
    """Baseline: no deduplication; every sample prefills its whole prompt on its decode actor."""

    name = "none"

    def __init__(self, params: NoParams | None = None) -> None:
        pass

    def plan(self, batch: PromptBatch, capacity_tokens: int) -> PrefillPlan:
        before = int((batch.prompt_lengths * batch.n_samples).sum())
        return PrefillPlan(planner=self.name, tokens_before=before, tokens_after=before)
