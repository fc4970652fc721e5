"""The streaming pipeline: engines generate without batch boundaries while the learner trains each B complete
groups as soon as they exist, under a hard bound on token age. Written once for every backend.

Generation never stops for a batch: an engine with a free slot pulls the next sample of the prompt stream (a
group's samples in a row, groups in order), and a weight update pauses the engines between decode iterations and
lets every running sample go on under the new weights (OpenRLHF's partial-rollout mode, AReaL's interruptible
generation). The learner trains batch k with weights version k (after k updates) on B complete groups and then
broadcasts version k + 1.

**Token age** (in weight updates) of a group trained in batch k: ``k - v``, where ``v`` is the version under which
its first sample was dispatched (every later token is younger). Two rules keep it at most ``max_age``:

- *admission*: a new group may start only while ``started <= (version + max_age + 1) * B`` (AReaL's bound on how far
  generation runs ahead); so the groups started under versions up to v fit in batches 0 .. v + max_age;
- *no group left behind*: batch k trains every group with ``v <= k - max_age`` (it would be too old for batch
  k + 1), waiting for it to complete if it must; the rest of the batch is the complete groups started first.

So groups due in batch k number at most B, batch k holds exactly B groups (OpenRLHF's optimizer step; never more:
``GroupBook.form``), and no token is older than ``max_age``. Every group trains exactly once; the last batch takes
what is left.

The stream's decisions (which engine gets which sample, the slots, what a finish tells the book, which groups a
batch trains) are ``StreamLoop``'s (``rlhfless_sdk.rollout.stream_loop``), the same object on every backend.
``run_stream`` drives it on a simulated clock: a backend gives it a ``StreamEngines`` (start samples, advance its
clock, say which engines want work, pause for a weight update) and a ``Learner`` (how long a batch trains, and the
update after it). On OpenRLHF's engines the adapter's ``EngineStream`` drives the same loop on the wall clock, while
OpenRLHF's async loop trains and broadcasts. The split between generation and learning may change between batches
(``SplitPolicy``: an elastic split; simulated only).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from rlhfless_sdk.api.errors import RlhflessError
from rlhfless_sdk.api.records import StepReport, TimePerTokenProfile
from rlhfless_sdk.planning.engine_model import drain_s, remaining_draw, steady_rate, steady_step
from rlhfless_sdk.rollout.stream_book import GroupBook, StreamStats
from rlhfless_sdk.rollout.stream_loop import KvSlots, StreamLoop

#: The stream's feeder as a backend's engines call it when samples of engine ``e`` finish: (e, samples in flight on
#: it) -> the samples to start there now (``StreamLoop.free``'s rule)
Feeder = Callable[[int, int], list[int]]


class StreamEngines(Protocol):
    """A backend's engines as the streaming loop drives them."""

    max_num_seqs: int  # samples an engine runs at once
    feeder: Feeder | None  # set by ``run_stream``: called at each finish, so that a freed slot is filled at once

    def now(self) -> float: ...

    def in_flight(self, slots: int | None = None) -> dict[int, int]:
        """Samples in flight (running or queued) on each engine, with at most ``slots`` running on one engine from
        now on (None: as many as the engine runs at once, ``max_num_seqs``)."""
        ...

    def start(self, samples: Sequence[int], engines: Sequence[int]) -> None: ...

    def advance(self, t: float) -> list[int]:
        """Run until ``t``; the samples that finished, in order."""
        ...

    def update(self, at: float, seconds: float, version: int) -> None:
        """A weight update at ``at`` taking ``seconds``: running samples pause, then go on under ``version``."""
        ...

    def resize(self, engines: int, at: float) -> None:
        """Generate on ``engines`` engines from ``at`` on (an elastic split)."""
        ...

    def generated_tokens(self) -> int:
        """Response tokens generated so far, on every engine."""
        ...

    def lengths(self, samples: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(prompt, response) tokens of finished ``samples``."""
        ...

    def running_lengths(self) -> tuple[np.ndarray, np.ndarray]:
        """(prompt, response tokens so far) of every sample started and not finished."""
        ...


class Learner(Protocol):
    """The learner as the streaming loop sees it."""

    def tokens(self, groups: Sequence[int]) -> float:
        """Tokens (prompts and responses) that training ``groups`` trains."""
        ...

    def train_s(self, tokens: float, gpus: int) -> float:
        """Seconds that training ``tokens`` takes on ``gpus`` GPUs (scoring and update)."""
        ...

    sync_s: float  # a weight update's seconds


class SplitPolicy(Protocol):
    """An elastic split: the rollout GPUs for the next batches, re-planned as the run goes."""

    def split(self, batch: int, stats: StreamStats, book: GroupBook, current: int) -> int: ...


def version_runs(marks: Sequence[tuple[int, int]], total: int) -> list[tuple[int, int]]:
    """(version, tokens generated under it) of a finished sample of ``total`` response tokens, from its marks: the
    version under which it started (with 0 tokens) and, at each weight update it ran across, the new version and
    the tokens it had then. A backend's marks may lag its tokens by a decode step; runs never exceed ``total``."""
    out = []
    for i, (version, upto) in enumerate(marks):
        nxt = marks[i + 1][1] if i + 1 < len(marks) else total
        tokens = min(int(nxt), total) - min(int(upto), total)
        if tokens > 0:
            out.append((int(version), tokens))
    return out


def batch_ages(runs: Iterable[Sequence[tuple[int, int]]], trained_version: int) -> tuple[int, int, int]:
    """(tokens, stale tokens, largest age in weight updates) of a batch trained with weights ``trained_version``,
    from each sample's ``version_runs``."""
    total = stale = oldest = 0
    for sample in runs:
        for version, tokens in sample:
            total += tokens
            if trained_version - version > 0:
                stale += tokens
                oldest = max(oldest, trained_version - version)
    return total, stale, oldest


@dataclass(frozen=True)
class BatchWindow:
    """What a stream batch's report is built from, on every backend: batch ``step`` of ``scheduler``, the window
    (``lo``, ``hi``) between the weight updates around it (the adapter's wall clock, the simulator's), the time an
    engine generated in it, what it bills (GPU-seconds, and serverful: every GPU for the window), the engines' idle
    share and busy seconds (their spread: the imbalance), the engines running, the samples and response tokens it
    trains, its token ages (``batch_ages``), its groups and the GPUs it holds at most."""

    step: int
    scheduler: str
    lo: float
    hi: float
    generation_s: float
    gpu_seconds: float
    gpu_seconds_serverful: float
    idle: float
    busy: Sequence[float]
    engines: int
    samples: int
    response_tokens: int
    ages: tuple[int, int, int]
    groups: int
    peak_gpus: int

    def report(self, **more: Any) -> StepReport:
        """The batch's ``StepReport`` (``more``: a backend's own fields: the simulator's learning times, the
        adapter's busy seconds and samples in flight)."""
        tokens, stale, oldest = self.ages
        mean = float(np.mean(self.busy)) if len(self.busy) else 0.0
        return StepReport(
            step=self.step,
            scheduler=self.scheduler,
            time_s=self.hi - self.lo,
            generation_s=self.generation_s,
            gpu_seconds=self.gpu_seconds,
            gpu_seconds_serverful=self.gpu_seconds_serverful,
            idle_fraction=min(max(self.idle, 0.0), 1.0),
            imbalance=max(float(max(self.busy)) / mean, 1.0) if mean > 0 else 1.0,
            num_actors=max(self.engines, 1),
            samples=self.samples,
            response_tokens=self.response_tokens,
            peak_gpus=self.peak_gpus,
            stale_token_fraction=stale / tokens if tokens else 0.0,
            max_token_age_steps=oldest,
            groups_trained=self.groups,
            **more,
        )


@dataclass
class BalancedSplit:
    """Re-plans the split when a batch starts training, so that generating a batch takes as long as training it.

    The engine model (``steady_rate``: an engine never short of work, at the batch and KV its samples allow) gives an
    engine's generation rate for samples like those of the batch about to train, whose lengths are now known; the
    profile gives the learner's GPU-seconds per trained token. The split is the argmin over every whole-engine split
    of the slower side's time for such a batch (``batch_s``); it moves only when that gains more than ``min_gain`` and,
    over the batches left, more than a move costs (``switch_s``: the learner's restart from checkpoint at its new
    size; it never gets fewer GPUs than its state needs, ``min_learners``).
    Once every prompt of the stream is dispatched (the drain), when the learning left outlasts the join, the engines
    shrink to the count that finishes soonest (``_drain_split``), at least what the samples still running need
    (``max_num_seqs`` each), and the rest learn.

    Whole engines balance coarsely: on long reasoning the balance lies between 7 and 8 of 16 GPUs, and at 7 the
    learner waits for some batches' last groups. So when the planner keeps the split and the learner waited for the
    batch about to train more than ``min_gain`` of the last batch's training, one more engine is lent for that batch
    (the next re-plan takes it back unless the learner waited again): the split alternates, a fractional balance.
    Only where a batch trains for more than four moves' ``switch_s``, so that the lent engine's start-up and the
    GPU's return to the learner are a small share of it (``lend``).

    The run starts with every GPU but one engine's generating (the learner has nothing to train before the first
    batch is complete: the pipeline's fill) unless the fill cannot pay (``first``), so the first re-plan is the first
    batch's."""

    profile: TimePerTokenProfile
    gpus: int
    learn_s_per_token: float
    min_gain: float = 0.03
    lend: bool = True  # lend one more engine for a batch the learner waited for (see the class docstring)
    switch_s: float = 0.0  # what a move costs: the learner's restart from checkpoint at its new size
    min_learners: int = 1  # the GPUs the learner's state needs: never fewer learn
    calibration: float = 1.0  # measured rate / the model's, over windows where no engine was held back
    moved_at: int = -1  # the last batch whose re-plan moved the split
    fill_bound_s: float | None = None  # the first batch's time at the fill, every sample at the cap (``first``)
    slots: KvSlots | None = None  # the engines' slots, when the stream holds samples back (``KvSlots``)
    choices: list[dict] = field(default_factory=list)  # each re-plan: what it read and chose

    @property
    def gpus_per_engine(self) -> int:
        return self.profile.gpus_per_actor

    def first(self, samples: int = 0, prompt_tokens: float = 0.0, cap: int = 0) -> int:
        """The split the run starts with: every GPU but one engine's generates (the fill), when the first batch
        (``samples`` of them, prompts of ``prompt_tokens``, responses at most ``cap`` long) may take the fill
        longer than a move costs. When even a batch of samples all at the cap would be done within ``switch_s``,
        the fill cannot pay: it gains at most its batch time times (its engines / half's - 1) over starting at
        half, and every GPU it lends must join the learner afterwards, ``switch_s`` late. Then the run starts with
        half the GPUs generating (no lengths are known yet) and the first batch re-plans. Without ``cap``: the
        fill."""
        gpe = self.gpus_per_engine
        fill = max((self.gpus - max(self.min_learners, 1)) // gpe * gpe, gpe)
        half = min(max(self.gpus // 2 // gpe * gpe, gpe), fill)
        self.fill_bound_s = None
        if cap <= 0 or samples <= 0 or half >= fill:
            return fill
        running, step = steady_step(self.profile, np.array([prompt_tokens]), np.array([float(cap)]))
        engines = fill // self.gpus_per_engine
        # every sample at the cap: the engines' throughput, or one sample's own decode, whichever is longer
        bound = max(samples * cap * step / (running * engines), cap * step) if step > 0 else 0.0
        self.fill_bound_s = float(bound)
        return fill if bound > self.switch_s else half

    def splits(self) -> list[int]:
        """Every split in whole engines that leaves the learner the GPUs its state needs."""
        return list(range(self.gpus_per_engine, self.gpus - max(self.min_learners, 1) + 1, self.gpus_per_engine))

    def batch_s(self, r: int, response_tokens: float, trained_tokens: float, rate: float) -> float:
        """Seconds a batch takes with ``r`` rollout GPUs, the slower side's: generating ``response_tokens`` at
        ``rate`` per engine, training ``trained_tokens`` on the other GPUs."""
        gen = response_tokens / (rate * (r // self.gpus_per_engine))
        return max(gen, trained_tokens * self.learn_s_per_token / (self.gpus - r))

    def sample_lengths(self, stats: StreamStats) -> tuple[np.ndarray, np.ndarray]:
        """The samples a batch is like: the last two batches'; for the first batch, which holds the groups that
        finished first (the short ones), also the unfinished samples, counted at their length so far."""
        parts = list(stats.lengths[-2:])
        if len(stats.lengths) == 1 and stats.running is not None:
            parts.append(stats.running)
        return np.concatenate([p for p, _ in parts]), np.concatenate([r for _, r in parts])

    def calibrate(self, batch: int, stats: StreamStats, current: int, model_rate: float) -> None:
        """Fold in what the engines really generated since the last re-plan, when that window says what they can:
        no engine held back by the admission rule (then they generated all they could) and the same engines
        throughout (no start-up in it). The engine model misses preemption waves and admission pauses, which
        grow with the lengths."""
        if len(stats.marks) < 2 or batch - 1 == self.moved_at or model_rate <= 0:
            return
        (t0, tok0, gated0), (t1, tok1, gated1) = stats.marks[-2], stats.marks[-1]
        engines = current // self.gpus_per_engine
        if gated1 > gated0 or t1 <= t0 or not engines:
            return
        measured = (tok1 - tok0) / ((t1 - t0) * engines)
        ratio = float(np.clip(measured / model_rate, 0.5, 1.5))
        self.calibration = 0.5 * self.calibration + 0.5 * ratio

    def split(self, batch: int, stats: StreamStats, book: GroupBook, current: int) -> int:
        best = self._split(batch, stats, book, current)
        if best != current:
            self.moved_at = batch
        return best

    def _drain_split(
        self, batch: int, stats: StreamStats, trained: float, fewest: int, current: int, choice: dict
    ) -> int:
        """At the drain, the split that finishes soonest: the batch about to train on the learners (the GPUs that
        join after ``switch_s``) against the running samples on the engines kept (``drain_s``: the engine model on
        one draw of their remaining lengths from the lengths seen, the moved ones recomputing their context). Fewer
        engines free GPUs for the learner but pack the longest samples, whose every decode step then costs more
        context. From ``fewest`` (the engines the running samples need at ``max_num_seqs`` each) to ``current``;
        ``fewest`` when nothing is known of the running samples."""
        if stats.running is None or not len(stats.running[1]) or not stats.lengths:
            return fewest
        prompt, so_far = (np.asarray(x, dtype=np.float64) for x in stats.running)
        seen = np.concatenate([r for _, r in stats.lengths])
        remaining = remaining_draw(seen, so_far, seed=batch)
        context = np.rint(prompt + so_far).astype(np.int64)
        work = trained * self.learn_s_per_token
        estimates = {}
        for r in range(fewest, current + 1, self.gpus_per_engine):
            learn = (self.switch_s if r != current else 0.0) + work / (self.gpus - r)  # a resize restarts it
            engines = r // self.gpus_per_engine
            gen = drain_s(self.profile, context, remaining, engines, kept=r / current)
            estimates[r] = (max(gen, learn), gen, learn)
        best = min(estimates, key=lambda r: (estimates[r][0], r))
        choice.update(drain_estimates={str(r): [round(x, 1) for x in v] for r, v in estimates.items()})
        return best

    def _split(self, batch: int, stats: StreamStats, book: GroupBook, current: int) -> int:
        prompt, response = self.sample_lengths(stats)
        trained = float(np.mean(prompt + response)) * sum(len(book.groups[g].samples) for g in stats.batches[-1])
        choice: dict = {"batch": batch, "trained_tokens": float(trained)}
        batches_left = 1 + -(-book.untrained // book.B)  # the batch about to train, and those after it
        if book.next_sample >= book.samples:  # the drain: the engines the running samples need, the rest learn
            left = book.samples - sum(g.done for g in book.groups)
            need = -(-left // self.profile.max_num_seqs) * self.gpus_per_engine
            best = min(max(need, self.gpus_per_engine), current)
            learn_s = batches_left * trained * self.learn_s_per_token / (self.gpus - current)
            if learn_s <= self.switch_s:  # the joiners would arrive after the last batch is trained: stay
                best = current
            else:
                best = self._drain_split(batch, stats, trained, best, current, choice)
            choice.update(reason="drain", unfinished=int(left), learn_s=float(learn_s))
        else:
            prof = self.profile
            if self.slots is not None:  # the engines run what the KV holds, held back to the slots
                prof = prof.model_copy(update={"max_num_seqs": self.slots.slots_for(prompt, response)})
            model = steady_rate(prof, prompt, response)
            self.calibrate(batch, stats, current, model)
            rate = model * self.calibration
            tokens = float(np.mean(response)) * sum(len(book.groups[g].samples) for g in stats.batches[-1])
            if rate <= 0 or trained <= 0:
                best = current
            else:
                best = min(self.splits(), key=lambda r: (self.batch_s(r, tokens, trained, rate), abs(r - current)))
                now_s, best_s = self.batch_s(current, tokens, trained, rate), self.batch_s(best, tokens, trained, rate)
                # a move pays when it gains, over the batches left, more than it costs (a start-up or a join)
                if not (best_s < now_s * (1 - self.min_gain) and (now_s - best_s) * batches_left > self.switch_s):
                    best = current
                elif best < current and batch == 0:  # leaving the fill: its in-flight groups still need finishing,
                    # so half the way (a whole move, or a third, measured slower on long reasoning)
                    best = current - (current - best) // (2 * self.gpus_per_engine) * self.gpus_per_engine
                choice.update(current_s=float(now_s), best_s=float(best_s))
            waited = stats.marks[-1][0] - stats.updates[-1][1] if stats.updates else 0.0
            last = stats.train[-1][1] - stats.train[-1][0] if stats.train else 0.0
            if (
                self.lend
                and best == current
                and last > 4 * self.switch_s
                and waited > self.min_gain * last
                and current + self.gpus_per_engine <= self.gpus - max(self.min_learners, self.gpus_per_engine)
            ):
                best = current + self.gpus_per_engine
            choice.update(reason="balance", rate=float(rate), calibration=self.calibration, waited=float(waited))
        choice.update(current=int(current), chosen=int(best))
        self.choices.append(choice)
        return best


@dataclass
class PinnedSplit:
    """``base``'s split, but the rollout GPUs of batch k pinned to ``schedule[k]`` where it is given and not 0 (to
    measure a split pattern, e.g. alternating whole engines for a fractional balance, against the planner's). The
    base still re-plans at every batch (its calibration and re-plan record stay whole); its choice is overridden."""

    base: SplitPolicy
    schedule: Sequence[int]

    def split(self, batch: int, stats: StreamStats, book: GroupBook, current: int) -> int:
        best = self.base.split(batch, stats, book, current)
        if batch < len(self.schedule) and self.schedule[batch] > 0:
            return int(self.schedule[batch])
        return best


def run_stream(
    engines: StreamEngines,
    learner: Learner,
    book: GroupBook,
    *,
    gpus: int,
    rollout_gpus: int,
    gpus_per_engine: int = 1,
    check_s: float = 1.0,
    split: SplitPolicy | None = None,
    switch_s: float = 0.0,
    slots: KvSlots | None = None,
    min_learners: int = 1,
    fill_engines: int = 0,
    fill_switch_s: float = 0.0,
) -> StreamStats:
    """Run the whole stream; returns when the last batch's update is done. ``gpus``: the fleet; ``rollout_gpus``:
    those that generate (the rest learn, at least ``min_learners``: the GPUs the learner's state needs), changed
    when a batch starts training by ``split`` when given. A resize is a restart of the learner from checkpoint
    (``switch_s``): the batch trains ``switch_s`` after it forms, on the new learner GPUs; a GPU taken from the
    learner is an engine that starts at once (the engines' start-up is theirs to model); a GPU taken from the
    engines stops generating at once. ``slots``: how many samples an engine runs at once, from the lengths finished
    so far (default: ``max_num_seqs``). ``fill_engines``: engines beyond ``rollout_gpus`` (``engines`` runs them
    last, on the learner's GPUs) that generate until the first batch forms; then they stop (``resize`` down to the
    rollout engines: their samples go on there with their tokens) and the first batch trains ``fill_switch_s``
    later. The learner keeps its GPUs throughout (no restart)."""
    most = gpus - max(min_learners, 1)
    if fill_engines and split is not None:
        raise RlhflessError("fill engines run beside a fixed split's learner; an elastic split lends GPUs itself")
    if not gpus_per_engine <= rollout_gpus <= most:
        raise RlhflessError(
            f"rollout_gpus={rollout_gpus} must leave the learner {max(min_learners, 1)} of the {gpus} GPUs (what "
            "its state needs) and run an engine"
        )
    run = _Stream(engines, learner, book, StreamLoop(book, engines.max_num_seqs, slots), gpus, rollout_gpus)
    run.gpus_per_engine, run.check_s, run.split, run.switch_s = gpus_per_engine, check_s, split, switch_s
    run.slots, run.min_learners, run.fill_engines, run.fill_switch_s = slots, min_learners, fill_engines, fill_switch_s
    return run.run()


class _Stream:
    """``run_stream``'s state as it runs: the engines and their feed (``StreamLoop``), the learner, the weights
    version, the batch under way and the batch in training, the split; its stats."""

    def __init__(
        self, engines: StreamEngines, learner: Learner, book: GroupBook, loop: StreamLoop, gpus: int, r: int
    ) -> None:
        self.engines, self.learner, self.book, self.loop, self.gpus, self.r = engines, learner, book, loop, gpus, r
        self.gpus_per_engine, self.check_s, self.switch_s, self.min_learners = 1, 1.0, 0.0, 1
        self.split: SplitPolicy | None = None
        self.slots: KvSlots | None = None
        self.fill_engines, self.fill_switch_s = 0, 0.0
        self.stats = StreamStats()
        self.version, self.k = 0, 0
        self.training: tuple[int, float, float] | None = None  # (batch, start, end)
        self.learner_free = 0.0
        self.changed = True  # a group completed (or the learner freed) since the last try at forming a batch

    def feed(self, engine: int, in_flight: int) -> list[int]:
        """At a finish, on the engines' clock: the same rule as every tick."""
        return [sid for sid, _ in self.loop.fill(self.loop.free({engine: in_flight}), self.version).sent]

    def run(self) -> StreamStats:
        engines, book, stats = self.engines, self.book, self.stats
        engines.feeder = self.feed
        stats.marks.append((engines.now(), engines.generated_tokens(), 0.0))
        while book.untrained or self.training is not None:
            now = engines.now()
            fill = self.loop.fill(self.loop.free(engines.in_flight(self.loop.held_back())), self.version)
            if fill.sent:
                engines.start([sid for sid, _ in fill.sent], [e for _, e in fill.sent])
            stats.gated_s += self.check_s * fill.gated
            if self.training is None and book.untrained and now >= self.learner_free and self.changed:
                self.changed = False
                self.form(now)
            self.advance(now)
        unfinished = [g.gid for g in book.groups if g.batch < 0]
        if unfinished:
            raise RlhflessError(f"the stream ended with {len(unfinished)} group(s) untrained (first: {unfinished[0]})")
        return stats

    def form(self, now: float) -> None:
        """Try to form batch k; formed, it starts training (on a resized learner, where the split changes)."""
        book, stats, engines = self.book, self.stats, self.engines
        chosen = self.loop.form(self.k)
        if chosen is None and book.done_samples == book.samples:
            raise RlhflessError(f"batch {self.k} cannot be formed although every sample has finished")
        if chosen is None:
            return
        tokens = self.learner.tokens(chosen)
        stats.trained_tokens.append(tokens)
        stats.lengths.append(engines.lengths([sid for g in chosen for sid in book.groups[g].samples]))
        stats.running = engines.running_lengths()
        stats.batches.append(chosen)
        if self.slots is not None:
            stats.slots.append(self.loop.limit())
        stats.marks.append((now, engines.generated_tokens(), stats.gated_s))
        restart = self.resize(now)
        learners = self.gpus - self.r
        self.training = (self.k, now, now + restart + self.learner.train_s(tokens, learners))
        stats.overdue = book.overdue
        stats.ready.append(max(book.groups[g].completed_at for g in chosen))
        stats.split.append(self.r)
        stats.learners.append(learners)

    def resize(self, now: float) -> float:
        """The split as batch k forms: the fill engines stop at batch 0, the split policy may move GPUs between the
        engines and the learner; the restart the learner pays for it."""
        restart, gpa, stats = 0.0, self.gpus_per_engine, self.stats
        if self.fill_engines and self.k == 0:  # the fill engines stop: the learner trains on its GPUs
            self.engines.resize(self.r // gpa, now)
            restart = self.fill_switch_s
            stats.fill_stop = (now, self.fill_switch_s)
        if self.split is not None:
            new = self.split.split(self.k, stats, self.book, self.r)
            most = self.gpus - max(self.min_learners, 1)
            if not (gpa <= new <= most and new % gpa == 0):
                raise RlhflessError(
                    f"the split policy chose {new} rollout GPUs of {self.gpus}: not a split that leaves the learner "
                    f"{max(self.min_learners, 1)}"
                )
            if new != self.r:
                self.engines.resize(new // gpa, now)
                restart = self.switch_s
                stats.restarts.append((self.k, self.switch_s))
                self.r = new
        return restart

    def advance(self, now: float) -> None:
        """The engines run to the next check (or the end of the training, or the learner freed); a batch whose
        training ends updates the weights."""
        engines, stats = self.engines, self.stats
        t = now + self.check_s
        if self.training is not None:
            t = min(t, self.training[2])
        elif self.learner_free > now:
            t = min(t, self.learner_free)
        finished = engines.advance(t)
        if finished:
            self.loop.finished(finished, engines.now(), *engines.lengths(finished))
            self.changed = True
        if self.training is None and engines.now() >= self.learner_free > now:
            self.changed = True
        if self.training is not None and engines.now() >= self.training[2]:
            kk, start, end = self.training
            stats.train.append((start, end))
            self.version = kk + 1
            engines.update(end, self.learner.sync_s, self.version)
            stats.updates.append((end, end + self.learner.sync_s))
            stats.tokens.append(engines.generated_tokens())
            stats.gated.append(stats.gated_s)
            self.learner_free = end + self.learner.sync_s
            self.training = None
            self.changed = True
            self.k += 1
