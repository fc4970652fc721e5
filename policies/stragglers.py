"""Straggler policies: what a step does about its long tail."""

from __future__ import annotations

from pydantic import Field, PositiveInt
from rlhfless_policies._base import Parameterless

from rlhfless_sdk import Record


class NoStragglerPolicy(Parameterless):
    """Baseline (OpenRLHF, verl): every sample runs to its end within its step."""

    description = "baseline: every sample finishes within its step"
    reads_predictions = False  # consults no predicted length

    def segment_tokens(self, step: int) -> int | None:
        return None


class PartialParams(Record):
    segment_tokens: PositiveInt = Field(
        default=2048, description="Most tokens a newly started sample generates in its first step."
    )


class PartialRollout:
    """Beyond the paper: partial rollouts (Kimi k1.5, APRIL) with at most one step of staleness.

    A new sample generates at most ``segment_tokens`` tokens in its first step; if it has not finished, it is
    carried with its tokens (and their logprobs, on a real backend) into the next step, continued there under the
    new weights until it ends, and its group trains once all its samples have. So the long tail of a step no
    longer waits for its longest samples, at the price of tokens one weight update old.
    """

    description = "partial rollouts: new samples stop at a token budget, finish in the next step (1 step stale)"

    def __init__(self, params: PartialParams | None = None) -> None:
        self.tokens = (params or PartialParams()).segment_tokens

    def segment_tokens(self, step: int) -> int | None:
        return self.tokens


class TailBatchParams(Record):
    over_provision: float = Field(
        default=0.25, ge=0.0, le=4.0, description="Extra share of groups a step starts beyond the B it trains."
    )
    margin: float | None = Field(
        None,
        ge=0.0,
        lt=1.0,
        description="Tail-batch a round only where the predicted lengths make it at least this share faster per "
        "trained group than a plain step (rlhfless_sdk.planning.tail_check), else run the plain step; none: every "
        "round.",
    )


class TailBatching:
    """Beyond the paper: tail batching (RollPacker, NSDI'26), on-policy.

    A step starts (1 + ``over_provision``) x B groups and trains on the first B to finish; the others are
    aborted (their tokens dropped) and their prompts deferred. Once B prompts are deferred, the next step runs
    them, and only them, to the end: the long tails wait for each other instead of every step waiting for its
    own. No token from older weights ever trains.
    """

    description = "tail batching: start extra groups, train the first B done, re-run the slowest later (on-policy)"

    def __init__(self, params: TailBatchParams | None = None) -> None:
        p = params or TailBatchParams()
        self.extra, self.margin = p.over_provision, p.margin

    def segment_tokens(self, step: int) -> int | None:
        return None

    def over_provision(self, step: int) -> float:
        return self.extra

    def tail_margin(self, step: int) -> float | None:
        return self.margin


class BatchCutParams(Record):
    over_provision: float = Field(
        default=0.25,
        ge=0.0,
        le=1.0,
        description="Extra share of B groups in flight: the groups a step does not train, carried into the next.",
    )


class BatchCutPartialRollout:
    """Beyond the paper: partial rollouts cut when B groups are done (APRIL), at most one step stale.

    A step has (1 + ``over_provision``) x B groups in flight: every group carried from the step before, which
    trains in this one, plus fresh ones. The step ends as soon as B groups are complete (the carried ones and
    the first fresh ones to finish); every other sample is cut there and carried, with its tokens, into the
    next step, where its group finishes and trains. So each step trains exactly B groups, the long tail of a
    step never waits for its longest fresh samples, and no token is more than one weight update old.
    """

    description = "partial rollouts cut when B groups are done (APRIL): exactly B groups a step, 1 step stale"

    def __init__(self, params: BatchCutParams | None = None) -> None:
        self.extra = (params or BatchCutParams()).over_provision

    def segment_tokens(self, step: int) -> int | None:
        return None

    def over_provision(self, step: int) -> float:
        return self.extra

    def keeps_tokens(self, step: int) -> bool:
        return True
