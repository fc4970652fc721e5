"""A discrete-event simulator of synchronous RLHF steps: a rollout backend like OpenRLHF's, driven by the same
planner and the same step controller (``rlhfless_sdk.rollout.controller``), on a simulated clock.

Each step: the scheduler's planner plans (its predictor has seen only earlier steps); the prefill actor, if
the plan deduplicates, prefills each shared prefix once and ships the KV to the decode actors; every decode
actor runs vLLM-style continuous batching (at most ``max_num_seqs`` sequences and ``kv_capacity_tokens`` of KV;
FCFS admission, a prefill pause per admission round, recompute preemption of the newest sequence when KV runs
out); at regular checkpoints the step controller may cut samples and move them, paying a re-prefill of
prompt + generated tokens (mode ``tokens``) or a KV transfer over the link between the two actors' nodes
(mode ``kv``); then scoring, learning and the weight sync take the time the profile gives. The finished
samples go back to the predictor, and a ``StepReport`` bills the step both serverless (each actor from its
first work to its last token) and serverful (every GPU for the whole step).

Start-up is charged once, to time and to GPU-seconds alike: an actor that did work in the previous step is
warm; a cold one (every actor in the first step, a new one when the scaler grows the fleet) starts
``cold_start_s`` late and is billed for those seconds. So billing serverless never exceeds billing serverful.

Between events a decode actor's batch is constant, so k decode steps cost
``k * (a + b*B + c*ctx) + c*B*k*(k-1)/2`` (context grows by B a step): the simulation jumps from event to event.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from rlhfless_sdk.api.batch import PromptBatch
from rlhfless_sdk.api.config import SchedulerConfig
from rlhfless_sdk.api.errors import RlhflessError
from rlhfless_sdk.api.history import isolated_history
from rlhfless_sdk.api.plugins import Registry
from rlhfless_sdk.api.records import (
    CandidateEstimate,
    Cluster,
    StepPlan,
    StepReport,
    TimePerTokenProfile,
)
from rlhfless_sdk.planning.engine_model import DONE, RUNNING, EngineModel, EngineSamples
from rlhfless_sdk.planning.planner import StepPlanner, planner_for, rollout_planner_for
from rlhfless_sdk.rollout.carry import CarryBook
from rlhfless_sdk.rollout.controller import (
    EngineStatus,
    EngineUsage,
    Finished,
    Poll,
    StepController,
    StepOutcome,
    StepUsage,
    billing,
    held,
    stopped_at,
)
from rlhfless_sdk.rollout.drivers import Driven, PlainStep, Ran, session_for
from rlhfless_sdk.rollout.modes import ASYNC, BATCH_CUT, PLAIN, TAIL_ROUNDS, TOKEN_BUDGET, Mode, mode_for, tail_of
from rlhfless_sdk.rollout.stream import (
    BalancedSplit,
    GroupBook,
    KvSlots,
    PinnedSplit,
    batch_ages,
    joined_train_s,
    run_stream,
)
from rlhfless_sdk.simulation.bound import WorkBound, work_bound
from rlhfless_sdk.simulation.pipeline import locked_pipeline, partial_pipeline, token_ages
from rlhfless_sdk.simulation.stream import SimulatedStream
from rlhfless_sdk.simulation.tail_prepare import (
    gradient_reduce_s,
    group_gpus,
    in_groups,
    learning_switch_s,
    score_in_tail,
    scoring_switch_s,
)
from rlhfless_sdk.workloads.traces import Workload, WorkloadStep


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


def covered(spans: Sequence[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] inside at least one of ``spans`` ((start, end) pairs)."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in spans if min(b, hi) > max(a, lo))
    total, end = 0.0, lo
    for a, b in clipped:
        if b > end:
            total += b - max(a, end)
            end = b
    return total


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
    ) -> None:
        """``burst_profile``: the engine model of burst engines (GPUs of their own: dedicated memory); default
        ``profile``. ``prefix_caching``: vLLM's prefix cache is on (a group's prompt is prefilled once an engine).
        ``pause_frees_kv``: each pause in ``pauses`` frees the KV cache (vLLM's ``pause_generation`` with its default
        ``clear_cache=True``, as OpenRLHF's engines pause): every running sample is preempted and re-prefills its
        prompt and tokens after the pause, and the prefix cache starts empty."""
        self.profile, self.cluster, self.ws, self.plan = profile, cluster, ws, plan
        self.warm, self.warm_prefill = warm, warm_prefill
        self.rates = profile.learner_rates(algo)
        self.pauses = deque(sorted(pauses))  # (at, seconds): every engine stops for a weight broadcast
        self.pause_frees_kv = pause_frees_kv
        self.tokens_before_pauses: list[int] = []  # tokens generated when each pause began
        self.s = s = EngineSamples.of_batch(ws.batch, ws.lengths, plan.predicted_lengths, plan.assignment, plan.prefill)
        s.prefix_cache = prefix_caching
        self.max_num_seqs = profile.max_num_seqs
        self.kv_capacity_tokens = profile.kv_capacity_tokens
        self.max_tokens = max_tokens or int(max(s.target, default=1)) or 1
        self.migrates = migrates
        self.pulls = plan.pull_buffer is not None  # the controller feeds engines from a shared queue as they free
        n = plan.num_actors
        self.node_of = {(p.actor.role, p.actor.actor_id): p.node for p in plan.placement}
        start = self._prefill(n)
        cold = np.array([0.0 if a in warm else profile.cold_start_s for a in range(n)])
        start = np.maximum(start, cold)  # a cold actor boots while the prefill actor works
        self.cold = cold
        nodes = [self.node_of.get(("decode", a), "") for a in range(n)]
        self.actors = [
            EngineModel(a, (burst_profile or profile) if node.startswith("burst") else profile, node, float(start[a]))
            for a, node in enumerate(nodes)
        ]
        chosen = plan.chosen_candidate()
        checks = checks_per_step * (4 if self.pulls else 1)  # a shared queue is refilled at every check
        self.interval = max((chosen.time_s if chosen else 1.0) / checks, 1e-3)
        self.checks_per_step = checks_per_step
        self.next_check_s = float(start.max(initial=0.0)) + self.interval
        self.checks = 0
        self._now = 0.0
        self.first_cut_s = math.inf  # when the controller first cut a sample off its engine (inf: never)
        self.cut_engines: set[int] = set()  # engines a sample was cut off

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
        clock = prof.prefill_base_s + (0.0 if self.warm_prefill else prof.cold_start_s)
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
        while self.pauses and self.pauses[0][0] <= limit:
            at, seconds = self.pauses.popleft()
            self.advance_to(at)
            if all(a.idle() for a in self.actors) and all(st == DONE for st in self.s.state):
                self.pauses.clear()  # the batch finished before the broadcast
                return
            self.tokens_before_pauses.append(sum(a.generated for a in self.actors))
            for actor in self.actors:
                if not actor.idle():
                    if self.pause_frees_kv:
                        actor.free_kv(self.s)
                    actor.t = max(actor.t, at) + seconds

    def poll(self) -> Poll:
        if self.migrates or self.pulls:
            now = self.next_check_s
            self._pause_until(now)
            self.advance_to(now)
            self.checks += 1
            if self.checks % (4 * self.checks_per_step) == 0:
                self.interval *= 2  # the plan was far off: check less often rather than forever
            self.next_check_s = now + self.interval
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
        self.first_cut_s = min(self.first_cut_s, self._now)
        self.cut_engines.add(engine)
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
            generation_s=max([a.last_token for a in used] + [self.prefill_s, 0.0]),
            engines=[
                EngineUsage(
                    a.busy,
                    a.first if a.used else None,
                    a.last_token,
                    float(self.cold[a.aid]),
                    burst=a.node.startswith("burst"),
                    warm_in=a.node.startswith("burst") and a.aid in self.warm,
                )
                for a in self.actors
            ],
            gpus=g,
            gpus_per_engine=prof.gpus_per_actor,
            prefill_s=self.prefill_s,
            prefill_tokens_saved=self.plan.prefill.tokens_saved,
            prepare_s=tokens * self.rates[0] / g,
            learn_s=tokens * self.rates[1] / g,
            sync_s=prof.weight_sync_s,
            extra={
                "preemptions": sum(a.preemptions for a in self.actors),
                "first_cut_s": self.first_cut_s,
                "cut_engines": sorted(self.cut_engines),
            },
        )


class _WorkloadIO:
    """The simulator's side of a driven step (``rlhfless_sdk.rollout.drivers.StepIO``): prompts drawn from the
    workload's steps in order, each sample's true length from the workload, the plan run whole on simulated
    engines (the clock is exact: a cut's instant and what each sample had by then are read off the run).

    A carrying driver's pieces (``book.step_pieces``: carried samples, then the new groups) are run to their true
    ends, a new sample capped at the plan's token budget (``segment_tokens``)."""

    def __init__(
        self, sim: Simulator, planner: StepPlanner, steps: Sequence[WorkloadStep], book: CarryBook | None = None
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


@dataclass
class _StreamLearner:
    """The learner of a simulated stream: each group's tokens, the algorithm's GPU-seconds per token."""

    group_tokens: Sequence[float]
    s_per_token: float
    sync_s: float

    def tokens(self, groups: Sequence[int]) -> float:
        return float(sum(self.group_tokens[g] for g in groups))

    def train_s(self, tokens: float, gpus: int, joining: int = 0, after_s: float = 0.0) -> float:
        return joined_train_s(tokens * self.s_per_token, gpus, joining, after_s)


@dataclass
class SimulatedStep:
    """A step's report plus what the simulator saw that the report does not hold."""

    report: StepReport
    plan: StepPlan
    chosen: CandidateEstimate | None
    preemptions: int = 0
    frontier: list[dict] | None = None  # every candidate N: predicted and simulated (time, GPU-seconds)
    outcome: StepOutcome | None = None  # per sample: final actor, migrations, the segments of its tokens
    usage: StepUsage | None = None  # what the report bills (learning, burst engines kept or released)

    @classmethod
    def of(
        cls,
        report: StepReport,
        plan: StepPlan,
        outcome: StepOutcome,
        frontier: list[dict] | None = None,
        usage: StepUsage | None = None,
    ) -> SimulatedStep:
        return cls(report, plan, plan.chosen_candidate(), outcome.usage.extra["preemptions"], frontier, outcome, usage)


@dataclass
class SimulationResult:
    scheduler: str
    steps: list[SimulatedStep]
    rollout_gpus: int | None = None  # async mode: GPUs that only generate
    workload_steps: int = 0  # the workload's steps (a carrying run may take one more to finish its carry)
    gpus: int = 0  # the fleet
    work: WorkBound | None = None  # the GPU work any schedule of the workload must do
    split_search: list[dict] | None = None  # async at its best split: each split tried and its time
    stream: dict | None = None  # the streaming pipeline: batches, splits, re-plans

    @property
    def reports(self) -> list[StepReport]:
        return [s.report for s in self.steps]

    def steady(self) -> list[StepReport]:
        """The steps a long run's pace is measured on, the same for every scheduler: the workload's steps but the
        first (engines' start-up, an async pipeline's fill) and the last (its drain); none with fewer than 3."""
        n = self.workload_steps or len(self.steps)
        return self.reports[1 : n - 1] if n >= 3 else []

    def totals(self) -> dict[str, float | None]:
        r = self.reports
        steady = self.steady()
        peak = max((x.peak_gpus for x in r), default=self.gpus)
        total = sum(x.time_s for x in r)
        bound = self.work.bound_s(peak) if self.work is not None and peak else None
        return {
            "total_time_s": total,
            # a long run's pace: without the first step's start-up or pipeline fill and the last step's drain
            "steady_step_s": float(np.mean([x.time_s for x in steady])) if steady else None,
            "peak_gpus": peak,
            "bound_s": bound,
            "bound_fraction": bound / total if bound is not None and total > 0 else None,
            "total_generation_s": sum(x.generation_s for x in r),
            "total_gpu_seconds": sum(x.gpu_seconds for x in r),
            "total_gpu_seconds_serverful": sum(x.gpu_seconds_serverful for x in r),
            "migrations": sum(x.migrations for x in r),
            "prefill_tokens_saved": sum(x.prefill_tokens_saved for x in r),
            "mean_idle_fraction": float(np.mean([x.idle_fraction for x in r])) if r else 0.0,
            "stale_token_fraction": sum(x.stale_token_fraction * x.response_tokens for x in r)
            / max(sum(x.response_tokens for x in r), 1),
            "max_token_age_steps": max((x.max_token_age_steps for x in r), default=0),
            "rollout_gpus": self.rollout_gpus,
        }


def equal_peak(config: SchedulerConfig, fleet_actors: int) -> SchedulerConfig:
    """``config`` on the fleet only: no burst engine, at most the fleet's decode actors (``simulate``'s default:
    every scheduler compared on the same peak GPUs; the fidelity check's: on the real run's engines and no more)."""
    most = min(config.max_actors or fleet_actors, fleet_actors)
    return config.derive(burst=1.0, max_actors=max(most, config.min_actors))


def carried_ages(driven: Driven, k: int, times: Sequence[Any]) -> tuple[int, int, int]:
    """(trained response tokens, stale ones, largest age) of batch ``k`` of an async pipeline whose batches are cut
    at B groups: a token generated in batch j is ``k - times[j].version`` weight updates old when batch k trains
    (an upper bound under partial rollout, where a broadcast mid-batch gives later tokens newer weights)."""
    assert driven.settled is not None
    total = stale = oldest = 0
    for group in driven.settled.trained:
        for per_sample in group.steps:
            for j, tokens in per_sample:
                age = k - times[j].version
                total += tokens
                if tokens > 0 and age > 0:
                    stale += tokens
                    oldest = max(oldest, age)
    return total, stale, oldest


class Simulator:
    """Runs a scheduler over a workload on a simulated cluster; see the module docstring for the model."""

    #: The step drivers this backend runs (``rlhfless_sdk.rollout.drivers``): all of them.
    modes = frozenset({PLAIN, TOKEN_BUDGET, TAIL_ROUNDS, BATCH_CUT, ASYNC})

    def __init__(
        self,
        profile: TimePerTokenProfile,
        cluster: Cluster,
        *,
        registry: Registry,
        max_tokens: int | None = None,
        checks_per_step: int = 40,
        algo: str | None = None,
        memory: str = "dedicated",
        split_probe_steps: int | None = 3,
        prefix_caching: bool = False,
        bound_profile: TimePerTokenProfile | None = None,
    ) -> None:
        """``algo``: the learner's rates (``ppo`` or ``grpo``); default: what each workload implies. ``memory``:
        the KV capacity of a synchronous engine, which shares its GPUs with the learner (``colocated``, the
        profile's ``colocated_kv_capacity_tokens``) or has them to itself during generation (``dedicated``, the
        profile's ``kv_capacity_tokens``: the learner offloaded). Engines on GPUs of their own (an async
        pipeline's, burst engines) always get the dedicated capacity. ``prefix_caching``: vLLM's prefix cache is
        on, so a sample admitted to an engine that prefilled its prompt before (a group-mate's) reads it from the
        cache (OpenRLHF's default is off; its demo and the fidelity check run with it on). ``bound_profile``: the
        engine the work bound is computed on (default ``profile``; a sharded profile's one-GPU form, so that no
        engine shape beats the bound)."""
        self.memory = memory
        self.bound_profile = bound_profile or profile
        self.prefix_caching = prefix_caching  # vLLM's prefix cache on the engines (OpenRLHF's default: off)
        self.split_probe_steps = split_probe_steps  # async with no split set: steps each split is tried on
        self.dedicated = profile
        profile = profile.with_memory(memory)
        self.profile = profile
        self.algo = algo
        self.cluster = cluster
        self.registry = registry
        self.max_tokens = max_tokens
        self.checks_per_step = checks_per_step
        self.warm: frozenset[int] = frozenset()  # actors that worked in the previous step
        self.warm_prefill = False
        self.run_algo = algo or "ppo"
        self._bounds: dict[int, tuple[Workload, str, WorkBound]] = {}

    def planner(self, config: SchedulerConfig) -> StepPlanner:
        """``config``'s planner on the fleet (``planner_for``: plus burst nodes when the config allows more decode
        actors than the fleet holds)."""
        return planner_for(config, self.profile, self.cluster, self.registry)

    def run(
        self,
        config: SchedulerConfig,
        workload: Workload,
        on_step: Callable[[StepReport], Any] | None = None,
        frontier: bool = False,
    ) -> SimulationResult:
        """Every step of ``workload`` under ``config``, with the workload's work bound on this cluster. A
        predictor's length history reads only what this run records (``isolated_history``): a replayed workload's
        later steps are never seen before their turn, whatever an earlier run left in a history file."""
        with isolated_history():
            result = self._run(config, workload, on_step, frontier)
        result.workload_steps, result.gpus = len(workload.steps), self.cluster.total_gpus
        result.work = self.work_bound(workload)
        return result

    def work_bound(self, workload: Workload) -> WorkBound:
        """The workload's work bound on this simulator's engines (computed once per workload)."""
        algo = self.algo or workload.algo
        cached = self._bounds.get(id(workload))
        if cached is None or cached[0] is not workload or cached[1] != algo:
            cached = self._bounds[id(workload)] = (workload, algo, work_bound(workload, self.bound_profile, algo))
        return cached[2]

    def refusal(self, config: SchedulerConfig, mode: Mode | None = None) -> str | None:
        """Why this simulator cannot run ``config`` (None: it can); ``run`` raises it, a command asks first.
        Scoring in the generation tail (``tail_prepare``) works on the groups a step completes from the samples it
        ran; a straggler policy that carries cut samples into the next step (partial rollouts) trains groups with
        samples of earlier steps, whose tail the model does not follow."""
        mode = mode or mode_for(config, self.registry)
        if not mode.tail or mode.driver not in (TOKEN_BUDGET, BATCH_CUT):
            return None
        fields = "pipeline.tail_prepare" + (" and tail_learn" if mode.tail == "learn" else "")
        return (
            f"scheduler {config.name!r}: {fields} (scoring complete groups on GPUs done decoding) cannot run with the "
            f"straggler policy {config.policy('straggler').name!r}, which carries cut samples into the next step "
            "(partial rollouts): use straggler none or tail-batch with it, or drop tail_prepare"
        )

    def _run(
        self,
        config: SchedulerConfig,
        workload: Workload,
        on_step: Callable[[StepReport], Any] | None,
        frontier: bool,
    ) -> SimulationResult:
        mode = mode_for(config, self.registry)
        refused = self.refusal(config, mode)
        if refused is not None:
            raise RlhflessError(refused)
        self.warm, self.warm_prefill = frozenset(), False
        self.run_algo = self.algo or workload.algo
        if mode.pipelined:
            if mode.elastic:  # the split is re-planned as it runs
                return self.run_stream(config, workload, on_step, None)
            fixed = self.rollout_gpus(config)
            if fixed is None:
                return self.best_split(config, workload, on_step, mode)
            return self.run_pipeline(config, workload, on_step, fixed, mode)
        planner = self.planner(config)
        if mode.driver == PLAIN:
            return self.run_plain(planner, workload, on_step, frontier)
        return self.run_driven(planner, workload, on_step, mode.driver)

    def run_plain(
        self,
        planner: StepPlanner,
        workload: Workload,
        on_step: Callable[[StepReport], Any] | None = None,
        frontier: bool = False,
    ) -> SimulationResult:
        """Every step of the workload, each sample run to its end in its step (``PlainStep``)."""
        steps = []
        for ws in workload.steps:
            sim = self.step(planner, ws, frontier=frontier)
            steps.append(sim)
            if on_step is not None:
                on_step(sim.report)
        return SimulationResult(planner.config.name, steps)

    # -- OpenRLHF's async mode ------------------------------------------------------------------------------
    def splits(self) -> list[int]:
        """Every rollout/learner split of the fleet: GPUs that generate, in whole engines, at least one GPU left
        to learn."""
        g, gpa = self.cluster.total_gpus, self.profile.gpus_per_actor
        if g - 1 < gpa:
            raise RlhflessError(f"async mode needs more than {gpa} GPU(s) (one engine and a learner); got {g}")
        return list(range(gpa, g, gpa))

    def rollout_gpus(self, config: SchedulerConfig) -> int | None:
        """The config's fixed split (checked), or None: find the best."""
        g, gpa = self.cluster.total_gpus, self.profile.gpus_per_actor
        fixed = config.pipeline.rollout_gpus
        if fixed is not None and (fixed % gpa or not gpa <= fixed <= g - 1):
            raise RlhflessError(
                f"scheduler {config.name!r}: rollout_gpus={fixed} must be a multiple of {gpa} (GPUs per "
                f"engine) and leave at least one of the {g} GPUs to learn"
            )
        return fixed

    def best_split(
        self, config: SchedulerConfig, workload: Workload, on_step: Callable[[StepReport], Any] | None, mode: Mode
    ) -> SimulationResult:
        """The async pipeline at the split a user tuning it would keep: every split is run on the first
        ``split_probe_steps`` steps (all of them when None) and the fastest there runs the whole workload."""
        probe_steps = self.split_probe_steps
        probe = workload if probe_steps is None else replace(workload, steps=workload.steps[:probe_steps])
        tried: list[dict] = []
        best: tuple[float, int, SimulationResult] | None = None
        for r in self.splits():
            res = self.run_pipeline(config, probe, None, r, mode)
            t = sum(x.time_s for x in res.reports)
            tried.append({"rollout_gpus": r, "time_s": t})
            if best is None or t < best[0]:
                best = (t, r, res)
        assert best is not None
        _, r, res = best
        if probe is not workload:
            res = self.run_pipeline(config, workload, on_step, r, mode)
        elif on_step is not None:
            for rep in res.reports:
                on_step(rep)
        res.split_search = tried
        return res

    def run_pipeline(
        self,
        config: SchedulerConfig,
        workload: Workload,
        on_step: Callable[[StepReport], Any] | None,
        r: int,
        mode: Mode,
    ) -> SimulationResult:
        """The config's pipeline (its ``mode``) with ``r`` rollout GPUs."""
        if mode.pipeline == "stream":
            return self.run_stream(config, workload, on_step, r)
        return self.run_async(config, workload, on_step, r, mode)

    def run_async(
        self,
        config: SchedulerConfig,
        workload: Workload,
        on_step: Callable[[StepReport], Any] | None,
        r: int,
        mode: Mode,
    ) -> SimulationResult:
        """OpenRLHF's async loop (``rlhfless_sdk.simulation.pipeline``): ``r`` GPUs generate with the scheduler's
        policies while the others learn. Step k's report spans the time between two weight broadcasts (k - 1's
        and k's) and bills what happened in that window: the engines from their first work to their last token on
        any batch, the learners while they train, every GPU during a broadcast; its ``generation_s`` is the time
        in the window during which some batch was generating. So no step bills more than every GPU for its time,
        and none is shorter than its generation."""
        self.warm, self.warm_prefill = frozenset(), False
        self.run_algo = self.algo or workload.algo
        pipe = config.pipeline
        g, prof = self.cluster.total_gpus, self.dedicated
        gen_cluster = Cluster.of_gpus(r, min(r, self.cluster.nodes[0].num_gpus if self.cluster.nodes else r))
        learners = g - r
        # OpenRLHF 0.11.2 refuses vLLM sleep with --train.async_enable: the engines hold GPUs of their own
        planner = rollout_planner_for(config, prof, r, gen_cluster.nodes[0].num_gpus, self.registry)
        if mode.driver not in (PLAIN, BATCH_CUT):
            raise RlhflessError(
                f"scheduler {config.name!r}: the {mode.driver} step driver inside the async pipeline is not simulated; "
                "partial rollouts cut at B groups (partial-batch) are"
            )
        token_counts = [float(ws.batch.prompt_lengths @ ws.batch.n_samples + ws.lengths.sum()) for ws in workload.steps]
        batches = len(workload.steps)
        io = _WorkloadIO(self, planner, workload.steps)
        session = None
        if mode.driver == BATCH_CUT:  # partial rollouts inside the pipeline: each batch cut once B groups are complete
            b_size = max((len(ws.batch) for ws in workload.steps), default=0)
            session = session_for(BATCH_CUT, planner, b_size, io.prompts())
            io.book = session.book
            prompts = sum(len(ws.batch) for ws in workload.steps)
            batches = -(-prompts // b_size) if b_size else 0  # every batch but the last trains B groups
            token_counts = [0.0] * batches  # what each batch trains: known once it is generated
        train_s = [sum(self._learning(t, learners)) for t in token_counts]
        done: dict[int, tuple[StepPlan, StepOutcome, list[int]]] = {}
        driven_of: dict[int, Driven] = {}

        def generate(k: int, start: float, pauses: list[tuple[float, float]]) -> float:
            relative = [(max(a - start, 0.0), b - max(a, start)) for a, b in pauses if b > start]
            frees = not pipe.pause_keeps_kv  # OpenRLHF's own engines pause with vLLM's default: the KV is freed
            io.backend_kw = {"cluster": gen_cluster, "pauses": relative, "pause_frees_kv": frees, "profile": prof}
            if session is None:  # the batch the workload gives, every sample to its end
                ws = workload.steps[k]
                io.begin(ws.step)
                driven = PlainStep(planner, ws.step).run(io, io.adopt(ws.batch, ws.lengths))
            else:
                io.begin(k)
                cut = session.next(io, k)
                if cut is None:
                    raise RlhflessError(f"scheduler {config.name!r}: batch {k} of {batches} found nothing to generate")
                driven = driven_of[k] = cut
                token_counts[k] = float(driven.trained_tokens)
                train_s[k] = sum(self._learning(token_counts[k], learners))
            usage = stopped_at(driven.outcome.usage, driven.stop_s)
            self.hold(planner, usage)  # no burst engine here: the fleet's engines that worked stay warm
            assert io.last_backend is not None
            done[k] = (driven.plan, replace(driven.outcome, usage=usage), io.last_backend.tokens_before_pauses)
            return start + usage.generation_s

        timeline = partial_pipeline if pipe.partial_rollout else locked_pipeline
        times = timeline(batches, generate, train_s, prof.weight_sync_s, pipe.queue_size)
        # what each GPU did on the run's clock: engine e's work on every batch, the learners', the broadcasts
        engine_spans: dict[int, list[tuple[float, float]]] = {}
        for k, b in enumerate(times):
            for e, usage in enumerate(done[k][1].usage.engines):
                if usage.first_s is not None:
                    engine_spans.setdefault(e, []).append(
                        (b.gen_start + usage.first_s - usage.cold_start_s, b.gen_start + usage.last_s)
                    )
        syncs = [(b.sync_start, b.sync_end) for b in times]
        trains = [(b.train_start, b.train_end) for b in times]
        gens = [(b.gen_start, b.gen_end) for b in times]
        gpa = prof.gpus_per_actor
        steps = []
        for k, b in enumerate(times):
            plan, outcome, before = done[k]
            rep, u = outcome.report, outcome.usage
            if k in driven_of:  # a cut batch: what trains, and each piece's age from the batch that made it
                rep = rep.model_copy(update=driven_of[k].fields)
                total, stale, oldest = carried_ages(driven_of[k], k, times)
            else:
                total = int(workload.steps[k].lengths.sum())
                stale, oldest = token_ages(k, b.version, before, total)
            lo, hi = (times[k - 1].sync_end if k else 0.0), b.sync_end
            prepare_s, learn_s = self._learning(token_counts[k], learners)
            usage = replace(u, gpus=g, learner_gpus=learners, prepare_s=prepare_s, learn_s=learn_s, step_s=hi - lo)
            engines_gpu_s = sum(covered([*spans, *syncs], lo, hi) for spans in engine_spans.values()) * gpa
            idle_engines = r // gpa - len(engine_spans)  # never worked: held during broadcasts only
            billed = (
                engines_gpu_s
                + idle_engines * gpa * covered(syncs, lo, hi)
                + learners * covered([*trains, *syncs], lo, hi)
            )
            report = rep.model_copy(
                update={
                    **billing(usage),
                    "generation_s": covered(gens, lo, hi),
                    "gpu_seconds": billed,
                    "gpu_seconds_serverful": g * (hi - lo),
                    "stale_token_fraction": stale / total if total else 0.0,
                    "max_token_age_steps": oldest,
                }
            )
            sim = SimulatedStep.of(report, plan, outcome, usage=usage)
            steps.append(sim)
            if on_step is not None:
                on_step(report)
        return SimulationResult(config.name, steps, rollout_gpus=r)

    def run_stream(
        self,
        config: SchedulerConfig,
        workload: Workload,
        on_step: Callable[[StepReport], Any] | None,
        r: int | None,
    ) -> SimulationResult:
        """The streaming pipeline (``rlhfless_sdk.rollout.stream``) with ``r`` rollout GPUs at first: the
        workload's prompts one stream, batches of B groups (the first step's batch size), engines on GPUs of their
        own (dedicated memory). Batch k's report spans the time between updates k - 1 and k and bills what
        happened in it: each engine while held (from its start, start-up included, to its last token or its
        stop), the learner GPUs while they train, every GPU during an update."""
        self.warm, self.warm_prefill = frozenset(), False
        self.run_algo = self.algo or workload.algo
        pipe = config.pipeline
        g, prof = self.cluster.total_gpus, self.dedicated
        gpa = prof.gpus_per_actor
        sizes: list[int] = []
        gid, index, plen, target, group_tokens = [], [], [], [], []
        for ws in workload.steps:
            b, lengths = ws.batch, np.asarray(ws.lengths, dtype=np.int64)
            if self.max_tokens is not None:
                lengths = np.minimum(lengths, self.max_tokens)
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
        b_size = max((len(ws.batch) for ws in workload.steps), default=0)
        book = GroupBook(sizes, max(b_size, 1), pipe.max_age)
        rates = prof.learner_rates(self.run_algo)
        learner = _StreamLearner(group_tokens, rates[0] + rates[1], prof.weight_sync_s)
        split: BalancedSplit | None = None
        policy: BalancedSplit | PinnedSplit | None = None
        slots = KvSlots(prof, pipe.kv_slots) if pipe.kv_slots is not None else None
        if pipe.elastic:
            split = policy = BalancedSplit(prof, g, rates[0] + rates[1], switch_s=prof.cold_start_s, slots=slots)
            cap = workload.cap if self.max_tokens is None else min(workload.cap, self.max_tokens)
            first = sizes[: book.B]
            r = split.first(sum(first), float(np.mean(plen)) if plen else 0.0, cap)
            if pipe.split_schedule is not None:
                bad = [x for x in pipe.split_schedule if x and (x % gpa or not gpa <= x <= g - 1)]
                if bad:
                    raise RlhflessError(
                        f"scheduler {config.name!r}: split_schedule entry {bad[0]} is not a split of {g} GPUs (a "
                        f"multiple of {gpa} GPUs per engine, at least one GPU left to learn; 0: the planner's)"
                    )
                policy = PinnedSplit(split, pipe.split_schedule)
        if r is None:
            raise RlhflessError(f"scheduler {config.name!r}: a stream with a fixed split needs its rollout GPUs")
        engines = SimulatedStream(prof, samples, r // gpa)
        stats = run_stream(
            engines,
            learner,
            book,
            gpus=g,
            rollout_gpus=r,
            gpus_per_engine=gpa,
            split=policy,
            switch_s=prof.cold_start_s,
            slots=slots,
        )
        held = engines.held()
        busy = [a.busy for a in engines.actors]
        idle = 1.0 - (sum(busy) + engines.busy) / max(sum(hi - lo for lo, hi in held.values()), 1e-9)
        imbalance = float(max(busy) / np.mean(busy)) if busy and np.mean(busy) > 0 else 1.0
        steps = []
        for k, chosen in enumerate(stats.batches):
            lo, hi = (stats.updates[k - 1][1] if k else 0.0), stats.updates[k][1]
            learners = stats.learners[k]
            trained = stats.trained_tokens[k]
            prepare_s, learn_s = trained * rates[0] / learners, trained * rates[1] / learners
            sync = covered(stats.updates, lo, hi)
            billed = (
                sum(covered([span], lo, hi) for span in held.values()) * gpa
                + sum((g - stats.split[j]) * covered([t], lo, hi) for j, t in enumerate(stats.train))
                + learners * sync
            )
            sids = [sid for c in chosen for sid in book.groups[c].samples]
            responses = len(sids)
            total, stale, oldest = batch_ages((engines.tokens_by_version(sid) for sid in sids), k)
            report = StepReport(
                step=k,
                scheduler=config.name,
                time_s=hi - lo,
                generation_s=covered(list(held.values()), lo, hi),
                prepare_s=prepare_s,
                learn_s=learn_s,
                gpu_seconds=billed,
                gpu_seconds_serverful=g * (hi - lo),
                idle_fraction=min(max(idle, 0.0), 1.0),
                imbalance=max(imbalance, 1.0),
                num_actors=max(stats.split[k] // gpa, 1),
                samples=responses,
                response_tokens=total,
                peak_gpus=g,
                stale_token_fraction=stale / total if total else 0.0,
                max_token_age_steps=oldest,
                groups_trained=len(chosen),
            )
            plan = StepPlan(
                step=k, scheduler=config.name, num_actors=report.num_actors, assignment=[], predicted_lengths=[]
            )
            steps.append(SimulatedStep(report, plan, None))
            if on_step is not None:
                on_step(report)
        result = SimulationResult(config.name, steps, rollout_gpus=r)
        result.stream = {
            "batches": len(stats.batches),
            "oversized_batches": stats.oversized,
            "gated_s": stats.gated_s,
            "splits": stats.split,
            "resizes": engines.resizes,
            "moved_samples": engines.moved,
            "replans": split.choices if split is not None else [],
            "slots": stats.slots,  # samples an engine ran at most as each batch formed (empty: max_num_seqs)
            "preemptions": sum(a.preemptions for a in engines.actors) + engines.preemptions,
            # the first split, and the first batch's time at the fill with every sample at the cap (what chose it)
            "first_split": r,
            "fill_bound_s": split.fill_bound_s if split is not None else None,
        }
        return result

    def hold(self, planner: StepPlanner, usage: StepUsage) -> StepUsage:
        """``usage`` of a finished step (its learning included), with each burst engine kept for the next step
        or released, as the planner decides on cost (``StepPlanner.keep_burst``). The fleet's engines live on
        GPUs the run holds for its learner anyway: once started they stay up (an engine that sits a step out is
        woken, not restarted), as OpenRLHF creates its engines once; kept burst engines stay warm too."""
        step_s = usage.step_s
        if step_s is None:
            step_s = usage.generation_s + usage.prepare_s + usage.learn_s + usage.sync_s
        engines = []
        for e in usage.engines:
            if e.burst and held(e):
                idle = step_s - (e.last_s if e.first_s is not None else 0.0)
                e = replace(e, kept=planner.keep_burst(idle))
            engines.append(e)
        fleet_actors = self.cluster.total_gpus // self.profile.gpus_per_actor
        burst = {a for a, e in enumerate(engines) if e.burst}
        self.warm = frozenset(
            {a for a in self.warm if a not in burst and (a < len(engines) or a < fleet_actors)}
            | {a for a, e in enumerate(engines) if not e.burst and e.first_s is not None}
            | {a for a, e in enumerate(engines) if e.burst and e.kept}
        )
        self.warm_prefill = self.warm_prefill or usage.prefill_s > 0
        return replace(usage, engines=engines)

    def _score_in_tail(self, planner: StepPlanner, usage: StepUsage, driven: Driven) -> StepUsage:
        """``usage`` of a synchronous step with ``tail_prepare``: the fleet's GPUs whose engines are done score the
        complete groups that train while the others generate (``score_in_tail``); the scoring left is spread over
        every GPU after generation, and the GPUs that switched are billed from their switch to its end. Burst
        engines' GPUs are not the learner's: they never score. With ``tail_learn`` they also learn, in gradient
        groups (``group_gpus``, formed as GPUs free: ``in_groups``), the first optimizer step's share of each group;
        the gradient reduce is charged once any did. Without ``tail_prepare``: ``usage`` as it is."""
        tail = tail_of(planner.config)
        if not tail or driven.ran.finish_s is None:
            return usage
        g, gpa = usage.gpus, usage.gpus_per_engine
        learn = tail == "learn"
        # with tail_learn only a consolidated tail is worth joining: a GPU joins if its engine was cut by the
        # consolidation or freed after the step's first cut; GPUs freed before it were released (a short tail
        # never consolidates, and then nothing joins)
        cut, cut_from = usage.extra.get("first_cut_s", math.inf), set(usage.extra.get("cut_engines", ()))

        def freed(i: int, e: EngineUsage) -> float:
            f = e.last_s if e.first_s is not None else 0.0
            return f if not learn or i in cut_from or f >= cut else usage.generation_s

        free = [freed(i, e) for i, e in enumerate(usage.engines) if not e.burst for _ in range(gpa)]
        free = (free + [usage.generation_s if learn else 0.0] * g)[:g]
        prepare, learning = self.profile.learner_rates(self.run_algo)
        # of k optimizer steps on the batch, only the first's learning can run before the batch is complete: the
        # tail learns 1/k of every group (a fluid stand-in for the first update's groups, the earliest complete)
        rate = prepare + learning / planner.config.pipeline.updates_per_batch if learn else prepare
        switch = scoring_switch_s(self.profile)
        if learn:
            size = group_gpus(self.dedicated, self.run_algo)
            free = in_groups(free, size, usage.generation_s)
            switch = learning_switch_s(self.dedicated, self.run_algo, size)
        batch, samples, finish = driven.batch, driven.outcome.samples, driven.ran.finish_s
        starts = np.concatenate([[0], np.cumsum(batch.n_samples)])
        ready = []
        for row in driven.trained_rows:
            sids = range(int(starts[row]), int(starts[row + 1]))
            tokens = sum(samples[i].prompt_length + samples[i].response_length for i in sids)
            ready.append((max(float(finish[i]) for i in sids), tokens * rate))
        scored = score_in_tail(free, ready, usage.generation_s, switch)
        extra = {**usage.extra, "tail_scored_gpu_s": scored.done_gpu_s, "tail_scorers": scored.scorers}
        if not learn:
            return replace(usage, prepare_s=scored.left_gpu_s / g, tail_scoring_gpu_s=scored.held_gpu_s, extra=extra)
        # what the tail did is scoring and learning in proportion; the rest of both is left for every GPU, and the
        # tail groups' gradients join the learner's before its first optimizer step
        prep_done = scored.done_gpu_s * prepare / rate
        reduce_s = gradient_reduce_s(self.profile) if scored.done_gpu_s > 0 else 0.0
        return replace(
            usage,
            prepare_s=usage.prepare_s - prep_done / g,
            learn_s=usage.learn_s - (scored.done_gpu_s - prep_done) / g + reduce_s,
            tail_scoring_gpu_s=scored.held_gpu_s,
            extra=extra,
        )

    def _learning(self, tokens: float, gpus: int) -> tuple[float, float]:
        """(scoring, learning) seconds of ``tokens`` (prompt + response) on ``gpus`` GPUs, for the run's algorithm."""
        prepare, learn = self.profile.learner_rates(self.run_algo)
        return tokens * prepare / gpus, tokens * learn / gpus

    # -- the step drivers of the straggler policies (``rlhfless_sdk.rollout.drivers``) -------------------------
    def run_driven(
        self,
        planner: StepPlanner,
        workload: Workload,
        on_step: Callable[[StepReport], Any] | None = None,
        mode: str = BATCH_CUT,
    ) -> SimulationResult:
        """Every step of a carrying or over-provisioning ``mode``, run by its driver session over the workload's
        prompts (B = the largest step's prompts a step). A step whose driver cuts it at some instant (tail batching's
        rounds, a batch cut) is simulated whole and cut there: what happens after it cannot change what happened
        before; what each sample had by then comes from the same engines run again up to it."""
        steps_in = workload.steps
        b = max((len(ws.batch) for ws in steps_in), default=0)
        if b == 0:
            return SimulationResult(planner.config.name, [])
        io = _WorkloadIO(self, planner, steps_in)
        session = session_for(mode, planner, b, io.prompts())
        io.book = session.book
        out: list[SimulatedStep] = []
        r = 0
        while True:
            io.begin(r)
            driven = session.next(io, r)
            if driven is None:
                return SimulationResult(planner.config.name, out)
            out.append(self._settle_step(planner, driven, on_step))
            r += 1

    def _settle_step(
        self, planner: StepPlanner, driven: Driven, on_step: Callable[[StepReport], Any] | None
    ) -> SimulatedStep:
        """A driven step billed: the engines up to when it ended, the learner on the tokens (prompt + response)
        that train, burst engines kept or released; the report with the driver's fields."""
        rep, u = driven.outcome.report, driven.outcome.usage
        prepare_s, learn_s = self._learning(float(driven.trained_tokens), self.cluster.total_gpus)
        usage = stopped_at(u, driven.stop_s)
        usage = self._score_in_tail(planner, replace(usage, prepare_s=prepare_s, learn_s=learn_s), driven)
        usage = self.hold(planner, usage)
        report = rep.model_copy(update={**billing(usage), **driven.fields})
        sim = SimulatedStep.of(report, driven.plan, driven.outcome, usage=usage)
        if on_step is not None:
            on_step(report)
        return sim

    def _tokens_at(self, planner: StepPlanner, ws: WorkloadStep, plan: StepPlan, t: float, **kw: Any) -> list[int]:
        """Each sample's tokens at time ``t`` of a step dispatched as the step controller does (no migration);
        ``kw``: where its engines ran (``backend``'s)."""
        backend = self.backend(planner, ws, plan, **kw)
        StepController(planner, backend, ws.batch, plan, step=ws.step).dispatch()
        backend.advance_to(t)
        return backend.tokens_now()

    def step(self, planner: StepPlanner, ws: WorkloadStep, frontier: bool = False) -> SimulatedStep:
        """One step (``PlainStep``); the actors that worked in it stay warm for the next (``self.warm``)."""
        io = _WorkloadIO(self, planner, [ws])
        io.begin(ws.step)
        driven = PlainStep(planner, ws.step).run(io, io.adopt(ws.batch, ws.lengths))
        plan, outcome = driven.plan, driven.outcome
        front = self.frontier(planner, ws, plan, outcome.report) if frontier else None
        usage = self.hold(planner, self._score_in_tail(planner, outcome.usage, driven))
        report = outcome.report.model_copy(update=billing(usage))
        return SimulatedStep.of(report, plan, outcome, front, usage)

    def backend(
        self,
        planner: StepPlanner,
        ws: WorkloadStep,
        plan: StepPlan,
        *,
        cluster: Cluster | None = None,
        pauses: Sequence[tuple[float, float]] = (),
        pause_frees_kv: bool = False,
        profile: TimePerTokenProfile | None = None,
    ) -> SimulatedBackend:
        """The simulated engines for one step of ``plan``, warm where the previous step left them (``profile``:
        the engines' model, default the synchronous engines'; ``pauses``, ``pause_frees_kv``: as
        ``SimulatedBackend`` takes them)."""
        return SimulatedBackend(
            profile or self.profile,
            cluster or self.cluster,
            ws,
            plan,
            max_tokens=self.max_tokens,
            checks_per_step=self.checks_per_step,
            migrates=planner.config.migrates(),
            warm=self.warm,
            warm_prefill=self.warm_prefill,
            algo=self.run_algo,
            pauses=pauses,
            pause_frees_kv=pause_frees_kv,
            burst_profile=self.dedicated,
            prefix_caching=self.prefix_caching,
        )

    def execute(self, planner: StepPlanner, ws: WorkloadStep, plan: StepPlan, *, observe: bool = False) -> StepOutcome:
        """Run one step of ``plan`` through the step controller on the simulated backend."""
        backend = self.backend(planner, ws, plan)
        return StepController(planner, backend, ws.batch, plan, step=ws.step).run(observe=observe)

    def frontier(self, planner: StepPlanner, ws: WorkloadStep, plan: StepPlan, report: StepReport) -> list[dict]:
        """Every candidate actor count: the cost model's (time, GPU-seconds) and the simulated ones."""
        out = []
        for e in sorted(plan.candidates, key=lambda e: e.num_actors):
            n = e.num_actors
            if n == plan.num_actors:
                sim = report
            else:
                variant = planner.plan(
                    ws.batch,
                    step=ws.step,
                    predicted=np.asarray(plan.predicted_lengths),
                    num_actors=n,
                    prefill=plan.prefill,
                )
                sim = self.execute(planner, ws, variant).report
            learner = self.cluster.total_gpus * (sim.prepare_s + sim.learn_s + self.profile.weight_sync_s)
            out.append(
                {
                    "num_actors": n,
                    # the cost model covers generation only; the simulated step adds scoring, learning, sync
                    "predicted_time_s": e.time_s,
                    "predicted_gpu_seconds": e.gpu_seconds,
                    "simulated_generation_s": sim.generation_s,
                    "simulated_generation_gpu_seconds": sim.gpu_seconds - learner,
                    "simulated_time_s": sim.time_s,
                    "simulated_gpu_seconds": sim.gpu_seconds,
                    "chosen": n == plan.num_actors,
                }
            )
        return out
