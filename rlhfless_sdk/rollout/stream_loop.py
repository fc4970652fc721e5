"""The stream's decisions, made by one ``StreamLoop`` on every backend: which engine gets which sample when slots
free, how many samples an engine may run (``KvSlots``), what a finished sample tells the book, which groups batch k
trains. The simulator's ``run_stream`` (``rlhfless_sdk.rollout.stream``) runs it on a simulated clock; the OpenRLHF
adapter's ``EngineStream`` on vLLM engines through Ray, between and inside OpenRLHF's async loop's calls. A backend
only says which engines have free slots, starts the samples it is handed and reports those that finish.

Feeding (one rule for every backend, ``free``): an engine takes samples up to the slots (``limit``) less the samples
it has in flight (running or in its queue), and is topped up as soon as a sample of its finishes; the adapter's
feeder thread does so on each completion Ray reports, the simulator's engines at each finish on their clock.
Dispatch: one sample at a time to the engine with the most free slots (ties: the lowest id), a sample to
regenerate (its engine died) before the stream's next; so samples spread over the engines when the admission rule
lets few start, as a least-loaded router does.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from rlhfless_sdk.api.errors import RlhflessError
from rlhfless_sdk.api.records import TimePerTokenProfile
from rlhfless_sdk.planning.engine_model import steady_context
from rlhfless_sdk.rollout.stream_book import GroupBook


@dataclass
class KvSlots:
    """How many samples each engine runs at once: ``max_num_seqs``, or fewer where the KV cache binds.

    vLLM admits a sample when the KV cache holds its tokens so far, not the tokens it will grow to; with long
    responses the running samples then outgrow the cache, and vLLM preempts the newest and recomputes it later (a
    prefill of its prompt and every token it had) while admitting nothing until a sample finishes. So a stream keeps
    at most ``fill`` x the samples the KV cache holds in steady state (``kv_capacity_tokens`` over the KV a running
    sample holds on average, ``steady_context`` of the lengths finished so far) on an engine, and never more than
    ``max_num_seqs``; until ``first`` samples have finished (nothing is known of the lengths), ``max_num_seqs``. The
    window is the last ``window`` finished samples, re-read every ``every`` (lengths drift during a run).

    ``fill`` 0.9: one engine of the L40S profile fed without pause (the engine model) on the long-reasoning lengths
    is 1.12x as fast at 0.9 as at vLLM's 256, and 1.08x at 5x those lengths; of 0.85, 0.9 and 0.95, 0.9 is the
    fastest at 5x and within 1% of the fastest at 1x (``python examples/kv_slots_engine.py``)."""

    profile: TimePerTokenProfile
    fill: float = 0.9
    first: int = 200
    every: int = 200
    window: int = 2000
    current: int = 0  # the slots now (0: not read yet, ``max_num_seqs``)
    seen: int = 0  # samples finished so far
    _read_at: int = 0
    _prompt: deque[float] = field(init=False)
    _response: deque[float] = field(init=False)

    def __post_init__(self) -> None:
        if not 0.0 < self.fill <= 1.0:
            raise RlhflessError(f"kv_slots fill must be in (0, 1]; got {self.fill}")
        self.current = self.profile.max_num_seqs
        self._prompt, self._response = deque(maxlen=self.window), deque(maxlen=self.window)

    def observe(self, prompt: Sequence[float], response: Sequence[float]) -> None:
        """Finished samples' prompt and response tokens."""
        if len(prompt) != len(response):
            raise RlhflessError(f"kv_slots: {len(prompt)} prompt lengths for {len(response)} responses")
        self._prompt.extend(float(p) for p in prompt)
        self._response.extend(float(r) for r in response)
        self.seen += len(prompt)
        if self.seen >= self.first and self.seen - self._read_at >= self.every:
            self._read_at = self.seen
            self.current = self.slots_for(np.fromiter(self._prompt, float), np.fromiter(self._response, float))

    def slots_for(self, prompt: np.ndarray, response: np.ndarray) -> int:
        """The slots for samples like these: ``fill`` x the KV's steady concurrency, at most ``max_num_seqs``."""
        ctx = steady_context(prompt, response)
        if ctx <= 0:
            return self.profile.max_num_seqs
        return max(1, min(self.profile.max_num_seqs, int(self.fill * self.profile.kv_capacity_tokens / ctx)))

    def slots(self) -> int:
        return self.current


@dataclass
class Fill:
    """What one ``StreamLoop.fill`` handed out: (sample, engine) in dispatch order, and how many engines were left
    with free slots while the stream had samples the admission rule held back (``gated``)."""

    sent: list[tuple[int, int]] = field(default_factory=list)
    gated: int = 0


class StreamLoop:
    """A stream's book (``GroupBook``) with the dispatch, the slots and the regeneration queue every backend shares.

    ``slots``: samples an engine runs at once (``max_num_seqs``); ``kv``: fewer where the KV cache binds, read from
    the finished lengths (``KvSlots``)."""

    def __init__(self, book: GroupBook, slots: int, kv: KvSlots | None = None) -> None:
        self.book, self.slots, self.kv = book, max(int(slots), 1), kv
        self.retry: deque[int] = deque()  # samples whose engine died or stopped: dispatched again first
        self.redone = 0  # samples regenerated from scratch (their engine died)
        self.moved = 0  # samples that went on elsewhere with their tokens (their engine stopped)

    def limit(self) -> int:
        """Samples an engine runs at once now: ``slots``, fewer where ``kv`` holds it back."""
        return self.slots if self.kv is None else max(1, min(self.slots, self.kv.slots()))

    def free(self, in_flight: dict[int, int]) -> dict[int, int]:
        """The feeding rule: how many more samples each engine takes now, from its samples in flight (running or
        queued on it): the slots left of ``limit``."""
        limit = self.limit()
        return {e: max(0, limit - n) for e, n in in_flight.items()}

    def held_back(self) -> int | None:
        """The per-engine cap ``kv`` sets now, or None when nothing but the engine's own ``max_num_seqs`` holds it."""
        return None if self.kv is None else self.limit()

    def next(self, version: int, more: Callable[[], bool] | None = None) -> int | None:
        """The next sample to dispatch under weights ``version``: one to regenerate, else the stream's next as the
        book's admission rule allows. ``more``: an open stream's way to add the next group when the book has none
        left to start (False: none came); called only when the rule would let it start."""
        if self.retry:
            return self.retry.popleft()
        book = self.book
        if more is not None and book.next_sample >= book.samples and not book.closed and book.may_start(version) > 0:
            more()
        got = book.take(1, version)
        return got[0] if got else None

    def to_draw(self, version: int) -> int:
        """Groups an open stream should add now so that every group the admission rule lets start under weights
        ``version`` is in the book (0: enough are)."""
        book = self.book
        return 0 if book.closed else max(book.may_start(version) - (len(book.groups) - book.started), 0)

    def fill(self, free: dict[int, int], version: int, more: Callable[[], bool] | None = None) -> Fill:
        """Samples for the engines' free slots (``free``: engine -> how many more it takes now), one at a time to
        the engine with the most left (ties: the lowest id)."""
        out = Fill()
        heap = [(-n, e) for e, n in free.items() if n > 0]
        heapq.heapify(heap)
        while heap:
            n, e = heapq.heappop(heap)
            sid = self.next(version, more)
            if sid is None:
                if self.book.next_sample < self.book.samples:
                    out.gated = 1 + len(heap)
                break
            out.sent.append((sid, e))
            if n + 1 < 0:
                heapq.heappush(heap, (n + 1, e))
        return out

    def move(self, sample: int) -> None:
        """``sample``'s engine stopped (a fill engine, once the first batch formed): it goes on on another engine
        with the tokens it has, before the stream's next."""
        self.retry.append(sample)
        self.moved += 1

    def requeue(self, sample: int) -> None:
        """``sample``'s engine died before it finished: it runs again from scratch, before the stream's next."""
        self.retry.append(sample)
        self.redone += 1

    def finished(self, samples: Sequence[int], at: float, prompt: Sequence[float], response: Sequence[float]) -> None:
        """``samples`` finished at ``at`` with these prompt and response lengths: the book counts them, the slots
        read their lengths."""
        for sid in samples:
            self.book.finish(sid, at)
        if self.kv is not None and len(samples):
            self.kv.observe(prompt, response)

    def form(self, k: int) -> list[int] | None:
        """Batch k's groups (``GroupBook.form``), or None while it cannot form."""
        return self.book.form(k)
