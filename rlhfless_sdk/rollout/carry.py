"""Samples carried across steps (partial rollouts): what each step generates and which groups train.

A straggler policy gives a newly started sample a token budget (``StepPlan.segment_tokens``). A sample that
reaches it is carried into the next step with its tokens, continued there under the new weights until it ends,
and its prompt's group trains once all its samples have ended. ``CarryBook`` keeps that account for any backend:

- ``pieces(new, predicted)`` builds the step's work: every carried sample as a prompt of its own (its prompt
  plus the tokens it has, one sample), then the new prompts' groups as they came;
- ``settle(step, ended, lengths)`` takes what each piece generated and whether its sample ended, and returns
  the groups that complete (to train now, each with all n samples in order), the finished samples (for the
  predictor's history) and the staleness of the trained tokens.

Sample identity: a group is one occurrence of a prompt (``group`` counts launches); a sample is
(group, sample index). Nothing is lost or duplicated: every launched sample is either carried or ended, every
ended sample belongs to exactly one group, and a group is returned once, when its last sample ends.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from rlhfless_sdk.api.batch import PromptBatch
from rlhfless_sdk.api.errors import RlhflessError
from rlhfless_sdk.api.records import FinishedSample, StepPlan

if TYPE_CHECKING:
    from rlhfless_sdk.planning.planner import StepPlanner


class CarryError(RlhflessError):
    """A backend's account of a step disagrees with the samples the step was given."""


@dataclass
class Piece:
    """One sample's work in one step."""

    group: int
    uid: str  # the prompt's uid, as the trainer knows it
    sample_index: int
    prompt_length: int  # the prompt's own tokens (the piece's prompt adds ``generated``)
    generated: int  # tokens the sample had when the step began
    predicted: float  # predicted total response length
    steps: list[tuple[int, int]] = field(default_factory=list)  # (step, tokens generated in it)


@dataclass
class Group:
    uid: str
    n: int
    prompt_length: int
    lengths: dict[int, int] = field(default_factory=dict)  # sample index -> response length, once ended
    steps: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # sample index -> its (step, tokens)


@dataclass
class TrainedGroup:
    uid: str
    group: int
    prompt_length: int
    lengths: list[int]  # response length of each sample, in sample order
    steps: list[list[tuple[int, int]]]  # per sample: (step, tokens) of each piece, oldest first


@dataclass
class Settlement:
    trained: list[TrainedGroup]  # groups whose last sample ended this step, in launch order
    finished: list[FinishedSample]  # samples that ended this step, full length (the predictor's history)
    carried: int  # samples carried into the next step
    stale_tokens: int  # trained response tokens generated before this step (older weights)
    trained_tokens: int  # trained response tokens
    max_age: int  # largest age, in steps, of a trained token

    @property
    def trained_prompt_and_response_tokens(self) -> int:
        return sum(g.prompt_length * len(g.lengths) + sum(g.lengths) for g in self.trained)

    def report_fields(self) -> dict[str, Any]:
        """What the step report says of the trained groups: their response tokens, the stale share and largest
        age of those tokens, how many groups trained and how many samples are carried on."""
        return {
            "response_tokens": self.trained_tokens,
            "stale_token_fraction": self.stale_tokens / self.trained_tokens if self.trained_tokens else 0.0,
            "max_token_age_steps": self.max_age,
            "groups_trained": len(self.trained),
            "carried_samples": self.carried,
        }


class CarryBook:
    """The carried samples and the open groups between steps; see the module docstring."""

    def __init__(self) -> None:
        self.carried: list[Piece] = []
        self.groups: dict[int, Group] = {}
        self._launched = 0
        self.step_pieces: list[Piece] = []  # the current step's samples, in its batch order

    def pieces(
        self,
        new: PromptBatch | None,
        predicted: np.ndarray | None = None,
        *,
        budget: int | None = None,
        remaining: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
        cap: int | None = None,
    ) -> tuple[PromptBatch, np.ndarray, np.ndarray]:
        """The step's batch (carried samples first, one prompt each, then ``new``'s groups), a predicted
        length per prompt of it (for a new prompt its prediction capped at ``budget``; for a carried sample
        ``remaining(predicted totals, generated)``, by default the prediction less what it has, at least 1) and
        the most tokens each may generate this step (``budget`` for new prompts; for carried samples, which
        finish, the run's length ``cap`` less what they have, or unbounded)."""
        pieces = list(self.carried)
        uids = [f"{p.uid}~g{p.group}s{p.sample_index}" for p in pieces]
        plen = [p.prompt_length + p.generated for p in pieces]
        n = [1] * len(pieces)
        totals = np.array([p.predicted for p in pieces], dtype=np.float64)
        have = np.array([p.generated for p in pieces], dtype=np.float64)
        left = remaining(totals, have) if remaining is not None and pieces else np.maximum(totals - have, 1.0)
        pred = [float(x) for x in left]
        if new is not None and len(new):
            new_pred = np.zeros(len(new)) if predicted is None else np.asarray(predicted, dtype=np.float64)
            for i, uid in enumerate(new.uids):
                g = self._launched
                self._launched += 1
                k = int(new.n_samples[i])
                self.groups[g] = Group(uid, k, int(new.prompt_lengths[i]))
                for j in range(k):
                    pieces.append(Piece(g, uid, j, int(new.prompt_lengths[i]), 0, float(new_pred[i])))
                uids.append(uid)
                plen.append(int(new.prompt_lengths[i]))
                n.append(k)
                pred.append(float(new_pred[i]) if budget is None else min(float(new_pred[i]), float(budget)))
        self.step_pieces = pieces
        # a carried sample's prompt is its prompt plus its tokens, which only a real backend holds: no token ids
        tokens = new.token_flat if new is not None and not self.carried else None
        batch = PromptBatch(
            uids=uids,
            prompt_lengths=np.asarray(plen, dtype=np.int64),
            n_samples=np.asarray(n, dtype=np.int64),
            token_flat=tokens,
        )
        caps = np.full(len(uids), np.inf)
        if cap is not None:
            caps[: len(self.carried)] = np.maximum(cap - have, 1.0)
        if budget is not None:
            caps[len(self.carried) :] = float(budget)
        return batch, np.asarray(pred, dtype=np.float64), caps

    def settle(
        self, step: int, lengths: list[int], ended: list[bool], train: Collection[int] | None = None
    ) -> Settlement:
        """``lengths[i]``: tokens the step's i-th sample (batch order) generated; ``ended[i]``: whether its
        sample ended (else it is carried). ``train``: the groups that train now (each must be complete; a
        complete group not named stays open and must be named by a later step); default: every complete one."""
        pieces = self.step_pieces
        if len(lengths) != len(pieces) or len(ended) != len(pieces):
            raise CarryError(f"step {step} had {len(pieces)} samples; the backend reported {len(lengths)}")
        self.carried = []
        done: list[int] = []
        finished = []
        for piece, tokens, end in zip(pieces, lengths, ended, strict=True):
            if tokens < 0:
                raise CarryError(f"sample {piece.uid}/{piece.sample_index} reported {tokens} tokens")
            if tokens:
                piece.steps.append((step, int(tokens)))
            total = piece.generated + int(tokens)
            if not end:
                carried = Piece(piece.group, piece.uid, piece.sample_index, piece.prompt_length, total, piece.predicted)
                carried.steps = list(piece.steps)
                self.carried.append(carried)
                continue
            finished.append(self._end(piece, total))
            if len(self.groups[piece.group].lengths) == self.groups[piece.group].n:
                done.append(piece.group)
        if train is not None:
            unknown = [g for g in train if g not in self.groups or len(self.groups[g].lengths) != self.groups[g].n]
            if unknown:
                raise CarryError(f"step {step} may not train group(s) {sorted(unknown)[:5]}: open or unknown")
            done = list(train)
        return self._train(step, sorted(set(done)), finished)

    def _end(self, piece: Piece, total: int) -> FinishedSample:
        """``piece``'s sample ended at ``total`` tokens: into its group, as a finished sample."""
        group = self.groups[piece.group]
        if piece.sample_index in group.lengths:
            raise CarryError(f"sample {piece.uid}/{piece.sample_index} ended twice")
        group.lengths[piece.sample_index] = total
        group.steps[piece.sample_index] = list(piece.steps)
        return FinishedSample.model_construct(
            uid=piece.uid,
            sample_index=piece.sample_index,
            prompt_length=piece.prompt_length,
            response_length=total,
            actor_id=None,
            migrations=0,
            finish_reason="stop",
            predicted_length=piece.predicted,
        )

    def _train(self, step: int, groups: list[int], finished: list[FinishedSample]) -> Settlement:
        """The complete ``groups`` leave the book and train in ``step``, each sample's tokens aged by the steps
        that made them."""
        trained = []
        stale = tokens_all = age = 0
        for g in groups:
            group = self.groups.pop(g)
            order = range(group.n)
            steps = [group.steps[i] for i in order]
            trained.append(TrainedGroup(group.uid, g, group.prompt_length, [group.lengths[i] for i in order], steps))
            for per_sample in steps:
                for s, t in per_sample:
                    tokens_all += t
                    if s < step:
                        stale += t
                        age = max(age, step - s)
        return Settlement(trained, finished, len(self.carried), stale, tokens_all, age)

    def state(self) -> dict[str, Any]:
        """What the book holds between steps, as plain data (a checkpoint's): the groups launched so far, the
        carried samples and the open groups."""
        return {
            "launched": self._launched,
            "carried": [asdict(p) for p in self.carried],
            "groups": {str(g): asdict(grp) for g, grp in self.groups.items()},
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> CarryBook:
        """A book holding what ``state()`` saved (after a round trip through JSON: tuples as lists, keys as str)."""
        book = cls()
        book._launched = int(state["launched"])
        book.carried = [Piece(**{**p, "steps": [tuple(x) for x in p["steps"]]}) for p in state["carried"]]
        for g, grp in state["groups"].items():
            lengths = {int(k): int(v) for k, v in grp["lengths"].items()}
            steps = {int(k): [tuple(x) for x in v] for k, v in grp["steps"].items()}
            book.groups[int(g)] = Group(grp["uid"], int(grp["n"]), int(grp["prompt_length"]), lengths, steps)
        return book

    def open_group_ids(self) -> list[int]:
        """Groups launched and not trained yet (carried samples, or complete and held), oldest first."""
        return sorted(self.groups)


def batch_cut(held: Sequence[int], fresh: Sequence[int], done_at: dict[int, float], b: int) -> tuple[set[int], float]:
    """Which groups a batch-cut step trains and when it ends (partial rollouts cut at B groups): every group
    ``held`` from the step before, then the first ``B - len(held)`` of the ``fresh`` ones to complete
    (``done_at``: each group's completion time; ties in launch order); everything in flight, with no cut (inf),
    when that is B or fewer. The other samples are cut at the returned time and carried."""
    if len(held) + len(fresh) <= b:
        return {*held, *fresh}, math.inf
    first = sorted(fresh, key=lambda g: (done_at[g], g))[: max(b - len(held), 0)]
    train = {*held, *first}
    return train, max(done_at[g] for g in train)


def plan_pieces(
    planner: StepPlanner,
    book: CarryBook,
    new: PromptBatch | None,
    step: int,
    fallbacks: list[str],
    budget: int | None = None,
) -> tuple[PromptBatch, StepPlan]:
    """A carrying step's work planned: ``book.pieces`` (the carried samples, one prompt each, then ``new``'s groups,
    a new sample's first piece at most ``budget`` tokens) and the plan, whose fallbacks start with ``fallbacks`` (the
    step's so far, the predictor's included). A carried sample's predicted length is what the learned spread expects
    it still to generate. ``book.step_pieces`` holds the pieces, in batch order."""
    pred = planner.predict(new, fallbacks) if new is not None and len(new) else None
    spread = planner.spread
    # a carried sample's expected remainder, in the predictor's units (the check model scales them again)
    remaining = (lambda t, h, sp=spread: sp.remaining(t, h) / sp.scale) if spread is not None else None
    batch, piece_pred, caps = book.pieces(
        new, pred, budget=budget, remaining=remaining, cap=spread.cap if spread and spread.cap else None
    )
    plan = planner.plan(
        batch, step=step, predicted=piece_pred, segment_tokens=budget, length_caps=caps, fallbacks=fallbacks
    )
    return batch, plan
