"""rlhfless SDK: plug length predictors, prefill planners, prompt assigners, migrators, actor scalers and
actor placers into RLHF rollout scheduling.

A plugin author needs one import::

    from rlhfless_sdk import hookimpl, PolicySpec
"""

from __future__ import annotations

import pluggy

from rlhfless_sdk.batch import PromptBatch
from rlhfless_sdk.config import PolicyRef, SchedulerConfig, read_scheduler_config
from rlhfless_sdk.errors import ConfigError, PluginError, RlhflessError, UnknownPolicyError
from rlhfless_sdk.hookspecs import PROJECT
from rlhfless_sdk.plugins import PluginManager, get_plugin_manager, reset_plugin_manager
from rlhfless_sdk.protocols import (
    ActorPlacer,
    ActorScaler,
    CostModel,
    LengthPredictor,
    Migrator,
    PrefillPlanner,
    PromptAssigner,
)
from rlhfless_sdk.records import NoParams, PolicySpec

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker(PROJECT)

__all__ = [
    "ActorPlacer",
    "ActorScaler",
    "ConfigError",
    "CostModel",
    "LengthPredictor",
    "Migrator",
    "NoParams",
    "PluginError",
    "PluginManager",
    "PolicyRef",
    "PolicySpec",
    "PrefillPlanner",
    "PromptAssigner",
    "PromptBatch",
    "RlhflessError",
    "SchedulerConfig",
    "UnknownPolicyError",
    "__version__",
    "get_plugin_manager",
    "hookimpl",
    "read_scheduler_config",
    "reset_plugin_manager",
]
