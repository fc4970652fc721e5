"""Speculative decoding in the cost model: what a drafter's acceptance buys, and what verifying its drafts costs.

A drafter proposes up to k tokens for a running sequence; one forward pass of the target model then scores the
k drafted tokens and the next one together, and rejection sampling keeps the drafted prefix the target agrees with
plus one token of its own. So a verification step yields ``1 + accepted`` tokens of a sequence instead of one,
whatever was drafted, and the sampled tokens have the target's distribution (lossless).

Per verification step of a sequence (``Acceptance``, measured on real rollouts):

- ``draft_rate``: the share of steps that carried a draft at all (a history drafter finds no match at times);
- ``accepted_at[j-1]``: the chance that the j-th drafted token was accepted, given a draft (non-increasing);
- ``drafted_per_draft``: the drafted tokens per draft at the measured budget ``K = len(accepted_at)``.

With a budget of k draft tokens a step yields ``tau(k) = 1 + draft_rate * sum(accepted_at[:k])`` tokens a sequence
(beyond K the last ratio continues geometrically) and computes ``1 + d(k)`` tokens a sequence, ``d(k) = draft_rate *
drafted_per_draft * min(k, K) / K`` (beyond K, ``draft_rate * k``). On the engine model a step of B sequences
holding ``ctx`` KV tokens costs what a plain step costs with the per-sequence compute ``s * B`` raised to ``s * B *
(1 + d)`` (the KV and the weights are read once for the k+1 positions) plus the proposer's host time
(``draft_overhead_s`` a step, ``search_s_per_seq`` a sequence and ``search_s_per_token`` a context token); it yields
``tau`` tokens a sequence, so one token of each sequence costs the step over tau.
Low concurrency is memory-bound (the extra positions are nearly free, so the step costs little more and yields
tau tokens); a full batch is compute-bound, where drafting costs more than it saves: the budget decides k per
step from the running count (``Speculation.budget``).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PrivateAttr, model_validator

from rlhfless_sdk.api.base import Record


class _Drafted(Record):
    """What a drafter's verification steps held: how often a draft, how deep each was kept, how long each was."""

    draft_rate: float = Field(ge=0.0, le=1.0, description="Share of a sequence's verification steps with a draft.")
    accepted_at: list[float] = Field(
        min_length=1, description="P(the j-th drafted token is accepted | a draft), j = 1..K, non-increasing."
    )
    drafted_per_draft: float = Field(ge=0.0, description="Drafted tokens per draft at the budget K.")

    @model_validator(mode="after")
    def _shape(self) -> _Drafted:
        a = self.accepted_at
        if any(not 0.0 <= x <= 1.0 for x in a):
            raise ValueError("accepted_at: each entry is a probability in [0, 1]")
        if any(a[j + 1] > a[j] + 1e-9 for j in range(len(a) - 1)):
            raise ValueError("accepted_at must be non-increasing (a token is accepted only after the ones before)")
        if self.drafted_per_draft > len(a) + 1e-9:
            raise ValueError(f"drafted_per_draft {self.drafted_per_draft} exceeds the budget K = {len(a)}")
        return self

    @property
    def budget(self) -> int:
        return len(self.accepted_at)

    def accepted(self, j: int) -> float:
        """P(the j-th drafted token is accepted | a draft), j >= 1; beyond K the last ratio goes on."""
        a = self.accepted_at
        if j <= len(a):
            return a[j - 1]
        ratio = a[-1] / a[-2] if len(a) > 1 and a[-2] > 0 else a[-1]
        return a[-1] * ratio ** (j - len(a))

    def tokens_per_step(self, k: int) -> float:
        """Tokens a verification step yields a sequence with a budget of ``k`` draft tokens."""
        return 1.0 + self.draft_rate * sum(self.accepted(j) for j in range(1, max(k, 0) + 1))

    def drafted(self, k: int) -> float:
        """Draft tokens a verification step computes for a sequence with a budget of ``k``."""
        if k <= 0:
            return 0.0
        K = self.budget
        if k <= K:
            return self.draft_rate * self.drafted_per_draft * k / K
        return self.draft_rate * (self.drafted_per_draft + (k - K))


class PositionAcceptance(_Drafted):
    """The acceptance of verification steps that start in one slice of a response: after the slice before it, up
    to ``upto`` of the response's length (a replay's first quarter, middle and last quarter)."""

    upto: float = Field(gt=0.0, le=1.0, description="The slice ends at this share of the response's length.")


class Acceptance(_Drafted):
    """A drafter's measured acceptance per verification step (see the module docstring)."""

    drafter: str = Field(min_length=1, description="The drafter these figures are for.")
    source: str = Field(min_length=1, description="What it was measured on, and the command that measured it.")
    assumption: bool = Field(default=False, description="True: figures assumed (published elsewhere), not measured.")
    tokens_per_step_measured: float | None = Field(
        default=None, ge=1.0, description="Tokens per verification step of a sequence, as measured (a check)."
    )
    search_s_per_seq: float = Field(
        default=0.0,
        ge=0.0,
        description="Host seconds the proposer takes per running sequence, each step it drafts (on the step's "
        "critical path), as measured: a drafter whose search does not scan the whole sequence (history).",
    )
    search_s_per_token: float = Field(
        default=0.0,
        ge=0.0,
        description="Host seconds the proposer's search takes per context token of a running sequence, each step "
        "it drafts, as measured: a drafter that scans the whole sequence (vLLM's n-gram lookup).",
    )

    by_position: list[PositionAcceptance] = Field(
        default_factory=list,
        description="The acceptance by where in a response a step starts (``upto`` ascending, the last 1.0), as a "
        "replay measures it (`rlhfless drafter-replay`); empty: the same everywhere. The figures above are overall.",
    )

    @model_validator(mode="after")
    def _slices(self) -> Acceptance:
        ends = [p.upto for p in self.by_position]
        if ends and (ends != sorted(set(ends)) or ends[-1] != 1.0):
            raise ValueError(f"by_position: upto must ascend to 1.0, not {ends}")
        if any(p.budget != self.budget for p in self.by_position):
            raise ValueError(f"by_position: each slice's accepted_at has the budget K = {self.budget}")
        return self


#: What an engine built with a drafter loses per decode step: vLLM 0.29 runs async scheduling (the host schedules
#: step N+1 while the model runs step N) only for EAGLE/MTP drafters (vllm-project/vllm#31998). Published figures
#: for what async scheduling gives a spec-decoding engine: 3.4% lower TPOT (vllm#25872, Llama-3.1-8B with EAGLE-3
#: on an L20, concurrency 1) and 3% (vllm#32951, DeepSeek-V3.2 with MTP on H100s, concurrency 1). The larger one is
#: taken. vLLM's V2 model runner, which runs only EAGLE-style drafters too, has no published step-time figure over
#: the V1 runner to price; it is not charged.
SYNC_PENALTY = 0.034


class Speculation(Record):
    """Speculative decoding on an engine of a profile: a drafter's acceptance and its per-step budget."""

    acceptance: Acceptance
    budget: list[NonNegativeInt] = Field(
        min_length=1,
        description="Draft tokens per verification step with 1, 2, ... sequences running (the last entry beyond).",
    )
    draft_overhead_s: NonNegativeFloat = Field(default=0.0, description="Host time to propose, per decode step.")
    sync_penalty: NonNegativeFloat = Field(
        default=SYNC_PENALTY,
        description="Share a decode step of an engine built with a drafter takes longer, whether it drafts or not: "
        "vLLM 0.29 turns async scheduling off for a drafter other than EAGLE/MTP (ngram, a custom_class proposer), "
        "so the host's scheduling no longer overlaps the model's step (see SYNC_PENALTY).",
    )
    _cache: dict[int, tuple[float, float]] = PrivateAttr(default_factory=dict)
    _slice_cache: dict[tuple[int, int], tuple[float, float]] = PrivateAttr(default_factory=dict)
    _tally: list[float] = PrivateAttr(default_factory=lambda: [0.0, 0.0])  # tokens, sequence steps (engines add)

    @classmethod
    def of_drafter(cls, acceptance: Acceptance, drafter: object, max_num_seqs: int) -> Speculation:
        """``drafter``'s own budget (its ``draft_tokens`` at 1 .. ``max_num_seqs`` running, no length known) at
        ``acceptance``; a negative count raises ValueError."""
        budget = [int(drafter.draft_tokens(r, None)) for r in range(1, max_num_seqs + 1)]
        if any(k < 0 for k in budget):
            raise ValueError(f"draft_tokens returned {min(budget)} (< 0)")
        return cls(acceptance=acceptance, budget=budget)

    def tally(self, tokens: float, steps: float) -> None:
        """Engines of this speculation add what they decoded: ``tokens`` in ``steps`` sequence-steps."""
        self._tally[0] += tokens
        self._tally[1] += steps

    def tokens_per_step(self) -> float | None:
        """Tokens a sequence's verification step yielded over what engines tallied (None: nothing decoded)."""
        return self._tally[0] / self._tally[1] if self._tally[1] > 0 else None

    def drafting_range(self) -> list[int] | None:
        """[fewest, most] running sequences at which a step drafts (None: at none)."""
        drafting = [r for r, k in enumerate(self.budget, start=1) if k > 0]
        return [drafting[0], drafting[-1]] if drafting else None

    def draft_tokens(self, running: int) -> int:
        b = self.budget
        return b[min(max(running, 1), len(b)) - 1]

    def at(self, running: int) -> tuple[float, float]:
        """(tokens a step yields a sequence, draft tokens it computes a sequence) with ``running`` sequences."""
        k = self.draft_tokens(running)
        got = self._cache.get(k)
        if got is None:
            got = self._cache[k] = (self.acceptance.tokens_per_step(k), self.acceptance.drafted(k))
        return got

    def at_positions(self, running: int, counts: Sequence[int]) -> tuple[float, float]:
        """``at`` averaged over the running sequences where the acceptance depends on the position in the response:
        ``counts[i]`` sequences are in the acceptance's slice ``i`` (``Acceptance.by_position``)."""
        total = sum(counts)
        if total == 0 or not self.acceptance.by_position:
            return self.at(running)
        k = self.draft_tokens(running)
        tau = drafted = 0.0
        for i, n in enumerate(counts):
            if n:
                got = self._slice_cache.get((i, k))
                if got is None:
                    piece = self.acceptance.by_position[i]
                    got = self._slice_cache[(i, k)] = (piece.tokens_per_step(k), piece.drafted(k))
                tau += n * got[0]
                drafted += n * got[1]
        return tau / total, drafted / total

    def best_tokens_per_step(self) -> float:
        """The most tokens a step yields a sequence under this budget, in any slice of a response (the work
        bound's)."""
        pieces = [self.acceptance, *self.acceptance.by_position]
        return max(a.tokens_per_step(k) for a in pieces for k in set(self.budget))


def drafts_on(drafter: object, device: str) -> bool:
    """Whether ``drafter`` drafts on engines of ``device`` (``gpu`` or ``cpu``): its optional ``drafts_on`` says,
    else it drafts on any. The simulator and the adapter's engine builder both ask here."""
    says = getattr(drafter, "drafts_on", None)
    return bool(says(device)) if callable(says) else True


def acceptance_tokens_needed(target_tau: float, budget: int) -> float:
    """The per-token acceptance a (draft every step, ``accepted_at[j] = a**j``) at which a budget of ``budget``
    draft tokens yields ``target_tau`` tokens a step: solves ``1 + a + ... + a**budget = target_tau``."""
    if target_tau <= 1.0:
        return 0.0
    if target_tau >= budget + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**j for j in range(budget + 1)) < target_tau:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def geometric(rate: float, budget: int) -> list[float]:
    """``accepted_at`` for a per-token acceptance ``rate``: ``rate, rate**2, ...`` (``budget`` entries)."""
    return [rate**j for j in range(1, budget + 1)]


__all__ = [
    "Acceptance",
    "PositionAcceptance",
    "Speculation",
    "acceptance_tokens_needed",
    "drafts_on",
    "geometric",
]
