"""The rollout/learner split of a pipeline, chosen for the user before a launch.

OpenRLHF's async loop keeps the split it was launched with (its DeepSpeed learner cannot be resized without a
restart), so the split decides what a stream gains. ``choose_split`` runs the pipeline on this simulator (the same
step core the launch runs) over a planning workload: a trace of the user's own run, or a workload made from the
profile and the dataset's prompt lengths. It walks from the middle split towards the faster neighbour until
neither is faster (step time against the split is one valley: too few engines starve the learner, too few
learner GPUs starve the engines), and measures OpenRLHF's async mode at its own best split on the same workload
for the expected gain. Where lengths drift, it also says whether restarting the learner at another split partway
through pays: the rest of the run at the best split there, plus the restart (``LearnerState.restart_s``),
against the rest at the chosen one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from rlhfless_sdk.api.config import SchedulerConfig
from rlhfless_sdk.api.errors import RlhflessError
from rlhfless_sdk.rollout.modes import mode_for
from rlhfless_sdk.workloads.traces import Workload

#: The scheduler the expected gain is measured against: OpenRLHF's async mode at its best split.
BASELINE = "openrlhf-async"
#: The least a plan must gain on its own cost model to run instead of what it replaces (never slower: within the
#: model's own noise, OpenRLHF's mode runs, with fewer moving parts).
MIN_GAIN = 0.01


def runs_plan(plan_s: float, replaced_s: float | None) -> bool:
    """Whether a plan priced ``plan_s`` runs instead of what it replaces (priced ``replaced_s``; None: unknown)."""
    return replaced_s is None or plan_s * (1 + MIN_GAIN) < replaced_s


@dataclass
class Restart:
    """A restart at ``rollout_gpus`` before step ``at_step`` saves ``saves_s`` net of its ``restart_s``."""

    at_step: int
    rollout_gpus: int
    saves_s: float
    restart_s: float


@dataclass
class SplitChoice:
    """The chosen split, each split tried with its time, the baseline at its best split, and restart advice."""

    scheduler: str
    gpus: int
    rollout_gpus: int
    time_s: float
    steps: int
    source: str
    tried: dict[int, float] = field(default_factory=dict)
    baseline_split: int | None = None
    baseline_s: float | None = None
    restart: Restart | None = None
    restart_checked: list[int] = field(default_factory=list)
    current: int | None = None  # the split a launch was given
    baseline_current_s: float | None = None  # the baseline at ``current``: what the launch runs without the plan
    fallback: bool = False  # priced slower than the baseline, so the baseline runs instead (``never_slower``)

    @property
    def gain(self) -> float | None:
        return self.baseline_s / self.time_s if self.baseline_s and self.time_s > 0 else None

    @property
    def replaced_s(self) -> float | None:
        """The time of what the plan replaces: the baseline at the launch's own split where one was given (what
        OpenRLHF runs with the same flags), else at its best split."""
        return self.baseline_current_s if self.baseline_current_s is not None else self.baseline_s

    def priced_slower(self) -> bool:
        """Whether the plan is not faster than what it replaces by ``MIN_GAIN``, on the same model (then the
        baseline runs instead)."""
        return not runs_plan(self.time_s, self.replaced_s)

    def line(self) -> str:
        """The one line a launch or ``rlhfless plan`` prints."""
        learn = self.gpus - self.rollout_gpus
        gain = (
            f", {self.gain:.2f}x OpenRLHF async at its best split ({self.baseline_split} rollout GPUs, "
            f"{self.baseline_s:,.0f} s)"
            if self.gain is not None
            else ""
        )
        if self.restart is not None:
            r = self.restart
            drift = (
                f"; lengths drift: restarting the learner at {r.rollout_gpus} rollout GPUs before step {r.at_step} "
                f"would save {r.saves_s:,.0f} s after its {r.restart_s:,.0f} s restart"
            )
        elif self.restart_checked:
            drift = "; no restart at another split pays on this workload"
        else:
            drift = ""
        line = (
            f"split for {self.scheduler}: {self.rollout_gpus} rollout GPUs, {learn} learner GPUs (of {self.gpus}), "
            f"chosen on {self.source}: {self.time_s:,.0f} s for {self.steps} steps expected{gain}{drift}"
        )
        if self.fallback:
            at = self.current if self.baseline_current_s is not None else self.baseline_split
            line += (
                f"; priced slower than OpenRLHF's async loop at {at} rollout GPUs ({self.replaced_s:,.0f} s), so "
                "that runs instead"
            )
        return line

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["tried"] = [{"rollout_gpus": r, "time_s": t} for r, t in sorted(self.tried.items())]
        out["gain"] = self.gain
        out["line"] = self.line()
        return out


def descend(splits: list[int], time_at: Callable[[int], float], start: int | None = None) -> int:
    """The split of least ``time_at`` found walking from ``start`` (default: the middle one) towards the faster
    neighbour until neither neighbour is faster."""
    i = splits.index(start) if start in splits else len(splits) // 2
    while True:
        here = time_at(splits[i])
        moves = [j for j in (i - 1, i + 1) if 0 <= j < len(splits)]
        best = min(moves, key=lambda j: time_at(splits[j]), default=i)
        if time_at(splits[best]) >= here:
            return splits[i]
        i = best


def choose_split(
    sim: Any,
    config: SchedulerConfig,
    workload: Workload,
    source: str,
    *,
    baseline: SchedulerConfig | None = None,
    drift: bool = True,
    allowed: Callable[[int], bool] | None = None,
    current: int | None = None,
) -> SplitChoice:
    """The split ``config``'s pipeline runs fastest at on ``workload`` (see the module docstring), on ``sim`` (a
    ``Simulator``, which imports this module: typed loosely to keep the import one-way); ``baseline``:
    the scheduler the gain is measured against (default OpenRLHF's async mode, when the registry has it).
    ``allowed``: only the rollout GPU counts it accepts are tried (a launch's learner must be one its trainer
    runs); ``current``: a split whose time is measured too (the one a launch was given), in ``tried``."""
    sim.begin(workload)
    every = sim.splits()
    splits = [r for r in every if allowed is None or allowed(r)]
    if not splits:
        raise RlhflessError(
            f"none of the {len(every)} rollout/learner splits of {sim.cluster.total_gpus} GPUs is one "
            "the launch can run"
        )
    tried: dict[int, float] = {}
    time_at = split_timer(sim, config, workload, tried)
    chosen = descend(splits, time_at)
    current = current if current is not None and current in every else None
    if current is not None:
        time_at(current)
    choice = SplitChoice(
        config.name, sim.cluster.total_gpus, chosen, tried[chosen], len(workload.steps), source, tried=tried
    )
    if baseline is None and BASELINE in sim.registry.schedulers:
        baseline = sim.registry.scheduler(BASELINE)
    if baseline is not None and baseline.name != config.name:
        base: dict[int, float] = {}
        base_at = split_timer(sim, baseline, workload, base)
        choice.baseline_split = descend(splits, base_at, start=chosen)
        choice.baseline_s = base[choice.baseline_split]
        if current is not None:
            choice.current, choice.baseline_current_s = current, base_at(current)
    if drift and len(workload.steps) >= 4:
        check_drift(sim, config, workload, splits, choice)
    return choice


def split_timer(
    sim: Any, config: SchedulerConfig, workload: Workload, cache: dict[int, float]
) -> Callable[[int], float]:
    """The run time of ``config``'s pipeline on ``workload`` at a rollout GPU count, each count simulated once
    (into ``cache``), on the scheduler's own engines (its drafter and KV watermark)."""
    mode = mode_for(config, sim.registry)

    def time_at(r: int) -> float:
        if r not in cache:
            run = sim.drafting(sim.speculation(config, workload), config.kv_watermark).pipeline_run(mode)
            cache[r] = sum(x.time_s for x in run(config, workload, None, r).reports)
        return cache[r]

    return time_at


def check_drift(sim: Any, config: SchedulerConfig, workload: Workload, splits: list[int], choice: SplitChoice) -> None:
    """Whether the best split drifts as the run goes on: at a quarter, half and three quarters of the workload,
    the rest is timed at each split; a restart there is noted in ``choice`` where it saves more than it costs."""
    n, chosen = len(workload.steps), choice.rollout_gpus
    restart_s = sim.restart_s()
    for k in sorted({n // 4, n // 2, (3 * n) // 4} - {0}):
        cache: dict[int, float] = {}
        time_at = split_timer(sim, config, replace(workload, steps=workload.steps[k:]), cache)
        better = descend(splits, time_at, start=chosen)
        choice.restart_checked.append(k)
        saves = time_at(chosen) - time_at(better) - restart_s
        if better != chosen and saves > 0 and (choice.restart is None or saves > choice.restart.saves_s):
            choice.restart = Restart(k, better, saves, restart_s)
