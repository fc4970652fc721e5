"""What a simulation returns: each step's report with what the simulator saw (``SimulatedStep``), a run's steps
and totals (``SimulationResult``), and the token ages of a carried batch (``carried_ages``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlhfless_sdk.api.records import (
    CandidateEstimate,
    StepPlan,
    StepReport,
)
from rlhfless_sdk.rollout.billing import StepUsage
from rlhfless_sdk.rollout.controller import StepOutcome
from rlhfless_sdk.rollout.drivers import Driven
from rlhfless_sdk.simulation.bound import WorkBound

#: What a run calls with each step's report as it is made (None: nothing).
OnStep = Callable[[StepReport], Any] | None


@dataclass
class SimulatedStep:
    """A step's report plus what the simulator saw that the report does not hold."""

    report: StepReport
    plan: StepPlan
    chosen: CandidateEstimate | None
    preemptions: int = 0
    frontier: list[dict] | None = None  # every candidate N: predicted and simulated (time, GPU-seconds)
    outcome: StepOutcome | None = None  # per sample: final actor, migrations, the segments of its tokens
    usage: StepUsage | None = None  # what the report bills (learning, burst engines kept or released)

    @classmethod
    def of(
        cls,
        report: StepReport,
        plan: StepPlan,
        outcome: StepOutcome,
        frontier: list[dict] | None = None,
        usage: StepUsage | None = None,
    ) -> SimulatedStep:
        return cls(report, plan, plan.chosen_candidate(), outcome.usage.extra["preemptions"], frontier, outcome, usage)


@dataclass(frozen=True)
class SimulationResult:
    scheduler: str
    steps: list[SimulatedStep]
    rollout_gpus: int | None = None  # async mode: GPUs that only generate
    workload_steps: int = 0  # the workload's steps (a carrying run may take one more to finish its carry)
    gpus: int = 0  # the fleet
    work: WorkBound | None = None  # the GPU work any schedule of the workload must do
    split_search: list[dict] | None = None  # async at its best split: each split tried and its time
    split_plan: dict | None = None  # a stream's split as a launch picks it (``simulation.split.SplitChoice``)
    stream: dict | None = None  # the streaming pipeline: batches, splits, re-plans
    drafter: dict | None = None  # speculative decoding: the drafter, its acceptance, tokens a step, drafted bound

    @property
    def reports(self) -> list[StepReport]:
        return [s.report for s in self.steps]

    def steady(self) -> list[StepReport]:
        """The steps a long run's pace is measured on, the same for every scheduler: the workload's steps but the
        first (engines' start-up, an async pipeline's fill) and the last (its drain); none with fewer than 3."""
        n = self.workload_steps or len(self.steps)
        return self.reports[1 : n - 1] if n >= 3 else []

    def totals(self) -> dict[str, float | None]:
        r = self.reports
        steady = self.steady()
        peak = max((x.peak_gpus for x in r), default=self.gpus)
        total = sum(x.time_s for x in r)
        bound = self.work.bound_s(peak) if self.work is not None and peak else None
        drafted = (self.drafter or {}).get("bound_gpu_s")  # a drafter that drafts somewhere: its bound's work
        return {
            "total_time_s": total,
            # a long run's pace: without the first step's start-up or pipeline fill and the last step's drain
            "steady_step_s": float(np.mean([x.time_s for x in steady])) if steady else None,
            "peak_gpus": peak,
            "bound_s": bound,
            "bound_fraction": bound / total if bound is not None and total > 0 else None,
            "total_generation_s": sum(x.generation_s for x in r),
            "total_gpu_seconds": sum(x.gpu_seconds for x in r),
            "total_gpu_seconds_serverful": sum(x.gpu_seconds_serverful for x in r),
            "migrations": sum(x.migrations for x in r),
            "prefill_tokens_saved": sum(x.prefill_tokens_saved for x in r),
            "mean_idle_fraction": float(np.mean([x.idle_fraction for x in r])) if r else 0.0,
            "stale_token_fraction": sum(x.stale_token_fraction * x.response_tokens for x in r)
            / max(sum(x.response_tokens for x in r), 1),
            "max_token_age_steps": max((x.max_token_age_steps for x in r), default=0),
            "rollout_gpus": self.rollout_gpus,
            # with a drafter: the work bound at its acceptance (the plain one is bound_s)
            "bound_drafted_s": drafted / peak if drafted is not None and peak else None,
        }


def carried_ages(driven: Driven, k: int, times: Sequence[Any]) -> tuple[int, int, int]:
    """(trained response tokens, stale ones, largest age) of batch ``k`` of an async pipeline whose batches are cut
    at B groups: a token generated in batch j is ``k - times[j].version`` weight updates old when batch k trains
    (an upper bound under partial rollout, where a broadcast mid-batch gives later tokens newer weights)."""
    assert driven.settled is not None
    total = stale = oldest = 0
    for group in driven.settled.trained:
        for per_sample in group.steps:
            for j, tokens in per_sample:
                age = k - times[j].version
                total += tokens
                if tokens > 0 and age > 0:
                    stale += tokens
                    oldest = max(oldest, age)
    return total, stale, oldest
