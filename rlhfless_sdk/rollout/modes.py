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

Both lists are registries, built through pluggy like every other kind: a plugin's ``rlhfless_register_modes``
hook registers a step driver (``DriverSpec``: what it claims, whether it keeps tokens of older weights, the session
that runs its steps) or a pipeline (``PipelineSpec``: its ``pipeline: mode`` name and the simulator's run of it).
The built-in ones come through the same hook, from the default plugin ``rlhfless-modes``
(``rlhfless_sdk.simulation.builtin_modes``), so ``RLHFLESS_PLUGINS`` and a reset plugin manager affect every one
alike. A backend that does not run a registered mode refuses it in one line
(``rlhfless_sdk.rollout.drivers.refusal``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from rlhfless_sdk.api.base import DriverSpec, PipelineSpec
from rlhfless_sdk.api.config import SchedulerConfig
from rlhfless_sdk.api.errors import RlhflessError
from rlhfless_sdk.api.kinds import KIND
from rlhfless_sdk.api.plugins import Registry, get_plugin_manager
from rlhfless_sdk.api.protocols import KeepsCutTokens, OverProvisioning

if TYPE_CHECKING:
    from rlhfless_sdk.planning.planner import StepPlanner

__all__ = ["DriverSpec", "Mode", "PipelineSpec", "mode_for", "mode_names", "mode_of", "planned_mode"]

PLAIN, TOKEN_BUDGET, TAIL_ROUNDS, BATCH_CUT, ASYNC = "plain", "token-budget", "tail-rounds", "batch-cut", "async"
STREAM = "stream"

log = logging.getLogger("rlhfless.modes")

#: (config, its straggler policy, a checked ``keeps_tokens(0)`` call) -> whether a driver runs this scheduler's steps
Claim = Callable[[SchedulerConfig, Any, Callable[[], bool]], bool]


def drivers(registry: Registry) -> list[DriverSpec]:
    """Every registered step driver, in the order they are asked (newest first, the built-in ones last)."""
    return list(reversed(registry.drivers.values()))


def mode_names(registry: Registry | None = None) -> list[str]:
    """Every mode a backend may declare: the drivers', then the pipelines' (each in the order registered)."""
    registry = registry or get_plugin_manager().registry
    return [*registry.drivers, *registry.pipelines]


@dataclass(frozen=True)
class Mode:
    """A scheduler's way of running steps: its ``pipeline`` (``sync``, ``async``, ``stream``), the ``driver`` each
    step (or a pipeline's batch) runs under, whether a stream re-plans its split (``elastic``) and whether a
    synchronous step scores (``prepare``) or also learns (``learn``) in its generation tail (``tail``)."""

    pipeline: str
    driver: str
    elastic: bool = False
    tail: str = ""
    keeps_tokens: bool = False  # it trains tokens generated under older weights (carried, or generated on through one)

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
    def carries(self) -> bool:
        """Whether its steps carry samples or defer prompts from one step to the next."""
        return self.driver != PLAIN


def mode_of(
    config: SchedulerConfig,
    straggler: Any,
    keeps_tokens: Callable[[], bool] | None = None,
    registry: Registry | None = None,
) -> Mode:
    """The mode of ``config``, whose straggler policy is ``straggler`` (an instance), among ``registry``'s drivers
    and pipelines. ``keeps_tokens``: how to ask it ``keeps_tokens(0)`` (a planner's checked call, which falls back to
    the baseline's answer); default: asked directly, a failure or an answer that is not a bool taken as the
    baseline's (False), with a warning."""
    registry = registry or get_plugin_manager().registry
    pipeline = config.pipeline
    ask = keeps_tokens or (lambda: _asked(straggler))
    driver = next((spec for spec in drivers(registry) if spec.claims(config, straggler, ask)), None)
    if driver is None:
        raise RlhflessError(f"scheduler {config.name!r}: no registered step driver runs it ({mode_names(registry)})")
    keeps = driver.keeps_tokens
    if pipeline.mode != "sync":
        spec = registry.pipeline(pipeline.mode)  # an unknown mode lists the known ones
        keeps = spec.keeps_tokens
    return Mode(pipeline.mode, driver.name, pipeline.elastic, tail_of(config), keeps)


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
    return mode_of(planner.config, planner.policies["straggler"], lambda: planner.keeps_tokens(0, []), planner.registry)


def mode_for(config: SchedulerConfig, registry: Registry | None = None) -> Mode:
    """The mode of ``config``, asked of a straggler policy built for the question (no planner, profile or
    cluster needed: the launcher and the commands check a scheduler with it before anything starts)."""
    registry = registry or get_plugin_manager().registry
    return mode_of(config, registry.create("straggler", config.policy("straggler")), registry=registry)


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
