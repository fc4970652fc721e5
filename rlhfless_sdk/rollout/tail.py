"""Tail batching's rounds: which prompts each step starts, and which it defers (RollPacker-style, on-policy).

The prompts come as a stream (a workload's steps, or a dataloader). A short round starts
``ceil((1 + over_provision) * B)`` fresh prompts; the step trains the first B groups to finish and aborts the
others, whose prompts are deferred (their tokens are dropped: nothing from older weights ever trains). Once B
prompts are deferred, a long round starts B of them and trains all it started. When the stream runs dry, the
deferred prompts fill the short rounds, and the last round trains whatever is left. So every round but the
last trains exactly B groups, every prompt trains exactly once, and the long tails wait for each other in
their own rounds instead of each step waiting for its own.

``TailRounds`` keeps that account for any backend; prompts are opaque references, drawn from the stream only
as a round needs them (a real run's stream is OpenRLHF's prompt dataloader).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlhfless_sdk.api.errors import RlhflessError
from rlhfless_sdk.api.records import FinishedSample


class TailError(RlhflessError):
    """A round's outcome names prompts the round did not start, or trains more than it may."""


@dataclass
class Round:
    prompts: list[Hashable]  # what the round starts, deferred ones first
    long: bool  # a round of deferred prompts only: all of them train
    train: int  # how many groups it trains (B, or fewer at the end of the stream)


class TailRounds:
    def __init__(self, batch_size: int, stream: Iterable[Hashable], deferred: Iterable[Hashable] = ()) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self.batch_size = batch_size
        self._source = iter(stream)
        self.dry = False  # the stream has nothing more
        self.fresh: deque[Hashable] = deque()  # drawn from the stream, not started yet
        self.deferred: deque[Hashable] = deque(deferred)
        self._round: Round | None = None

    def _draw(self, k: int) -> None:
        """Hold at least ``k`` fresh prompts, or every one the stream has left."""
        while len(self.fresh) < k and not self.dry:
            try:
                self.fresh.append(next(self._source))
            except StopIteration:
                self.dry = True

    def waiting(self) -> list[Hashable]:
        """The prompts drawn and not trained yet, outside a round: deferred first, then fresh (a checkpoint's)."""
        return [*self.deferred, *self.fresh]

    def done(self) -> bool:
        self._draw(1)
        return not self.fresh and not self.deferred

    def start(self, over_provision: float) -> int:
        """Groups a short round starts: (1 + ``over_provision``) x B, rounded up, and at least B."""
        return max(math.ceil((1.0 + over_provision) * self.batch_size), self.batch_size)

    def short_candidates(self, over_provision: float) -> list[Hashable] | None:
        """The fresh prompts the next round would start if it is a short round with all it asks for, else None
        (a long round is due, or the stream runs dry)."""
        b = self.batch_size
        if len(self.deferred) >= b:
            return None
        start = self.start(over_provision)
        self._draw(start)
        if len(self.fresh) < start:
            return None
        return list(self.fresh)[:start]

    def cycle_candidates(self, over_provision: float) -> list[Hashable] | None:
        """``short_candidates``, where the stream still holds the fresh prompts for every short round until the
        deferred ones fill a long round, else None. Tail batching pays in that cycle (its short rounds pay for the
        long one); begun later, the groups it defers drain in the stream's last rounds, their aborted tokens lost
        and nothing left to amortize them over. So near a run's end (or in a run of a few rounds) it is not begun."""
        b = self.batch_size
        start = self.start(over_provision)
        per_round = start - b
        if per_round <= 0 or len(self.deferred) >= b:
            return None
        rounds = math.ceil((b - len(self.deferred)) / per_round)
        self._draw(rounds * start)
        if len(self.fresh) < rounds * start:
            return None
        return self.short_candidates(over_provision)

    def next(self, over_provision: float) -> Round:
        """The next round's prompts; ``over_provision`` >= 0 (0: every started group trains)."""
        if self.done():
            raise TailError("no prompt left to start")
        b = self.batch_size
        start = self.start(over_provision)
        if len(self.deferred) >= b:  # a long round: B deferred prompts, all of which train
            prompts = [self.deferred.popleft() for _ in range(b)]
            self._round = Round(prompts, True, b)
            return self._round
        self._draw(start)
        if len(self.fresh) + len(self.deferred) <= b:  # the end of the stream: everything left, all trains
            prompts = [*self.deferred, *self.fresh]
            self.deferred.clear()
            self.fresh.clear()
            self._round = Round(prompts, True, len(prompts))
            return self._round
        prompts = [self.fresh.popleft() for _ in range(min(start, len(self.fresh)))]
        if len(prompts) < b:  # the stream runs dry: the deferred prompts fill the round (and may be deferred again)
            while len(prompts) < b + (start - b) and self.deferred:
                prompts.insert(0, self.deferred.popleft())
        self._round = Round(prompts, False, b)
        return self._round

    def settle(self, trained: Sequence[Hashable]) -> list[Hashable]:
        """The round's trained prompts (the first to finish); returns the ones deferred."""
        r = self._round
        if r is None:
            raise TailError("settle without a round")
        started = set(r.prompts)
        done = set(trained)
        if len(done) != len(trained) or not done <= started or len(done) != r.train:
            raise TailError(
                f"a round that started {len(r.prompts)} prompts must train {r.train} of them once each; "
                f"got {len(trained)} ({len(done - started)} not started)"
            )
        aborted = [p for p in r.prompts if p not in done]
        if r.long and aborted:
            raise TailError("a long round trains everything it started")
        self.deferred.extend(aborted)
        self._round = None
        return aborted


def round_fields(trained: Sequence[FinishedSample], groups: int, deferred: int, cut: bool) -> dict[str, Any]:
    """The step report's fields for a round: its ``trained`` samples (every sample of the ``groups`` that train),
    the prompts ``deferred`` after it, and no estimate error for a round that was cut (the plan's estimate is for
    every group run to its end)."""
    fields: dict[str, Any] = {
        "samples": len(trained),
        "response_tokens": int(sum(s.response_length for s in trained)),
        "groups_trained": groups,
        "deferred_prompts": deferred,
    }
    if cut:
        fields["estimate_error"] = None
    return fields


def first_done(done_at: np.ndarray, train: int, long: bool) -> tuple[np.ndarray, float]:
    """A round's trained rows (``train`` of them, the first groups to complete; ties in batch order; sorted)
    and when the round ends: when the last of them completes, or never cut (inf) for a long round."""
    order = np.lexsort((np.arange(len(done_at)), done_at))
    rows = np.sort(order[:train])
    return rows, (math.inf if long else float(np.asarray(done_at)[rows].max(initial=0.0)))


def note_completed(completed: dict[int, int], now: Iterable[int]) -> None:
    """Record the groups seen complete at this poll (``now``; those already recorded keep their rank), all with the
    same rank, the poll's: an end rule's completion order, ties broken later in launch order."""
    rank = len(completed)
    for g in now:
        completed.setdefault(g, rank)
