"""How a scheduler's steps run, decided once.

``mode_of`` reads a scheduler's ``pipeline`` block and the capabilities its straggler policy declares
(``rlhfless_sdk.api.protocols``) and returns a ``Mode``; the simulator, every command and the OpenRLHF adapter ask
it, and nothing else reads ``pipeline.mode`` or probes a policy to pick a loop. The driver names:

- ``plain``: every sample runs to its end within its step (the baseline straggler policy, as OpenRLHF and verl run);
- ``token-budget``: a new sample generates at most ``segment_tokens`` tokens in its first step and is carried into
  the next (``StragglerPolicy.segment_tokens``, any straggler policy other than the baseline);
- ``tail-rounds``: rounds that start extra groups, train the first B to complete and re-run the others' prompts
  from scratch later (``OverProvisioning``);
- ``batch-cut``: steps cut when B groups are complete, the others carried with their tokens (``KeepsCutTokens``).

A pipeline (``pipeline: async`` or ``stream``) runs its batches with its straggler policy's driver; its mode's
``name`` is the pipeline's (``async``, ``stream``), which is what a backend declares it runs.

Both lists are registries. A new way of running steps registers itself where it is written: a step driver with
``register_driver`` (what it claims, whether it keeps tokens of older weights, the session that runs its steps), a
pipeline with ``register_pipeline`` (its ``pipeline: mode`` name and the simulator's run of it). A backend that does
not run a registered mode refuses it in one line (``rlhfless_sdk.rollout.drivers.refusal``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from rlhfless_sdk.api.config import PIPELINE_MODES, SchedulerConfig
from rlhfless_sdk.api.kinds import KIND
from rlhfless_sdk.api.plugins import Registry, get_plugin_manager
from rlhfless_sdk.api.protocols import KeepsCutTokens, OverProvisioning

if TYPE_CHECKING:
    from rlhfless_sdk.planning.planner import StepPlanner

PLAIN, TOKEN_BUDGET, TAIL_ROUNDS, BATCH_CUT, ASYNC = "plain", "token-budget", "tail-rounds", "batch-cut", "async"
STREAM = "stream"

log = logging.getLogger("rlhfless.modes")

#: (config, its straggler policy, a checked ``keeps_tokens(0)`` call) -> whether a driver runs this scheduler's steps
Claim = Callable[[SchedulerConfig, Any, Callable[[], bool]], bool]


@dataclass(frozen=True)
class DriverSpec:
    """A step driver: its ``name``, which schedulers it runs (``claims``; drivers are asked in the order they were
    registered, a new one before the built-in ones), whether it trains tokens of older weights (``keeps_tokens``)
    and its ``session`` (``(planner, B, prompts) -> DriverSession``: the steps of a run; a built-in's is attached
    by ``rlhfless_sdk.rollout.drivers``; none at all: one step at a time, ``PlainStep``)."""

    name: str
    claims: Claim
    keeps_tokens: bool = False
    session: Callable[..., Any] | None = None


@dataclass(frozen=True)
class PipelineSpec:
    """A pipeline (``pipeline: mode``): its name, whether it trains tokens of older weights, and the simulator's
    run of it (``(simulator, config, workload, on_step, mode) -> SimulationResult``; None: the simulator's own)."""

    name: str
    keeps_tokens: bool = False
    simulate: Callable[..., Any] | None = None


_DRIVERS: dict[str, DriverSpec] = {}
_PIPELINES: dict[str, PipelineSpec] = {}


def register_driver(spec: DriverSpec) -> None:
    """Add a step driver; asked before those registered earlier (a driver that claims a new capability wins)."""
    if spec.name in _DRIVERS or spec.name in _PIPELINES:
        raise ValueError(f"a step driver or pipeline named {spec.name!r} is already registered")
    ahead = {spec.name: spec, **_DRIVERS}
    _DRIVERS.clear()
    _DRIVERS.update(ahead)


def register_pipeline(spec: PipelineSpec) -> None:
    """Add a pipeline; ``pipeline: mode`` accepts its name from now on."""
    if spec.name in _PIPELINES or spec.name in _DRIVERS:
        raise ValueError(f"a step driver or pipeline named {spec.name!r} is already registered")
    _PIPELINES[spec.name] = spec
    if spec.name not in PIPELINE_MODES:
        PIPELINE_MODES.append(spec.name)


def attach_session(name: str, session: Callable[..., Any]) -> None:
    """Give the registered driver ``name`` the session that runs its steps (a built-in's, from
    ``rlhfless_sdk.rollout.drivers``, which holds the session classes); its place in the order stays."""
    _DRIVERS[name] = replace(_DRIVERS[name], session=session)


def unregister(name: str) -> None:
    """Remove a registered driver or pipeline (a test's toy mode)."""
    _DRIVERS.pop(name, None)
    if _PIPELINES.pop(name, None) is not None and name in PIPELINE_MODES:
        PIPELINE_MODES.remove(name)


def drivers() -> dict[str, DriverSpec]:
    """Every registered step driver, in the order they are asked."""
    return _DRIVERS


def pipeline_spec(name: str) -> PipelineSpec:
    return _PIPELINES[name]


def mode_names() -> list[str]:
    """Every mode a backend may declare: the drivers', then the pipelines' (built-in first)."""
    return [*reversed(drivers()), *_PIPELINES]


@dataclass(frozen=True)
class Mode:
    """A scheduler's way of running steps: its ``pipeline`` (``sync``, ``async``, ``stream``), the ``driver`` each
    step (or a pipeline's batch) runs under, whether a stream re-plans its split (``elastic``) and whether a
    synchronous step scores (``prepare``) or also learns (``learn``) in its generation tail (``tail``)."""

    pipeline: str
    driver: str
    elastic: bool = False
    tail: str = ""

    @property
    def name(self) -> str:
        """The name a backend declares it runs: the pipeline's, else the driver's."""
        return self.pipeline if self.pipelined else self.driver

    @property
    def pipelined(self) -> bool:
        """Generation and learning on GPUs of their own, at once (``async`` or ``stream``)."""
        return self.pipeline != "sync"

    @property
    def fixed_split(self) -> bool:
        """A pipeline whose rollout/learner split is set (or searched) before the run, not re-planned in it."""
        return self.pipelined and not self.elastic

    @property
    def keeps_tokens(self) -> bool:
        """Whether it trains tokens generated under older weights (carried across a weight update, or generated on
        through one: the stream)."""
        return (_PIPELINES[self.pipeline] if self.pipelined else drivers()[self.driver]).keeps_tokens

    @property
    def carries(self) -> bool:
        """Whether its steps carry samples or defer prompts from one step to the next."""
        return self.driver != PLAIN


def mode_of(config: SchedulerConfig, straggler: Any, keeps_tokens: Callable[[], bool] | None = None) -> Mode:
    """The mode of ``config``, whose straggler policy is ``straggler`` (an instance). ``keeps_tokens``: how to ask
    it ``keeps_tokens(0)`` (a planner's checked call, which falls back to the baseline's answer); default: asked
    directly, a failure or an answer that is not a bool taken as the baseline's (False), with a warning."""
    pipeline = config.pipeline
    ask = keeps_tokens or (lambda: _asked(straggler))
    driver = next(spec.name for spec in drivers().values() if spec.claims(config, straggler, ask))
    return Mode(pipeline=pipeline.mode, driver=driver, elastic=pipeline.elastic, tail=tail_of(config))


def cuts_and_keeps(config: SchedulerConfig, straggler: Any, ask: Callable[[], bool]) -> bool:
    """``batch-cut``'s claim: the policy over-provisions and keeps its cut samples' tokens."""
    return isinstance(straggler, OverProvisioning) and isinstance(straggler, KeepsCutTokens) and ask()


def over_provisions(config: SchedulerConfig, straggler: Any, ask: Callable[[], bool]) -> bool:
    """``tail-rounds``' claim: the policy over-provisions (and drops what it cuts)."""
    return isinstance(straggler, OverProvisioning)


def not_the_baseline(config: SchedulerConfig, straggler: Any, ask: Callable[[], bool]) -> bool:
    """``token-budget``'s claim: any straggler policy other than the baseline."""
    return config.policy("straggler").name != KIND["straggler"].baseline


def tail_of(config: SchedulerConfig) -> str:
    """``Mode.tail`` of ``config`` (it needs no policy): ``prepare``, ``learn`` or empty."""
    pipeline = config.pipeline
    return ("learn" if pipeline.tail_learn else "prepare") if pipeline.tail_prepare else ""


def planned_mode(planner: StepPlanner) -> Mode:
    """The mode of ``planner``'s scheduler, asked of the planner's own straggler policy."""
    return mode_of(planner.config, planner.policies["straggler"], lambda: planner.keeps_tokens(0, []))


def mode_for(config: SchedulerConfig, registry: Registry | None = None) -> Mode:
    """The mode of ``config``, asked of a straggler policy built for the question (no planner, profile or
    cluster needed: the launcher and the commands check a scheduler with it before anything starts)."""
    registry = registry or get_plugin_manager().registry
    return mode_of(config, registry.create("straggler", config.policy("straggler")))


def consults_predictor(config: SchedulerConfig, registry: Registry | None = None) -> bool:
    """Whether ``config``'s steps read its predictor's lengths: a streaming pipeline never plans a step (its
    engines take groups as they free up); otherwise, whether any of its other policies reads predictions
    (``PolicySpec.reads_predictions``)."""
    registry = registry or get_plugin_manager().registry
    if mode_for(config, registry).pipeline == "stream":
        return False
    return any(
        registry.policy(kind, ref.name).reads_predictions
        for kind, ref in config.policy_refs().items()
        if kind != "predictor"
    )


def _asked(policy: Any) -> bool:
    try:
        answer = policy.keeps_tokens(0)
    except Exception as exc:  # the planner's rule: a failing policy gets its kind's baseline, which keeps nothing
        log.warning("straggler policy keeps_tokens(0) failed (%s): taken as False, the baseline's answer", exc)
        return False
    if not isinstance(answer, bool | np.bool_):
        log.warning("straggler policy keeps_tokens(0) returned %r, not a bool: taken as False", answer)
        return False
    return bool(answer)


# the built-ins (``rlhfless_sdk.rollout.drivers`` attaches their sessions), drivers asked last to first
register_driver(DriverSpec(PLAIN, lambda config, straggler, ask: True))
register_driver(DriverSpec(TOKEN_BUDGET, not_the_baseline, keeps_tokens=True))
register_driver(DriverSpec(TAIL_ROUNDS, over_provisions))
register_driver(DriverSpec(BATCH_CUT, cuts_and_keeps, keeps_tokens=True))
register_pipeline(PipelineSpec(ASYNC))
register_pipeline(PipelineSpec(STREAM, keeps_tokens=True))
