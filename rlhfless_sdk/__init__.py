"""rlhfless SDK: plug length predictors, prefill planners, prompt assigners, migrators, actor scalers,
straggler policies, actor placers and drafters into RLHF rollout scheduling.

Every policy kind of the kind table (``rlhfless_sdk.api.kinds``) and the protocol its policies implement:

- predictor: ``LengthPredictor``
- prefill planner: ``PrefillPlanner``
- assigner: ``PromptAssigner``
- migrator: ``Migrator``
- scaler: ``ActorScaler``
- straggler: ``StragglerPolicy`` (capabilities: ``OverProvisioning``, ``KeepsCutTokens``)
- placer: ``ActorPlacer``
- drafter: ``Drafter`` (capability: ``engine_method``)

A plugin author needs one import::

    from rlhfless_sdk import hookimpl, PolicySpec
"""

from __future__ import annotations

import pluggy

from rlhfless_sdk.api.base import DriverSpec, NoParams, PipelineSpec, PolicySpec, Record
from rlhfless_sdk.api.batch import PromptBatch
from rlhfless_sdk.api.config import PolicyRef, SchedulerConfig, read_scheduler_config
from rlhfless_sdk.api.errors import ConfigError, PluginError, RlhflessError, UnknownPolicyError
from rlhfless_sdk.api.history import HistoryError, HistoryLocked, LengthHistory
from rlhfless_sdk.api.hookspecs import PROJECT
from rlhfless_sdk.api.plugins import PluginManager, get_plugin_manager, reset_plugin_manager
from rlhfless_sdk.api.protocols import (
    ActorPlacer,
    ActorScaler,
    Candidate,
    CandidateSearch,
    CostModel,
    Drafter,
    KeepsCutTokens,
    LengthPredictor,
    Migrator,
    OverProvisioning,
    PrefillPlanner,
    PromptAssigner,
    StragglerPolicy,
)
from rlhfless_sdk.api.records import (
    Actor,
    ActorPlacement,
    ActorProgress,
    CandidateEstimate,
    Cluster,
    FinishedSample,
    MigrationDecision,
    Node,
    PrefillPlan,
    SampleProgress,
    StepPlan,
    StepProgress,
    StepReport,
    TimePerTokenProfile,
)

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker(PROJECT)

__all__ = [
    "Actor",
    "ActorPlacement",
    "ActorPlacer",
    "ActorProgress",
    "ActorScaler",
    "Candidate",
    "CandidateEstimate",
    "CandidateSearch",
    "Cluster",
    "ConfigError",
    "CostModel",
    "Drafter",
    "DriverSpec",
    "FinishedSample",
    "HistoryError",
    "HistoryLocked",
    "KeepsCutTokens",
    "LengthHistory",
    "LengthPredictor",
    "MigrationDecision",
    "Migrator",
    "NoParams",
    "Node",
    "OverProvisioning",
    "PipelineSpec",
    "PluginError",
    "PluginManager",
    "PolicyRef",
    "PolicySpec",
    "PrefillPlan",
    "PrefillPlanner",
    "PromptAssigner",
    "PromptBatch",
    "Record",
    "RlhflessError",
    "SampleProgress",
    "SchedulerConfig",
    "StepPlan",
    "StepProgress",
    "StepReport",
    "StragglerPolicy",
    "TimePerTokenProfile",
    "UnknownPolicyError",
    "__version__",
    "get_plugin_manager",
    "hookimpl",
    "read_scheduler_config",
    "reset_plugin_manager",
]
