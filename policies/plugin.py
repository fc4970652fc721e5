"""Registers the reference policies and the shipped scheduler presets.

The SDK registers this module in-process as its default plugin (``rlhfless_sdk.api.plugins.DEFAULT_PLUGINS``),
through the same hooks as any third-party plugin.
"""

from __future__ import annotations

from importlib.resources import files

from rlhfless_policies.assigners import (
    BalancedAssigner,
    LeastPendingAssigner,
    PullAssigner,
    PullParams,
    RoundRobinAssigner,
    SortedAssigner,
    SortedParams,
    StaticChunksAssigner,
    WorkAssigner,
    WorkParams,
)
from rlhfless_policies.drafters import (
    HistoryDrafter,
    HistoryParams,
    NgramDrafter,
    NgramParams,
    NoDrafter,
    SuffixDrafter,
    SuffixParams,
)
from rlhfless_policies.migrators import (
    BalanceMigrator,
    BalanceParams,
    GlobalMigrator,
    GlobalParams,
    NoMigrator,
    TauMigrator,
    TauParams,
)
from rlhfless_policies.model_predictor import ModelParams, ModelPredictor
from rlhfless_policies.placers import LocalityAwarePlacer, PackPlacer
from rlhfless_policies.predictors import (
    EwmaParams,
    EwmaPredictor,
    GroupParams,
    GroupPredictor,
    HybridParams,
    HybridPredictor,
    OraclePredictor,
    PromptLengthParams,
    PromptLengthPredictor,
)
from rlhfless_policies.prefill import DedupParams, DedupPrefillPlanner, NoPrefillPlanner
from rlhfless_policies.scalers import (
    CostAwareParams,
    CostAwareScaler,
    DeadlineParams,
    DeadlineScaler,
    FixedParams,
    FixedScaler,
)
from rlhfless_policies.stragglers import (
    BatchCutParams,
    BatchCutPartialRollout,
    NoStragglerPolicy,
    PartialParams,
    PartialRollout,
    TailBatching,
    TailBatchParams,
)

from rlhfless_sdk import NoParams, PolicySpec, SchedulerConfig, hookimpl
from rlhfless_sdk.api.config import parse_scheduler_config
from rlhfless_sdk.api.kinds import KIND

#: Kind -> (name, factory, params model) of each reference policy, or (name, factory) for one without parameters
#: (``NoParams``); its description is the class's ``description``.
POLICIES: dict[str, list[tuple]] = {
    "predictor": [
        ("ewma", EwmaPredictor, EwmaParams),
        ("model", ModelPredictor, ModelParams),
        ("hybrid", HybridPredictor, HybridParams),
        ("group", GroupPredictor, GroupParams),
        ("prompt-length", PromptLengthPredictor, PromptLengthParams),
        ("oracle", OraclePredictor),
    ],
    "prefill_planner": [
        ("dedup", DedupPrefillPlanner, DedupParams),
        ("none", NoPrefillPlanner),
    ],
    "assigner": [
        ("sorted", SortedAssigner, SortedParams),
        ("least-pending", LeastPendingAssigner),
        ("round-robin", RoundRobinAssigner),
        ("balanced", BalancedAssigner),
        ("chunks", StaticChunksAssigner),
        ("work", WorkAssigner, WorkParams),
        ("work-pull", PullAssigner, PullParams),
    ],
    "migrator": [
        ("tau", TauMigrator, TauParams),
        ("global", GlobalMigrator, GlobalParams),
        ("balance", BalanceMigrator, BalanceParams),
        ("none", NoMigrator),
    ],
    "scaler": [
        ("cost-aware", CostAwareScaler, CostAwareParams),
        ("deadline", DeadlineScaler, DeadlineParams),
        ("fixed", FixedScaler, FixedParams),
    ],
    "straggler": [
        ("none", NoStragglerPolicy),
        ("partial", PartialRollout, PartialParams),
        ("partial-batch", BatchCutPartialRollout, BatchCutParams),
        ("tail-batch", TailBatching, TailBatchParams),
    ],
    "placer": [
        ("locality-aware", LocalityAwarePlacer),
        ("pack", PackPlacer),
    ],
    "drafter": [
        ("none", NoDrafter),
        ("ngram", NgramDrafter, NgramParams),
        ("history", HistoryDrafter, HistoryParams),
        ("suffix", SuffixDrafter, SuffixParams),
    ],
}


def specs(kind: str) -> list[PolicySpec]:
    return [
        PolicySpec(
            name=n,
            factory=f,
            params=p[0] if p else NoParams,
            description=f.description,
            reads_predictions=getattr(f, "reads_predictions", True),
        )
        for n, f, *p in POLICIES[kind]
    ]


def _register_kind(kind: str):
    def register_policies(register):
        for spec in specs(kind):
            register(spec)

    register_policies.__name__ = KIND[kind].hook
    return hookimpl(register_policies)


for _kind in POLICIES:  # one hook per kind: rlhfless_register_predictors, ..._prefill_planners, ...
    globals()[KIND[_kind].hook] = _register_kind(_kind)


def shipped_presets() -> list[SchedulerConfig]:
    """The scheduler configs in the ``configs/`` folder (package ``rlhfless_configs``): the presets and baselines,
    and ``configs/research/``, the research set (simulated only; each says ``group: research``)."""
    out = []
    for folder, prefix in (
        (files("rlhfless_configs"), "configs"),
        (files("rlhfless_configs") / "research", "configs/research"),
    ):
        for entry in sorted(folder.iterdir(), key=lambda e: e.name):
            if entry.name.endswith(".yaml"):
                config = parse_scheduler_config(entry.read_text(encoding="utf-8"), f"{prefix}/{entry.name}")
                if (config.group == "research") != (prefix == "configs/research"):
                    raise RuntimeError(f"{prefix}/{entry.name}: group {config.group!r} in the wrong folder")
                out.append(config)
    return out


@hookimpl
def rlhfless_register_schedulers(register):
    for config in shipped_presets():
        register(config)
