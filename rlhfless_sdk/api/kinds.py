"""The one table of policy kinds: protocol, registration hook, baseline and optional capabilities.

Everything that varies by kind reads this table: the scheduler config (one field per row), the registry (protocol
checks), the planner (fallback to the baseline) and the CLI; the hookspecs (one ``rlhfless_register_<kind>s`` hook per
row) are written out in ``hookspecs.py`` and held to it by a test. Adding a kind means a row here, a protocol in
``protocols.py``, its hook and the planner's wiring.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhfless_sdk.api.protocols import (
    ActorPlacer,
    ActorScaler,
    Drafter,
    LengthPredictor,
    Migrator,
    PrefillPlanner,
    PromptAssigner,
    StragglerPolicy,
)


@dataclass(frozen=True)
class PolicyKind:
    """One kind of policy, as configs (``assigner: sorted``), hooks and the planner know it."""

    name: str  #: the config field and registry key, e.g. ``"assigner"``
    protocol: type  #: the ``typing.Protocol`` every policy of this kind implements
    baseline: str  #: the policy used when the configured one raises or breaks its guarantee (a framework's own)
    summary: str  #: what the kind's registration hook registers (its docstring)
    #: Optional attributes a policy may have, each with what the planner does with it.
    capabilities: tuple[tuple[str, str], ...] = ()
    #: A config may omit the field and get the baseline (kinds added after the first configs were written).
    optional: bool = False

    @property
    def hook(self) -> str:
        """The registration hook's name: ``rlhfless_register_<kind>s``."""
        return f"rlhfless_register_{self.name}s"

    @property
    def title(self) -> str:
        return self.name.replace("_", " ")


KINDS: tuple[PolicyKind, ...] = (
    PolicyKind(
        "predictor",
        LengthPredictor,
        baseline="prompt-length",
        summary="Register length predictors (``LengthPredictor``): ``register(PolicySpec(name=..., factory=...))``.",
        capabilities=(("refine", "re-estimates unfinished samples mid-step, before the migrator runs"),),
    ),
    PolicyKind(
        "prefill_planner",
        PrefillPlanner,
        baseline="none",
        summary="Register prefill planners (``PrefillPlanner``) that deduplicate shared prompt prefixes.",
    ),
    PolicyKind(
        "assigner",
        PromptAssigner,
        baseline="round-robin",
        summary="Register prompt assigners (``PromptAssigner``) that map prompts to decode actors.",
        capabilities=(
            ("order", "order(batch, predicted, assignment): the order to dispatch the samples in (a permutation)"),
            (
                "pull_buffer",
                "pull_buffer (int attribute): dispatch from a shared queue, in that order, keeping at most this many "
                "samples waiting on each engine; an engine that frees first takes the next",
            ),
        ),
    ),
    PolicyKind(
        "migrator",
        Migrator,
        baseline="none",
        summary="Register cut-and-migrate policies (``Migrator``) consulted while a step runs.",
        capabilities=(
            (
                "balanced_share",
                "balanced_share(max_tokens) -> float: the share of a step's tail imbalance it evens out when samples "
                "decode at most max_tokens; a tail batching check prices the rounds run to their end that much "
                "nearer the mean engine's work",
            ),
        ),
    ),
    PolicyKind(
        "scaler",
        ActorScaler,
        baseline="fixed",
        summary="Register actor scalers (``ActorScaler``) that choose the step's decode-actor count.",
        capabilities=(
            ("wants_migration_estimates", "when true and the scheduler migrates, estimates count on migration"),
            (
                "wants_checked_estimates",
                "when true, every candidate is estimated by the planner's per-sample check model (if it has one)",
            ),
        ),
    ),
    PolicyKind(
        "straggler",
        StragglerPolicy,
        baseline="none",
        summary="Register straggler policies (``StragglerPolicy``): how a step treats its long tail.",
        capabilities=(
            (
                "over_provision",
                "OverProvisioning: over_provision(step), start that many more groups than train; the slowest are "
                "re-run later (tail batching's rounds)",
            ),
            (
                "keeps_tokens",
                "KeepsCutTokens: keeps_tokens(step) -> True, with over_provision the groups not trained keep their "
                "tokens and finish in the next step (partial rollouts cut at the B-th group)",
            ),
        ),
        optional=True,
    ),
    PolicyKind(
        "placer",
        ActorPlacer,
        baseline="pack",
        summary="Register actor placers (``ActorPlacer``) that put actors onto nodes and GPUs.",
    ),
    PolicyKind(
        "drafter",
        Drafter,
        baseline="none",
        summary="Register drafters (``Drafter``) that propose tokens for the engines' speculative decoding.",
        capabilities=(("engine_method", "engine_method() -> dict: run as this vLLM built-in method (e.g. ngram)"),),
        optional=True,
    ),
)

KIND: dict[str, PolicyKind] = {k.name: k for k in KINDS}
POLICY_KINDS: tuple[str, ...] = tuple(KIND)
