"""What a step (or a pipeline's batch) bills, one formula for every backend: each engine's usage (``EngineUsage``:
from its first work to its last token, start-up included, burst or fleet), the step's (``StepUsage``), and
``billing``, its GPU-seconds serverless (each GPU while its engine or the learner holds it) and serverful (every
GPU of the run for the whole step)."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

log = logging.getLogger("rlhfless.rollout")


@dataclass(slots=True)
class EngineUsage:
    busy_s: float  # seconds with at least one sample running
    first_s: float | None  # first work this step (serverless billing starts); None: the engine did no work
    last_s: float  # last token
    cold_start_s: float = 0.0  # the engine was started for this step (0: warm from the previous step)
    burst: bool = False  # a serverless engine beyond the fleet: billed on top of the fleet even when serverful
    warm_in: bool = False  # burst: held since the step before (billed from the step's start, not its work)
    kept: bool = False  # burst: held after the step for the next one (billed to the step's end)


def held_s(e: EngineUsage, step_s: float) -> float:
    """Seconds an engine is billed in a step of ``step_s``: from its first work to its last token (plus its
    start-up when cold), or, for a burst engine held across steps, for as long as it is held: from the step's
    start when it was kept from the step before, to the step's end when it is kept for the next one."""
    if e.burst and (e.warm_in or e.kept):
        if e.warm_in:
            start = 0.0
        elif e.first_s is not None:
            start = e.first_s - e.cold_start_s
        else:  # not used: started for nothing only if kept
            start = step_s
        end = step_s if e.kept else (e.last_s if e.first_s is not None else start)
        return max(end - start, 0.0)
    if e.first_s is None:
        return 0.0
    return e.last_s - e.first_s + e.cold_start_s


def held(e: EngineUsage) -> bool:
    """Whether the engine holds its GPUs at some instant of the step."""
    return e.first_s is not None or (e.burst and (e.warm_in or e.kept))


@dataclass
class StepUsage:
    """What the backend measured (or simulated) for the report."""

    generation_s: float
    engines: list[EngineUsage]  # by engine id
    gpus: int  # GPUs billed for the whole step when serverful
    gpus_per_engine: int = 1
    prefill_s: float = 0.0  # the prefill actor's billed time, its start-up included (simulator's dedup prefill)
    prefill_tokens_saved: int = 0
    prepare_s: float = 0.0  # scoring, learning and the weight sync, on every GPU after generation
    learn_s: float = 0.0
    sync_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)  # backend-specific figures (preemptions, ...)
    learner_gpus: int | None = None  # GPUs that score and learn (default: all ``gpus``; fewer when disaggregated)
    step_s: float | None = None  # the step's wall time when learning overlaps generation (default: their sum)
    tail_scoring_gpu_s: float = 0.0  # GPUs held to score complete groups during generation (``tail_prepare``)
    plan_s: float = 0.0  # the plan's own time, in ``generation_s`` before any engine starts (not engines' idling)


def billing(u: StepUsage) -> dict[str, Any]:
    """The step's time and cost figures from what the backend measured: one formula for every backend and
    every way of running steps (synchronous, an async pipeline, partial rollouts, tail batching)."""
    g, gpa = u.gpus, u.gpus_per_engine
    learners = g if u.learner_gpus is None else u.learner_gpus
    generation = u.generation_s
    used = [e for e in u.engines if e.first_s is not None]
    time_s = generation + u.prepare_s + u.learn_s + u.sync_s if u.step_s is None else u.step_s
    # An engine is billed from its first work to its last token, plus its start-up when it was cold (the backend
    # delays a cold engine's first work by that start-up, so the start-up is in the step's time too); a burst
    # engine kept warm between steps is billed for as long as it is held, idle and learning time included.
    billed = [held_s(e, time_s) * gpa for e in u.engines]
    serverless = sum(billed) + u.prefill_s + learners * (u.prepare_s + u.learn_s) + g * u.sync_s
    serverless += u.tail_scoring_gpu_s
    burst_gpu_s = sum(b for b, e in zip(billed, u.engines, strict=True) if e.burst)
    burst_held = sum(1 for e in u.engines if e.burst and held(e))
    busy = np.array([e.busy_s for e in used]) if used else np.zeros(1)
    decode_gpus = max(len(used), 1) * gpa
    window = generation - u.plan_s  # from the plan to the last token
    idle = 1.0 - float(busy.sum()) * gpa / (decode_gpus * window) if window > 0 else 0.0
    return {
        "time_s": time_s,
        "generation_s": generation,
        "prepare_s": u.prepare_s,
        "learn_s": u.learn_s,
        "gpu_seconds": serverless,
        "gpu_seconds_serverful": g * time_s + burst_gpu_s,  # burst engines are paid on top of the fleet
        "idle_fraction": min(max(idle, 0.0), 1.0),
        "imbalance": float(busy.max() / busy.mean()) if busy.mean() > 0 else 1.0,
        "actor_busy_s": [e.busy_s for e in u.engines],
        "cold_starts": sum(1 for e in used if e.cold_start_s > 0),
        # the fleet (engines and learner share it, or split it in an async pipeline) plus burst engines held
        "peak_gpus": g + burst_held * gpa,
    }


def covered(spans: Sequence[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] inside at least one of ``spans`` ((start, end) pairs)."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in spans if min(b, hi) > max(a, lo))
    total, end = 0.0, lo
    for a, b in clipped:
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def window_gpu_seconds(
    lo: float,
    hi: float,
    engines: Sequence[Sequence[tuple[float, float]]],
    gpus_per_engine: int,
    trains: Sequence[tuple[int, tuple[float, float]]],
    updates: tuple[int, Sequence[tuple[float, float]]],
) -> float:
    """Serverless GPU-seconds of a pipeline's window [lo, hi] (a stream batch's or an async step's report, the
    simulated and the real one alike): each engine's GPUs while it is held (``engines``: the (from, until) spans
    of each engine), each training's learner GPUs while it trains (``trains``: (GPUs, span) per batch trained) and
    the learner GPUs during the weight updates (``updates``: (GPUs, spans)). Serverful is every GPU of the run for
    ``hi - lo``."""
    learners, update_spans = updates
    return (
        sum(covered(spans, lo, hi) for spans in engines) * gpus_per_engine
        + sum(n * covered([span], lo, hi) for n, span in trains)
        + learners * covered(update_spans, lo, hi)
    )


def stopped_at(u: StepUsage, t: float) -> StepUsage:
    """``u`` for a step whose engines stopped at ``t`` seconds (a round cut once enough groups finished): no
    engine works or is billed past ``t``; one that had not started by then did no work. ``t`` infinite: the step
    ran to its end, ``u`` as it is."""
    if math.isinf(t):
        return u
    engines = []
    for e in u.engines:
        if e.first_s is None or e.first_s >= t:
            engines.append(replace(e, first_s=None, busy_s=0.0, last_s=0.0))
        else:
            last = min(e.last_s, t)
            engines.append(replace(e, last_s=last, busy_s=min(e.busy_s, last - e.first_s)))
    return replace(u, engines=engines, generation_s=min(u.generation_s, t))
