"""A toy way of running steps, in one file, as a third-party plugin ships one (the tests install it through an
entry point, as pip would): a straggler policy ``toy-plain``, the step driver that claims it (its session draws a
batch of B prompts a step and runs it as a plain step, printing one line a step), and a preset ``toy-plain`` that
uses it. Nothing else in the project names it: the simulator runs its steps through the session, and the OpenRLHF
adapter runs the same session on its engines (``rlhfless_openrlhf.run_modes.RoundsRun``)."""

from __future__ import annotations

from typing import Any

from rlhfless_sdk import DriverSpec, NoParams, PolicySpec, SchedulerConfig, hookimpl
from rlhfless_sdk.rollout.drivers import PlainStep

NAME = "toy-plain"


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


@hookimpl
def rlhfless_register_stragglers(register):
    register(PolicySpec(name=NAME, factory=ToyPlain, params=NoParams, description="a toy: every sample to its end"))


@hookimpl
def rlhfless_register_modes(register):
    register(DriverSpec(NAME, claims, session=ToyPlainSession, description="a toy: a plain step through a session"))


@hookimpl
def rlhfless_register_schedulers(register):
    register(
        SchedulerConfig.model_validate(
            {
                "name": NAME,
                "group": "preset",
                "description": "a toy preset: OpenRLHF's dispatch, its steps run by the toy driver",
                "predictor": "prompt-length",
                "prefill_planner": "none",
                "assigner": "least-pending",
                "migrator": "none",
                "scaler": "fixed",
                "placer": "pack",
                "straggler": NAME,
            }
        )
    )
