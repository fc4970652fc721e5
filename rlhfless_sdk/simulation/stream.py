"""The simulator's engines for the streaming pipeline (``rlhfless_sdk.rollout.stream``): decode engines on GPUs of
their own, on one simulated clock for the whole run, fed sample by sample as they free slots.

Each engine is the simulator's continuous-batching engine (``EngineModel``: vLLM-like admission, KV limits and
recompute preemption). A weight update pauses every engine that has work for the update's seconds at its instant;
its running samples then go on under the new weights. An elastic split starts engines (billed from their start,
start-up included, which delays their first work) or stops them: a stopped engine's samples, running or queued,
go to the other engines' queues first, each re-prefilling its prompt and the tokens it had (nothing is lost).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rlhfless_sdk.api.records import TimePerTokenProfile
from rlhfless_sdk.planning.engine_model import DONE, QUEUED, EngineModel, EngineSamples
from rlhfless_sdk.rollout.stream import version_runs

#: queued samples an engine keeps beyond its running batch (a short queue, so the stream balances engines)
QUEUE = 8


class SimulatedStream:
    """``StreamEngines`` on a simulated clock."""

    def __init__(self, profile: TimePerTokenProfile, samples: EngineSamples, engines: int) -> None:
        self.profile, self.s = profile, samples
        self.t = 0.0
        self.paused_until = 0.0
        self.actors: list[EngineModel] = []
        self.spans: dict[int, list[float]] = {}  # engine -> [held from, held until]
        self.version_at: dict[int, list[tuple[int, int]]] = {}  # sample -> (version, its tokens then) at each change
        self.version = 0
        self.next_id = 0
        self.resizes = 0
        self.moved = 0  # samples moved off a stopped engine
        self.stopped_tokens = 0  # tokens generated on engines an elastic split stopped
        self.busy = 0.0  # busy seconds of stopped engines
        self.preemptions = 0  # preemptions on stopped engines
        self.resize(engines, 0.0)

    # -- StreamEngines -----------------------------------------------------------------------------------------
    def now(self) -> float:
        return self.t

    def wants(self, slots: int | None = None) -> dict[int, int]:
        cap = self.profile.max_num_seqs if slots is None else max(1, min(slots, self.profile.max_num_seqs))
        out = {}
        for a in self.actors:
            a.slots = 0 if slots is None else cap  # samples moved here by a split wait their turn too
            if a.B == 0 and not a.waiting:
                out[a.aid] = cap
            else:
                out[a.aid] = max(0, min(cap - a.B - len(a.waiting), QUEUE - len(a.waiting)))
        return out

    def _actor(self, aid: int) -> EngineModel:
        for a in self.actors:
            if a.aid == aid:
                return a
        raise KeyError(aid)

    def start(self, samples: Sequence[int], engines: Sequence[int]) -> None:
        for sid, e in zip(samples, engines, strict=True):
            actor = self._actor(e)
            if actor.idle():
                actor.t = max(actor.t, self.t, self.paused_until)
            self.s.actor[sid] = e
            self.version_at.setdefault(sid, [(self.version, 0)])
            actor.waiting.append(sid)

    def _run_to(self, t: float) -> None:
        """Every engine runs until ``t``; what finishes stays in ``s.events`` for the next ``advance`` to report."""
        for a in self.actors:
            a.run_until(self.s, t)
        self.t = max(self.t, t)

    def advance(self, t: float) -> list[int]:
        self._run_to(t)
        done, self.s.events = self.s.events, []
        return done

    def update(self, at: float, seconds: float, version: int) -> None:
        self._run_to(at)
        self.version = version
        s = self.s
        for a in self.actors:
            for sid in a.stack:
                self.version_at[sid].append((version, a.gen_now(s, sid)))
            for sid in a.waiting:
                if s.generated[sid] > 0:
                    self.version_at[sid].append((version, s.generated[sid]))
            a.t = max(a.t, at) + seconds if not a.idle() else max(a.t, at + seconds)
        self.paused_until = at + seconds

    def resize(self, engines: int, at: float) -> None:
        if engines == len(self.actors):
            return
        if self.actors:
            self.resizes += 1
        self._run_to(at)
        while len(self.actors) < engines:  # a new engine boots, then takes work
            start = at + self.profile.cold_start_s
            actor = EngineModel(self.next_id, self.profile, "", start)
            self.spans[self.next_id] = [at, start]
            self.next_id += 1
            self.actors.append(actor)
        orphans: list[int] = []
        while len(self.actors) > max(engines, 1):  # the newest engines stop; their samples move
            actor = self.actors.pop()
            for sid in list(actor.stack):
                actor._remove_running(self.s, sid)
                orphans.append(sid)
            orphans.extend(actor.waiting)
            actor.waiting.clear()
            self.spans[actor.aid][1] = at
            self.stopped_tokens += actor.generated
            self.busy += actor.busy
            self.preemptions += actor.preemptions
        self.moved += len(orphans)
        for i, sid in enumerate(orphans):  # first in the queues of the engines that stay, round robin
            dest = self.actors[i % len(self.actors)]
            if dest.idle():
                dest.t = max(dest.t, at)
            self.s.actor[sid] = dest.aid
            dest.waiting.appendleft(sid)

    def lengths(self, samples: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        s = self.s
        return np.asarray([s.prompt_len[i] for i in samples]), np.asarray([s.target[i] for i in samples])

    def running_lengths(self) -> tuple[np.ndarray, np.ndarray]:
        s = self.s
        live = [(sid, a.gen_now(s, sid)) for a in self.actors for sid in a.stack]
        live += [(sid, s.generated[sid]) for a in self.actors for sid in a.waiting if s.generated[sid] > 0]
        return np.asarray([s.prompt_len[i] for i, _ in live]), np.asarray([g for _, g in live])

    def generated_tokens(self) -> int:
        return self.stopped_tokens + sum(a.generated for a in self.actors)

    # -- what the run's report reads ---------------------------------------------------------------------------
    def held(self) -> dict[int, tuple[float, float]]:
        """Each engine's (held from, held until): from its start (start-up included) to its last token, or to when
        an elastic split stopped it."""
        out = {}
        for aid, (lo, hi) in self.spans.items():
            live = next((a for a in self.actors if a.aid == aid), None)
            out[aid] = (lo, max(hi, live.last_token) if live is not None else hi)
        return out

    def tokens_by_version(self, sid: int) -> list[tuple[int, int]]:
        """(version, tokens generated under it) of a finished sample (its first part counted from the weights when
        it was dispatched: an upper bound on its age)."""
        return version_runs(self.version_at.get(sid, [(self.version, 0)]), int(self.s.target[sid]))

    def finished(self) -> bool:
        return all(st == DONE for st in self.s.state)

    def queued(self) -> int:
        return sum(1 for st in self.s.state if st == QUEUED)
