"""OpenRLHF's asynchronous training loop (``--train.async_enable``) as a timeline: when each batch is generated,
trained and its weights broadcast, given how long each part takes; ``AsyncRun``, the simulator's run of it.

Two processes share the rollout engines, as in OpenRLHF 0.11.2's ``PPOTrainerAsync``:

- the generator takes a slot from a pool of ``queue_size`` (the bound on batches generated ahead), generates
  batch k and queues it;
- the trainer takes batch k from the queue (returning its slot, so the generator may start the next batch),
  trains on it, then broadcasts the new weights to the engines.

Without partial rollout a vLLM lock keeps generation and broadcast apart: a broadcast waits for the batch
being generated to finish, and a batch waits for a broadcast under way. With partial rollout the generator
takes no lock: the broadcast pauses the engines, and generation goes on with the new weights afterwards.

Weights start at version 0; the broadcast after training batch j installs version j + 1. Batch k trains on
version k, so a token generated under version v is ``k - v`` updates old.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from rlhfless_sdk.api.config import SchedulerConfig
from rlhfless_sdk.api.errors import RlhflessError
from rlhfless_sdk.api.records import (
    Cluster,
    StepPlan,
)
from rlhfless_sdk.planning.planner import rollout_planner_for
from rlhfless_sdk.rollout.billing import billing, covered, stopped_at, window_gpu_seconds
from rlhfless_sdk.rollout.controller import StepOutcome
from rlhfless_sdk.rollout.drivers import Driven, PlainStep, session_for
from rlhfless_sdk.rollout.modes import BATCH_CUT, PLAIN, Mode
from rlhfless_sdk.simulation.backend import WorkloadIO
from rlhfless_sdk.simulation.results import OnStep, SimulatedStep, SimulationResult, carried_ages
from rlhfless_sdk.workloads.traces import Workload


@dataclass
class BatchTimes:
    """One batch's life on the pipeline's clock (seconds from the start of the run)."""

    gen_start: float = 0.0
    gen_end: float = 0.0
    train_start: float = 0.0
    train_end: float = 0.0
    sync_start: float = 0.0
    sync_end: float = 0.0
    version: int = 0  # weights the engines held when the batch started generating
    pauses: list[tuple[float, float]] = field(default_factory=list)  # broadcasts (start, end) while it generated


#: generate(k, start, pauses) -> when batch k's last sample finished, its generation started at ``start`` and
#: paused for each broadcast in ``pauses`` (absolute (start, end), partial rollout only) still running then.
Generate = Callable[[int, float, list[tuple[float, float]]], float]


def partial_pipeline(
    steps: int, generate: Generate, train_s: Sequence[float], sync_s: float, queue_size: int
) -> list[BatchTimes]:
    """Partial rollout: no lock, so the trainer's broadcasts depend only on batches generated before; each
    batch is generated through the broadcasts that fall in its window."""
    out: list[BatchTimes] = []
    for k in range(steps):
        b = BatchTimes()
        slot = out[k - queue_size].train_start if k >= queue_size else 0.0
        b.gen_start = max(out[k - 1].gen_end if k else 0.0, slot)
        b.version = sum(1 for j in out if j.sync_end <= b.gen_start)
        b.pauses = [(j.sync_start, j.sync_end) for j in out if j.sync_end > b.gen_start]
        b.gen_end = generate(k, b.gen_start, b.pauses)
        b.train_start = max(b.gen_end, out[k - 1].sync_end if k else 0.0)
        b.train_end = b.train_start + train_s[k]
        b.sync_start, b.sync_end = b.train_end, b.train_end + sync_s
        out.append(b)
    return out


def locked_pipeline(
    steps: int, generate: Generate, train_s: Sequence[float], sync_s: float, queue_size: int
) -> list[BatchTimes]:
    """No partial rollout: generation and broadcast hold one FIFO lock, so each is atomic; a small event loop."""
    return _LockedTimeline(steps, generate, train_s, sync_s, queue_size).run()


class _LockedTimeline:
    """``locked_pipeline``'s event loop: a heap of (time, order, event, batch); one lock, held by a batch generating
    or a broadcast (FIFO); ``queue_size`` slots for batches generated ahead of training."""

    def __init__(
        self, steps: int, generate: Generate, train_s: Sequence[float], sync_s: float, queue_size: int
    ) -> None:
        self.steps, self.generate, self.train_s, self.sync_s = steps, generate, train_s, sync_s
        self.out = [BatchTimes() for _ in range(steps)]
        self.events: list[tuple[float, int, str, int]] = []
        self.seq = 0
        self.slots, self.queue, self.waiting = queue_size, deque[int](), deque[tuple[str, int]]()
        self.holder: tuple[str, int] | None = None
        self.next_batch, self.version, self.trainer_idle, self.wants_slot = 0, 0, True, False

    def push(self, t: float, kind: str, k: int = -1) -> None:
        heapq.heappush(self.events, (t, self.seq, kind, k))
        self.seq += 1

    def grant(self, who: tuple[str, int], now: float) -> None:
        self.holder = who
        kind, k = who
        if kind == "gen":
            b = self.out[k]
            b.gen_start, b.version = now, self.version
            b.gen_end = self.generate(k, now, [])
            self.push(b.gen_end, "gen_done", k)
        else:
            self.out[k].sync_start = now
            self.push(now + self.sync_s, "sync_done", k)

    def lock(self, who: tuple[str, int], now: float) -> None:
        if self.holder is None:
            self.grant(who, now)
        else:
            self.waiting.append(who)

    def unlock(self, now: float) -> None:
        self.holder = None
        if self.waiting:
            self.grant(self.waiting.popleft(), now)

    def try_train(self, now: float) -> None:
        if self.trainer_idle and self.queue:
            k = self.queue.popleft()
            self.trainer_idle = False
            self.slots += 1
            if self.wants_slot:
                self.wants_slot = False
                self.push(now, "gen_ready")
            self.out[k].train_start = now
            self.out[k].train_end = now + self.train_s[k]
            self.push(self.out[k].train_end, "train_done", k)

    def run(self) -> list[BatchTimes]:
        self.push(0.0, "gen_ready")
        while self.events:
            now, _, kind, k = heapq.heappop(self.events)
            if kind == "gen_ready":
                if self.next_batch == self.steps:
                    continue
                if self.slots == 0:
                    self.wants_slot = True
                    continue
                self.slots -= 1
                self.lock(("gen", self.next_batch), now)
                self.next_batch += 1
            elif kind == "gen_done":
                self.unlock(now)
                self.queue.append(k)
                self.try_train(now)
                self.push(now, "gen_ready")
            elif kind == "train_done":
                self.lock(("sync", k), now)
            elif kind == "sync_done":
                self.out[k].sync_end = now
                self.version += 1
                self.unlock(now)
                self.trainer_idle = True
                self.try_train(now)
        return self.out


def token_ages(batch: int, version: int, tokens_before_pauses: Sequence[int], total: int) -> tuple[int, int]:
    """(stale tokens, largest age) of batch ``batch`` that started under weights ``version`` and was paused for a
    broadcast after ``tokens_before_pauses[i]`` of its ``total`` tokens (each pause installs the next version)."""
    bounds = [*tokens_before_pauses, total]
    stale, oldest, prev = 0, 0, 0
    for i, upto in enumerate(bounds):
        n = upto - prev
        age = batch - (version + i)
        if n > 0 and age > 0:
            stale += n
            oldest = max(oldest, age)
        prev = upto
    return stale, oldest


# -- the async pipeline run on the simulator --------------------------------------------------------------------------
class AsyncRun:
    """The ``Simulator``'s run of OpenRLHF's async pipeline (a mixin: its methods use the simulator's engines, clock
    and learner)."""

    def run_async(
        self,
        config: SchedulerConfig,
        workload: Workload,
        on_step: OnStep,
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
        if mode.driver not in (PLAIN, BATCH_CUT):
            raise RlhflessError(
                f"scheduler {config.name!r}: the {mode.driver} step driver inside the async pipeline is not simulated; "
                "partial rollouts cut at B groups (partial-batch) are"
            )
        run = AsyncBatches(self, config, workload, r, mode)
        pipe = config.pipeline
        timeline = partial_pipeline if pipe.partial_rollout else locked_pipeline
        times = timeline(run.batches, run.generate, run.train_s, self.dedicated.weight_sync_s, pipe.queue_size)
        steps = []
        for step in run.steps(times):
            steps.append(step)
            if on_step is not None:
                on_step(step.report)
        return SimulationResult(config.name, steps, rollout_gpus=r)


class AsyncBatches:
    """One run of OpenRLHF's async pipeline on a simulator (its explicit context: the simulator's engines, clock
    and learner, the scheduler, the workload, the ``r`` rollout GPUs): each batch generated when the timeline asks
    (``generate``, plain steps or batches cut at B groups), then every batch's step report billed on the run's
    clock (``steps``)."""

    def __init__(self, sim: Any, config: SchedulerConfig, workload: Workload, r: int, mode: Mode) -> None:
        self.sim, self.config, self.workload, self.r = sim, config, workload, r
        g, prof = sim.cluster.total_gpus, sim.dedicated
        nodes = sim.cluster.nodes
        self.gen_cluster = Cluster.of_gpus(r, min(r, nodes[0].num_gpus if nodes else r))
        self.learners = g - r
        # OpenRLHF 0.11.2 refuses vLLM sleep with --train.async_enable: the engines hold GPUs of their own
        self.planner = rollout_planner_for(config, prof, r, self.gen_cluster.nodes[0].num_gpus, sim.registry)
        self.token_counts = [
            float(ws.batch.prompt_lengths @ ws.batch.n_samples + ws.lengths.sum()) for ws in workload.steps
        ]
        self.batches = len(workload.steps)
        self.io = WorkloadIO(sim, self.planner, workload.steps)
        self.session = None
        if mode.driver == BATCH_CUT:  # partial rollouts inside the pipeline: each batch cut once B groups are complete
            b_size = max((len(ws.batch) for ws in workload.steps), default=0)
            self.session = session_for(BATCH_CUT, self.planner, b_size, self.io.prompts())
            self.io.book = self.session.book
            prompts = sum(len(ws.batch) for ws in workload.steps)
            self.batches = -(-prompts // b_size) if b_size else 0  # every batch but the last trains B groups
            self.token_counts = [0.0] * self.batches  # what each batch trains: known once it is generated
        self.train_s = [sum(sim._learning(t, self.learners)) for t in self.token_counts]
        self.done: dict[int, tuple[StepPlan, StepOutcome, list[int]]] = {}
        self.driven_of: dict[int, Driven] = {}

    def generate(self, k: int, start: float, pauses: list[tuple[float, float]]) -> float:
        """Batch ``k`` generated from ``start``, paused for the broadcasts in ``pauses``; when it ends."""
        sim, io = self.sim, self.io
        relative = [(max(a - start, 0.0), b - max(a, start)) for a, b in pauses if b > start]
        frees = not self.config.pipeline.pause_keeps_kv  # OpenRLHF's own engines pause with vLLM's default: freed
        io.backend_kw = {
            "cluster": self.gen_cluster,
            "pauses": relative,
            "pause_frees_kv": frees,
            "profile": sim.dedicated,
        }
        if self.session is None:  # the batch the workload gives, every sample to its end
            ws = self.workload.steps[k]
            io.begin(ws.step)
            driven = PlainStep(self.planner, ws.step).run(io, io.adopt(ws.batch, ws.lengths))
        else:
            io.begin(k)
            cut = self.session.next(io, k)
            if cut is None:
                raise RlhflessError(
                    f"scheduler {self.config.name!r}: batch {k} of {self.batches} found nothing to generate"
                )
            driven = self.driven_of[k] = cut
            self.token_counts[k] = float(driven.trained_tokens)
            self.train_s[k] = sum(sim._learning(self.token_counts[k], self.learners))
        usage = stopped_at(driven.outcome.usage, driven.stop_s)
        sim.hold(self.planner, usage)  # no burst engine here: the fleet's engines that worked stay warm
        assert io.last_backend is not None
        self.done[k] = (driven.plan, replace(driven.outcome, usage=usage), io.last_backend.tokens_before_pauses)
        return start + usage.generation_s

    def steps(self, times: list[BatchTimes]) -> list[SimulatedStep]:
        """Each batch's step, spanning the time between two weight broadcasts (k - 1's and k's) and billing what
        happened in that window: the engines from their first work to their last token on any batch, the learners
        while they train, every GPU during a broadcast; its ``generation_s`` is the time in the window during which
        some batch was generating."""
        g, gpa, learners = self.sim.cluster.total_gpus, self.sim.dedicated.gpus_per_actor, self.learners
        # what each GPU did on the run's clock: engine e's work on every batch, the learners', the broadcasts
        engine_spans: dict[int, list[tuple[float, float]]] = {}
        for k, b in enumerate(times):
            for e, usage in enumerate(self.done[k][1].usage.engines):
                if usage.first_s is not None:
                    engine_spans.setdefault(e, []).append(
                        (b.gen_start + usage.first_s - usage.cold_start_s, b.gen_start + usage.last_s)
                    )
        syncs = [(b.sync_start, b.sync_end) for b in times]
        trains = [(learners, (b.train_start, b.train_end)) for b in times]
        gens = [(b.gen_start, b.gen_end) for b in times]
        idle_engines = self.r // gpa - len(engine_spans)  # never worked: held during broadcasts only
        held = [[*spans, *syncs] for spans in engine_spans.values()] + [syncs] * idle_engines
        out = []
        for k, b in enumerate(times):
            plan, outcome, before = self.done[k]
            rep, u = outcome.report, outcome.usage
            total, stale, oldest = self.ages(k, b, before, times)
            if k in self.driven_of:  # a cut batch: what trains
                rep = rep.model_copy(update=self.driven_of[k].fields)
            lo, hi = (times[k - 1].sync_end if k else 0.0), b.sync_end
            prepare_s, learn_s = self.sim._learning(self.token_counts[k], learners)
            usage = replace(u, gpus=g, learner_gpus=learners, prepare_s=prepare_s, learn_s=learn_s, step_s=hi - lo)
            billed = window_gpu_seconds(lo, hi, held, gpa, trains, (learners, syncs))
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
            out.append(SimulatedStep.of(report, plan, outcome, usage=usage))
        return out

    def ages(self, k: int, b: BatchTimes, before: list[int], times: list[BatchTimes]) -> tuple[int, int, int]:
        """Batch ``k``'s tokens, the stale ones and the largest age: a cut batch's each piece aged from the batch
        that made it; a plain one's from the broadcasts it was paused for."""
        if k in self.driven_of:
            return carried_ages(self.driven_of[k], k, times)
        total = int(self.workload.steps[k].lengths.sum())
        stale, oldest = token_ages(k, b.version, before, total)
        return total, stale, oldest
