"""The rollout-step controller: one step's life, written once for every backend.

A step starts from a plan (``StepPlanner.plan``). The controller dispatches each sample to an engine, polls
the backend for finished samples and lost engines, re-dispatches what a dead engine held, builds the progress
snapshots the migrator sees, applies its cut-and-migrate decisions, regroups every prompt's n samples
adjacent and in batch order, and writes the ``StepReport``. A backend only starts, cuts, continues and polls
work on engines: the simulator is one (a simulated clock), the OpenRLHF adapter's generator another (Ray
actors, vLLM engines). So every report figure has one formula, and this logic is tested without Ray.

Sample ids are positions in batch order (prompt after prompt, each prompt's samples in index order): sample
``batch.sample_offsets[i] + k`` is prompt i's k-th sample.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from rlhfless_sdk.api.batch import PromptBatch
from rlhfless_sdk.api.errors import RlhflessError
from rlhfless_sdk.api.records import (
    ActorProgress,
    FinishedSample,
    SampleProgress,
    StepPlan,
    StepProgress,
    StepReport,
)
from rlhfless_sdk.planning.planner import StepPlanner
from rlhfless_sdk.rollout.billing import StepUsage, billing

log = logging.getLogger("rlhfless.rollout")


class SampleAccountingError(RlhflessError):
    """A backend reported a sample the step does not hold, or twice: the step's output would corrupt training."""


class NoEngineLeft(RlhflessError):
    """Every engine of the step died; the samples they held cannot be generated."""


# -- what a backend reports --------------------------------------------------------------------------------
@dataclass(slots=True)
class Finished:
    """A sample finished: ``length`` response tokens in all (every segment, wherever generated)."""

    sample: int
    length: int
    output: Any = None  # what the backend hands back to its caller for this sample (e.g. OpenRLHF's response)
    finish_reason: str = "stop"


@dataclass(slots=True)
class Lost:
    """A sample's engine died. ``tokens_kept`` of its tokens survive (held by the backend since a cut); the
    controller re-dispatches it from there, or from scratch when 0."""

    sample: int
    tokens_kept: int = 0


@dataclass
class Poll:
    finished: list[Finished] = field(default_factory=list)
    lost: list[Lost] = field(default_factory=list)
    dead_engines: list[int] = field(default_factory=list)


@dataclass(slots=True)
class EngineStatus:
    """One engine at a progress check: tokens it generated this step, and its running samples (sample id ->
    tokens generated so far, in the engine's admission order)."""

    generated_tokens: int
    running: dict[int, int]
    waiting: int = 0  # samples the engine holds but does not run (queued, preempted); 0 if the backend cannot say


class RolloutBackend(Protocol):
    """What a backend does for the controller; all sample ids are the controller's (batch positions)."""

    max_num_seqs: int  # sequences one engine runs at once (free slots in progress snapshots)
    max_tokens: int  # the most response tokens a sample may have
    kv_capacity_tokens: int  # tokens one engine's KV cache holds (0: not known), in progress snapshots

    def engines(self) -> list[int]:
        """Engines that can take work now, in order (the plan's actor a runs on ``engines()[a % len]``)."""
        ...

    def start(self, samples: Sequence[int], engines: Sequence[int]) -> None:
        """Start each sample from its prompt on the engine beside it (samples in batch order)."""
        ...

    def poll(self) -> Poll:
        """Let work proceed until the next check (the simulator: a clock tick; a real backend: a short wait)."""
        ...

    def progress(self) -> dict[int, EngineStatus]:
        """Every live engine's status now (called only when the scheduler migrates)."""
        ...

    def cut(self, engine: int, sample: int) -> int | None:
        """Stop a running sample and keep its tokens; how many it generated, or None if it is not running there."""
        ...

    def cut_all(self, running: Sequence[tuple[int, int]]) -> list[int | None]:
        """The step ends: cut every (engine, sample) of ``running`` as ``cut`` does, answering for each in order;
        a real backend sends them all in one round instead of a round trip each."""
        ...

    def resume(self, engine: int, sample: int, mode: str = "tokens") -> None:
        """Continue a cut sample (or one whose engine died after a cut) on ``engine``, from the tokens it kept:
        re-prefilled (``tokens``) or with its KV shipped (``kv``)."""
        ...

    def carry(self, engine: int, sample: int) -> None:
        """The step ended: keep a just-cut sample's tokens for a later step instead of resuming it (needed only by
        ``StepController.run(stop=...)``; the backend never reports it finished in this step)."""
        ...

    def now(self) -> float:
        """Seconds since the step started."""
        ...

    def usage(self) -> StepUsage:
        """The step's accounting, once every sample finished."""
        ...


# -- the outcome -------------------------------------------------------------------------------------------
@dataclass
class StepOutcome:
    report: StepReport
    samples: list[FinishedSample]  # batch order: each prompt's samples adjacent, in sample order
    outputs: list[Any]  # the backend's output per sample, same order
    segments: list[list[tuple[int, int]]]  # per sample: (engine, tokens) generated there, in order; sums to its length
    usage: StepUsage
    carried: list[int] = field(default_factory=list)  # samples cut when the step ended (``run(stop=...)``)


_WAITING, _DONE, _CARRIED = 0, 1, 2


@dataclass(frozen=True)
class _Layout:
    """The batch's samples as a step sees them: each sample's prompt (batch position), its index in its group and
    its predicted length; each prompt's position by uid and its length-history key."""

    prompt: list[int]
    index_in_group: list[int]
    predicted: list[float]
    prompt_index: dict[str, int]
    history_uids: list[str]

    @classmethod
    def of(cls, batch: PromptBatch, plan: StepPlan, history_uids: Sequence[str] | None) -> _Layout:
        prompt_of = batch.sample_prompt_index()
        index_in_group = (np.arange(batch.total_samples) - batch.sample_offsets[prompt_of]).tolist()
        pred = np.asarray(plan.predicted_lengths, dtype=np.float64)
        predicted: list[float] = pred[prompt_of].tolist() if len(pred) else []
        uids = list(history_uids) if history_uids is not None else list(batch.uids)
        return cls(prompt_of.tolist(), index_in_group, predicted, {u: i for i, u in enumerate(batch.uids)}, uids)


@dataclass
class _Made:
    """What each sample made: its pieces (engine, tokens), its length, why it finished, the backend's output."""

    segments: list[list[tuple[int, int]]]
    length: list[int]
    finish_reason: list[str]
    outputs: list[Any]

    @classmethod
    def of(cls, n: int) -> _Made:
        return cls([[] for _ in range(n)], [0] * n, ["stop"] * n, [None] * n)


class StepController:
    """Runs one step of ``plan`` over ``batch`` on ``backend``; ``run()`` returns the ``StepOutcome``."""

    def __init__(
        self,
        planner: StepPlanner,
        backend: RolloutBackend,
        batch: PromptBatch,
        plan: StepPlan,
        *,
        step: int = 0,
        history_uids: Sequence[str] | None = None,
    ) -> None:
        self.planner, self.backend, self.batch, self.plan, self.step = planner, backend, batch, plan, step
        self.layout = _Layout.of(batch, plan, history_uids)
        n = batch.total_samples
        self.state = [_WAITING] * n
        self.engine = [-1] * n
        self.kept = [0] * n  # tokens kept from earlier segments (cuts)
        self.sample_migrations = [0] * n
        self.made = _Made.of(n)
        self.pending: dict[int, int] = {}  # engine -> unfinished samples it holds
        self.planned: dict[int, float] = {}  # engine -> predicted tokens of the samples dispatched to it
        self.finished_lengths: dict[int, list[int]] = {}  # prompt -> lengths of its finished samples, in order
        self.unfinished = n
        self.migrations = 0
        self.redispatched = 0
        self.fallbacks: list[str] = list(plan.fallbacks)  # the plan's, and any of the policies run during the step
        self.queue: deque[int] = deque()  # the shared queue: samples not started yet (``plan.pull_buffer``)

    # -- the step --------------------------------------------------------------------------------------------
    def run(self, *, observe: bool = True, stop: Callable[[StepController], bool] | None = None) -> StepOutcome:
        """Dispatch, drive to the end, regroup, report; feed the samples to the predictor when ``observe``.

        ``stop``: an end rule, asked after every poll (e.g. "B groups are complete"). Once it says so, every
        unfinished sample is cut where it is and carried (``backend.carry``: its engine hands back what it has);
        a sample that finishes before its cut lands is finished as usual. ``StepOutcome.carried`` lists them."""
        self.dispatch()
        migrates = self.planner.config.migrates()
        stopped = False
        while self.unfinished:
            poll = self.backend.poll()
            self._finish_all(poll.finished)
            if poll.dead_engines:
                log.info("step %d: engine(s) %s died; re-dispatching what they held", self.step, poll.dead_engines)
            if poll.lost:
                self._redispatch(poll.lost)
            if stopped:
                continue  # only the cuts that had not landed are left to report
            if stop is not None and self.unfinished and stop(self):
                stopped = True
                self._carry_rest()
                continue
            if self.unfinished and migrates:
                self._migrate()
            if self.queue:
                self._pull()
        samples = self._samples()
        if observe:
            self.planner.observe(samples)
        self.planner.warn_slow(self.step, ("migrator", "predictor"))
        usage = self.backend.usage()
        report = self._report(usage)
        if observe:
            self.planner.note_error(report.estimate_error)
        carried = [sid for sid, s in enumerate(self.state) if s == _CARRIED]
        return StepOutcome(report, samples, self.made.outputs, self.made.segments, usage, carried)

    def done_prompts(self) -> list[int]:
        """Prompts (batch positions) all of whose samples have finished, for an end rule."""
        n = self.batch.n_samples
        return [p for p, lengths in self.finished_lengths.items() if len(lengths) == int(n[p])]

    def _carry_rest(self) -> None:
        """The step ends now: cut every unfinished sample and carry it with the tokens it has (a queued one with
        none). A cut that comes back empty-handed (the sample just finished, or its engine died) leaves the
        sample to the next polls."""
        for sid in self.queue:  # never started
            self.state[sid] = _CARRIED
            self.made.finish_reason[sid] = "abort"
            self.unfinished -= 1
        self.queue.clear()
        running = [(self.engine[sid], sid) for sid in range(len(self.state)) if self.state[sid] == _WAITING]
        for (e, sid), tokens in zip(running, self.backend.cut_all(running), strict=True):
            if tokens is None:
                continue
            if tokens < self.kept[sid]:
                raise SampleAccountingError(f"sample {sid} was cut at {tokens} tokens, below the {self.kept[sid]} kept")
            if tokens > self.kept[sid]:
                self.made.segments[sid].append((e, tokens - self.kept[sid]))
            self.kept[sid] = self.made.length[sid] = tokens
            self.state[sid] = _CARRIED
            self.made.finish_reason[sid] = "abort"
            self.pending[e] -= 1
            self.unfinished -= 1
            self.backend.carry(e, sid)

    def dispatch(self) -> None:
        """Start every sample on the engine the plan assigned it (modulo the live engines), in the plan's order;
        with a shared queue (``plan.pull_buffer``), only what the engines take now (``_pull``)."""
        live = self.backend.engines()
        if not live and self.unfinished:
            raise NoEngineLeft("no engine can take work; cannot generate")
        order = self.plan.order or range(len(self.state))  # the assigner's dispatch order, else batch order
        if self.plan.pull_buffer is not None:
            self.queue = deque(order)
            self._pull()
            return
        engines = [live[a % len(live)] for a in self.plan.assignment]
        self._place_all(engines)
        self.backend.start(order, [engines[i] for i in order])

    def _pull(self) -> None:
        """Shared queue: every live engine takes samples from the head of the queue until ``pull_buffer`` of
        them wait there (the engine admits what it has room for), the engines with the fewest pending first;
        rounds repeat while some engine still takes. Each sample is started exactly once."""
        buffer = max(self.plan.pull_buffer or 0, 1)
        while self.queue:
            status = self.backend.progress()
            if not status:
                raise NoEngineLeft(f"every rollout engine has died; {len(self.queue)} queued sample(s) cannot start")
            took = False
            for e in sorted(status, key=lambda x: (self.pending.get(x, 0), x)):
                want = min(buffer - status[e].waiting, len(self.queue))
                if want <= 0:
                    continue
                sids = [self.queue.popleft() for _ in range(want)]
                for sid in sids:
                    self._place(sid, e)
                self.backend.start(sids, [e] * len(sids))
                took = True
            if not took:
                return

    def sample_id(self, uid: str, sample_index: int) -> int:
        i = self.layout.prompt_index.get(uid)
        if i is None or not 0 <= sample_index < int(self.batch.n_samples[i]):
            raise SampleAccountingError(f"sample {uid!r}/{sample_index} belongs to no prompt of step {self.step}")
        return int(self.batch.sample_offsets[i]) + sample_index

    # -- bookkeeping -----------------------------------------------------------------------------------------
    def _place(self, sid: int, engine: int) -> None:
        self.engine[sid] = engine
        self.pending[engine] = self.pending.get(engine, 0) + 1
        self.planned[engine] = self.planned.get(engine, 0.0) + self._still_planned(sid)

    def _still_planned(self, sid: int) -> float:
        """The predicted tokens of a sample not yet generated (it kept some from a cut): what its next engine
        is planned to generate for it, so an engine's done fraction counts the same tokens above and below."""
        return max(self.layout.predicted[sid] - self.kept[sid], 0.0) if self.layout.predicted else 0.0

    def _place_all(self, engines: list[int]) -> None:
        """The initial dispatch, in batch order (the same sums as placing one sample after another)."""
        self.engine = list(engines)
        if not engines:
            return
        e = np.asarray(engines, dtype=np.int64)
        count = np.bincount(e)
        predicted = self.layout.predicted
        planned = np.bincount(e, weights=np.asarray(predicted, dtype=np.float64)) if predicted else 0 * count
        for x in np.flatnonzero(count).tolist():
            self.pending[x] = int(count[x])
            self.planned[x] = float(planned[x])

    def _leave(self, sid: int) -> None:
        self.pending[self.engine[sid]] -= 1

    def _finish_all(self, finished: Sequence[Finished]) -> None:
        state, kept, engine, pending = self.state, self.kept, self.engine, self.pending
        made = self.made
        segments, length, reason, outputs = made.segments, made.length, made.finish_reason, made.outputs
        prompt, by_prompt, n = self.layout.prompt, self.finished_lengths, len(self.state)
        for f in finished:
            sid, tokens = f.sample, f.length
            if not 0 <= sid < n or state[sid] != _WAITING:
                raise SampleAccountingError(f"backend reported sample {sid} finished; it is not pending in this step")
            if tokens < kept[sid]:
                raise SampleAccountingError(f"sample {sid} finished with {tokens} tokens, below the {kept[sid]} kept")
            segments[sid].append((engine[sid], tokens - kept[sid]))
            kept[sid] = length[sid] = tokens
            state[sid] = _DONE
            reason[sid] = f.finish_reason
            outputs[sid] = f.output
            by_prompt.setdefault(prompt[sid], []).append(tokens)
            pending[engine[sid]] -= 1
            self.unfinished -= 1

    def _redispatch(self, lost: Sequence[Lost]) -> None:
        """Samples of a dead engine go to the live engine with the fewest pending samples, a prompt's together;
        a sample that kept tokens from a cut resumes from them, the others start over."""
        live = self.backend.engines()
        fresh: dict[int, list[int]] = {}
        resumed: list[tuple[int, int]] = []
        kept: dict[int, int] = {}  # a sample reported lost twice in one poll (its engine and the engine holding
        for item in lost:  # its cut tokens both died) keeps the fewer tokens: the later report is the truth
            kept[item.sample] = min(kept.get(item.sample, item.tokens_kept), item.tokens_kept)
        for item in (Lost(sid, k) for sid, k in kept.items()):
            sid = item.sample
            if self.state[sid] != _WAITING:
                continue  # finished, or carried (a lost carried sample: the backend no longer has its tokens)
            if not live:
                raise NoEngineLeft(f"every rollout engine has died; {self.unfinished} sample(s) cannot be generated")
            self._truncate(sid, item.tokens_kept)
            self._leave(sid)
            if item.tokens_kept:
                resumed.append((sid, item.tokens_kept))
            else:
                fresh.setdefault(self.layout.prompt[sid], []).append(sid)
        for sid, _ in resumed:
            e = min(live, key=lambda x: self.pending.get(x, 0))
            self._place(sid, e)
            self.backend.resume(e, sid, "tokens")
        for sids in fresh.values():
            e = min(live, key=lambda x: self.pending.get(x, 0))
            for sid in sids:
                self._place(sid, e)
            self.backend.start(sids, [e] * len(sids))
        self.redispatched += len(resumed) + sum(len(s) for s in fresh.values())

    def _truncate(self, sid: int, kept: int) -> None:
        """Drop the segments beyond the ``kept`` tokens that survived (a lost engine's work)."""
        segments, total = [], 0
        for engine, tokens in self.made.segments[sid]:
            take = min(tokens, kept - total)
            if take <= 0:
                break
            segments.append((engine, take))
            total += take
        if total != kept:
            raise SampleAccountingError(f"sample {sid}: the backend kept {kept} tokens, but only {total} were cut")
        self.made.segments[sid], self.kept[sid] = segments, kept

    # -- migration -------------------------------------------------------------------------------------------
    def snapshot(self, status: dict[int, EngineStatus]) -> StepProgress:
        """The progress the migrator sees: every live engine, every running sample."""
        uids, cap = self.batch.uids, max(int(self.backend.max_tokens), 1)
        plens, kv = self.batch.prompt_lengths, int(self.backend.kv_capacity_tokens)
        actors, unfinished, prompts = [], [], set()
        for e, st in status.items():
            pending = self.pending.get(e, 0)
            running = len(st.running)
            context = sum(int(plens[self.layout.prompt[sid]]) + tokens for sid, tokens in st.running.items())
            actors.append(
                ActorProgress.model_construct(
                    actor_id=e,
                    planned_tokens=self.planned.get(e, 0.0),
                    generated_tokens=st.generated_tokens,
                    running=running,
                    waiting=max(pending - running, 0),
                    free_slots=max(0, self.backend.max_num_seqs - pending),
                    context_tokens=context,
                    kv_capacity_tokens=kv,
                )
            )
            for sid, tokens in st.running.items():
                if self.state[sid] == _DONE or self.engine[sid] != e:
                    continue  # finished since the backend looked; the next poll reports it
                unfinished.append(
                    SampleProgress.model_construct(
                        uid=uids[self.layout.prompt[sid]],
                        sample_index=self.layout.index_in_group[sid],
                        actor_id=e,
                        tokens_generated=tokens,
                        predicted_length=self.layout.predicted[sid],
                        max_tokens=cap,
                        migrations=self.sample_migrations[sid],
                        planned_length=self.layout.predicted[sid],
                    )
                )
                prompts.add(self.layout.prompt[sid])
        finished = {uids[p]: tuple(self.finished_lengths[p]) for p in prompts if p in self.finished_lengths}
        return StepProgress.model_construct(
            step=self.step,
            elapsed_s=self.backend.now(),
            total_samples=self.batch.total_samples,
            actors=actors,
            unfinished=unfinished,
            finished=finished,
        )

    def _migrate(self) -> None:
        status = self.backend.progress()
        if not status:
            return
        for d in self.planner.migration.decide(self.snapshot(status), self.fallbacks):
            sid = self.sample_id(d.uid, d.sample_index)
            if self.state[sid] == _DONE or self.engine[sid] != d.from_actor:
                continue
            tokens = self.backend.cut(d.from_actor, sid)
            if tokens is None:
                continue  # it finished (or was lost) before the cut landed; a later poll says which
            if tokens < self.kept[sid]:
                raise SampleAccountingError(f"sample {sid} was cut at {tokens} tokens, below the {self.kept[sid]} kept")
            self.made.segments[sid].append((d.from_actor, tokens - self.kept[sid]))
            self.kept[sid] = tokens
            moved = self._still_planned(sid)  # the rest of the prediction moves with the sample
            self.planned[d.from_actor] = self.planned.get(d.from_actor, 0.0) - moved
            self.planned[d.to_actor] = self.planned.get(d.to_actor, 0.0) + moved
            self.sample_migrations[sid] += 1
            self.migrations += 1
            self._leave(sid)
            self.engine[sid] = d.to_actor
            self.pending[d.to_actor] = self.pending.get(d.to_actor, 0) + 1
            self.backend.resume(d.to_actor, sid, d.mode)

    # -- the end ---------------------------------------------------------------------------------------------
    def _samples(self) -> list[FinishedSample]:
        hist, plens = self.layout.history_uids, self.batch.prompt_lengths.tolist()
        return [
            FinishedSample.model_construct(
                uid=hist[self.layout.prompt[sid]],
                sample_index=self.layout.index_in_group[sid],
                prompt_length=plens[self.layout.prompt[sid]],
                response_length=self.made.length[sid],
                actor_id=self.engine[sid],
                migrations=self.sample_migrations[sid],
                finish_reason=self.made.finish_reason[sid],
                predicted_length=self.layout.predicted[sid] if self.layout.predicted else None,
            )
            for sid in range(len(self.state))
        ]

    def _report(self, u: StepUsage) -> StepReport:
        """The step's report: ``billing``'s figures plus what the controller saw."""
        bill = billing(u)
        generation = u.generation_s
        pred = np.asarray(self.layout.predicted)
        mae = float(np.abs(pred - np.asarray(self.made.length)).mean()) if len(pred) else 0.0
        chosen = self.plan.estimate or self.plan.chosen_candidate()
        estimate = chosen.time_s if chosen is not None else None
        return StepReport(
            step=self.step,
            scheduler=self.planner.config.name,
            **bill,
            prefill_tokens_saved=u.prefill_tokens_saved,
            migrations=self.migrations,
            num_actors=self.plan.num_actors,
            samples=len(self.state),
            response_tokens=sum(self.made.length),
            prediction_mae=mae,
            estimated_generation_s=estimate,
            estimate_error=estimate / generation - 1.0 if estimate is not None and generation > 0 else None,
            planner_ms=self.plan.planner_ms,
            fallbacks=self.fallbacks,
        )
