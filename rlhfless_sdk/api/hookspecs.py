"""Hook specifications: the whole extension API of rlhfless.

Every hook is a registration hook in the ``register(record)`` style: rlhfless calls it once per plugin while
it builds its registry, with a ``register`` callable; the plugin calls ``register`` once for each policy or
preset it provides. Names must be unique across all plugins of one kind. Hooks are called with keyword
arguments only; a plugin may implement any subset of them.
"""

from __future__ import annotations

from collections.abc import Callable

import pluggy

from rlhfless_sdk.api.config import SchedulerConfig
from rlhfless_sdk.api.records import PolicySpec

PROJECT = "rlhfless"
hookspec = pluggy.HookspecMarker(PROJECT)

RegisterPolicy = Callable[[PolicySpec], None]


@hookspec
def rlhfless_register_predictors(register: RegisterPolicy) -> None:
    """Register length predictors (``LengthPredictor``): ``register(PolicySpec(name=..., factory=...))``."""


@hookspec
def rlhfless_register_prefill_planners(register: RegisterPolicy) -> None:
    """Register prefill planners (``PrefillPlanner``) that deduplicate shared prompt prefixes."""


@hookspec
def rlhfless_register_assigners(register: RegisterPolicy) -> None:
    """Register prompt assigners (``PromptAssigner``) that map prompts to decode actors."""


@hookspec
def rlhfless_register_migrators(register: RegisterPolicy) -> None:
    """Register cut-and-migrate policies (``Migrator``) consulted while a step runs."""


@hookspec
def rlhfless_register_scalers(register: RegisterPolicy) -> None:
    """Register actor scalers (``ActorScaler``) that choose the step's decode-actor count."""


@hookspec
def rlhfless_register_placers(register: RegisterPolicy) -> None:
    """Register actor placers (``ActorPlacer``) that put actors onto nodes and GPUs."""


@hookspec
def rlhfless_register_schedulers(register: Callable[[SchedulerConfig], None]) -> None:
    """Register scheduler presets: ``register(SchedulerConfig(...))``, one policy of each kind plus parameters."""


#: Policy kind -> the hook that registers it.
KIND_HOOKS: dict[str, str] = {
    "predictor": "rlhfless_register_predictors",
    "prefill_planner": "rlhfless_register_prefill_planners",
    "assigner": "rlhfless_register_assigners",
    "migrator": "rlhfless_register_migrators",
    "scaler": "rlhfless_register_scalers",
    "placer": "rlhfless_register_placers",
}
SCHEDULER_HOOK = "rlhfless_register_schedulers"
