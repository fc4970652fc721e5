"""The small typed interfaces each policy kind implements.

A policy is a plain object: no Ray, no vLLM, no GPU. The planner calls it with a ``PromptBatch`` (numpy
columns) and validates what comes back, so a policy that breaks a guarantee below is replaced by its kind's
baseline for that step rather than corrupting a training run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from rlhfless_sdk.api.batch import PromptBatch
from rlhfless_sdk.api.records import (
    Actor,
    ActorPlacement,
    CandidateEstimate,
    Cluster,
    FinishedSample,
    MigrationDecision,
    PrefillPlan,
    StepProgress,
)


@runtime_checkable
class LengthPredictor(Protocol):
    """Predicts each prompt's response length before the step runs.

    May assume: ``observe`` is called with every finished sample of earlier steps, in step order.
    Must guarantee: ``predict`` returns a float array of shape ``(len(batch),)``, finite and >= 0, and does
    not change the batch. A prompt never seen must still get a prediction (the policy documents its cold start).
    """

    def predict(self, batch: PromptBatch) -> np.ndarray: ...

    def observe(self, samples: Sequence[FinishedSample]) -> None: ...


@runtime_checkable
class PrefillPlanner(Protocol):
    """Groups prompts that share a token prefix so that the prefix is prefilled once.

    May assume: ``capacity_tokens`` > 0 is what the prefill actor can hold in one batch.
    Must guarantee: every prompt index appears in exactly one group; a group's ``prefix_tokens`` is no longer
    than its shortest member and all members share those tokens; ``tokens_after <= tokens_before``.
    """

    def plan(self, batch: PromptBatch, capacity_tokens: int) -> PrefillPlan: ...


@runtime_checkable
class PromptAssigner(Protocol):
    """Decides which decode actor runs each prompt.

    May assume: ``predicted`` has shape ``(len(batch),)``, finite and >= 0; ``num_actors`` >= 1.
    Must guarantee: returns an int array of actor indices in ``[0, num_actors)``, either one per prompt
    (shape ``(P,)``: all n samples of a prompt go together) or, for a policy that documents splitting groups,
    one per sample (shape ``(S,)``, samples in prompt order); the planner returns samples to the trainer
    regrouped by prompt either way.
    """

    def assign(self, batch: PromptBatch, predicted: np.ndarray, num_actors: int) -> np.ndarray: ...


@runtime_checkable
class Migrator(Protocol):
    """Cut-and-migrate: decides, mid-step, which unfinished samples move to which actor.

    May assume: ``progress`` lists every decode actor and every started, unfinished sample at this instant.
    Must guarantee: each decision names an unfinished sample once, moves it to a different actor, and the
    decisions sent to one actor never exceed its ``free_slots``; ``tokens_generated`` equals the sample's
    (the tokens travel with it, none is lost). Returning ``[]`` is always valid.
    """

    def decide(self, progress: StepProgress) -> list[MigrationDecision]: ...


@runtime_checkable
class ActorScaler(Protocol):
    """Chooses how many decode actors the step uses.

    May assume: ``choose`` receives one estimate per candidate returned by ``candidates``.
    Must guarantee: ``candidates`` returns distinct counts within ``[min_actors, max_actors]``; ``choose``
    returns one of the estimates' ``num_actors`` and documents the criterion it minimises. A scaler that asks for
    checked estimates may also implement ``search(space: CandidateSearch) -> int``, which estimates only the counts
    it needs and returns one of them (the argmin of its criterion over those it estimated).
    """

    def candidates(self, min_actors: int, max_actors: int) -> Sequence[int]: ...

    def choose(self, estimates: Sequence[CandidateEstimate]) -> int: ...


class CandidateSearch:
    """A scaler's candidate counts, each estimated only when the scaler asks for it (``space(n)``).

    A per-sample estimate of one count costs milliseconds (an event simulation of every sample), so a scaler
    that compares checked estimates may implement ``search(space) -> int`` to look at a few counts instead of
    every one: the planner then calls ``search`` instead of ``choose``, and the plan lists only the counts it
    estimated (``space.estimated``). ``counts``: the candidates, ascending; ``fleet``: the most decode actors the
    fleet holds without serverless burst actors; ``uncertainty``: what every estimate's ``uncertainty`` says (the
    median relative error of the planner's recent checked estimates, 1 before any was measured).
    """

    def __init__(
        self, counts: Sequence[int], estimate: Callable[[int], CandidateEstimate], fleet: int, uncertainty: float
    ) -> None:
        self.counts = tuple(sorted(int(n) for n in counts))
        self.fleet = int(fleet)
        self.uncertainty = float(uncertainty)
        self._estimate = estimate
        self._seen: dict[int, CandidateEstimate] = {}

    def __call__(self, n: int) -> CandidateEstimate:
        """The estimate of ``n`` actors, made once."""
        if n not in self.counts:
            raise ValueError(f"{n} actors is not one of the candidates {list(self.counts)}")
        if n not in self._seen:
            self._seen[n] = self._estimate(n)
        return self._seen[n]

    @property
    def estimated(self) -> tuple[CandidateEstimate, ...]:
        """Every estimate made so far, by count."""
        return tuple(self._seen[n] for n in sorted(self._seen))


@runtime_checkable
class ActorPlacer(Protocol):
    """Puts the learner, the prefill actor and the decode actors onto the cluster's GPUs.

    May assume: ``decode_loads[i]`` is decode actor i's predicted work; ``extra`` lists the other actors to
    place (learner, prefill), each with its GPU count; the cluster has enough GPUs for all of them.
    Must guarantee: one placement per actor (every extra actor, then decode actors 0..N-1, any order), each
    on an existing node, within that node's GPUs, no GPU used twice.
    """

    def place(
        self, decode_loads: np.ndarray, cluster: Cluster, gpus_per_actor: int, extra: Sequence[Actor]
    ) -> list[ActorPlacement]: ...


@runtime_checkable
class StragglerPolicy(Protocol):
    """Decides how a step treats its long tail: how many tokens a newly started sample may generate this step.

    May assume: ``step`` is the training step about to generate (0, 1, ...).
    Must guarantee: ``segment_tokens`` returns None (every sample runs to its end, as today) or a positive
    token budget; a sample that reaches it is carried, with its tokens, into the next step and finished there
    (so no token is more than one weight update old when it trains), and a prompt's group trains only once all
    its samples have finished.

    A policy that also implements ``OverProvisioning`` (and maybe ``KeepsCutTokens``) asks for another way of
    running steps; ``rlhfless_sdk.rollout.modes.mode_of`` says which driver each policy gets.
    """

    def segment_tokens(self, step: int) -> int | None: ...


@runtime_checkable
class OverProvisioning(Protocol):
    """A straggler policy's capability: start more groups than a step trains (tail batching's rounds).

    Must guarantee: ``over_provision(step)`` is a finite number >= 0, the extra share of groups the step starts;
    the step trains the first B groups to finish, and the others' prompts are re-run from scratch later
    (on-policy), unless the policy also ``KeepsCutTokens``."""

    def over_provision(self, step: int) -> float: ...


@runtime_checkable
class KeepsCutTokens(OverProvisioning, Protocol):
    """A straggler policy's capability on top of ``OverProvisioning``: ``keeps_tokens(step)`` True means the groups a
    step does not train keep their tokens, continue in the next step under the new weights and train there
    (partial rollouts cut when B groups are complete, APRIL-style; tokens at most one weight update old)."""

    def keeps_tokens(self, step: int) -> bool: ...


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens for speculative decoding; the engine verifies them against the target model.

    May assume: ``observe`` gets each finished group of a prompt (its token ids and the responses' token ids) after
    the step that made it; ``propose`` gets a running sequence's prompt and response so far, its group siblings'
    responses so far, and the budget ``k`` that ``draft_tokens`` gave for this step.
    Must guarantee: ``draft_tokens`` returns an int >= 0; ``propose`` returns at most ``k`` token ids (``[]``: no
    draft this step); memory stays bounded however long it runs. It can never change what is sampled: rejection
    sampling keeps only what the target model agrees with, so a bad draft costs time, never correctness. A drafter
    that raises is replaced by ``none`` (no drafts) with a warning naming it.

    A drafter with ``engine_method()`` (a dict) runs on vLLM as that built-in method (``ngram``); others run through
    the adapter's proposer class in each engine. A drafter with ``drafts_on(device)`` (``gpu`` or ``cpu``) that
    returns False drafts nothing on engines of that device: they are built without speculative decoding.
    """

    def draft_tokens(self, running: int, remaining: float | None = None) -> int: ...

    def propose(
        self, prompt: Sequence[int], response: Sequence[int], k: int, siblings: Sequence[Sequence[int]] = ()
    ) -> list[int]: ...

    def observe(self, prompt: Sequence[int], responses: Sequence[Sequence[int]]) -> None: ...


@dataclass(frozen=True)
class Candidate:
    """One candidate plan of a step as a cost model estimates it: the batch, the predicted lengths (one per prompt,
    or one per sample in prompt order to evaluate a plan against lengths that differ within a group), each sample's
    decode actor (or each prompt's), the decode actors and the prefill plan."""

    batch: PromptBatch
    predicted: np.ndarray
    sample_actor: np.ndarray
    num_actors: int
    prefill: PrefillPlan


@runtime_checkable
class CostModel(Protocol):
    """Estimates a step's time and GPU-seconds for one candidate plan (the SDK's interface; see cost model).
    ``migrates``: the scheduler cuts and migrates laggards; ``warm_actors``: actors ``0..warm_actors-1`` need no
    start-up."""

    def estimate(self, candidate: Candidate, migrates: bool = False, warm_actors: int = 0) -> CandidateEstimate: ...
