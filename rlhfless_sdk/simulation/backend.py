"""The simulated rollout backend: decode engines on a simulated clock, driven by the SDK's step controller.

``SimulatedBackend`` runs a plan's samples on engine models (``rlhfless_sdk.planning.engine_model``: vLLM-style
continuous batching, KV capacity, recompute preemption), after the prefill actor's deduplicated prefixes arrive;
it starts, cuts, resumes and polls samples as ``StepController`` asks and bills each engine from its first work to
its last token. ``WorkloadIO`` is a workload's side of a driven step (``rlhfless_sdk.rollout.drivers.StepIO``): its
prompts drawn in step order, batches built from them, a plan run on a ``SimulatedBackend``."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from rlhfless_sdk.api.batch import PromptBatch
from rlhfless_sdk.api.records import (
    Cluster,
    StepPlan,
    TimePerTokenProfile,
)
from rlhfless_sdk.planning.engine_model import DONE, RUNNING, EngineModel, EngineSamples
from rlhfless_sdk.planning.planner import StepPlanner
from rlhfless_sdk.rollout.billing import EngineUsage, StepUsage
from rlhfless_sdk.rollout.carry import CarryBook
from rlhfless_sdk.rollout.controller import EngineStatus, Finished, Poll, StepController
from rlhfless_sdk.rollout.drivers import Ran
from rlhfless_sdk.workloads.traces import WorkloadStep


def _true_totals(
    truth: dict[tuple[int, int], int], pieces: Sequence[Any], n_carried: int, new_lengths: np.ndarray
) -> list[int]:
    """Each piece's true total length: the new samples' (after the ``n_carried`` carried ones) recorded in
    ``truth`` from ``new_lengths``, the carried ones' read from it."""
    for piece, length in zip(pieces[n_carried:], np.asarray(new_lengths).tolist(), strict=True):
        truth[(piece.group, piece.sample_index)] = int(length)
    return [truth[(p.group, p.sample_index)] for p in pieces]


def _round_batch(steps: Sequence[WorkloadStep], refs: Sequence[Any]) -> tuple[PromptBatch, np.ndarray]:
    """A batch of the prompts ``refs`` ((step, row) of ``steps``), with their samples' true lengths. A uid seen
    twice in the round (a prompt of two epochs) gets the step as a suffix."""
    seen: dict[str, int] = {}
    for k, i in refs:
        uid = steps[k].batch.uids[i]
        seen[uid] = seen.get(uid, 0) + 1
    uids, plen, n, tokens, true, lengths = [], [], [], [], [], []
    has_tokens = all(steps[k].batch.token_flat is not None for k, _ in refs)
    has_true = all(steps[k].batch.true_lengths is not None for k, _ in refs)
    for k, i in refs:
        b = steps[k].batch
        uid = b.uids[i]
        uids.append(uid if seen[uid] == 1 else f"{uid}@{steps[k].step}")
        plen.append(int(b.prompt_lengths[i]))
        n.append(int(b.n_samples[i]))
        if has_tokens:
            tokens.append(b.tokens(i))
        if has_true:
            true.append(float(b.true_lengths[i]))  # type: ignore[index]
        lo, hi = int(b.sample_offsets[i]), int(b.sample_offsets[i + 1])
        lengths.append(steps[k].lengths[lo:hi])
    batch = PromptBatch(
        uids=uids,
        prompt_lengths=np.asarray(plen, dtype=np.int64),
        n_samples=np.asarray(n, dtype=np.int64),
        token_flat=np.concatenate(tokens) if has_tokens and tokens else None,
        true_lengths=np.asarray(true) if has_true else None,
    )
    return batch, np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)


@dataclass
class _Broadcasts:
    """The weight broadcasts a step's engines pause for: (at, seconds) each, not reached yet; whether a pause frees
    the KV cache; the tokens generated when each one began."""

    pauses: deque[tuple[float, float]]
    frees_kv: bool
    tokens_before: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _Boot:
    """How the step's engines start: those warm from the step before, whether the prefill actor is warm, each
    engine's start-up seconds, and the seconds the plan took (every engine starts after it)."""

    warm: frozenset[int]
    warm_prefill: bool
    cold: np.ndarray
    plan_s: float


@dataclass
class _Checks:
    """When the controller next looks (``poll``): every ``interval`` seconds, doubled each ``4 x per_step`` checks
    (the plan was far off: check less often rather than forever)."""

    interval: float
    per_step: int
    next_s: float
    count: int = 0

    def tick(self, now: float) -> None:
        self.count += 1
        if self.count % (4 * self.per_step) == 0:
            self.interval *= 2
        self.next_s = now + self.interval


@dataclass
class _Cuts:
    """When the controller first cut a sample off its engine (inf: never), and the engines it cut samples off."""

    first_s: float = math.inf
    engines: set[int] = field(default_factory=set)


class SimulatedBackend:
    """The simulator as a rollout backend: decode actors on a simulated clock, driven by ``StepController``.

    Before decode, the prefill actor (when the plan deduplicates) prefills each distinct shared prefix once,
    actor by actor (heaviest first), and ships each actor's prefixes as soon as they are done: a decode actor
    starts when its own prefixes arrive. ``poll`` advances every actor to the next check (every
    ``checks_per_step``-th of the chosen candidate's predicted time, less often if the plan was far off), or
    to the end when nothing migrates.
    """

    def __init__(
        self,
        profile: TimePerTokenProfile,
        cluster: Cluster,
        ws: WorkloadStep,
        plan: StepPlan,
        *,
        max_tokens: int | None = None,
        checks_per_step: int = 40,
        migrates: bool = False,
        warm: frozenset[int] = frozenset(),
        warm_prefill: bool = False,
        algo: str = "ppo",
        pauses: Sequence[tuple[float, float]] = (),
        pause_frees_kv: bool = False,
        burst_profile: TimePerTokenProfile | None = None,
        prefix_caching: bool = False,
        plan_s: float = 0.0,
    ) -> None:
        """``plan_s``: seconds the plan took to make, charged to the step (every engine starts after it).
        ``burst_profile``: the engine model of burst engines (GPUs of their own: dedicated memory); default
        ``profile``. ``prefix_caching``: vLLM's prefix cache is on (a group's prompt is prefilled once an engine).
        ``pause_frees_kv``: each pause in ``pauses`` frees the KV cache (vLLM's ``pause_generation`` with its default
        ``clear_cache=True``, as OpenRLHF's engines pause): every running sample is preempted and re-prefills its
        prompt and tokens after the pause, and the prefix cache starts empty."""
        self.profile, self.cluster, self.ws, self.plan = profile, cluster, ws, plan
        self.rates = profile.learner_rates(algo)
        self.broadcasts = _Broadcasts(deque(sorted(pauses)), pause_frees_kv)
        self.s = s = EngineSamples.of_batch(ws.batch, ws.lengths, plan.predicted_lengths, plan.assignment, plan.prefill)
        s.prefix_cache = prefix_caching
        self.max_num_seqs = profile.max_num_seqs
        self.kv_capacity_tokens = profile.kv_capacity_tokens
        self.max_tokens = max_tokens or int(max(s.target, default=1)) or 1
        self.migrates = migrates
        self.pulls = plan.pull_buffer is not None  # the controller feeds engines from a shared queue as they free
        n = plan.num_actors
        self.node_of = {(p.actor.role, p.actor.actor_id): p.node for p in plan.placement}
        cold = np.array([0.0 if a in warm else profile.cold_start_s for a in range(n)])
        self.boot = _Boot(warm, warm_prefill, cold, plan_s)
        # a cold actor boots while the prefill actor works; both begin once the plan is made
        start = plan_s + np.maximum(self._prefill(n), cold)
        nodes = [self.node_of.get(("decode", a), "") for a in range(n)]
        self.actors = [
            EngineModel(a, (burst_profile or profile) if node.startswith("burst") else profile, node, float(start[a]))
            for a, node in enumerate(nodes)
        ]
        chosen = plan.chosen_candidate()
        checks = checks_per_step * (4 if self.pulls else 1)  # a shared queue is refilled at every check
        interval = max((chosen.time_s if chosen else 1.0) / checks, 1e-3)
        self.clock = _Checks(interval, checks_per_step, float(start.max(initial=0.0)) + interval)
        self._now = 0.0
        self.cuts = _Cuts()

    @property
    def tokens_before_pauses(self) -> list[int]:
        """Tokens generated when each weight-broadcast pause began."""
        return self.broadcasts.tokens_before

    def _prefill(self, n: int) -> np.ndarray:
        """When each decode actor can start; sets ``prefill_s``, the prefill actor's busy time."""
        prof, plan, s = self.profile, self.plan, self.s
        self.prefill_s = 0.0
        start = np.zeros(n)
        if not plan.prefill.prompt_group:
            return start
        group = np.asarray(plan.prefill.prompt_group)[np.asarray(s.prompt, dtype=np.int64)]
        prefix = np.asarray(plan.prefill.group_prefix_tokens, dtype=np.float64)
        sample_actor = np.asarray(plan.assignment, dtype=np.int64)
        load = np.bincount(sample_actor, weights=np.asarray(s.predicted), minlength=n)
        done = np.zeros(len(prefix), dtype=bool)
        # groups share template blocks: the prefill actor's real work is the prefix tree, D tokens in all
        scale = plan.prefill.prefill_actor_tokens / max(float(prefix.sum()), 1.0)
        clock = prof.prefill_base_s + (0.0 if self.boot.warm_prefill else prof.cold_start_s)
        for a in np.argsort(-load, kind="stable").tolist():
            groups = np.unique(group[sample_actor == a])
            if groups.size == 0:
                continue
            todo = groups[~done[groups]]
            done[todo] = True
            clock += prof.prefill_per_new_token_s * scale * float(prefix[todo].sum())
            gbytes = float(prefix[groups].sum()) * prof.kv_bytes_per_token / 1e9
            start[a] = clock + gbytes / self._bandwidth(
                self.node_of.get(("prefill", 0)), self.node_of.get(("decode", a))
            )
        self.prefill_s = clock
        return start

    def _bandwidth(self, a: str | None, b: str | None) -> float:
        return self.profile.intra_node_gbps if a is not None and a == b else self.profile.inter_node_gbps

    # -- the backend protocol --------------------------------------------------------------------------------
    def engines(self) -> list[int]:
        return list(range(len(self.actors)))

    def start(self, samples: Sequence[int], engines: Sequence[int]) -> None:
        s = self.s
        for sid, e in zip(samples, engines, strict=True):
            s.actor[sid] = e
            self.actors[e].waiting.append(sid)
        if self.pulls:  # a shared queue's engine admits what it has room for now (its next scheduler step)
            for e in set(engines):
                actor = self.actors[e]
                if actor.B == 0:
                    actor.t = max(actor.t, self._now)
                actor.admit(s)

    def _pause_until(self, limit: float) -> None:
        """Apply every weight-broadcast pause that begins before ``limit``: engines with work stop for it."""
        pauses = self.broadcasts.pauses
        while pauses and pauses[0][0] <= limit:
            at, seconds = pauses.popleft()
            self.advance_to(at)
            if all(a.idle() for a in self.actors) and all(st == DONE for st in self.s.state):
                pauses.clear()  # the batch finished before the broadcast
                return
            self.broadcasts.tokens_before.append(sum(a.generated for a in self.actors))
            for actor in self.actors:
                if not actor.idle():
                    if self.broadcasts.frees_kv:
                        actor.free_kv(self.s)
                    actor.t = max(actor.t, at) + seconds

    def poll(self) -> Poll:
        if self.migrates or self.pulls:
            now = self.clock.next_s
            self._pause_until(now)
            self.advance_to(now)
            self.clock.tick(now)
        else:
            now = math.inf
            self._pause_until(now)
            self.advance_to(now)
        self._now = now
        s = self.s
        finished = [Finished(sid, s.target[sid]) for sid in s.events]
        s.events.clear()
        return Poll(finished=finished)

    def advance_to(self, t: float) -> None:
        """Every engine runs until its clock reaches ``t`` (or it runs out of work)."""
        for actor in self.actors:
            actor.run_until(self.s, t)

    def progress(self) -> dict[int, EngineStatus]:
        s = self.s
        return {
            a.aid: EngineStatus(a.generated, {sid: a.gen_now(s, sid) for sid in a.stack}, len(a.waiting))
            for a in self.actors
        }

    def tokens_now(self) -> list[int]:
        """Each sample's response tokens so far: all of a finished one's, a running one's, a queued one's kept."""
        s = self.s
        made = list(s.generated)
        for actor in self.actors:
            for sid in actor.stack:
                made[sid] = actor.gen_now(s, sid)
        for sid, state in enumerate(s.state):
            if state == DONE:
                made[sid] = s.target[sid]
        return made

    def cut(self, engine: int, sample: int) -> int | None:
        s = self.s
        if s.state[sample] != RUNNING or s.actor[sample] != engine:
            return None
        s.cut_from[sample] = engine
        self.cuts.first_s = min(self.cuts.first_s, self._now)
        self.cuts.engines.add(engine)
        return self.actors[engine]._remove_running(s, sample)

    def cut_all(self, running: Sequence[tuple[int, int]]) -> list[int | None]:
        return [self.cut(e, sid) for e, sid in running]

    def resume(self, engine: int, sample: int, mode: str = "tokens") -> None:
        """Queue the sample first on ``engine``: its KV arrives over the link (``kv``), or the engine recomputes
        prompt + generated tokens (``tokens``)."""
        s, now = self.s, self._now
        src, dest = self.actors[s.cut_from[sample]], self.actors[engine]
        if mode == "kv":  # no recompute, but the KV arrives later
            gb = (s.prompt_len[sample] + s.generated[sample]) * self.profile.kv_bytes_per_token / 1e9
            s.ready_at[sample] = now + gb / self._bandwidth(src.node, dest.node)
            s.kv_cached[sample] = True
        else:
            s.ready_at[sample] = now
        if dest.idle():  # an actor that had finished wakes up now; a busy one keeps its own clock
            dest.t = max(dest.t, now)
        dest.waiting.appendleft(sample)

    def now(self) -> float:
        return self._now

    def usage(self) -> StepUsage:
        prof, s = self.profile, self.s
        g = self.cluster.total_gpus
        used = [a for a in self.actors if a.used]
        tokens = float(sum(s.prompt_len) + sum(s.target))
        return StepUsage(
            generation_s=max([a.last_token for a in used] + [self.boot.plan_s + self.prefill_s]),
            engines=[
                EngineUsage(
                    a.busy,
                    a.first if a.used else None,
                    a.last_token,
                    float(self.boot.cold[a.aid]),
                    burst=a.node.startswith("burst"),
                    warm_in=a.node.startswith("burst") and a.aid in self.boot.warm,
                )
                for a in self.actors
            ],
            gpus=g,
            gpus_per_engine=prof.gpus_per_actor,
            prefill_s=self.prefill_s,
            plan_s=self.boot.plan_s,
            prefill_tokens_saved=self.plan.prefill.tokens_saved,
            prepare_s=tokens * self.rates[0] / g,
            learn_s=tokens * self.rates[1] / g,
            sync_s=prof.weight_sync_s,
            extra={
                "preemptions": sum(a.preemptions for a in self.actors),
                "first_cut_s": self.cuts.first_s,
                "cut_engines": sorted(self.cuts.engines),
            },
        )


class Runs(Protocol):
    """What ``WorkloadIO`` needs of the simulator that runs it."""

    warm: frozenset[int]

    def backend(self, planner: StepPlanner, ws: WorkloadStep, plan: StepPlan, **kw: Any) -> SimulatedBackend: ...

    def _tokens_at(self, planner: StepPlanner, ws: WorkloadStep, plan: StepPlan, t: float, **kw: Any) -> list[int]: ...


class WorkloadIO:
    """The simulator's side of a driven step (``rlhfless_sdk.rollout.drivers.StepIO``): prompts drawn from the
    workload's steps in order, each sample's true length from the workload, the plan run whole on simulated
    engines (the clock is exact: a cut's instant and what each sample had by then are read off the run).

    A carrying driver's pieces (``book.step_pieces``: carried samples, then the new groups) are run to their true
    ends, a new sample capped at the plan's token budget (``segment_tokens``)."""

    def __init__(
        self, sim: Runs, planner: StepPlanner, steps: Sequence[WorkloadStep], book: CarryBook | None = None
    ) -> None:
        self.sim, self.planner, self.steps, self.book = sim, planner, steps, book
        self.stream = deque((k, i) for k, ws in enumerate(steps) for i in range(len(ws.batch)))
        self.truth: dict[tuple[int, int], int] = {}  # a carried sample's true total length
        self.step = 0
        self.whole: WorkloadStep | None = None  # the workload step ``draw(None)`` drew last
        self.next_whole = 0
        self.new_lengths = np.zeros(0, dtype=np.int64)
        self.lengths = np.zeros(0, dtype=np.int64)  # what each sample of the executed batch generates
        self.total: list[int] = []
        self.ws: WorkloadStep | None = None
        self.plan: StepPlan | None = None
        self.backend_kw: dict[str, Any] = {}  # where the engines run (an async pipeline's: its GPUs, its pauses)
        self.last_backend: SimulatedBackend | None = None

    def begin(self, step: int) -> None:
        """A new step: its number, and the planner told which engines are warm."""
        self.step = step
        self.new_lengths = np.zeros(0, dtype=np.int64)
        self.planner.warm_actors = len(self.sim.warm)

    def prompts(self) -> Iterator[Any]:
        """The workload's prompts one at a time, in step order."""
        while self.stream:
            yield self.stream.popleft()

    def draw(self, k: int | None) -> list[Any]:
        if k is not None:
            return [self.stream.popleft() for _ in range(min(k, len(self.stream)))]
        # the next workload step whole (numbered as the workload numbers it), or none after the last
        self.whole = self.steps[self.next_whole] if self.next_whole < len(self.steps) else None
        if self.whole is None:
            self.step = self.steps[-1].step + 1 if self.steps else 0
            return []
        self.next_whole += 1
        self.step = self.whole.step
        return [self.stream.popleft() for _ in range(len(self.whole.batch))]

    def step_number(self, step: int) -> int:
        return self.step

    def batch(self, prompts: list[Any]) -> PromptBatch:
        whole, self.whole = self.whole, None
        if whole is not None:  # ``draw(None)`` drew a workload step whole: its batch as it is
            return self.adopt(whole.batch, whole.lengths)
        batch, self.new_lengths = _round_batch(self.steps, prompts)
        return batch

    def adopt(self, batch: PromptBatch, lengths: np.ndarray) -> PromptBatch:
        """A workload step's batch as it is, with its true lengths."""
        self.new_lengths = np.asarray(lengths)
        return batch

    def execute(self, batch: PromptBatch, plan: StepPlan, stop: Any, observe: bool) -> Ran:
        """The plan run whole (``stop`` is read off the finish times by the driver instead)."""
        if self.book is None:
            self.lengths = self.new_lengths
        else:
            pieces = self.book.step_pieces
            n_carried = len(pieces) - len(self.new_lengths)
            self.total = _true_totals(self.truth, pieces, n_carried, self.new_lengths)
            budget = plan.segment_tokens
            self.lengths = np.asarray(
                [
                    t - p.generated if (i < n_carried or budget is None) else min(t, budget)
                    for i, (p, t) in enumerate(zip(pieces, self.total, strict=True))
                ],
                dtype=np.int64,
            )
        self.ws = WorkloadStep(step=self.step, batch=batch, lengths=self.lengths)
        self.plan = plan
        backend = self.last_backend = self.sim.backend(self.planner, self.ws, plan, **self.backend_kw)
        outcome = StepController(self.planner, backend, batch, plan, step=self.step).run(observe=observe)
        return Ran(outcome, [], finish_s=backend.s.finish_time)

    def tokens(self, ran: Ran, stop_s: float) -> tuple[list[int], list[bool]]:
        """Each piece's tokens when the step ended: by the cut instant (the same engines run again up to it), or
        all it was to generate in this step; ended when they reach its true total."""
        assert self.book is not None and self.ws is not None and self.plan is not None
        pieces = self.book.step_pieces
        if math.isfinite(stop_s):
            made = [int(m) for m in self.sim._tokens_at(self.planner, self.ws, self.plan, stop_s, **self.backend_kw)]
        elif self.plan.segment_tokens is not None:
            made = [s.response_length for s in ran.outcome.samples]
        else:
            made = [int(m) for m in self.lengths]
        target = made if math.isfinite(stop_s) else self.lengths.tolist()
        ended = [p.generated + m >= t for p, m, t in zip(pieces, target, self.total, strict=True)]
        return made, ended

    def history_key(self, uid: str) -> str:
        return uid
