"""The built-in ways of running steps, registered through ``rlhfless_register_modes`` as a plugin's are (this module
is the default plugin ``rlhfless-modes``): the step drivers ``plain``, ``token-budget``, ``tail-rounds`` and
``batch-cut`` (their sessions in ``rlhfless_sdk.rollout.drivers``, written once for every backend) and the
pipelines ``async`` and ``stream`` (the simulator's runs of them, below)."""

from __future__ import annotations

from typing import Any

from rlhfless_sdk import hookimpl
from rlhfless_sdk.api.base import DriverSpec, PipelineSpec
from rlhfless_sdk.rollout.drivers import TailSession, batch_cut_session, budget_session
from rlhfless_sdk.rollout.modes import (
    ASYNC,
    BATCH_CUT,
    PLAIN,
    STREAM,
    TAIL_ROUNDS,
    TOKEN_BUDGET,
    cuts_and_keeps,
    not_the_baseline,
    over_provisions,
)


def simulate_async(sim: Any, config: Any, workload: Any, on_step: Any, mode: Any) -> Any:
    """OpenRLHF's async pipeline: at the scheduler's own split, else at the fastest split a search finds (the one
    a user tuning it would keep)."""
    fixed = sim.rollout_gpus(config)
    if fixed is None:
        return sim.best_split(config, workload, on_step, mode)
    return sim.run_async(config, workload, on_step, fixed, mode=mode)


def run_async_at(sim: Any, config: Any, workload: Any, on_step: Any, rollout_gpus: int, mode: Any) -> Any:
    return sim.run_async(config, workload, on_step, rollout_gpus, mode=mode)


def simulate_stream(sim: Any, config: Any, workload: Any, on_step: Any, mode: Any) -> Any:
    """The streaming pipeline: an elastic stream re-plans its split as it runs; a fixed one runs at its own split,
    else at the split a launch picks (``Simulator.planned_split``)."""
    if mode.elastic:
        return sim.run_stream(config, workload, on_step, None)
    fixed = sim.rollout_gpus(config)
    if fixed is None:
        return sim.planned_split(config, workload, on_step, mode)
    return sim.run_stream(config, workload, on_step, fixed)


def run_stream_at(sim: Any, config: Any, workload: Any, on_step: Any, rollout_gpus: int, mode: Any) -> Any:
    return sim.run_stream(config, workload, on_step, rollout_gpus)


@hookimpl
def rlhfless_register_modes(register):
    register(DriverSpec(PLAIN, lambda config, straggler, ask: True, description="every sample runs to its end"))
    register(
        DriverSpec(
            TOKEN_BUDGET,
            not_the_baseline,
            keeps_tokens=True,
            session=budget_session,
            description="new samples stop at a token budget and go on in the next step",
        )
    )
    register(
        DriverSpec(
            TAIL_ROUNDS,
            over_provisions,
            session=TailSession,
            description="rounds train the first B groups to complete; the others' prompts re-run later",
        )
    )
    register(
        DriverSpec(
            BATCH_CUT,
            cuts_and_keeps,
            keeps_tokens=True,
            session=batch_cut_session,
            description="steps cut when B groups are complete; the others carried with their tokens",
        )
    )
    register(
        PipelineSpec(
            ASYNC,
            simulate=simulate_async,
            run_at=run_async_at,
            description="OpenRLHF's async loop: rollout and learner GPUs, batches generated ahead",
        )
    )
    register(
        PipelineSpec(
            STREAM,
            keeps_tokens=True,
            simulate=simulate_stream,
            run_at=run_stream_at,
            description="engines generate on through training; batches of B complete groups",
        )
    )
