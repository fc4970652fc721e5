"""Actor scalers: choose how many decode actors a step uses."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
from pydantic import ConfigDict, Field, PositiveInt

from rlhfless_sdk import CandidateEstimate, CandidateSearch, Record


def candidate_grid(lo: int, hi: int, max_candidates: int) -> list[int]:
    """Every count in [lo, hi] when there are few, else a geometric grid that keeps both ends."""
    if hi - lo + 1 <= max_candidates:
        return list(range(lo, hi + 1))
    grid = np.unique(np.round(np.geomspace(lo, hi, max_candidates)).astype(np.int64))
    return [int(x) for x in grid]


def first_meeting(counts: Sequence[int], meets: Callable[[int], bool], hint: int | None = None) -> int:
    """The first index of ``counts`` whose count ``meets`` (the last index when none does), for a test that holds
    from some index on: from ``hint`` outward in doubling steps to a bracket, then a bisection inside it (without
    a hint, a bisection of them all)."""
    lo, hi = 0, len(counts) - 1  # the answer lies in [lo, hi]
    if hint is not None:
        lo, hi = bracket(lambda i: meets(counts[i]), lo, hi, min(max(hint, lo), hi))
    while lo < hi:
        mid = (lo + hi) // 2
        if meets(counts[mid]):
            hi = mid
        else:
            lo = mid + 1
    return hi


def bracket(meets: Callable[[int], bool], lo: int, hi: int, i: int) -> tuple[int, int]:
    """A narrower [lo, hi] holding the first index that ``meets``, found from index ``i`` outward in doubling steps."""
    step = 1
    if meets(i):
        hi = i
        while i > lo:  # downward until one fails
            i = max(hi - step, lo)
            if not meets(i):
                return i + 1, hi
            hi, step = i, step * 2
        return lo, hi
    lo = i + 1
    while lo < hi:  # upward until one meets
        i = min(lo + step - 1, hi)
        if meets(i):
            return lo, i
        lo, step = i + 1, step * 2
    return lo, hi


def minmax(x: np.ndarray) -> np.ndarray:
    span = x.max() - x.min()
    return np.zeros_like(x) if span <= 0 else (x - x.min()) / span


class CostAwareParams(Record):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    lam: float = Field(default=0.7, ge=0.0, le=1.0, alias="lambda", description="Weight of time against cost.")
    max_candidates: PositiveInt = Field(default=32, description="Counts tried; a geometric grid beyond this.")
    normalise: Literal["min-max", "relative"] = Field(
        default="min-max",
        description="min-max over the candidates (the paper), or relative to the best candidate's time and cost.",
    )


class CostAwareScaler:
    """The paper's scaler: N' = argmin_N lambda * T~(N) + (1 - lambda) * C~(N).

    ``min-max`` (the paper): T~ and C~ are the cost model's step time and GPU-seconds, min-max normalised over
    the candidates; ties go to the faster candidate, then the smaller N. The pick then depends on the worst
    candidates: adding one that is slower and dearer than another (dominated) can widen a span and move the
    pick, and so does the candidate range (N = 1 usually sets the time span).
    ``relative``: T~ = T / min T and C~ = C / min C, each as a multiple of the best candidate's; ties go to the
    faster, then the cheaper, then the smaller N. Only the best values matter, so adding or removing a dominated
    candidate never changes the pick.
    """

    description = "argmin of lambda*time + (1-lambda)*cost, min-max normalised (RLHFless)"

    def __init__(self, params: CostAwareParams | None = None) -> None:
        self.params = params or CostAwareParams()

    def candidates(self, min_actors: int, max_actors: int) -> Sequence[int]:
        return candidate_grid(min_actors, max_actors, self.params.max_candidates)

    def scores(self, estimates: Sequence[CandidateEstimate]) -> np.ndarray:
        t = np.array([e.time_s for e in estimates], dtype=np.float64)
        c = np.array([e.gpu_seconds for e in estimates], dtype=np.float64)
        if self.params.normalise == "relative":
            eps = 1e-6  # seconds / GPU-seconds: keeps a zero estimate finite, the same for every candidate set
            return self.params.lam * (t + eps) / (t.min() + eps) + (1.0 - self.params.lam) * (c + eps) / (c.min() + eps)
        return self.params.lam * minmax(t) + (1.0 - self.params.lam) * minmax(c)

    def choose(self, estimates: Sequence[CandidateEstimate]) -> int:
        s = self.scores(estimates)
        if self.params.normalise == "relative":
            e = estimates
            best = min(range(len(e)), key=lambda i: (s[i], e[i].time_s, e[i].gpu_seconds, e[i].num_actors))
        else:
            best = min(range(len(estimates)), key=lambda i: (s[i], estimates[i].time_s, estimates[i].num_actors))
        return estimates[best].num_actors


class DeadlineParams(Record):
    slack: float = Field(
        default=0.05, ge=0.0, description="Allowed predicted time over the fastest candidate's (0.05 = 5%)."
    )
    deadline_s: float | None = Field(
        default=None, gt=0.0, description="An explicit step-time deadline in seconds (overrides slack)."
    )
    max_candidates: PositiveInt = Field(default=64, description="Counts tried; a geometric grid beyond this.")
    max_uncertainty: float = Field(
        default=0.05,
        ge=0.0,
        description="When the planner's recent estimates were off by more than this (median relative error), "
        "the slack is not trusted: never fewer actors than the whole fleet.",
    )


class DeadlineScaler:
    """Beyond the paper: the cheapest actor count whose predicted step time meets a deadline.

    The deadline is ``(1 + slack)`` times the fastest candidate's predicted time, or ``deadline_s``. Among the
    candidates that meet it, the one with the fewest predicted GPU-seconds wins (ties: faster, then fewer
    actors). If none meets an explicit deadline, the fastest candidate is chosen. The planner's cost model
    accounts for deduplicated prefill and, when the scheduler migrates, for cut-and-migrate; with a check model
    (the simulator's) every candidate is estimated per sample. When the planner's recent estimates were off by
    more than ``max_uncertainty`` (median relative error), a slack of 1% means nothing: the scaler then never
    picks fewer actors than the whole fleet (the most that need no serverless burst actor, what a fixed scaler
    runs), only the fleet or more, until the estimates are good again.
    """

    description = "cheapest actor count within a slack of the fastest predicted time (beyond the paper)"

    wants_migration_estimates = True  # the planner's estimates count on cut-and-migrate when it is on
    wants_checked_estimates = True  # per-sample estimates: a deadline within 1% needs them

    def __init__(self, params: DeadlineParams | None = None) -> None:
        self.params = params or DeadlineParams()
        self._last = 0  # the last trusted search's pick: where the next search starts

    def candidates(self, min_actors: int, max_actors: int) -> Sequence[int]:
        return candidate_grid(min_actors, max_actors, self.params.max_candidates)

    def limit(self, estimates: Sequence[CandidateEstimate]) -> float:
        if self.params.deadline_s is not None:
            return self.params.deadline_s
        return (1.0 + self.params.slack) * min(e.time_s for e in estimates)

    def search(self, space: CandidateSearch) -> int:
        """``choose`` over the few counts it needs: with the slack untrusted, only the fleet and the burst counts
        above it (it picks nothing below them); else the largest count (the fastest, as a step's time falls with
        engines), then the fewest engines within the deadline of it, searched from the last step's pick outward
        (doubling steps, then a bisection). Time falls and GPU-seconds grow with the count, near enough, so that
        count is the cheapest that meets the deadline; where the estimates say otherwise (a draw's noise),
        ``choose`` still decides among every count estimated. Three estimates when the pick holds from the step
        before, at most about twice log2(candidates) when it moves, instead of every candidate's."""
        counts = list(space.counts)
        if self.params.deadline_s is None and space.uncertainty > self.params.max_uncertainty:
            fleet = max((n for n in counts if n <= space.fleet), default=counts[0])
            return self.choose([space(n) for n in counts if n >= fleet])
        fastest = space(counts[-1]).time_s
        limit = (1.0 + self.params.slack) * fastest if self.params.deadline_s is None else self.params.deadline_s
        if fastest > limit * (1 + 1e-12):  # no count meets an explicit deadline: the fastest, on the fewest engines
            limit = fastest
        hint = max(bisect.bisect_right(counts, self._last) - 1, 0) if self._last else None
        space(counts[first_meeting(counts, lambda n: space(n).time_s <= limit * (1 + 1e-12), hint)])
        self._last = self.choose(space.estimated)  # an untrusted pick (the fleet) says nothing of where to start
        return self._last

    def choose(self, estimates: Sequence[CandidateEstimate]) -> int:
        if self.params.deadline_s is None and max(e.uncertainty for e in estimates) > self.params.max_uncertainty:
            # the estimates were recently off by more than the slack can absorb: never fewer actors than the
            # whole fleet (what runs today); more, serverless burst actors, only where they still pay
            fleet = max((e.num_actors for e in estimates if not e.burst), default=0)
            estimates = [e for e in estimates if e.num_actors >= fleet]
        limit = self.limit(estimates)
        feasible = [e for e in estimates if e.time_s <= limit * (1 + 1e-12)]
        if not feasible:
            return min(estimates, key=lambda e: (e.time_s, e.num_actors)).num_actors
        return min(feasible, key=lambda e: (e.gpu_seconds, e.time_s, e.num_actors)).num_actors


class FixedParams(Record):
    num_actors: PositiveInt | None = Field(
        default=None,
        description="Decode actors every step, clipped to what fits; default: as many as fit (OpenRLHF's count).",
    )


class FixedScaler:
    """Baseline: the same actor count every step (OpenRLHF's fixed ``--vllm.num_engines``)."""

    description = "baseline: the same actor count every step"
    reads_predictions = False  # consults no predicted length

    def __init__(self, params: FixedParams | None = None) -> None:
        self.num_actors = (params or FixedParams()).num_actors

    def candidates(self, min_actors: int, max_actors: int) -> Sequence[int]:
        n = max_actors if self.num_actors is None else self.num_actors
        return [min(max(n, min_actors), max_actors)]

    def choose(self, estimates: Sequence[CandidateEstimate]) -> int:
        return estimates[0].num_actors
