"""A discrete-event simulator of synchronous RLHF steps: a backend like OpenRLHF, driven by the same planner.

Each step: the scheduler's planner plans (its predictor has seen only earlier steps); the prefill actor, if
the plan deduplicates, prefills each shared prefix once and ships the KV to the decode actors; every decode
actor runs vLLM-style continuous batching (at most ``max_num_seqs`` sequences and ``kv_capacity_tokens`` of KV;
FCFS admission, a prefill pause per admission round, recompute preemption of the newest sequence when KV runs
out); at regular checkpoints the migration controller may cut samples and move them, paying a re-prefill of
prompt + generated tokens (mode ``tokens``) or a KV transfer over the link between the two actors' nodes
(mode ``kv``); then scoring, learning and the weight sync take the time the profile gives. The finished
samples go back to the predictor, and a ``StepReport`` bills the step both serverless (each actor from its
start to its last token, plus a cold start) and serverful (every GPU for the whole step).

Between events a decode actor's batch is constant, so k decode steps cost
``k * (a + b*B + c*ctx) + c*B*k*(k-1)/2`` (context grows by B a step): the simulation jumps from event to event.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlhfless_sdk.api.config import SchedulerConfig
from rlhfless_sdk.api.plugins import Registry
from rlhfless_sdk.api.records import (
    ActorProgress,
    CandidateEstimate,
    Cluster,
    FinishedSample,
    MigrationDecision,
    SampleProgress,
    StepPlan,
    StepProgress,
    StepReport,
    TimePerTokenProfile,
)
from rlhfless_sdk.planning.costmodel import AnalyticCostModel, shared_prefix_per_prompt
from rlhfless_sdk.planning.planner import StepPlanner
from rlhfless_sdk.simulation.traces import Workload, WorkloadStep

_QUEUED, _RUNNING, _DONE = 0, 1, 2


class _Samples:
    """Per-sample state of one step, as parallel lists (fast scalar access in the event loop)."""

    def __init__(self, step: WorkloadStep, plan: StepPlan) -> None:
        batch = step.batch
        prompt_of = batch.sample_prompt_index()
        self.prompt = prompt_of.tolist()
        self.index_in_group = (np.arange(batch.total_samples) - batch.sample_offsets[prompt_of]).tolist()
        self.prompt_len = batch.prompt_lengths[prompt_of].tolist()
        self.shared = shared_prefix_per_prompt(batch, plan.prefill)[prompt_of].tolist()
        self.target = step.lengths.tolist()
        pred = np.asarray(plan.predicted_lengths, dtype=np.float64)
        self.predicted = pred[prompt_of].tolist() if len(pred) else []
        n = batch.total_samples
        self.state = [_QUEUED] * n
        self.generated = [0] * n  # tokens generated before the current admission
        self.admit_step = [0] * n
        self.actor = list(plan.assignment)
        self.migrations = [0] * n
        self.ready_at = [0.0] * n
        self.prefilled = [False] * n  # first admission prefills only the part not shared via the prefill actor
        self.kv_cached = [False] * n  # migrated with its KV: admission needs no recompute
        self.finish_time = [0.0] * n
        self.finished_lengths: dict[int, list[int]] = {}  # prompt index -> lengths of its finished samples


@dataclass
class _Actor:
    """One decode actor's continuous-batching engine."""

    aid: int
    prof: TimePerTokenProfile
    node: str
    start: float
    t: float = 0.0
    S: int = 0  # decode steps so far
    B: int = 0  # running sequences
    ctx: int = 0  # KV tokens held by running sequences
    busy: float = 0.0
    generated: int = 0  # tokens generated on this actor
    planned: float = 0.0
    last_token: float = 0.0
    first: float = 0.0  # when it first admitted work: serverless billing starts here
    used: bool = False
    waiting: deque[int] = field(default_factory=deque)
    heap: list[tuple[int, int]] = field(default_factory=list)  # (finish step, sample)
    stack: list[int] = field(default_factory=list)  # running samples, newest last (preemption order)
    preemptions: int = 0
    blocked: bool = False  # after a preemption, admit nothing until a running sequence finishes

    def __post_init__(self) -> None:
        self.t = self.start

    def gen_now(self, s: _Samples, sid: int) -> int:
        return s.generated[sid] + (self.S - s.admit_step[sid])

    def _admit(self, s: _Samples) -> None:
        p = self.prof
        new_tok = cached_tok = 0
        admitted = 0
        if self.blocked and self.B > 0:
            return
        self.blocked = False
        while self.waiting and p.max_num_seqs > self.B:
            sid = self.waiting[0]
            if s.ready_at[sid] > self.t:
                if self.B == 0 and admitted == 0:
                    self.t = s.ready_at[sid]  # idle until the migrated sample's KV arrives
                else:
                    break
            need = s.prompt_len[sid] + s.generated[sid]
            if self.B > 0 and self.ctx + need > p.kv_capacity_tokens:
                break
            self.waiting.popleft()
            if s.kv_cached[sid]:
                cached_tok += need
                s.kv_cached[sid] = False
            elif not s.prefilled[sid]:
                new_tok += need - s.shared[sid]
                cached_tok += s.shared[sid]
            else:  # preempted or migrated by tokens: recompute prompt + generated
                new_tok += need
            s.prefilled[sid] = True
            s.state[sid] = _RUNNING
            s.admit_step[sid] = self.S
            s.actor[sid] = self.aid
            heapq.heappush(self.heap, (self.S + max(s.target[sid] - s.generated[sid], 0), sid))
            self.stack.append(sid)
            self.B += 1
            self.ctx += need
            admitted += 1
        if admitted:
            if not self.used:
                self.first = self.t
            dt = p.prefill_base_s + p.prefill_per_new_token_s * new_tok + p.prefill_per_cached_token_s * cached_tok
            self.t += dt
            self.busy += dt
            self.used = True

    def _valid(self, s: _Samples, finish: int, sid: int) -> bool:
        return (
            s.state[sid] == _RUNNING
            and s.actor[sid] == self.aid
            and finish == s.admit_step[sid] + max(s.target[sid] - s.generated[sid], 0)
        )

    def _remove_running(self, s: _Samples, sid: int) -> int:
        """Take a running sample off this actor (preemption or migration); returns its generated tokens."""
        g = self.gen_now(s, sid)
        s.generated[sid] = g
        s.state[sid] = _QUEUED
        self.B -= 1
        self.ctx -= s.prompt_len[sid] + g
        self.stack.remove(sid)
        return g

    def idle(self) -> bool:
        return self.B == 0 and not self.waiting

    def run_until(self, s: _Samples, limit: float) -> None:
        """Advance this actor's engine until its clock reaches ``limit`` or it runs out of work."""
        p = self.prof
        while self.t < limit:
            self._admit(s)
            if self.B == 0:
                return
            while self.heap and not self._valid(s, *self.heap[0]):
                heapq.heappop(self.heap)
            k = self.heap[0][0] - self.S
            if k > 0 and self.B > 1 and self.ctx + self.B * k > p.kv_capacity_tokens:
                k = (p.kv_capacity_tokens - self.ctx) // self.B
                if k <= 0:  # KV full: preempt the newest sequence; it is recomputed once a sequence finishes
                    sid = self.stack[-1]
                    self._remove_running(s, sid)
                    self.waiting.appendleft(sid)
                    self.preemptions += 1
                    self.blocked = True
                    continue
            A = p.decode_base_s + p.decode_per_seq_s * self.B + p.decode_per_ctx_token_s * self.ctx
            C = p.decode_per_ctx_token_s * self.B
            dt = k * A + C * k * (k - 1) / 2.0
            if self.t + dt > limit:  # partial advance: the most whole steps that fit before the limit
                room = limit - self.t
                if C > 0:
                    h = A - C / 2.0
                    k = int((-h + math.sqrt(h * h + 2.0 * C * room)) / C)
                else:
                    k = int(room / A) if A > 0 else k
                k = max(0, min(k, self.heap[0][0] - self.S - 1))
                if k == 0:
                    return
                dt = k * A + C * k * (k - 1) / 2.0
            self.t += dt
            self.busy += dt
            self.S += k
            self.ctx += self.B * k
            self.generated += self.B * k
            while self.heap and self.heap[0][0] <= self.S:
                finish, sid = heapq.heappop(self.heap)
                if not self._valid(s, finish, sid):
                    continue
                s.state[sid] = _DONE
                s.generated[sid] = s.target[sid]
                s.finish_time[sid] = self.t
                s.finished_lengths.setdefault(s.prompt[sid], []).append(s.target[sid])
                self.B -= 1
                self.ctx -= s.prompt_len[sid] + s.target[sid]
                self.stack.remove(sid)
                self.last_token = self.t
                self.blocked = False


@dataclass
class SimulatedStep:
    """A step's report plus what the simulator saw that the report does not hold."""

    report: StepReport
    plan: StepPlan
    chosen: CandidateEstimate | None
    preemptions: int = 0
    frontier: list[dict] | None = None  # every candidate N: predicted and simulated (time, GPU-seconds)


@dataclass
class SimulationResult:
    scheduler: str
    steps: list[SimulatedStep]

    @property
    def reports(self) -> list[StepReport]:
        return [s.report for s in self.steps]

    def totals(self) -> dict[str, float]:
        r = self.reports
        return {
            "total_time_s": sum(x.time_s for x in r),
            "total_generation_s": sum(x.generation_s for x in r),
            "total_gpu_seconds": sum(x.gpu_seconds for x in r),
            "total_gpu_seconds_serverful": sum(x.gpu_seconds_serverful for x in r),
            "migrations": sum(x.migrations for x in r),
            "prefill_tokens_saved": sum(x.prefill_tokens_saved for x in r),
            "mean_idle_fraction": float(np.mean([x.idle_fraction for x in r])) if r else 0.0,
        }


class Simulator:
    """Runs a scheduler over a workload on a simulated cluster; see the module docstring for the model."""

    def __init__(
        self,
        profile: TimePerTokenProfile,
        cluster: Cluster,
        *,
        registry: Registry,
        max_tokens: int | None = None,
        checks_per_step: int = 40,
    ) -> None:
        self.profile = profile
        self.cluster = cluster
        self.registry = registry
        self.max_tokens = max_tokens
        self.checks_per_step = checks_per_step
        self.cost_model = AnalyticCostModel(profile)

    def planner(self, config: SchedulerConfig) -> StepPlanner:
        # Colocated learner (as verl and OpenRLHF's --colocate_all run): it takes no GPU during generation and
        # scores and learns on every GPU afterwards.
        return StepPlanner(
            config,
            cluster=self.cluster,
            cost_model=self.cost_model,
            registry=self.registry,
            gpus_per_actor=self.profile.gpus_per_actor,
            learner_gpus=0,
        )

    def run(
        self,
        config: SchedulerConfig,
        workload: Workload,
        on_step: Callable[[StepReport], Any] | None = None,
        frontier: bool = False,
    ) -> SimulationResult:
        planner = self.planner(config)
        steps = []
        for ws in workload.steps:
            sim = self.step(planner, ws, frontier=frontier)
            steps.append(sim)
            if on_step is not None:
                on_step(sim.report)
        return SimulationResult(config.name, steps)

    # -- one step ----------------------------------------------------------------------------------------
    def step(self, planner: StepPlanner, ws: WorkloadStep, frontier: bool = False) -> SimulatedStep:
        plan = planner.plan(ws.batch, step=ws.step)
        report, s, preemptions = self.execute(planner, ws, plan)
        self.last_samples = s  # for tests and debugging: the per-sample state of the latest step
        planner.observe(self._finished(ws, s))
        chosen = next((e for e in plan.candidates if e.num_actors == plan.num_actors), None)
        front = self.frontier(planner, ws, plan, report) if frontier else None
        return SimulatedStep(report, plan, chosen, preemptions, front)

    def frontier(self, planner: StepPlanner, ws: WorkloadStep, plan: StepPlan, report: StepReport) -> list[dict]:
        """Every candidate actor count: the cost model's (time, GPU-seconds) and the simulated ones."""
        out = []
        for e in sorted(plan.candidates, key=lambda e: e.num_actors):
            n = e.num_actors
            if n == plan.num_actors:
                sim = report
            else:
                actor = planner.last_assignments[n]
                loads = np.bincount(actor, weights=np.repeat(plan.predicted_lengths, ws.batch.n_samples), minlength=n)
                extra = planner.extra_actors(plan.prefill)
                try:
                    placement = planner.policies["placer"].place(
                        loads, self.cluster, self.profile.gpus_per_actor, extra
                    )
                except Exception:
                    placement = planner.baseline("placer").place(
                        loads, self.cluster, self.profile.gpus_per_actor, extra
                    )
                variant = plan.model_copy(
                    update={"num_actors": n, "assignment": actor.tolist(), "placement": placement}
                )
                sim, _, _ = self.execute(planner, ws, variant)
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

    def execute(self, planner: StepPlanner, ws: WorkloadStep, plan: StepPlan) -> tuple[StepReport, _Samples, int]:
        """Run one step of ``plan``; the report, the per-sample state and the preemption count."""
        prof = self.profile
        s = _Samples(ws, plan)
        n = plan.num_actors
        node_of = {(p.actor.role, p.actor.actor_id): p.node for p in plan.placement}

        # The prefill actor prefills each distinct shared prefix once, actor by actor (heaviest first), and ships
        # each actor's prefixes as soon as they are done: a decode actor starts when its own prefixes arrive.
        prefill_s = 0.0
        start = np.zeros(n)
        if plan.prefill.prompt_group:
            group = np.asarray(plan.prefill.prompt_group)[np.asarray(s.prompt, dtype=np.int64)]
            prefix = np.asarray(plan.prefill.group_prefix_tokens, dtype=np.float64)
            sample_actor = np.asarray(plan.assignment, dtype=np.int64)
            load = np.bincount(sample_actor, weights=np.asarray(s.predicted), minlength=n)
            done = np.zeros(len(prefix), dtype=bool)
            # groups share template blocks: the prefill actor's real work is the prefix tree, D tokens in all
            scale = plan.prefill.prefill_actor_tokens / max(float(prefix.sum()), 1.0)
            clock = prof.prefill_base_s
            for a in np.argsort(-load, kind="stable").tolist():
                groups = np.unique(group[sample_actor == a])
                if groups.size == 0:
                    continue
                todo = groups[~done[groups]]
                done[todo] = True
                clock += prof.prefill_per_new_token_s * scale * float(prefix[todo].sum())
                gbytes = float(prefix[groups].sum()) * prof.kv_bytes_per_token / 1e9
                start[a] = clock + gbytes / self._bandwidth(node_of.get(("prefill", 0)), node_of.get(("decode", a)))
            prefill_s = clock
        actors = [_Actor(a, prof, node_of.get(("decode", a), ""), float(start[a])) for a in range(n)]
        pred = s.predicted
        for sid, a in enumerate(plan.assignment):
            actors[a].waiting.append(sid)
            actors[a].planned += pred[sid]

        migrations = 0
        controller = planner.migration
        if config_migrates(planner.config):
            chosen = next((e for e in plan.candidates if e.num_actors == n), None)
            interval = max((chosen.time_s if chosen else 1.0) / self.checks_per_step, 1e-3)
            tau = float(start.max(initial=0.0)) + interval
            checks = 0
            while True:
                for actor in actors:
                    actor.run_until(s, tau)
                if all(a.idle() for a in actors):
                    break
                decisions = controller.decide(self._progress(ws, s, actors, tau))
                migrations += self._apply(ws, s, actors, decisions, tau)
                checks += 1
                if checks % (4 * self.checks_per_step) == 0:
                    interval *= 2  # the plan was far off: check less often rather than forever
                tau += interval
        else:
            for actor in actors:
                actor.run_until(s, math.inf)

        report = self._report(planner, ws, plan, s, actors, prefill_s, migrations)
        return report, s, sum(a.preemptions for a in actors)

    def _bandwidth(self, a: str | None, b: str | None) -> float:
        gbps = self.profile.intra_node_gbps if a is not None and a == b else self.profile.inter_node_gbps
        return gbps

    def _progress(self, ws: WorkloadStep, s: _Samples, actors: Sequence[_Actor], now: float) -> StepProgress:
        cap = self.max_tokens or int(max(s.target, default=1)) or 1
        uids = ws.batch.uids
        act, unfinished, prompts = [], [], set()
        for a in actors:
            act.append(
                ActorProgress.model_construct(
                    actor_id=a.aid,
                    planned_tokens=a.planned,
                    generated_tokens=a.generated,
                    running=a.B,
                    waiting=len(a.waiting),
                    free_slots=max(0, self.profile.max_num_seqs - a.B - len(a.waiting)),
                )
            )
            for sid in a.stack:
                unfinished.append(
                    SampleProgress.model_construct(
                        uid=uids[s.prompt[sid]],
                        sample_index=s.index_in_group[sid],
                        actor_id=a.aid,
                        tokens_generated=a.gen_now(s, sid),
                        predicted_length=s.predicted[sid],
                        max_tokens=max(cap, 1),
                        migrations=s.migrations[sid],
                        planned_length=s.predicted[sid],
                    )
                )
                prompts.add(s.prompt[sid])
        finished = {uids[p]: s.finished_lengths[p] for p in prompts if p in s.finished_lengths}
        return StepProgress.model_construct(
            step=ws.step,
            elapsed_s=now,
            total_samples=ws.batch.total_samples,
            actors=act,
            unfinished=unfinished,
            finished=finished,
        )

    def _apply(
        self, ws: WorkloadStep, s: _Samples, actors: Sequence[_Actor], decisions: list[MigrationDecision], now: float
    ) -> int:
        """Cut each decided sample off its actor and queue it first on the destination, tokens and all."""
        if not decisions:
            return 0
        prompt_index = {uid: i for i, uid in enumerate(ws.batch.uids)}
        offsets = ws.batch.sample_offsets
        moved = 0
        for d in decisions:
            sid = int(offsets[prompt_index[d.uid]]) + d.sample_index
            src, dest = actors[d.from_actor], actors[d.to_actor]
            if s.state[sid] != _RUNNING or s.actor[sid] != src.aid:
                continue  # the controller checked the snapshot; the sample cannot have moved since
            g = src._remove_running(s, sid)
            s.migrations[sid] += 1
            if d.mode == "kv":  # move the KV over the link: no recompute, but it arrives later
                gb = (s.prompt_len[sid] + g) * self.profile.kv_bytes_per_token / 1e9
                s.ready_at[sid] = now + gb / self._bandwidth(src.node, dest.node)
                s.kv_cached[sid] = True
            else:  # resubmit prompt + generated tokens: the destination recomputes them
                s.ready_at[sid] = now
            if dest.idle():  # an actor that had finished wakes up now; a busy one keeps its own clock
                dest.t = max(dest.t, now)
            dest.waiting.appendleft(sid)
            moved += 1
        return moved

    def _finished(self, ws: WorkloadStep, s: _Samples) -> list[FinishedSample]:
        uids = ws.batch.uids
        return [
            FinishedSample.model_construct(
                uid=uids[s.prompt[sid]],
                sample_index=s.index_in_group[sid],
                prompt_length=s.prompt_len[sid],
                response_length=s.target[sid],
                actor_id=s.actor[sid],
                migrations=s.migrations[sid],
                finish_reason="stop",
                predicted_length=s.predicted[sid],
            )
            for sid in range(len(s.target))
        ]

    def _report(
        self,
        planner: StepPlanner,
        ws: WorkloadStep,
        plan: StepPlan,
        s: _Samples,
        actors: Sequence[_Actor],
        prefill_s: float,
        migrations: int,
    ) -> StepReport:
        prof = self.profile
        g = self.cluster.total_gpus
        used = [a for a in actors if a.used]
        generation = max([a.last_token for a in used] + [prefill_s, 0.0])
        tokens = float(sum(s.prompt_len) + sum(s.target))
        prepare = tokens * prof.prepare_gpu_s_per_token / g
        learn = tokens * prof.learn_gpu_s_per_token / g
        time_s = generation + prepare + learn + prof.weight_sync_s
        gpa = prof.gpus_per_actor
        decode_gpu_s = sum((a.last_token - a.first + prof.cold_start_s) * gpa for a in used)
        prefill_gpu_s = prefill_s + prof.cold_start_s if prefill_s else 0.0
        serverless = decode_gpu_s + prefill_gpu_s + g * (prepare + learn + prof.weight_sync_s)
        busy = np.array([a.busy for a in used]) if used else np.zeros(1)
        decode_gpus = max(len(used), 1) * gpa
        idle = 1.0 - float(busy.sum()) * gpa / (decode_gpus * generation) if generation > 0 else 0.0
        pred = np.asarray(s.predicted)
        mae = float(np.abs(pred - np.asarray(s.target)).mean()) if len(pred) else 0.0
        return StepReport(
            step=ws.step,
            scheduler=planner.config.name,
            time_s=time_s,
            generation_s=generation,
            prepare_s=prepare,
            learn_s=learn,
            gpu_seconds=serverless,
            gpu_seconds_serverful=g * time_s,
            idle_fraction=min(max(idle, 0.0), 1.0),
            imbalance=float(busy.max() / busy.mean()) if busy.mean() > 0 else 1.0,
            prefill_tokens_saved=plan.prefill.tokens_saved,
            migrations=migrations,
            num_actors=plan.num_actors,
            samples=len(s.target),
            actor_busy_s=[a.busy for a in actors],
            prediction_mae=mae,
            planner_ms=plan.planner_ms,
            fallbacks=plan.fallbacks,
        )


def config_migrates(config: SchedulerConfig) -> bool:
    return config.migrator.name != "none"
