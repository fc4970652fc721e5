"""Step drivers: one per way of running rollout steps, each written once for every backend.

``rlhfless_sdk.rollout.modes.mode_of`` says which driver a scheduler's steps run under (``Mode.driver``): ``PlainStep``
(``plain``), ``BudgetStep`` (``token-budget``), ``TailRound`` (``tail-rounds``) or ``BatchCutStep`` (``batch-cut``);
a pipeline's batches run under its straggler policy's driver too.

A driver owns what a step of its mode decides: the prompts it draws, the plan (with every policy fallback of the
step), the end rule, which groups train, what is carried or deferred, what the predictor observes and the report's
fields. A backend gives it a ``StepIO``: prompts drawn from its stream (a workload's steps, a dataloader), a batch
built from them, the plan run under the end rule (``Ran``), and the tokens each piece had when the step ended.
Each backend declares the modes it runs; ``refusal`` is the one-line reason one cannot run a scheduler.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from rlhfless_sdk.api.batch import PromptBatch
from rlhfless_sdk.api.config import SchedulerConfig
from rlhfless_sdk.api.errors import RlhflessError
from rlhfless_sdk.api.plugins import Registry
from rlhfless_sdk.api.records import FinishedSample, StepPlan
from rlhfless_sdk.rollout.carry import CarryBook, Settlement, batch_cut, plan_pieces
from rlhfless_sdk.rollout.controller import StepController, StepOutcome
from rlhfless_sdk.rollout.modes import BATCH_CUT, PLAIN, TAIL_ROUNDS, TOKEN_BUDGET, Mode, mode_names
from rlhfless_sdk.rollout.tail import Round, TailRounds, first_done, note_completed, round_fields

if TYPE_CHECKING:
    from rlhfless_sdk.planning.planner import StepPlanner
    from rlhfless_sdk.planning.tail_check import TailEstimate

EndRule = Callable[[StepController], bool]


def refusal(
    config: SchedulerConfig, mode: Mode, modes: Collection[str], backend: str, registry: Registry | None = None
) -> str | None:
    """Why ``backend`` (which runs the modes named ``modes``) cannot run ``config``, whose mode is ``mode``; None:
    it can. The line names the pipeline or the policy that asks for the mode."""
    if mode.name in modes:
        return None
    if mode.pipelined:
        what = f"its {mode.name} pipeline (pipeline: {mode.name})"
    else:
        what = f"its straggler policy {config.policy('straggler').name!r}"
    return (
        f"scheduler {config.name!r}: {what} needs the {mode.name} step driver, which {backend} does not run "
        f"(it runs: {', '.join(m for m in mode_names(registry) if m in modes)})"
    )


# -- what a backend gives a driver ------------------------------------------------------------------------------
@dataclass
class Ran:
    """A plan run on a backend: the controller's outcome; the prompts (batch positions) complete when it ended
    (the end rule's last poll); and, from a backend whose clock is exact (the simulator, which may run the step
    whole and read the cut instant off it), when each sample finished, batch order."""

    outcome: StepOutcome
    done_prompts: list[int]
    finish_s: Sequence[float] | None = None


class StepIO(Protocol):
    """A backend's side of a driven step."""

    def draw(self, k: int | None) -> list[Hashable]:
        """Up to ``k`` prompts from the backend's stream, as references (fewer, or none, once it runs dry); None:
        the source's next batch as it comes (a workload's step, a dataloader's batch)."""
        ...

    def step_number(self, step: int) -> int:
        """The number of the step whose batch ``draw(None)`` drew last (a workload's own step numbers), or ``step``
        (the driver's count) where prompts come one at a time."""
        ...

    def batch(self, prompts: list[Hashable]) -> PromptBatch:
        """The prompts as a batch of groups (uids distinct from the open groups')."""
        ...

    def execute(self, batch: PromptBatch, plan: StepPlan, stop: EndRule | None, observe: bool) -> Ran:
        """Run ``plan`` through the step controller under the end rule ``stop`` (None: to the end), feeding the
        predictor only when ``observe``."""
        ...

    def tokens(self, ran: Ran, stop_s: float) -> tuple[list[int], list[bool]]:
        """A carrying step's account: per piece (batch order), the tokens it generated in this step by its end
        (``stop_s``: when the step ended, inf when it ran to the end) and whether its sample ended."""
        ...

    def history_key(self, uid: str) -> str:
        """The length-history key of a batch uid (a prompt repeated in one batch shares its history)."""
        ...


@dataclass
class Driven:
    """A driven step: its batch, plan and outcome, the report's fields the driver sets, the groups (batch
    positions, in order) or samples that train, and when the step ended (inf: every sample ran to its end)."""

    batch: PromptBatch
    plan: StepPlan
    ran: Ran
    fields: dict[str, Any]
    trained_rows: list[int]
    trained: list[FinishedSample]
    stop_s: float = math.inf
    settled: Settlement | None = None
    prompts: list[Hashable] | None = None
    trained_tokens: int = 0  # prompt + response tokens of what trains (the learner's work)

    @property
    def outcome(self) -> StepOutcome:
        return self.ran.outcome


# -- plain ----------------------------------------------------------------------------------------------------
class PlainStep:
    """Step ``step``: every sample of the drawn prompts runs to its end; the controller feeds the predictor."""

    mode = PLAIN

    def __init__(self, planner: StepPlanner, step: int) -> None:
        self.planner, self.step = planner, step

    def run(self, io: StepIO, batch: PromptBatch) -> Driven:
        plan = self.planner.plan(batch, step=self.step)
        ran = io.execute(batch, plan, None, True)
        rows = list(range(len(batch)))
        samples = ran.outcome.samples
        tokens = sum(s.prompt_length + s.response_length for s in samples)
        return Driven(batch, plan, ran, {}, rows, samples, trained_tokens=tokens)


# -- tail batching's rounds -------------------------------------------------------------------------------------
class TailRound:
    """Round ``step`` of tail batching over ``rounds`` (which persist between rounds): a short round starts
    (1 + over_provision) x B groups and ends once B are complete, the others aborted (tokens dropped) and their
    prompts deferred; a long round runs B deferred prompts to the end. Nothing from older weights trains."""

    mode = TAIL_ROUNDS

    def __init__(self, planner: StepPlanner, rounds: TailRounds, step: int, io: StepIO | None = None) -> None:
        self.planner, self.rounds, self.step = planner, rounds, step
        self.fallbacks: list[str] = []
        over = planner.over_provision(step, self.fallbacks)
        self.check: TailEstimate | None = None
        margin = planner.tail_margin(step, self.fallbacks) if over > 0 and io is not None else None
        if margin is not None and io is not None:
            # tail batching only where a whole cycle of it fits in what the stream has left and its predicted
            # cost per trained group beats a plain step's by the margin; else the round is a plain step (a long
            # round, when one is due, ignores over_provision)
            candidates = rounds.cycle_candidates(over)
            if candidates is not None:
                self.check = planner.tail_check(io.batch(candidates), rounds.batch_size, self.fallbacks)
                over = over if self.check.pays(margin) else 0.0
            else:
                over = 0.0
        self.round: Round = rounds.next(over)
        self.completed: dict[int, int] = {}  # group -> completion rank (groups seen complete at one poll tie)

    @property
    def prompts(self) -> list[Hashable]:
        return self.round.prompts

    def cuts(self) -> bool:
        """Whether the round ends before everything it started is complete."""
        return not self.round.long and self.round.train < len(self.round.prompts)

    def stop(self, ctl: StepController) -> bool:
        """The end rule: ``train`` groups complete."""
        note_completed(self.completed, ctl.done_prompts())
        return len(self.completed) >= self.round.train

    def run(self, io: StepIO) -> Driven:
        batch = io.batch(self.round.prompts)
        plan = self.planner.plan(batch, step=self.step, fallbacks=self.fallbacks)
        ran = io.execute(batch, plan, self.stop if self.cuts() else None, False)
        if ran.finish_s is not None:  # an exact clock: each group's completion time
            finish = np.asarray(ran.finish_s, dtype=np.float64)
            done_at = np.maximum.reduceat(finish, batch.sample_offsets[:-1]) if len(batch) else np.zeros(0)
        else:  # the order the end rule saw them complete in, ties in batch order
            note_completed(self.completed, ran.done_prompts)
            done_at = np.array([self.completed.get(g, math.inf) for g in range(len(batch))], dtype=np.float64)
        rows, stop_s = first_done(done_at, self.round.train, self.round.long)
        rows_l = rows.tolist()
        self.rounds.settle([self.round.prompts[i] for i in rows_l])
        samples = ran.outcome.samples
        offsets = batch.sample_offsets
        trained = [samples[sid] for g in rows_l for sid in range(int(offsets[g]), int(offsets[g + 1]))]
        self.planner.observe([s.model_copy(update={"uid": io.history_key(s.uid)}) for s in trained])
        cut = self.cuts()
        fields = round_fields(trained, len(rows_l), len(self.rounds.deferred), cut)
        tokens = int((batch.prompt_lengths * batch.n_samples)[rows].sum()) + sum(s.response_length for s in trained)
        return Driven(
            batch, plan, ran, fields, rows_l, trained, stop_s, prompts=self.round.prompts, trained_tokens=tokens
        )


# -- partial rollouts under a token budget -------------------------------------------------------------------
class BudgetStep:
    """Step ``step`` of partial rollouts under a token budget over ``book`` (which persists between steps): new
    samples stop at the straggler policy's ``segment_tokens`` and finish in the next step; a group trains in the
    step its last sample ends. ``index`` counts the run's steps (token ages are differences of it)."""

    mode = TOKEN_BUDGET

    def __init__(self, planner: StepPlanner, book: CarryBook, step: int, index: int) -> None:
        self.planner, self.book, self.step, self.index = planner, book, step, index
        self.fallbacks: list[str] = []
        self.budget = planner.segment_tokens(step, self.fallbacks)

    def run(self, io: StepIO, new: PromptBatch | None) -> Driven:
        batch, plan = plan_pieces(self.planner, self.book, new, self.step, self.fallbacks, self.budget)
        ran = io.execute(batch, plan, None, False)
        made, ended = io.tokens(ran, math.inf)
        settled = self.book.settle(self.index, made, ended)
        self.planner.observe([f.model_copy(update={"uid": io.history_key(f.uid)}) for f in settled.finished])
        self.planner.note_error(ran.outcome.report.estimate_error)
        rows = [g.group for g in settled.trained]
        tokens = settled.trained_prompt_and_response_tokens
        return Driven(
            batch, plan, ran, settled.report_fields(), rows, settled.finished, settled=settled, trained_tokens=tokens
        )


# -- partial rollouts cut when B groups are complete ---------------------------------------------------------
class BatchCutStep:
    """Step ``step`` of partial rollouts cut when B = ``b`` groups are complete (APRIL-style), over ``book`` (which
    persists between steps).

    A step has (1 + over_provision) x B groups in flight: every group held from the step before (carried samples,
    or complete and waiting), which all train in this one, plus fresh prompts. It ends as soon as the held groups
    and the first ``B - held`` fresh ones are complete; every other sample is cut there and carried, with its
    tokens, into the next step. So every step but the last trains exactly B groups, each once and whole, and no
    token is more than one weight update old.
    """

    mode = BATCH_CUT

    def __init__(self, planner: StepPlanner, book: CarryBook, b: int, step: int) -> None:
        self.planner, self.book, self.b, self.step = planner, book, b, step
        self.fallbacks: list[str] = []
        self.held = book.open_group_ids()  # they all train in this step
        self.pieces: list[Any] = []
        self.n_carried = 0
        self.fresh: list[int] = []  # the new groups, in launch order
        self.completed: dict[int, int] = {}  # fresh group -> completion rank (groups seen complete at one poll tie)
        self._prompts_of: dict[int, list[int]] = {}

    def fresh_wanted(self) -> int:
        """How many fresh prompts the step starts: (1 + over_provision) x B in flight, the held groups included."""
        over = self.planner.over_provision(self.step, self.fallbacks)
        return max(math.ceil((1.0 + over) * self.b) - len(self.held), 0)

    def plan(self, new: PromptBatch | None) -> tuple[PromptBatch, StepPlan]:
        """The step's work (the carried samples, one prompt each, then ``new``'s groups) and its plan."""
        self.n_carried = len(self.book.carried)
        batch, plan = plan_pieces(self.planner, self.book, new, self.step, self.fallbacks)
        self.pieces = self.book.step_pieces
        self.fresh = list(dict.fromkeys(p.group for p in self.pieces[self.n_carried :]))
        prompts_of: dict[int, set[int]] = {}
        for piece, prompt in zip(self.pieces, batch.sample_prompt_index().tolist(), strict=True):
            prompts_of.setdefault(piece.group, set()).add(prompt)  # a carried sample is a prompt of its own
        self._prompts_of = {g: sorted(v) for g, v in prompts_of.items()}
        return batch, plan

    def cuts(self) -> bool:
        """Whether the step may end before everything in flight is complete (more than B groups in flight)."""
        return len(self.held) + len(self.fresh) > self.b

    def scan(self, done_prompts: list[int]) -> bool:
        """Note the fresh groups complete by now (``done_prompts``: batch positions all of whose samples have
        finished); True once every held group is complete."""
        done = set(done_prompts)
        note_completed(self.completed, [g for g in self.fresh if all(i in done for i in self._prompts_of[g])])
        # a held group complete before the step (every sample ended, waiting for its turn) has no work in it
        return all(all(i in done for i in self._prompts_of.get(g, ())) for g in self.held)

    def stop(self, ctl: StepController) -> bool:
        """The end rule: the held groups and B - held fresh ones complete."""
        return self.scan(ctl.done_prompts()) and len(self.completed) >= self.b - len(self.held)

    def end(self, done_at: dict[int, float] | None = None) -> tuple[set[int], float]:
        """The groups that train and when the step ends (inf: no cut): the held ones and the first fresh ones to
        complete (``done_at``: each group's completion time; default: the order the end rule saw them complete
        in, ties in launch order); every group in flight when no cut was possible."""
        if done_at is None:
            done_at = {**dict.fromkeys(self.held, 0.0), **{g: self.completed.get(g, math.inf) for g in self.fresh}}
        return batch_cut(self.held, self.fresh, done_at, self.b)

    def run(self, io: StepIO) -> Driven | None:
        """Draw, plan, run under the end rule, settle; None when nothing is left (the stream dry, nothing held)."""
        prompts = io.draw(self.fresh_wanted())
        if not prompts and not self.held:
            return None
        batch, plan = self.plan(io.batch(prompts) if prompts else None)
        ran = io.execute(batch, plan, self.stop if self.cuts() else None, False)
        done_at = None
        if ran.finish_s is not None:  # an exact clock: each group completes when its last piece does
            done_at = dict.fromkeys(self.held, 0.0)
            for piece, t in zip(self.pieces, ran.finish_s, strict=True):
                done_at[piece.group] = max(done_at[piece.group], t) if piece.group in done_at else t
        else:
            self.scan(ran.done_prompts)  # groups that completed in the last poll (or all of them before a cut)
        train, stop_s = self.end(done_at)
        made, ended = io.tokens(ran, stop_s)
        settled = self.book.settle(self.step, made, ended, train=train)
        self.planner.observe([f.model_copy(update={"uid": io.history_key(f.uid)}) for f in settled.finished])
        # the prediction error is over the samples that ended in this step, each full length against its predicted
        # total (a cut sample's tokens so far, or a carried sample's remainder, would say nothing of the predictor)
        ended_s = settled.finished
        errors = [abs((f.predicted_length or 0.0) - f.response_length) for f in ended_s]
        mae = sum(errors) / len(errors) if errors else 0.0
        fields = {
            **settled.report_fields(),
            "samples": sum(len(g.lengths) for g in settled.trained),
            "prediction_mae": mae,
        }
        if math.isfinite(stop_s):  # the plan's estimate is for every piece run to its end
            fields["estimate_error"] = None
        rows = [g.group for g in settled.trained]
        tokens = settled.trained_prompt_and_response_tokens
        return Driven(batch, plan, ran, fields, rows, settled.finished, stop_s, settled, prompts, tokens)


# -- a run's steps: one session per mode, holding what persists between steps ----------------------------------
class DriverSession(Protocol):
    """The steps of one run in one mode: ``next`` drives the next step (None: nothing is left to run); ``book``: what
    it carries between steps (None: nothing)."""

    mode: str
    book: CarryBook | None

    def next(self, io: StepIO, step: int) -> Driven | None: ...


class BudgetSession:
    """Partial rollouts under a token budget: each step draws the source's next batch (``io.draw(None)``); once it
    runs dry, steps finish what is carried."""

    mode = TOKEN_BUDGET

    def __init__(self, planner: StepPlanner, book: CarryBook) -> None:
        self.planner, self.book, self.index = planner, book, 0

    def next(self, io: StepIO, step: int) -> Driven | None:
        prompts = io.draw(None)
        if not prompts and not self.book.carried:
            return None
        driver = BudgetStep(self.planner, self.book, io.step_number(step), self.index)
        self.index += 1
        return driver.run(io, io.batch(prompts) if prompts else None)


class TailSession:
    """Tail batching's rounds over the source's prompts (``stream``), B = ``b`` groups a round; ``deferred``: prompts
    drawn and not trained before (a resumed run's), re-run first."""

    mode = TAIL_ROUNDS

    def __init__(
        self, planner: StepPlanner, b: int, stream: Iterable[Hashable], deferred: Iterable[Hashable] = ()
    ) -> None:
        self.planner, self.rounds = planner, TailRounds(b, stream, deferred=deferred)
        self.book = None

    def next(self, io: StepIO, step: int) -> Driven | None:
        if self.rounds.done():
            return None
        return TailRound(self.planner, self.rounds, step, io).run(io)


class BatchCutSession:
    """Partial rollouts cut when B = ``b`` groups are complete, over ``book``."""

    mode = BATCH_CUT

    def __init__(self, planner: StepPlanner, b: int, book: CarryBook) -> None:
        if planner.config.migrates():
            raise RlhflessError(
                f"scheduler {planner.config.name!r}: cut-and-migrate with a batch-cut straggler policy is not supported"
            )
        self.planner, self.b, self.book = planner, b, book

    def next(self, io: StepIO, step: int) -> Driven | None:
        return BatchCutStep(self.planner, self.book, self.b, step).run(io)


def budget_session(planner: StepPlanner, b: int, stream: Iterable[Hashable]) -> BudgetSession:
    """``token-budget``'s session: a fresh carry book."""
    return BudgetSession(planner, CarryBook())


def batch_cut_session(planner: StepPlanner, b: int, stream: Iterable[Hashable]) -> BatchCutSession:
    """``batch-cut``'s session: a fresh carry book, B = ``b`` groups a step."""
    return BatchCutSession(planner, b, CarryBook())


def steps_alone(mode: str, registry: Registry) -> bool:
    """Whether the driver ``mode`` runs each step on its own, every sample to its end (no session: ``PlainStep``)."""
    return registry.drivers[mode].session is None


def session_for(mode: str, planner: StepPlanner, b: int, stream: Iterable[Hashable]) -> DriverSession:
    """The session of a carrying or over-provisioning ``mode`` (B = ``b`` groups a step, prompts from ``stream``
    where the mode draws them one at a time), as the planner's registry has it."""
    spec = planner.registry.drivers.get(mode)
    if spec is None or spec.session is None:
        raise ValueError(f"no session for the {mode} step driver")
    return spec.session(planner, b, stream)
