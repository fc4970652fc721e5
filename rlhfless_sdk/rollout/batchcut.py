"""One step of partial rollouts cut when B groups are complete (the ``partial-batch`` straggler policy, APRIL-style),
written once for every backend.

A step has (1 + over_provision) x B groups in flight: every group held from the step before (carried samples, or
complete and waiting), which all train in this one, plus fresh prompts. It ends as soon as the held groups and the
first ``B - held`` fresh ones are complete; every other sample is cut there and carried, with its tokens, into the
next step. So every step but the last trains exactly B groups, each once and whole, and no token is more than one
weight update old. The simulator and the OpenRLHF generator both run it as:

1. ``fresh_wanted()`` prompts drawn from their stream (a workload's steps, OpenRLHF's dataloader);
2. ``plan(new)``: the book's pieces (carried samples first, then the new groups) predicted and planned;
3. the backend runs them under the step controller with ``stop`` as its end rule (the simulator, whose clock
   is exact, may instead run the step whole and read each group's completion off its finish times);
4. ``end()``: which groups train (``batch_cut``) and when the step ended; ``settle(made, ended, train)``: what
   is carried, the predictor's observations, and ``report_fields`` for the step report.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from rlhfless_sdk.api.batch import PromptBatch
from rlhfless_sdk.api.records import StepPlan
from rlhfless_sdk.rollout.carry import CarryBook, Piece, Settlement, batch_cut

if TYPE_CHECKING:
    from rlhfless_sdk.planning.planner import StepPlanner
    from rlhfless_sdk.rollout.controller import StepController


def plan_pieces(
    planner: StepPlanner,
    book: CarryBook,
    new: PromptBatch | None,
    step: int,
    fallbacks: list[str],
    budget: int | None = None,
) -> tuple[PromptBatch, StepPlan]:
    """A carrying step's work planned: ``book.pieces`` (the carried samples, one prompt each, then ``new``'s groups,
    a new sample's first piece at most ``budget`` tokens) and the plan. A carried sample's predicted length is what
    the learned spread expects it still to generate. ``book.step_pieces`` holds the pieces, in batch order."""
    pred = planner.predict(new, fallbacks) if new is not None and len(new) else None
    spread = planner.spread
    # a carried sample's expected remainder, in the predictor's units (the check model scales them again)
    remaining = (lambda t, h, sp=spread: sp.remaining(t, h) / sp.scale) if spread is not None else None
    batch, piece_pred, caps = book.pieces(
        new, pred, budget=budget, remaining=remaining, cap=spread.cap if spread and spread.cap else None
    )
    return batch, planner.plan(batch, step=step, predicted=piece_pred, segment_tokens=budget, length_caps=caps)


def note_completed(completed: dict[int, int], now: Iterable[int]) -> None:
    """Record the groups seen complete at this poll (``now``; those already recorded keep their rank), all with the
    same rank, the poll's: an end rule's completion order, ties broken later in launch order."""
    rank = len(completed)
    for g in now:
        completed.setdefault(g, rank)


class BatchCutStep:
    """Step ``step`` of a batch-cut run over ``book`` (which persists between steps), B = ``b`` groups a step."""

    def __init__(self, planner: StepPlanner, book: CarryBook, b: int, step: int) -> None:
        self.planner, self.book, self.b, self.step = planner, book, b, step
        self.fallbacks: list[str] = []
        self.held = book.open_group_ids()  # they all train in this step
        self.pieces: list[Piece] = []
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
        prompts_of: dict[int, set[int]] = defaultdict(set)
        for piece, prompt in zip(self.pieces, batch.sample_prompt_index().tolist(), strict=True):
            prompts_of[piece.group].add(prompt)  # a carried sample is a prompt of its own, a new group one prompt
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
        """The end rule, for ``StepController.run(stop=...)``: the held groups and B - held fresh ones complete."""
        return self.scan(ctl.done_prompts()) and len(self.completed) >= self.b - len(self.held)

    def end(self, done_at: dict[int, float] | None = None) -> tuple[set[int], float]:
        """The groups that train and when the step ends (inf: no cut): the held ones and the first fresh ones to
        complete (``done_at``: each group's completion time; default: the order the end rule saw them complete
        in, ties in launch order); every group in flight when no cut was possible."""
        if done_at is None:
            done_at = {**dict.fromkeys(self.held, 0.0), **{g: self.completed.get(g, math.inf) for g in self.fresh}}
        return batch_cut(self.held, self.fresh, done_at, self.b)

    def settle(
        self,
        made: list[int],
        ended: list[bool],
        train: set[int],
        history_key: Callable[[str], str] | None = None,
    ) -> Settlement:
        """Account the step: ``made[i]`` tokens the i-th piece generated, ``ended[i]`` whether its sample ended,
        ``train`` the groups that train (``end``). Feeds the finished samples to the predictor, under
        ``history_key(uid)`` when given."""
        settled = self.book.settle(self.step, made, ended, train=train)
        finished = settled.finished
        if history_key is not None:
            finished = [f.model_copy(update={"uid": history_key(f.uid)}) for f in finished]
        self.planner.observe(finished)
        return settled

    def report_fields(self, settled: Settlement) -> dict:
        """The step report's fields for a batch-cut step. Its prediction error is over the samples that ended in
        it, each full length against its predicted total (a cut sample's tokens so far, or a carried sample's
        remainder, would say nothing about the predictor)."""
        ended = settled.finished
        mae = sum(abs((f.predicted_length or 0.0) - f.response_length) for f in ended) / len(ended) if ended else 0.0
        return {
            **settled.report_fields(),
            "samples": sum(len(g.lengths) for g in settled.trained),
            "prediction_mae": mae,
        }
