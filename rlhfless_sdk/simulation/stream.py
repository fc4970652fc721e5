"""The simulator's engines for the streaming pipeline (``rlhfless_sdk.rollout.stream``): decode engines on GPUs of
their own, on one simulated clock for the whole run, fed sample by sample as they free slots; ``StreamRun``, the
simulator's run of the stream on them.

Each engine is the simulator's continuous-batching engine (``EngineModel``: vLLM-like admission, KV limits and
recompute preemption). A weight update pauses every engine that has work for the update's seconds at its instant;
its running samples then go on under the new weights. An elastic split starts engines (billed from their start,
start-up included, which delays their first work) or stops them: a stopped engine's samples, running or queued,
go to the other engines' queues first, each re-prefilling its prompt and the tokens it had (nothing is lost).
Fill engines (``fill_engines``) run on the learner's GPUs beside its state (``beside_learner``: less KV cache) until
the first batch is complete, and stop as an elastic split's engines do, with no restart: the learner never left.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlhfless_sdk.api.config import SchedulerConfig
from rlhfless_sdk.api.errors import RlhflessError
from rlhfless_sdk.api.learner import beside_learner
from rlhfless_sdk.api.records import StepPlan, TimePerTokenProfile
from rlhfless_sdk.planning.engine_model import DONE, QUEUED, EngineModel, EngineSamples
from rlhfless_sdk.rollout.billing import covered, window_gpu_seconds
from rlhfless_sdk.rollout.stream import (
    BalancedSplit,
    BatchWindow,
    Feeder,
    GroupBook,
    KvSlots,
    PinnedSplit,
    batch_ages,
    run_stream,
    version_runs,
)
from rlhfless_sdk.rollout.stream_book import StreamStats
from rlhfless_sdk.simulation.results import OnStep, SimulatedStep, SimulationResult
from rlhfless_sdk.workloads.traces import Workload

#: Seconds from the first batch's forming to its training when fill engines ran on the learner's GPUs: each of their
#: samples cut (vLLM's abort) and handed to a rollout engine, then the fill engines' sleep, which frees their weights
#: and KV cache (a round figure, not measured: the cuts are milliseconds each, a sleep a few seconds)
FILL_SWITCH_S = 10.0


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
        self.feeder: Feeder | None = None
        self.resize(engines, 0.0)

    # -- StreamEngines -----------------------------------------------------------------------------------------
    @property
    def max_num_seqs(self) -> int:
        return self.profile.max_num_seqs

    def now(self) -> float:
        return self.t

    def in_flight(self, slots: int | None = None) -> dict[int, int]:
        cap = self.profile.max_num_seqs if slots is None else max(1, min(slots, self.profile.max_num_seqs))
        for a in self.actors:
            a.slots = 0 if slots is None else cap  # samples moved here by a split wait their turn too
        return {a.aid: a.B + len(a.waiting) for a in self.actors}

    def _refill(self, actor: EngineModel) -> None:
        """Samples of ``actor`` finished on its clock: the stream tops it up there and then (``feeder``)."""
        if self.feeder is not None:
            sids = self.feeder(actor.aid, actor.B + len(actor.waiting))
            self.start(sids, [actor.aid] * len(sids))

    def _engine(self, aid: int, profile: TimePerTokenProfile, start: float) -> EngineModel:
        actor = EngineModel(aid, profile, "", start)
        actor.on_finish = self._refill
        return actor

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

    def lend(self, engines: int, profile: TimePerTokenProfile) -> None:
        """``engines`` more engines of ``profile`` (the learner's GPUs, beside its state) from the start, after the
        fleet's; the first ``resize`` below the fleet stops them first."""
        for _ in range(engines):
            start = self.t + profile.cold_start_s
            self.spans[self.next_id] = [self.t, start]
            self.actors.append(self._engine(self.next_id, profile, start))
            self.next_id += 1

    def resize(self, engines: int, at: float) -> None:
        if engines == len(self.actors):
            return
        if self.actors:
            self.resizes += 1
        self._run_to(at)
        while len(self.actors) < engines:  # a new engine boots, then takes work
            start = at + self.profile.cold_start_s
            actor = self._engine(self.next_id, self.profile, start)
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


# -- the stream run on the simulator ---------------------------------------------------------------------------------
@dataclass
class _StreamLearner:
    """The learner of a simulated stream: each group's tokens, the algorithm's GPU-seconds per token."""

    group_tokens: Sequence[float]
    s_per_token: float
    sync_s: float

    def tokens(self, groups: Sequence[int]) -> float:
        return float(sum(self.group_tokens[g] for g in groups))

    def train_s(self, tokens: float, gpus: int) -> float:
        return tokens * self.s_per_token / gpus


@dataclass(frozen=True)
class _StreamWork:
    """A workload as one stream: its samples (group, index, prompt and response lengths), each group's size and
    tokens (prompt and response: what the learner trains on), B (the first step's batch size)."""

    samples: EngineSamples
    sizes: list[int]
    prompt_lengths: list[int]
    group_tokens: list[float]
    batch: int

    @classmethod
    def of(cls, workload: Workload, max_tokens: int | None) -> _StreamWork:
        sizes: list[int] = []
        gid, index, plen, target, group_tokens = [], [], [], [], []
        for ws in workload.steps:
            b, lengths = ws.batch, np.asarray(ws.lengths, dtype=np.int64)
            if max_tokens is not None:
                lengths = np.minimum(lengths, max_tokens)
            for i in range(len(b)):
                lo, hi = int(b.sample_offsets[i]), int(b.sample_offsets[i + 1])
                n, p = hi - lo, int(b.prompt_lengths[i])
                gid += [len(sizes)] * n
                index += list(range(n))
                plen += [p] * n
                target += lengths[lo:hi].tolist()
                group_tokens.append(float(p * n + lengths[lo:hi].sum()))
                sizes.append(n)
        n_samples = len(target)
        samples = EngineSamples(gid, index, plen, [0] * n_samples, target, [0.0] * n_samples, [0] * n_samples)
        batch = max((len(ws.batch) for ws in workload.steps), default=0)
        return cls(samples, sizes, plen, group_tokens, max(batch, 1))


class StreamRun:
    """The ``Simulator``'s run of the streaming pipeline: a ``StreamPipeline`` on this simulator (a mixin)."""

    def run_stream(
        self,
        config: SchedulerConfig,
        workload: Workload,
        on_step: OnStep,
        r: int | None,
    ) -> SimulationResult:
        """The streaming pipeline with ``r`` rollout GPUs at first (``StreamPipeline``)."""
        self.begin(workload)
        return StreamPipeline(self, config, workload).run(on_step, r)


class StreamPipeline:
    """One run of the streaming pipeline (``rlhfless_sdk.rollout.stream``) on a simulator (its explicit context:
    the simulator's dedicated engines, fleet and learner, the scheduler, the workload): the workload's prompts one
    stream, batches of B groups (the first step's batch size), engines on GPUs of their own (dedicated memory).
    Batch k's report spans the time between updates k - 1 and k and bills what happened in it: each engine while
    held (from its start, start-up included, to its last token or its stop), the learner GPUs while they train,
    every GPU during an update."""

    def __init__(self, sim: Any, config: SchedulerConfig, workload: Workload) -> None:
        self.sim, self.config, self.workload = sim, config, workload
        self.prof, self.g = sim.dedicated, sim.cluster.total_gpus
        self.work = _StreamWork.of(workload, sim.max_tokens)
        self.rates = self.prof.learner_rates(sim.run_algo)
        self.floor, self.restart_s = sim.learner_floor(), sim.restart_s()

    def run(self, on_step: OnStep, r: int | None) -> SimulationResult:
        pipe, prof, g, work, rates = self.config.pipeline, self.prof, self.g, self.work, self.rates
        book = GroupBook(work.sizes, work.batch, pipe.max_age)
        slots = KvSlots(prof, pipe.kv_slots) if pipe.kv_slots is not None else None
        split, policy, r = self.first_split(r, slots)
        engines = SimulatedStream(prof, work.samples, r // prof.gpus_per_actor)
        beside = beside_learner(prof, self.sim.run_algo, g - r) if pipe.fill_engines else None
        fill = (g - r) // prof.gpus_per_actor if beside is not None else 0
        if fill:
            engines.lend(fill, beside)
        stats = run_stream(
            engines,
            _StreamLearner(work.group_tokens, rates[0] + rates[1], prof.weight_sync_s),
            book,
            gpus=g,
            rollout_gpus=r,
            gpus_per_engine=prof.gpus_per_actor,
            split=policy,
            switch_s=self.restart_s,
            slots=slots,
            min_learners=self.floor,
            fill_engines=fill,
            fill_switch_s=FILL_SWITCH_S if fill else 0.0,
        )
        steps = self.steps(engines, book, stats, on_step)
        summary = _stream_summary(stats, engines, split, r, self.floor, fill)
        return SimulationResult(self.config.name, steps, rollout_gpus=r, stream=summary)

    def first_split(
        self, r: int | None, slots: KvSlots | None
    ) -> tuple[BalancedSplit | None, BalancedSplit | PinnedSplit | None, int]:
        """The stream's first split and, for an elastic one, the policy that re-plans it between batches (a pinned
        schedule over the balanced split, where the config pins one)."""
        config, prof, g, work = self.config, self.prof, self.g, self.work
        pipe = config.pipeline
        if not pipe.elastic:
            if r is None:
                raise RlhflessError(f"scheduler {config.name!r}: a stream with a fixed split needs its rollout GPUs")
            return None, None, r
        gpa, floor, rates = prof.gpus_per_actor, self.floor, self.rates
        split = BalancedSplit(prof, g, rates[0] + rates[1], switch_s=self.restart_s, min_learners=floor, slots=slots)
        max_tokens = self.sim.max_tokens
        cap = self.workload.cap if max_tokens is None else min(self.workload.cap, max_tokens)
        plen = work.prompt_lengths
        r = split.first(sum(work.sizes[: work.batch]), float(np.mean(plen)) if plen else 0.0, cap)
        if pipe.split_schedule is None:
            return split, split, r
        bad = [x for x in pipe.split_schedule if x and (x % gpa or not gpa <= x <= g - floor)]
        if bad:
            raise RlhflessError(
                f"scheduler {config.name!r}: split_schedule entry {bad[0]} is not a split of {g} GPUs (a multiple of "
                f"{gpa} GPUs per engine, {floor} left to learn; 0: the planner's)"
            )
        return split, PinnedSplit(split, pipe.split_schedule), r

    def steps(
        self, engines: SimulatedStream, book: GroupBook, stats: StreamStats, on_step: OnStep
    ) -> list[SimulatedStep]:
        """Each batch's report (``BatchWindow``, the adapter's stream builds its own the same way): the window
        between the updates around it and what it billed there."""
        config, prof, g, rates = self.config, self.prof, self.g, self.rates
        gpa = prof.gpus_per_actor
        held = engines.held()
        busy = [a.busy for a in engines.actors]
        idle = 1.0 - (sum(busy) + engines.busy) / max(sum(hi - lo for lo, hi in held.values()), 1e-9)
        steps = []
        for k, chosen in enumerate(stats.batches):
            lo, hi = (stats.updates[k - 1][1] if k else 0.0), stats.updates[k][1]
            learners, trained = stats.learners[k], stats.trained_tokens[k]
            trains = [(g - stats.split[j], t) for j, t in enumerate(stats.train)]
            billed = window_gpu_seconds(lo, hi, [[s] for s in held.values()], gpa, trains, (learners, stats.updates))
            sids = [sid for c in chosen for sid in book.groups[c].samples]
            ages = batch_ages((engines.tokens_by_version(sid) for sid in sids), k)
            window = BatchWindow(
                k, config.name, lo, hi, covered(list(held.values()), lo, hi), billed, g * (hi - lo), idle, busy,
                stats.split[k] // gpa, len(sids), ages[0], ages, len(chosen), g,
            )  # fmt: skip
            report = window.report(prepare_s=trained * rates[0] / learners, learn_s=trained * rates[1] / learners)
            plan = StepPlan(
                step=k, scheduler=config.name, num_actors=report.num_actors, assignment=[], predicted_lengths=[]
            )
            steps.append(SimulatedStep(report, plan, None))
            if on_step is not None:
                on_step(report)
        return steps


def _stream_summary(
    stats: StreamStats, engines: SimulatedStream, split: BalancedSplit | None, r: int, floor: int, fill: int
) -> dict[str, Any]:
    """What a stream run did, beside its batches' reports (``SimulationResult.stream``)."""
    return {
        "batches": len(stats.batches),
        "overdue_groups": stats.overdue,
        "gated_s": stats.gated_s,
        "splits": stats.split,
        "resizes": engines.resizes,
        "moved_samples": engines.moved,
        "replans": split.choices if split is not None else [],
        "slots": stats.slots,  # samples an engine ran at most as each batch formed (empty: max_num_seqs)
        "preemptions": sum(a.preemptions for a in engines.actors) + engines.preemptions,
        # the first split, and the first batch's time at the fill with every sample at the cap (what chose it)
        "first_split": r,
        "learner_floor": floor,  # the fewest GPUs the learner's state fits on
        "restarts": [{"batch": k, "restart_s": s} for k, s in stats.restarts],  # each resize, a restart
        "fill_bound_s": split.fill_bound_s if split is not None else None,
        # engines on the learner's GPUs until the first batch, when they stopped, and what moving their samples
        # (prompt and tokens re-prefilled on the rollout engines) delayed its training
        "fill_engines": fill,
        "fill_stopped_at_s": stats.fill_stop[0] if stats.fill_stop else None,
        "fill_switch_s": stats.fill_stop[1] if stats.fill_stop else None,
    }
