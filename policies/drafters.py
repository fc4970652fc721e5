"""Reference drafters for speculative decoding: none (OpenRLHF's and verl's engines), ngram, history, suffix.

A drafter only proposes tokens; the engine's rejection sampling decides what is kept, so a drafter can make a step
yield more tokens but never changes what is sampled. ``history`` is the one built for RL: every epoch revisits the
same prompts, and a prompt's earlier responses (and its group siblings' tokens so far) often continue the way the
current sample goes, so a suffix match over them drafts tokens the target accepts.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence

import numpy as np
from pydantic import Field, PositiveInt, model_validator
from rlhfless_policies._base import Parameterless

from rlhfless_sdk import Record


def prompt_key(prompt: Sequence[int]) -> bytes:
    """A prompt's identity: a digest of its token ids."""
    return hashlib.blake2b(np.asarray(prompt, dtype=np.int64).tobytes(), digest_size=16).digest()


class NoDrafter(Parameterless):
    """No speculative decoding: one token a decode step (OpenRLHF's and verl's engines)."""

    description = "no speculative decoding: one token a decode step (OpenRLHF's and verl's engines)"
    reads_predictions = False

    def draft_tokens(self, running: int, remaining: float | None = None) -> int:
        return 0

    def propose(
        self, prompt: Sequence[int], response: Sequence[int], k: int, siblings: Sequence[Sequence[int]] = ()
    ) -> list[int]:
        return []

    def observe(self, prompt: Sequence[int], responses: Sequence[Sequence[int]]) -> None:
        return None


class _Matching(Record):
    """The shortest and longest suffix a drafter matches (``min_match <= max_match``)."""

    min_match: PositiveInt = Field(default=2, description="Shortest suffix (n-gram) matched.")
    max_match: PositiveInt = Field(default=16, description="Longest suffix matched.")

    @model_validator(mode="after")
    def _order(self) -> _Matching:
        if self.min_match > self.max_match:
            raise ValueError(f"min_match {self.min_match} exceeds max_match {self.max_match}")
        return self


class NgramParams(_Matching):
    tokens: PositiveInt = Field(default=4, description="Draft tokens a step (vLLM's num_speculative_tokens).")
    max_match: PositiveInt = Field(default=4, description="Longest n-gram matched (vLLM's prompt_lookup_max).")
    step_tokens: PositiveInt | None = Field(
        default=None,
        description="Tokens a decode step verifies while it stays memory-bound on a GPU (the engine's roofline; "
        "about 750 for a 7B model on an L40S, as HistoryParams.step_tokens). Set: with B sequences running a step "
        "drafts min(tokens, step_tokens // B - 1), through vLLM's batch-size schedule "
        "(num_speculative_tokens_per_batch_size), so drafts run in the long tail and a full batch drafts little or "
        "nothing. None: `tokens` every step (vLLM's fixed budget).",
    )
    gpu_only: bool = Field(
        default=False,
        description="Draft on GPU engines only. A CPU engine's decode step is compute-bound at every batch size, "
        "so each drafted token costs a token of compute (`rlhfless drafter-bench` measures ngram slower than a "
        "plain CPU engine).",
    )


def batch_size_schedule(budget: Sequence[int]) -> list[tuple[int, int, int]]:
    """A budget (draft tokens at 1, 2, ... running sequences) as vLLM's ``num_speculative_tokens_per_batch_size``:
    ``(first, last, k)`` ranges of running counts, the last one's k going on to any batch size."""
    ranges: list[tuple[int, int, int]] = []
    for running, k in enumerate(budget, start=1):
        if ranges and ranges[-1][2] == k:
            ranges[-1] = (ranges[-1][0], running, int(k))
        else:
            ranges.append((running, running, int(k)))
    return ranges


class NgramDrafter:
    """vLLM's own n-gram drafter: the tokens that followed the last n-gram's latest earlier occurrence in the same
    request (prompt and response), a fixed budget a step. On the engines it is vLLM's ``ngram`` method."""

    description = "vLLM's n-gram prompt lookup within a request (fixed draft budget)"
    reads_predictions = False

    def __init__(self, params: NgramParams | None = None) -> None:
        self.params = params or NgramParams()

    def engine_method(self) -> dict:
        """vLLM's speculative config for this drafter (its built-in method; with ``step_tokens``, the budget for each
        running count as vLLM's batch-size schedule)."""
        p = self.params
        config = {
            "method": "ngram",
            "num_speculative_tokens": p.tokens,
            "prompt_lookup_min": p.min_match,
            "prompt_lookup_max": p.max_match,
        }
        if p.step_tokens is not None:
            config["num_speculative_tokens_per_batch_size"] = self.schedule()
        return config

    def schedule(self) -> list[tuple[int, int, int]]:
        """The budget as vLLM's ``num_speculative_tokens_per_batch_size`` (``batch_size_schedule``), up to the
        first running count that drafts nothing (0 once a step would turn compute-bound)."""
        budget = [self.draft_tokens(1)]
        while budget[-1] > 0:
            budget.append(self.draft_tokens(len(budget) + 1))
        return batch_size_schedule(budget)

    def drafts_on(self, device: str) -> bool:
        """Whether this drafter drafts on engines of ``device`` (``gpu`` or ``cpu``)."""
        return not (self.params.gpu_only and device == "cpu")

    def draft_tokens(self, running: int, remaining: float | None = None) -> int:
        p = self.params
        if p.step_tokens is None:
            return p.tokens
        return max(0, min(p.tokens, p.step_tokens // max(running, 1) - 1))

    def propose(
        self, prompt: Sequence[int], response: Sequence[int], k: int, siblings: Sequence[Sequence[int]] = ()
    ) -> list[int]:
        seq = list(prompt) + list(response)
        p = self.params
        for n in range(min(p.max_match, len(seq) - 1), p.min_match - 1, -1):
            tail = seq[-n:]
            for start in range(len(seq) - n - 1, -1, -1):  # latest earlier occurrence
                if seq[start : start + n] == tail:
                    return seq[start + n : start + n + k]
        return []

    def observe(self, prompt: Sequence[int], responses: Sequence[Sequence[int]]) -> None:
        return None


class HistoryParams(_Matching):
    max_draft: PositiveInt = Field(default=8, description="Most draft tokens a step (a lone sequence, long to go).")
    step_tokens: PositiveInt = Field(
        default=768,
        description="Tokens a decode step can verify before it turns compute-bound (the engine's roofline: weights "
        "and KV read time over per-token compute time; about 750 for a 7B model on an L40S at 256 sequences of 1.5k "
        "tokens, by the shipped profile's arithmetic). With B sequences running a step drafts step_tokens / B - 1.",
    )
    long_tokens: PositiveInt = Field(
        default=1024,
        description="Predicted remaining tokens at which a sequence gets the whole budget; fewer get a share.",
    )
    responses_per_prompt: PositiveInt = Field(
        default=8, description="Earlier responses kept per prompt (a sliding window: the newest)."
    )
    sibling_window: PositiveInt = Field(
        default=2048, description="A sibling's newest tokens searched for a match (its whole response up to this)."
    )
    max_tokens: PositiveInt = Field(
        default=4_000_000, description="Tokens held over all prompts; the least recently seen prompts go first."
    )


class _Responses:
    """One prompt's recent responses (each after the prompt's last ``max_match`` tokens) with an n-gram index:
    for each ``n``-token window, where the token after it sits."""

    def __init__(self, n: int, keep: int) -> None:
        self.n = n
        self.seqs: deque[list[int]] = deque(maxlen=keep)
        self.index: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        self.base = 0  # id of seqs[0]
        self.tokens = 0
        self.lengths: deque[int] = deque(maxlen=keep)  # response lengths, for the remaining-length estimate

    def add(self, seq: list[int], response_length: int) -> None:
        if len(self.seqs) == self.seqs.maxlen:
            self.tokens -= len(self.seqs[0])
            self.base += 1
            self.seqs.popleft()
            self._reindex()
        self.seqs.append(seq)
        self.lengths.append(response_length)
        self.tokens += len(seq)
        self._index_one(self.base + len(self.seqs) - 1, seq)

    def _index_one(self, sid: int, seq: list[int]) -> None:
        n = self.n
        for i in range(n, len(seq)):
            self.index.setdefault(tuple(seq[i - n : i]), []).append((sid, i))

    def _reindex(self) -> None:
        self.index = {}
        for j, seq in enumerate(self.seqs):
            self._index_one(self.base + j, seq)

    def seq(self, sid: int) -> list[int]:
        return self.seqs[sid - self.base]


def _match_length(seq: Sequence[int], end: int, ctx: Sequence[int], most: int) -> int:
    """How many tokens before ``seq[end]`` equal the end of ``ctx`` (at most ``most``)."""
    m = 0
    while m < most and end - m - 1 >= 0 and m < len(ctx) and seq[end - m - 1] == ctx[-m - 1]:
        m += 1
    return m


class HistoryDrafter:
    """Suffix matching over rollout history: the tokens that followed the longest match of the sequence's last
    tokens in the same prompt's earlier responses (the newest ``responses_per_prompt``) and in its group siblings'
    tokens so far. Its budget is length-aware: drafts pay where a step is memory-bound (few sequences running) and
    a sequence has long to go, so the budget falls with the running count (the tokens a step verifies stay within
    ``step_tokens``) and with the predicted remaining length.
    Memory: at most ``max_tokens`` tokens of history, least recently seen prompts evicted first."""

    description = "suffix matches over the prompt's earlier responses and its siblings (length-aware budget)"
    reads_predictions = False

    def __init__(self, params: HistoryParams | None = None) -> None:
        self.params = params or HistoryParams()
        self._prompts: OrderedDict[bytes, _Responses] = OrderedDict()
        self._held = 0

    # -- memory -----------------------------------------------------------------------------------------------
    def observe(self, prompt: Sequence[int], responses: Sequence[Sequence[int]]) -> None:
        """Keep finished ``responses`` of ``prompt`` (a step's group), evicting what exceeds the memory bound."""
        p = self.params
        key = prompt_key(prompt)
        entry = self._prompts.pop(key, None)
        if entry is None:
            entry = _Responses(p.min_match, p.responses_per_prompt)
        self._held -= entry.tokens
        head = [int(t) for t in list(prompt)[-p.max_match :]]
        for response in responses:
            seq = head + [int(t) for t in response]
            entry.add(seq[: p.max_tokens], len(response))
        self._prompts[key] = entry  # now the most recently seen
        self._held += entry.tokens
        while self._held > p.max_tokens and self._prompts:
            _, old = self._prompts.popitem(last=False)
            self._held -= old.tokens

    def predicted_remaining(self, prompt: Sequence[int], generated: int) -> float | None:
        """The prompt's median earlier response length less ``generated`` (None: never seen)."""
        entry = self._prompts.get(prompt_key(prompt))
        if entry is None or not entry.lengths:
            return None
        return max(float(np.median(np.asarray(entry.lengths))) - generated, 0.0)

    # -- drafting ---------------------------------------------------------------------------------------------
    def draft_tokens(self, running: int, remaining: float | None = None) -> int:
        p = self.params
        k = min(p.max_draft, p.step_tokens // max(running, 1) - 1)
        if remaining is not None and remaining < p.long_tokens:
            k = min(k, math.ceil(p.max_draft * max(remaining, 0.0) / p.long_tokens))
        return max(k, 0)

    def propose(
        self, prompt: Sequence[int], response: Sequence[int], k: int, siblings: Sequence[Sequence[int]] = ()
    ) -> list[int]:
        """Up to ``k`` tokens to follow ``response``: the continuation of the longest suffix match (ties: the
        newest earlier response, then a sibling). ``siblings``: the group's other responses so far."""
        p = self.params
        if k <= 0:
            return []
        head = [int(t) for t in prompt[-p.max_match :]]
        ctx = (head + [int(t) for t in response[-p.max_match :]])[-p.max_match :]
        if len(ctx) < p.min_match:
            return []
        best: tuple[int, Sequence[int], int] = (0, (), 0)
        for found in self._matches(prompt, head, ctx, siblings):
            if found[0] > best[0]:
                best = found
        m, seq, end = best
        return [int(t) for t in seq[end : end + k]] if m else []

    def _matches(
        self, prompt: Sequence[int], head: list[int], ctx: list[int], siblings: Sequence[Sequence[int]]
    ) -> Iterator[tuple[int, Sequence[int], int]]:
        """Every match of ``ctx``'s last ``min_match`` tokens (the newest 64 of each source) in the prompt's
        earlier responses, then in each sibling (its newest ``sibling_window`` tokens; a short one after the
        prompt's head): ``(match length, source, where its continuation starts)``."""
        p = self.params
        entry = self._prompts.get(prompt_key(prompt))
        if entry is not None:
            for sid, end in reversed(entry.index.get(tuple(ctx[-p.min_match :]), [])[-64:]):
                seq = entry.seq(sid)
                if end < len(seq):
                    yield _match_length(seq, end, ctx, p.max_match), seq, end
        for sib in siblings:
            if len(sib) > p.sibling_window:
                arr = np.asarray(sib[-p.sibling_window :], dtype=np.int64)
            else:
                arr = np.concatenate([np.asarray(head, dtype=np.int64), np.asarray(sib, dtype=np.int64)])
            yield from _array_matches(arr, ctx, p.min_match, p.max_match)


def _array_matches(arr: np.ndarray, ctx: list[int], n: int, most: int) -> Iterator[tuple[int, np.ndarray, int]]:
    """Matches of ``ctx``'s last ``n`` tokens in ``arr`` that a token follows (the newest 64), each with its length
    (at most ``most``) and where its continuation starts."""
    if arr.size <= n:
        return
    key = ctx[-n:]
    starts = np.flatnonzero(arr[: arr.size - n] == key[0])  # a token follows each: start + n < arr.size
    for j in range(1, n):
        starts = starts[arr[starts + j] == key[j]]
    for start in starts[::-1][:64]:
        end = int(start) + n
        lo = max(end - most, 0)
        yield _match_length(arr[lo:end].tolist(), end - lo, ctx, most), arr, end


class SuffixParams(HistoryParams):
    max_match: PositiveInt = Field(default=32, description="Longest suffix matched (a longer match drafts more).")
    own_window: PositiveInt = Field(
        default=8192, description="The sequence's own newest tokens (prompt and response) searched for a match."
    )
    spec_factor: float = Field(
        default=1.0,
        gt=0,
        description="Tokens drafted per token of the match (SuffixDecoding's factor): a match of m tokens drafts at "
        "most ceil(spec_factor * m), so a short, chance match drafts little.",
    )


class SuffixDrafter(HistoryDrafter):
    """Suffix matching over everything the sequence's group has written: the sequence's own tokens (prompt and
    response, as prompt lookup does), its siblings (running ones so far, finished ones in full) and the prompt's
    earlier responses. It takes the longest match; where several sources match as long, it follows the most
    frequent continuation token by token (SuffixDecoding's idea). A longer match drafts more (``spec_factor``),
    within the history drafter's budget: more tokens where few sequences run, none once a step is compute-bound.
    Memory: as ``history`` (at most ``max_tokens`` tokens of earlier responses)."""

    description = "suffix matches over the sequence, its siblings (finished ones too) and the prompt's history"

    def __init__(self, params: SuffixParams | None = None) -> None:
        super().__init__(params or SuffixParams())

    def propose(
        self, prompt: Sequence[int], response: Sequence[int], k: int, siblings: Sequence[Sequence[int]] = ()
    ) -> list[int]:
        p = self.params
        if k <= 0:
            return []
        tail = np.asarray(response[-p.own_window :], dtype=np.int64)
        if tail.size < p.own_window:
            tail = np.concatenate([np.asarray(prompt[-(p.own_window - tail.size) :], dtype=np.int64), tail])
        own = tail
        ctx = own[-p.max_match :].tolist()
        if len(ctx) < p.min_match:
            return []
        head = [int(t) for t in prompt[-p.max_match :]]
        found = [*_array_matches(own, ctx, p.min_match, p.max_match), *self._matches(prompt, head, ctx, siblings)]
        if not found:
            return []
        best = max(m for m, _, _ in found)
        longest = [(seq, end) for m, seq, end in found if m == best]
        return _majority_walk(longest, min(k, math.ceil(p.spec_factor * best)))


def _majority_walk(sources: list[tuple[Sequence[int], int]], k: int) -> list[int]:
    """Up to ``k`` tokens, each the most frequent next token among the sources that agreed so far (ties: the
    earliest source)."""
    out: list[int] = []
    for j in range(k):
        votes: dict[int, list[tuple[Sequence[int], int]]] = {}
        for seq, end in sources:
            if end + j < len(seq):
                votes.setdefault(int(seq[end + j]), []).append((seq, end))
        if not votes:
            break
        token, sources = max(votes.items(), key=lambda kv: len(kv[1]))
        out.append(token)
    return out
