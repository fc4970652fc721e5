"""Toy ways of running steps, in one file, as a third-party plugin ships them (the tests install it through an
entry point, as pip would). Nothing else in the project names them.

- A step driver: the straggler policy ``toy-plain`` and the driver that claims it, whose session draws a batch of B
  prompts a step and runs it as a plain step (one printed line a step); preset ``toy-plain``. The simulator runs its
  steps through the session; the OpenRLHF adapter runs the same session on its engines (``RoundsRun``).
- A pipeline: ``toy-pipe`` (``pipeline: {mode: toy-pipe}``), its simulator run (the driver's steps, one after the
  other) and its own run on OpenRLHF (``backends["openrlhf"]``: the driver's session, one printed line a batch);
  preset ``toy-pipe``, the toy driver's steps inside the toy pipeline."""

from __future__ import annotations

from typing import Any

from rlhfless_sdk import DriverSpec, NoParams, PipelineSpec, PolicySpec, SchedulerConfig, hookimpl
from rlhfless_sdk.rollout.drivers import PlainStep

NAME = "toy-plain"
PIPE = "toy-pipe"


class ToyPlain:
    """The straggler policy: every sample runs to its end (no token budget)."""

    def __init__(self, params: Any = None) -> None:
        pass

    def segment_tokens(self, step: int) -> None:
        return None


class ToyPlainSession:
    """The steps of a run: each one draws the source's next batch (``io.draw(None)``: B prompts) and runs it as a
    plain step; none is left once the source is dry."""

    mode = NAME

    def __init__(self, planner: Any, b: int, stream: Any) -> None:
        self.planner, self.book, self.steps = planner, None, 0  # it carries nothing between steps

    def next(self, io: Any, step: int) -> Any:
        prompts = io.draw(None)
        if not prompts:
            return None
        self.steps += 1
        print(f"{NAME}: step {self.steps} runs {len(prompts)} prompts", flush=True)
        return PlainStep(self.planner, io.step_number(step)).run(io, io.batch(prompts))


def claims(config: SchedulerConfig, straggler: Any, ask: Any) -> bool:
    return isinstance(straggler, ToyPlain)


def simulate_pipe(sim: Any, config: SchedulerConfig, workload: Any, on_step: Any, mode: Any) -> Any:
    """The toy pipeline on the simulator: its driver's steps, one after the other."""
    return sim.run_driven(sim.planner(config), workload, on_step, mode.driver)


def openrlhf_pipe(gen: Any) -> Any:
    """The toy pipeline on OpenRLHF: its driver's session on the engines, one printed line a batch (the adapter is
    imported here only, where the pipeline runs on it)."""
    from rlhfless_openrlhf.run_modes import RoundsRun

    class ToyPipeRun(RoundsRun):
        batches = 0

        def batch(self, dataloader_iter: Any, b: int, dynamic_filtering: bool, kw: dict[str, Any]) -> Any:
            self.batches += 1
            print(f"{PIPE}: batch {self.batches}", flush=True)
            return super().batch(dataloader_iter, b, dynamic_filtering, kw)

    return ToyPipeRun(gen, NAME)


@hookimpl
def rlhfless_register_stragglers(register):
    register(PolicySpec(name=NAME, factory=ToyPlain, params=NoParams, description="a toy: every sample to its end"))


@hookimpl
def rlhfless_register_modes(register):
    register(DriverSpec(NAME, claims, session=ToyPlainSession, description="a toy: a plain step through a session"))
    register(
        PipelineSpec(
            PIPE, simulate=simulate_pipe, backends={"openrlhf": openrlhf_pipe}, description="a toy: the driver's steps"
        )
    )


def _preset(name: str, pipeline: str) -> SchedulerConfig:
    return SchedulerConfig.model_validate(
        {
            "name": name,
            "group": "preset",
            "description": f"a toy preset: OpenRLHF's dispatch, the toy driver's steps, pipeline {pipeline}",
            "predictor": "prompt-length",
            "prefill_planner": "none",
            "assigner": "least-pending",
            "migrator": "none",
            "scaler": "fixed",
            "placer": "pack",
            "straggler": NAME,
            "pipeline": {"mode": pipeline},
        }
    )


@hookimpl
def rlhfless_register_schedulers(register):
    register(_preset(NAME, "sync"))
    register(_preset(PIPE, PIPE))
