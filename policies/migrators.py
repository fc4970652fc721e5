"""Migrators (cut-and-migrate): move unfinished samples off lagging actors while a step runs."""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Iterable
from typing import Literal

from pydantic import Field, NonNegativeInt, PositiveInt
from rlhfless_policies._base import Parameterless

from rlhfless_sdk import ActorProgress, MigrationDecision, Record, SampleProgress, StepProgress


class _Destinations:
    """Free slots of the destination actors; each take goes to the least loaded one that still has a slot."""

    def __init__(self, actors: Iterable[ActorProgress]) -> None:
        actors = list(actors)
        self.free = {a.actor_id: a.free_slots for a in actors if a.free_slots > 0}
        self.heap = [(a.running, a.actor_id) for a in actors if a.free_slots > 0]
        heapq.heapify(self.heap)

    def take(self) -> int | None:
        while self.heap:
            load, actor = heapq.heappop(self.heap)
            if self.free[actor] > 0:
                self.free[actor] -= 1
                if self.free[actor] > 0:
                    heapq.heappush(self.heap, (load + 1, actor))
                return actor
        return None


def _by_actor(progress: StepProgress) -> defaultdict[int, list[SampleProgress]]:
    """The snapshot's unfinished samples, by the actor running them."""
    by_actor: defaultdict[int, list[SampleProgress]] = defaultdict(list)
    for s in progress.unfinished:
        by_actor[s.actor_id].append(s)
    return by_actor


def _mean_prompt(context_tokens: float, samples: list[SampleProgress]) -> float:
    """An actor's mean prompt, from the KV it holds less its samples' tokens: a moved sample's context is its tokens
    plus that (a snapshot states each actor's KV, not each sample's prompt)."""
    return max(context_tokens - sum(s.tokens_generated for s in samples), 0) / max(len(samples), 1)


def _planned(s: SampleProgress) -> float:
    return s.predicted_length if s.planned_length is None else s.planned_length


def _underestimated(s: SampleProgress) -> bool:
    """It has outgrown the plan's prediction, or a refined prediction (e.g. from its GRPO siblings) says it will."""
    return s.tokens_generated > _planned(s) or s.predicted_length > _planned(s)


def _overrun(s: SampleProgress) -> float:
    return max(s.tokens_generated, s.predicted_length) - _planned(s)


class TauParams(Record):
    tau: float = Field(default=0.7, gt=0.0, le=1.0, description="Share of its planned work an actor must finish.")
    mode: Literal["tokens", "kv"] = Field(default="tokens", description="Re-prefill the tokens, or move the KV.")
    max_migrations: NonNegativeInt = Field(default=1, description="Times one sample may be moved in a step.")
    wake_idle: bool = Field(
        default=False,
        description="Also move work to actors that have finished (serverless: they were released and restart).",
    )


class TauMigrator:
    """The paper's fine-grained cut-and-migrate.

    An actor that has generated ``tau`` of its planned tokens and still runs samples that have outgrown their
    prediction (underestimated) has those samples cut and moved to other actors with free slots, emptiest
    first; no other actor is interrupted. Destinations are actors that are not themselves cutting this round
    and still hold work (a finished actor is released under serverless billing), unless ``wake_idle``.
    """

    description = "cut underestimated samples of actors past tau of their work (RLHFless)"

    def __init__(self, params: TauParams | None = None) -> None:
        self.params = params or TauParams()

    def decide(self, progress: StepProgress) -> list[MigrationDecision]:
        p = self.params
        by_actor = _by_actor(progress)
        sources = {
            a.actor_id
            for a in progress.actors
            if a.done_fraction >= p.tau and any(_underestimated(s) for s in by_actor.get(a.actor_id, ()))
        }
        if not sources:
            return []
        dests = _Destinations(
            a for a in progress.actors if a.actor_id not in sources and (p.wake_idle or a.running + a.waiting > 0)
        )
        laggards = (
            s
            for src in sorted(sources)
            for s in sorted(by_actor[src], key=_overrun, reverse=True)
            if _underestimated(s) and s.migrations < p.max_migrations
        )
        return _move(laggards, dests, p.mode)


class GlobalParams(Record):
    threshold: float = Field(
        default=0.2, gt=0.0, le=1.0, description="Migrate once at most this share of the step's samples remain."
    )
    mode: Literal["tokens", "kv"] = "tokens"
    max_migrations: NonNegativeInt = 1
    kv_fill: float | None = Field(
        default=None,
        gt=0.0,
        le=1.0,
        description="Keep enough actors that the tail's KV (prompts and tokens so far) fills at most this share of "
        "theirs, and move a sample only where it fits; none: fill free slots only.",
    )
    min_tail_tokens: NonNegativeInt = Field(
        default=0,
        description="Consolidate only while some unfinished sample may still decode this many tokens (its "
        "max_tokens less its tokens): a short tail does not repay the moves.",
    )


class _KvDestinations:
    """Keepers' room: a free slot and KV for the sample's context within ``fill`` of the keeper's capacity; each
    take goes to the keeper with the most KV room left (ties: the lowest id). A heap, so a take is O(log keepers)."""

    def __init__(self, actors: Iterable[ActorProgress], fill: float) -> None:
        self.slots = {a.actor_id: a.free_slots for a in actors}
        self.heap = [(-(fill * a.kv_capacity_tokens - a.context_tokens), a.actor_id) for a in actors]
        heapq.heapify(self.heap)

    def take(self, context: float) -> int | None:
        while self.heap and self.slots[self.heap[0][1]] <= 0:  # full keepers leave for good
            heapq.heappop(self.heap)
        if not self.heap or -self.heap[0][0] < context:  # the roomiest keeper cannot hold it: none can
            return None
        room, to = heapq.heappop(self.heap)
        self.slots[to] -= 1
        heapq.heappush(self.heap, (room + context, to))
        return to


class GlobalMigrator:
    """RLHFuse-style: once few samples remain overall, consolidate all of them onto as few actors as possible.

    The actors with the most running samples keep theirs and take the rest into their free slots, so the
    others can be released; this is one global decision, not per-actor. With ``kv_fill`` the keepers are also
    enough for the tail's KV: packing a long tail by slots alone overfills the keepers' KV caches, and vLLM then
    preempts and recomputes (the released GPUs are what ``tail_learn`` puts to work).
    """

    description = "RLHFuse-style: consolidate the tail once few samples remain"

    def __init__(self, params: GlobalParams | None = None) -> None:
        self.params = params or GlobalParams()

    def decide(self, progress: StepProgress) -> list[MigrationDecision]:
        p = self.params
        remaining = len(progress.unfinished)
        if remaining == 0 or remaining > p.threshold * max(progress.total_samples, remaining):
            return []
        if max(s.max_tokens - s.tokens_generated for s in progress.unfinished) < p.min_tail_tokens:
            return []
        by_actor = _by_actor(progress)
        if p.kv_fill is not None and all(a.kv_capacity_tokens > 0 for a in progress.actors):
            return self._by_kv(progress, by_actor, p.kv_fill)
        actors = sorted(
            (a for a in progress.actors if by_actor.get(a.actor_id)), key=lambda a: (-a.running, a.actor_id)
        )
        keepers, capacity, movable = [], 0, remaining
        for a in actors:  # smallest prefix of busiest actors whose free slots absorb everyone else's samples
            keepers.append(a)
            capacity += a.free_slots
            movable -= len(by_actor[a.actor_id])
            if capacity >= movable:
                break
        dests = _Destinations(keepers)
        keep_ids = {a.actor_id for a in keepers}
        tail = (
            s
            for a in actors
            if a.actor_id not in keep_ids
            for s in by_actor[a.actor_id]
            if s.migrations < p.max_migrations
        )
        return _move(tail, dests, p.mode)

    def _by_kv(
        self, progress: StepProgress, by_actor: dict[int, list[SampleProgress]], fill: float
    ) -> list[MigrationDecision]:
        """Consolidate onto the fewest actors whose KV holds the whole tail at ``fill``: actors with queued samples
        keep theirs (they cannot be released), then those holding the most KV (the fewest tokens to re-prefill)
        until their capacity holds every unfinished sample's context and their slots take the others' samples.
        Each moved sample's context is its tokens plus its actor's mean prompt (the snapshot's per-actor KV)."""
        busy = [a for a in progress.actors if by_actor.get(a.actor_id) or a.waiting]
        total = sum(a.context_tokens for a in busy)
        order = sorted(busy, key=lambda a: (a.waiting == 0, -a.context_tokens, a.actor_id))
        keepers: list[ActorProgress] = []
        room, slots, moving = 0.0, 0, sum(len(by_actor[a.actor_id]) for a in busy)
        for a in order:  # the actors with queued samples come first and are all kept
            if keepers and a.waiting == 0 and room >= total and slots >= moving:
                break
            keepers.append(a)
            room += fill * a.kv_capacity_tokens
            slots += a.free_slots
            moving -= len(by_actor[a.actor_id])
        if len(keepers) == len(busy):
            return []
        dests = _KvDestinations(keepers, fill)
        kept = {k.actor_id for k in keepers}
        out = []
        for a in busy:
            if a.actor_id in kept:
                continue
            samples = by_actor[a.actor_id]
            prompt = _mean_prompt(a.context_tokens, samples)
            for s in sorted(samples, key=lambda s: -s.tokens_generated):
                if s.migrations >= self.params.max_migrations:
                    continue
                to = dests.take(s.tokens_generated + prompt)
                if to is None:
                    return out
                out.append(MigrationDecision.move(s, to, self.params.mode))
        return out


class BalanceParams(Record):
    margin: float = Field(
        default=0.2,
        gt=0.0,
        description="Move while the actor holding the most KV holds more than the one holding the least by this share "
        "of the actors' mean.",
    )
    moves: PositiveInt = Field(default=8, description="Most samples moved at one check.")
    min_left: NonNegativeInt = Field(
        default=2000,
        description="Move only a sample that may still decode this many tokens (its max_tokens less its tokens): a "
        "short remainder does not repay its re-prefill. Above every sample's cap (short responses), nothing moves.",
    )
    mode: Literal["tokens", "kv"] = "tokens"


class BalanceMigrator:
    """Beyond the paper: spread a synchronous step's long tail so that no actor's decode steps are the slowest.

    In the tail every actor decodes until its longest sample ends, and each decode step reads the weights once plus
    the KV of every running sequence: with a runaway sample on every actor they all run about as many steps, and the
    one holding the most KV ends last. Once no actor has samples queued, a check moves a sample from the actor holding
    the most KV to the one holding the least (with a free slot and room for it), choosing the sample whose context is
    nearest half their gap, so each move narrows it, while the gap exceeds ``margin`` of the mean. A sample moves at
    most once a step; one that may decode fewer than ``min_left`` more tokens stays.
    """

    description = "spread the long tail's KV evenly over the actors (beyond the paper; sync steps)"
    reads_predictions = False  # reads tokens, caps and each actor's KV, no predicted length

    def __init__(self, params: BalanceParams | None = None) -> None:
        self.params = params or BalanceParams()

    def balanced_share(self, max_tokens: int) -> float:
        """The share of a step's tail imbalance this evens out when samples decode at most ``max_tokens``: a sample
        moves only before its last ``min_left`` tokens (what a tail batching check prices, ``tail_check``)."""
        return max(0.0, 1.0 - self.params.min_left / max_tokens) if max_tokens > 0 else 0.0

    def decide(self, progress: StepProgress) -> list[MigrationDecision]:
        p = self.params
        if len(progress.actors) < 2 or any(a.waiting for a in progress.actors):
            return []
        by_actor = _by_actor(progress)
        kv = {a.actor_id: float(a.context_tokens) for a in progress.actors}
        slots = {a.actor_id: a.free_slots for a in progress.actors}
        cap = {a.actor_id: a.kv_capacity_tokens for a in progress.actors}
        prompt = {a: _mean_prompt(kv[a], ss) for a, ss in by_actor.items() if ss}
        mean = sum(kv.values()) / len(kv)
        movable = {
            a: [s for s in ss if s.migrations == 0 and s.max_tokens - s.tokens_generated >= p.min_left]
            for a, ss in by_actor.items()
        }
        out: list[MigrationDecision] = []
        for _ in range(p.moves):
            src = max(kv, key=lambda a: (kv[a], -a))
            open_ = [a for a in kv if a != src and slots[a] > 0]
            if not open_:
                break
            dst = min(open_, key=lambda a: (kv[a], a))
            gap = kv[src] - kv[dst]
            if gap <= p.margin * mean:
                break
            fits = [
                s
                for s in movable.get(src, [])
                if (ctx := s.tokens_generated + prompt[src]) < gap and (cap[dst] <= 0 or kv[dst] + ctx <= cap[dst])
            ]
            if not fits:
                break
            pick = min(fits, key=lambda s: (abs(s.tokens_generated + prompt[src] - gap / 2), s.uid, s.sample_index))
            movable[src].remove(pick)
            ctx = pick.tokens_generated + prompt[src]
            kv[src] -= ctx
            kv[dst] += ctx
            slots[dst] -= 1
            out.append(MigrationDecision.move(pick, dst, p.mode))
        return out


def _move(
    samples: Iterable[SampleProgress], dests: _Destinations, mode: Literal["tokens", "kv"]
) -> list[MigrationDecision]:
    """A decision for each sample, in order, while the destinations have free slots."""
    out = []
    for s in samples:
        to = dests.take()
        if to is None:
            break
        out.append(MigrationDecision.move(s, to, mode))
    return out


class NoMigrator(Parameterless):
    """Baseline: never migrate."""

    description = "baseline: never migrate"
    reads_predictions = False  # consults no predicted length

    def decide(self, progress: StepProgress) -> list[MigrationDecision]:
        return []
