"""Registers the reference policies and the shipped scheduler presets (entry point ``rlhfless-policies``)."""

from __future__ import annotations

from importlib.resources import files

from rlhfless_policies import assigners, migrators, model_predictor, placers, predictors, prefill, scalers

from rlhfless_sdk import PolicySpec, SchedulerConfig, hookimpl
from rlhfless_sdk.api.config import parse_scheduler_config
from rlhfless_sdk.api.records import NoParams


@hookimpl
def rlhfless_register_predictors(register):
    register(
        PolicySpec(
            name="ewma",
            factory=predictors.EwmaPredictor,
            params=predictors.EwmaParams,
            description="EWMA of each prompt's response length in its last steps (RLHFless)",
        )
    )
    register(
        PolicySpec(
            name="model",
            factory=model_predictor.ModelPredictor,
            params=model_predictor.ModelParams,
            description="ridge regression on hashed token n-grams of the prompt, trained online",
        )
    )
    register(
        PolicySpec(
            name="hybrid",
            factory=predictors.HybridPredictor,
            params=predictors.HybridParams,
            description="EWMA for prompts with a history, the model for new ones (beyond the paper)",
        )
    )
    register(
        PolicySpec(
            name="group",
            factory=predictors.GroupPredictor,
            params=predictors.GroupParams,
            description="EWMA, refined mid-step from finished GRPO siblings (beyond the paper)",
        )
    )
    register(
        PolicySpec(
            name="prompt-length",
            factory=predictors.PromptLengthPredictor,
            params=predictors.PromptLengthParams,
            description="naive baseline: response length proportional to prompt length",
        )
    )
    register(
        PolicySpec(
            name="oracle",
            factory=predictors.OraclePredictor,
            params=NoParams,
            description="true lengths, for simulation bounds only",
        )
    )


@hookimpl
def rlhfless_register_prefill_planners(register):
    register(
        PolicySpec(
            name="dedup",
            factory=prefill.DedupPrefillPlanner,
            params=prefill.DedupParams,
            description="prefill each shared prefix once; largest prefix length that fits (RLHFless)",
        )
    )
    register(
        PolicySpec(
            name="none",
            factory=prefill.NoPrefillPlanner,
            description="baseline: every sample prefills its whole prompt",
        )
    )


@hookimpl
def rlhfless_register_assigners(register):
    register(
        PolicySpec(
            name="sorted",
            factory=assigners.SortedAssigner,
            params=assigners.SortedParams,
            description="sort by predicted length, contiguous length ranges per actor (RLHFless)",
        )
    )
    register(
        PolicySpec(
            name="least-pending",
            factory=assigners.LeastPendingAssigner,
            description="OpenRLHF 0.11.2: engine with the fewest unfinished samples",
        )
    )
    register(
        PolicySpec(name="round-robin", factory=assigners.RoundRobinAssigner, description="prompt i to actor i mod N")
    )
    register(
        PolicySpec(
            name="balanced",
            factory=assigners.BalancedAssigner,
            description="longest-processing-time-first on predicted tokens (beyond the paper)",
        )
    )


@hookimpl
def rlhfless_register_migrators(register):
    register(
        PolicySpec(
            name="tau",
            factory=migrators.TauMigrator,
            params=migrators.TauParams,
            description="cut underestimated samples of actors past tau of their work (RLHFless)",
        )
    )
    register(
        PolicySpec(
            name="global",
            factory=migrators.GlobalMigrator,
            params=migrators.GlobalParams,
            description="RLHFuse-style: consolidate the tail once few samples remain",
        )
    )
    register(PolicySpec(name="none", factory=migrators.NoMigrator, description="baseline: never migrate"))


@hookimpl
def rlhfless_register_scalers(register):
    register(
        PolicySpec(
            name="cost-aware",
            factory=scalers.CostAwareScaler,
            params=scalers.CostAwareParams,
            description="argmin of lambda*time + (1-lambda)*cost, min-max normalised (RLHFless)",
        )
    )
    register(
        PolicySpec(
            name="deadline",
            factory=scalers.DeadlineScaler,
            params=scalers.DeadlineParams,
            description="cheapest actor count within a slack of the fastest predicted time (beyond the paper)",
        )
    )
    register(
        PolicySpec(
            name="fixed",
            factory=scalers.FixedScaler,
            params=scalers.FixedParams,
            description="baseline: the same actor count every step",
        )
    )


@hookimpl
def rlhfless_register_placers(register):
    register(
        PolicySpec(
            name="locality-aware",
            factory=placers.LocalityAwarePlacer,
            description="learner, prefill and heaviest decode actors on one node (RLHFless)",
        )
    )
    register(
        PolicySpec(name="pack", factory=placers.PackPlacer, description="OpenRLHF's PACK order: fill node after node")
    )


def shipped_presets() -> list[SchedulerConfig]:
    """The scheduler presets in the ``configs/`` folder (package ``rlhfless_configs``)."""
    out = []
    for entry in sorted(files("rlhfless_configs").iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".yaml"):
            out.append(parse_scheduler_config(entry.read_text(encoding="utf-8"), f"configs/{entry.name}"))
    return out


@hookimpl
def rlhfless_register_schedulers(register):
    for config in shipped_presets():
        register(config)
