"""The step planner and the migration controller: compose one policy of each kind into a valid plan.

Data flows one way: prompts -> predictor -> prefill planner -> (for each candidate N: assigner -> cost
model) -> scaler picks N -> placer -> ``StepPlan``. Every policy's output is checked; a policy that raises or
breaks its protocol's guarantee (a lost or duplicated sample, an actor out of range, a GPU used twice) is
replaced for that step by its kind's baseline, with a warning naming the plugin, so the plan is always valid.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rlhfless_sdk.api.batch import PromptBatch, readonly
from rlhfless_sdk.api.config import SchedulerConfig
from rlhfless_sdk.api.errors import RlhflessError
from rlhfless_sdk.api.history import HistoryError
from rlhfless_sdk.api.kinds import KIND
from rlhfless_sdk.api.plugins import Registry, get_plugin_manager
from rlhfless_sdk.api.protocols import Candidate, CandidateSearch, CostModel
from rlhfless_sdk.api.records import (
    Actor,
    CandidateEstimate,
    Cluster,
    FinishedSample,
    MigrationDecision,
    PrefillPlan,
    StepPlan,
    StepProgress,
    TimePerTokenProfile,
)
from rlhfless_sdk.planning.checks import (
    InvalidPolicyOutput,
    PolicyExit,
    _reason,
    check_assignment,
    check_order,
    check_placement,
    check_predictions,
    check_prefill,
    whole,
)
from rlhfless_sdk.planning.costmodel import AnalyticCostModel
from rlhfless_sdk.planning.engine_model import EngineCostModel, LengthSpread
from rlhfless_sdk.planning.tail_check import TailEstimate, estimate_tail

log = logging.getLogger("rlhfless.planner")


#: A policy whose calls take this long in one step (seconds) gets a warning naming it.
SLOW_POLICY_S = 1.0
_PLAN_KINDS = ("predictor", "prefill_planner", "assigner", "scaler", "placer", "straggler")


class StepPlanner:
    """Builds a ``StepPlan`` each step from a scheduler config's policies and a cost model."""

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        cluster: Cluster,
        cost_model: CostModel,
        registry: Registry | None = None,
        gpus_per_actor: int = 1,
        learner_gpus: int = 1,
        check_model: EngineCostModel | None = None,
        prefill_actor: bool = True,
    ) -> None:
        """``check_model``: a per-sample cost model (``EngineCostModel``) that estimates the chosen plan for the
        report, and every candidate for a scaler that ``wants_checked_estimates``, from the predictions and the
        length spread learned from the previous step (``self.spread``). ``prefill_actor``: a deduplicated prefill
        plan takes a GPU of its own (the paper's prefill actor, as simulated); False where each decode engine
        prefills its own shared prefixes (the OpenRLHF adapter), so no engine is held back for it."""
        self.config = config
        self.check_model = check_model
        self.spread: LengthSpread | None = None
        self.estimate_errors: deque[float] = deque(maxlen=5)  # |relative error| of the last steps' estimates
        self._planned_with_spread = False
        self.cluster = cluster
        self.cost_model = cost_model
        self.registry = registry or get_plugin_manager().registry
        self.gpus_per_actor = gpus_per_actor
        self.learner_gpus = learner_gpus
        self.prefill_actor = prefill_actor
        self.policies: dict[str, Any] = {k: self.registry.create(k, ref) for k, ref in config.policy_refs().items()}
        self.spent: dict[str, tuple[int, float]] = {}  # kind -> (calls, seconds) in the current step
        self.slow_policy_s = SLOW_POLICY_S
        self._baselines: dict[str, Any] = {}
        self.migration = MigrationController(self)
        #: Decode actors 0..warm_actors-1 are running already (no start-up); the backend keeps this current.
        self.warm_actors = 0

    def keep_burst(self, idle_s: float) -> bool:
        """Keep a burst engine warm for the next step, or release it. Kept, it is billed while it idles
        (``idle_s``: from its last token to the next step's work, learning included); released, it pays its
        start-up again when next used. Whichever costs fewer GPU-seconds; on a tie keep (no start-up delay)."""
        cold = float(getattr(getattr(self.cost_model, "profile", None), "cold_start_s", 0.0))
        return idle_s <= cold

    # -- helpers ---------------------------------------------------------------------------------------
    def policy_label(self, kind: str) -> str:
        name = self.config.policy_refs()[kind].name
        return f"{kind} {name!r} (plugin {self.registry.policy(kind, name).plugin!r})"

    def baseline(self, kind: str) -> Any:
        if kind not in self._baselines:
            self._baselines[kind] = self.registry.create(kind, KIND[kind].baseline)
        return self._baselines[kind]

    def timed(self, kind: str, fn: Callable[[Any], Any], policy: Any) -> Any:
        """``fn(policy)``, adding its wall time to this step's account of the kind (see ``warn_slow``)."""
        t0 = time.perf_counter()
        try:
            return fn(policy)
        except SystemExit as exc:
            raise PolicyExit(
                f"{self.policy_label(kind)} raised SystemExit({exc.code!r}) (sys.exit?): a policy must raise an "
                "exception, never end the process; the run stops"
            ) from None
        finally:
            calls, total = self.spent.get(kind, (0, 0.0))
            self.spent[kind] = (calls + 1, total + time.perf_counter() - t0)

    def warn_slow(self, step: int, kinds: Sequence[str]) -> None:
        """One warning per policy of ``kinds`` whose calls took ``slow_policy_s`` or more this step; resets them."""
        for kind in kinds:
            calls, total = self.spent.pop(kind, (0, 0.0))
            if total >= self.slow_policy_s:
                log.warning(
                    "%s took %.1f s in step %d (%d call(s)); the step waits for it",
                    self.policy_label(kind),
                    total,
                    step,
                    calls,
                )

    def call(self, kind: str, fallbacks: list[str], fn: Callable[[Any], Any], check: Callable[[Any], Any]) -> Any:
        """``check(fn(policy))``, or the same with the kind's baseline if the policy raises or fails the check."""
        policy = self.policies[kind]
        try:
            return check(self.timed(kind, fn, policy))
        except PolicyExit:
            raise
        except Exception as exc:
            if self.config.policy_refs()[kind].name == KIND[kind].baseline:
                raise
            log.warning(
                "%s failed: %s; using baseline %r for this step",
                self.policy_label(kind),
                _reason(exc),
                KIND[kind].baseline,
            )
            label = f"{kind}:{self.config.policy_refs()[kind].name}"
            if label not in fallbacks:
                fallbacks.append(label)
            return check(fn(self.baseline(kind)))

    def extra_actors(self, prefill: PrefillPlan) -> list[Actor]:
        extra = []
        if self.learner_gpus:
            extra.append(Actor(actor_id=0, role="learner", num_gpus=self.learner_gpus))
        if prefill.prompt_group and self.prefill_actor:
            extra.append(Actor(actor_id=0, role="prefill", num_gpus=1))
        return extra

    def actor_range(self, extra: Sequence[Actor]) -> tuple[int, int]:
        free = self.cluster.total_gpus - sum(a.num_gpus for a in extra)
        most = free // self.gpus_per_actor
        if self.config.max_actors is not None:
            most = min(most, self.config.max_actors)
        if most < self.config.min_actors:
            fleet = sum(n.num_gpus for n in self.cluster.nodes if not n.name.startswith("burst"))
            burst = self.cluster.total_gpus - fleet
            raise RlhflessError(
                f"scheduler {self.config.name!r}: the cluster has {fleet} GPUs"
                f"{f' and {burst} burst GPUs' if burst else ''}; after {sum(a.num_gpus for a in extra)} for "
                f"learner/prefill, at most {most} decode actors of {self.gpus_per_actor} GPU(s) fit, "
                f"below min_actors={self.config.min_actors}"
            )
        return self.config.min_actors, most

    # -- the plan ----------------------------------------------------------------------------------------
    def predict(self, batch: PromptBatch, fallbacks: list[str]) -> np.ndarray:
        return self.call("predictor", fallbacks, lambda p: p.predict(batch), lambda o: check_predictions(o, batch))

    def plan(
        self,
        batch: PromptBatch,
        step: int = 0,
        predicted: np.ndarray | None = None,
        *,
        num_actors: int | None = None,
        prefill: PrefillPlan | None = None,
        segment_tokens: int | bool | None = False,
        length_caps: np.ndarray | None = None,
        fallbacks: Sequence[str] = (),
    ) -> StepPlan:
        """The plan for one step. ``predicted`` overrides the predictor (a backend that already asked it).

        ``segment_tokens`` reuses the straggler policy's answer for this step (``segment_tokens()``);
        ``length_caps`` (per prompt) bounds the check model's lengths (a piece of a partial rollout).
        ``num_actors`` plans the step with exactly that many decode actors instead of asking the scaler (the
        time-cost frontier, a backend that lost engines); ``prefill`` reuses a prefill plan made for this batch.
        Either way every policy's output is checked and a failing policy falls back to its baseline.
        ``fallbacks``: the step's fallbacks so far (a driver's calls before the plan: the straggler policy, the
        predictor of a carrying step); the plan's ``fallbacks`` start with them, so the step report has them all.
        """
        t0 = time.perf_counter()
        self._planned_with_spread = self.spread is not None
        fallbacks = list(fallbacks)
        for kind in _PLAN_KINDS:
            self.spent.pop(kind, None)
        pred = self.predict(batch, fallbacks) if predicted is None else check_predictions(predicted, batch)
        prefill = self.prefill_plan(batch, fallbacks) if prefill is None else check_prefill(prefill, batch)
        extra = self.extra_actors(prefill)
        bounds = self.count_bounds(extra, num_actors)
        chosen, assignments, estimates, checked = self.choose_count(
            batch, pred, prefill, bounds, num_actors, length_caps, fallbacks
        )
        sample_actor = assignments[chosen]
        order = self.dispatch_order(batch, pred, sample_actor, fallbacks)
        placement = self.place(batch, pred, sample_actor, chosen, extra, fallbacks)
        segment = self.segment_tokens(step, fallbacks) if segment_tokens is False else segment_tokens
        self.warn_slow(step, _PLAN_KINDS)
        estimate = None
        if self.check_model is not None:  # the chosen count's estimate per sample, made already or now
            estimate = next(e for e in estimates if e.num_actors == chosen) if checked else None
            estimate = estimate or self.checked_estimate(batch, pred, sample_actor, chosen, prefill, length_caps)
        return StepPlan.model_construct(
            step=step,
            scheduler=self.config.name,
            num_actors=chosen,
            assignment=sample_actor.tolist(),
            predicted_lengths=pred.tolist(),
            prefill=prefill,
            placement=placement,
            candidates=estimates,
            order=order,
            pull_buffer=self.pull_buffer(),
            segment_tokens=segment,
            estimate=estimate,
            fallbacks=fallbacks,
            planner_ms=(time.perf_counter() - t0) * 1000.0,
        )

    def count_bounds(self, extra: list[Actor], num_actors: int | None) -> tuple[int, int]:
        """The decode-actor counts this cluster allows beside ``extra``; ``num_actors``, when given, must be one."""
        lo, hi = self.actor_range(extra)
        if num_actors is not None and not lo <= num_actors <= hi:
            raise RlhflessError(f"cannot plan with {num_actors} decode actors: this cluster allows {lo} to {hi}")
        return lo, hi

    def prefill_plan(self, batch: PromptBatch, fallbacks: list[str]) -> PrefillPlan:
        """The prefill planner's plan of the batch, checked."""
        cap = self.config.prefill_capacity_tokens
        return self.call("prefill_planner", fallbacks, lambda p: p.plan(batch, cap), lambda o: check_prefill(o, batch))

    def place(
        self,
        batch: PromptBatch,
        pred: np.ndarray,
        sample_actor: np.ndarray,
        chosen: int,
        extra: list[Actor],
        fallbacks: list[str],
    ) -> list[Any]:
        """The placer's placement of the ``chosen`` decode actors (loaded with their predicted work) and ``extra``."""
        loads = readonly(np.bincount(sample_actor, weights=pred[batch.sample_prompt_index()], minlength=chosen))
        gpa = self.gpus_per_actor
        return self.call(
            "placer",
            fallbacks,
            lambda p: p.place(loads, self.cluster, gpa, tuple(extra)),
            lambda o: check_placement(o, self.cluster, chosen, gpa, extra),
        )

    def dispatch_order(
        self, batch: PromptBatch, pred: np.ndarray, sample_actor: np.ndarray, fallbacks: list[str]
    ) -> list[int]:
        """The order the samples are dispatched in, when the assigner has one (else empty: batch order)."""
        if not hasattr(self.policies["assigner"], "order"):
            return []

        def ask_order(p: Any) -> Any:
            return p.order(batch, pred, sample_actor) if hasattr(p, "order") else np.arange(batch.total_samples)

        return self.call("assigner", fallbacks, ask_order, lambda o: check_order(o, batch)).tolist()

    def choose_count(
        self,
        batch: PromptBatch,
        pred: np.ndarray,
        prefill: PrefillPlan,
        bounds: tuple[int, int],
        num_actors: int | None,
        length_caps: np.ndarray | None,
        fallbacks: list[str],
    ) -> tuple[int, dict[int, np.ndarray], list[CandidateEstimate], bool]:
        """The step's decode-actor count within ``bounds`` (``num_actors`` when given), the assignment of each
        count estimated, their estimates, and whether those are the check model's (per sample).

        A scaler that wants checked estimates and has ``search`` looks only at the counts it needs (each is an
        event simulation of every sample); any other scaler gets every candidate estimated, as ``choose`` expects.
        """
        count = _CountChoice(self, batch, pred, prefill, length_caps, fallbacks)
        candidates = count.candidates(bounds) if num_actors is None else [num_actors]
        scaler = self.policies["scaler"]
        checked = self.check_model is not None and getattr(scaler, "wants_checked_estimates", False)
        baseline_now = self.config.policy_refs()["scaler"].name != KIND["scaler"].baseline and any(
            f.startswith("scaler:") for f in fallbacks
        )
        if checked and num_actors is None and not baseline_now and callable(getattr(scaler, "search", None)):
            chosen, estimated = count.search(candidates)
            return chosen, count.assignments, estimated, True
        if checked:  # the scaler compares candidates within 1%: all of them per sample
            estimates = [count.checked_at(n) for n in candidates]
        else:
            estimates = [self.cost_estimate(batch, pred, count.assign(n), n, prefill) for n in candidates]
            if count.fleet < max(candidates):  # mark the counts that need burst actors
                estimates = [e.model_copy(update={"burst": e.num_actors > count.fleet}) for e in estimates]
        if num_actors is not None:
            chosen = num_actors
        elif baseline_now:
            chosen = count.check_choice(self.baseline("scaler").choose(tuple(estimates)))
        else:
            chosen = self.call("scaler", fallbacks, lambda p: p.choose(tuple(estimates)), count.check_choice)
        return chosen, count.assignments, estimates, checked

    def cost_estimate(
        self, batch: PromptBatch, pred: np.ndarray, sample_actor: np.ndarray, n: int, prefill: PrefillPlan
    ) -> CandidateEstimate:
        """The planner's cost model's estimate of one candidate (counting on cut-and-migrate for a scaler that
        asks for it: the paper's cost-aware scaler plans without, so its published behaviour stays as it is)."""
        migrates = self.config.migrates() and getattr(self.policies["scaler"], "wants_migration_estimates", False)
        flags: dict[str, Any] = {"migrates": True} if migrates else {}  # a cost model without them still works
        if self.warm_actors:
            flags["warm_actors"] = self.warm_actors
        return self.cost_model.estimate(Candidate(batch, pred, sample_actor, n, prefill), **flags)

    def pull_buffer(self) -> int | None:
        """The assigner's shared-queue buffer (``pull_buffer``), or None when it assigns every sample up front."""
        b = getattr(self.policies["assigner"], "pull_buffer", None)
        if b is None:
            return None
        if isinstance(b, bool) or not isinstance(b, int | np.integer) or b < 0:
            raise InvalidPolicyOutput(f"{self.policy_label('assigner')}: pull_buffer must be an int >= 0, got {b!r}")
        return int(b)

    def _ask_straggler(self, fallbacks: list[str], method: str, step: int, default: Any, check: Callable) -> Any:
        """The straggler policy's answer to an optional ``method(step)`` (``default`` without it), checked."""

        def ask(p: Any) -> Any:
            answer = getattr(p, method, None)
            return default if answer is None else answer(step)

        return self.call("straggler", fallbacks, ask, check)

    def segment_tokens(self, step: int, fallbacks: list[str]) -> int | None:
        """The straggler policy's token budget for a sample started in ``step`` (None: unlimited)."""

        def check_segment(t: Any) -> int | None:
            if t is None:
                return None
            if isinstance(t, bool) or not isinstance(t, int | np.integer) or int(t) < 1:
                raise InvalidPolicyOutput(f"segment_tokens must be None or a positive int, got {t!r}")
            return int(t)

        return self._ask_straggler(fallbacks, "segment_tokens", step, None, check_segment)

    def over_provision(self, step: int, fallbacks: list[str]) -> float:
        """The straggler policy's extra share of groups to start in ``step`` (tail batching; 0 without one)."""

        def check_extra(x: Any) -> float:
            value = float(x)
            if not (math.isfinite(value) and value >= 0.0):
                raise InvalidPolicyOutput(f"over_provision must be a finite number >= 0, got {x!r}")
            return value

        return self._ask_straggler(fallbacks, "over_provision", step, 0.0, check_extra)

    def tail_margin(self, step: int, fallbacks: list[str]) -> float | None:
        """How much faster (a share) tail batching must be predicted to be for ``step`` to run it (``tail_check``);
        None: every round that may over-provision does."""

        def check(x: Any) -> float | None:
            if x is None:
                return None
            value = float(x)
            if not (math.isfinite(value) and 0.0 <= value < 1.0):
                raise InvalidPolicyOutput(f"tail_margin must be None or in [0, 1), got {x!r}")
            return value

        return self._ask_straggler(fallbacks, "tail_margin", step, None, check)

    def tail_check(self, batch: PromptBatch, train: int, fallbacks: list[str]) -> TailEstimate:
        """Tail batching's predicted cost per trained group against a plain step's, if ``batch`` (in start order)
        were the next short round training ``train`` groups (``rlhfless_sdk.planning.tail_check``): the predictor's
        lengths with the learned spread, on the fleet's engines, balanced as far as the migrator evens out the
        tail's KV under the run's length cap (its ``balanced_share``; none before a step has run)."""
        assert self.check_model is not None
        pred = self.predict(batch, fallbacks)
        lengths = self.check_model.lengths(batch, pred, self.spread or LengthSpread())
        offsets = batch.sample_offsets
        groups = [lengths[offsets[i] : offsets[i + 1]] for i in range(len(batch))]
        engines = self.actor_range([])[1]
        share = getattr(self.policies["migrator"], "balanced_share", None)
        cap = self.spread.cap if self.spread is not None else 0
        balanced = float(share(cap)) if callable(share) and cap > 0 else 0.0
        return estimate_tail(self.check_model.profile, groups, batch.prompt_lengths.tolist(), train, engines, balanced)

    def keeps_tokens(self, step: int, fallbacks: list[str]) -> bool:
        """Whether an over-provisioning straggler policy carries its untrained groups' tokens into the next step
        (partial rollouts cut at the B-th group) rather than re-running them (tail batching)."""

        def check(x: Any) -> bool:
            if not isinstance(x, bool | np.bool_):
                raise InvalidPolicyOutput(f"keeps_tokens must be a bool, got {x!r}")
            return bool(x)

        return self._ask_straggler(fallbacks, "keeps_tokens", step, False, check)

    def checked_estimate(
        self,
        batch: PromptBatch,
        pred: np.ndarray,
        sample_actor: np.ndarray,
        n: int,
        prefill: PrefillPlan,
        caps: np.ndarray | None = None,
    ) -> CandidateEstimate:
        """The check model's estimate of one candidate plan (the same length draw for every candidate);
        ``caps`` (per prompt) bounds its lengths."""
        assert self.check_model is not None
        migrates = self.config.migrates() and getattr(self.policies["scaler"], "wants_migration_estimates", False)
        return self.check_model.estimate(
            Candidate(batch, pred, sample_actor, n, prefill),
            migrates=migrates,
            warm_actors=self.warm_actors,
            spread=self.spread,
            caps=caps,
        )

    def note_error(self, estimate_error: float | None) -> None:
        """How far the chosen plan's estimate was from the step's real (or simulated) generation time. A plan
        made before any step was observed (no learned spread: the predictor's cold start) says nothing about the
        estimates to come and is not counted."""
        if estimate_error is not None and math.isfinite(estimate_error) and self._planned_with_spread:
            self.estimate_errors.append(abs(estimate_error))

    def observe(self, samples: Sequence[FinishedSample]) -> None:
        """Feed a finished step's samples to the predictor (its length history) and learn how true lengths
        spread around the predictions (``self.spread``). A predictor that raises is warned about and skipped,
        except a failed history write (``HistoryError``), which stops the run."""
        known = [s for s in samples if s.predicted_length is not None]
        if known:
            true = np.array([s.response_length for s in known], dtype=np.float64)
            pred = np.array([s.predicted_length for s in known], dtype=np.float64)
            self.spread = LengthSpread.observe(true, pred, self.spread, groups=np.array([s.uid for s in known]))
        try:
            self.timed("predictor", lambda p: p.observe(tuple(samples)), self.policies["predictor"])
        except (HistoryError, PolicyExit):
            raise  # observations would be lost: stop, unless the predictor's history is best-effort
        except Exception as exc:
            log.warning("%s failed to observe %d samples: %s", self.policy_label("predictor"), len(samples), exc)


class MigrationController:
    """Runs the scheduler's migrator while a step runs, and checks each decision before a backend applies it."""

    def __init__(self, planner: StepPlanner) -> None:
        self.planner = planner
        self.fallbacks: list[str] = []
        self.decisions = 0

    @staticmethod
    def check(decisions: Any, progress: StepProgress) -> list[MigrationDecision]:
        if not isinstance(decisions, list) or not all(isinstance(d, MigrationDecision) for d in decisions):
            raise InvalidPolicyOutput("migrator must return a list of MigrationDecision")
        unfinished = {(s.uid, s.sample_index): s for s in progress.unfinished}
        free = {a.actor_id: a.free_slots for a in progress.actors}
        seen: set[tuple[str, int]] = set()
        for d in decisions:
            key = (d.uid, d.sample_index)
            s = unfinished.get(key)
            if s is None or key in seen:
                raise InvalidPolicyOutput(f"migration of {key} names a finished, unknown or repeated sample")
            seen.add(key)
            if s.actor_id != d.from_actor or d.tokens_generated != s.tokens_generated:
                raise InvalidPolicyOutput(f"migration of {key} misstates its actor or its generated tokens")
            if free.get(d.to_actor, 0) <= 0:
                raise InvalidPolicyOutput(f"migration of {key} to actor {d.to_actor}, which has no free slot")
            free[d.to_actor] -= 1
        return decisions

    def refine(self, progress: StepProgress) -> StepProgress:
        """Let the predictor re-estimate unfinished samples mid-step (e.g. from finished GRPO siblings)."""
        refine = getattr(self.planner.policies["predictor"], "refine", None)
        if refine is None:
            return progress
        try:
            out = self.planner.timed("predictor", lambda _p: refine(progress), None)
            if not isinstance(out, StepProgress) or len(out.unfinished) != len(progress.unfinished):
                raise InvalidPolicyOutput("refine must return a StepProgress with the same unfinished samples")
            return out
        except PolicyExit:
            raise
        except Exception as exc:
            log.warning(
                "%s failed to refine predictions: %s; keeping the plan's", self.planner.policy_label("predictor"), exc
            )
            return progress

    def decide(self, progress: StepProgress, fallbacks: list[str] | None = None) -> list[MigrationDecision]:
        """The migrator's checked decisions; a failure falls back to ``none`` and is noted in ``fallbacks``
        (the step's list, which its report shows)."""
        progress = self.refine(progress)
        decisions = self.planner.call(
            "migrator",
            self.fallbacks if fallbacks is None else fallbacks,
            lambda p: p.decide(progress),
            lambda o: self.check(o, progress),
        )
        self.decisions += len(decisions)
        return decisions


def most_actors(config: SchedulerConfig, fleet: Cluster, gpus_per_actor: int) -> int:
    """The most decode actors ``config`` may run on ``fleet``: its ``max_actors``, else ``burst`` times the
    fleet's engines (beyond the fleet: serverless burst actors)."""
    if config.max_actors is not None:
        return config.max_actors
    return int(config.burst * (fleet.total_gpus // gpus_per_actor))


def planner_for(
    config: SchedulerConfig,
    profile: TimePerTokenProfile,
    cluster: Cluster,
    registry: Registry | None = None,
    *,
    prefill_actor: bool = True,
) -> StepPlanner:
    """The step planner of ``config`` on ``cluster`` (the fleet) with engines as ``profile`` describes them: the
    one way the simulator, every command and the OpenRLHF adapter build one, so they all plan on the same cluster.

    The learner is colocated (as verl and OpenRLHF's ``--colocate_all`` run): it takes no GPU during generation.
    The cluster grows serverless burst nodes up to ``most_actors`` (the config's ``max_actors``, else ``burst``
    times the fleet's engines); a backend that cannot burst passes a config whose ``max_actors`` is its fleet.
    Candidates are estimated by the analytic cost model and checked per sample (``EngineCostModel``).
    ``prefill_actor``: a deduplicated prefill takes a GPU of its own (False where each engine prefills its own
    prompts' prefixes, as on OpenRLHF's engines)."""
    gpa = profile.gpus_per_actor
    return StepPlanner(
        config,
        cluster=cluster.with_burst(most_actors(config, cluster, gpa) * gpa),
        cost_model=AnalyticCostModel(profile),
        registry=registry,
        gpus_per_actor=gpa,
        learner_gpus=0,
        check_model=EngineCostModel(profile),
        prefill_actor=prefill_actor,
    )


def rollout_planner_for(
    config: SchedulerConfig,
    profile: TimePerTokenProfile,
    rollout_gpus: int,
    gpus_per_node: int,
    registry: Registry | None = None,
) -> StepPlanner:
    """The planner of an async pipeline's engines: alone on ``rollout_gpus`` GPUs (the others learn), with the
    memory ``profile`` gives an engine on GPUs of its own, never beyond them."""
    cluster = Cluster.of_gpus(rollout_gpus, min(rollout_gpus, gpus_per_node))
    engines = rollout_gpus // profile.gpus_per_actor
    return planner_for(config.derive(burst=1.0, max_actors=max(engines, 1)), profile, cluster, registry)


class _CountChoice:
    """One step's choice of a decode-actor count: the assignment of each count asked about (the assigner asked
    once a count), each count's estimate, and the planner's own time spent estimating inside a scaler's search
    (not the scaler's)."""

    def __init__(
        self,
        planner: StepPlanner,
        batch: PromptBatch,
        pred: np.ndarray,
        prefill: PrefillPlan,
        length_caps: np.ndarray | None,
        fallbacks: list[str],
    ) -> None:
        self.planner, self.batch, self.pred, self.prefill = planner, batch, pred, prefill
        self.length_caps, self.fallbacks = length_caps, fallbacks
        self.assignments: dict[int, np.ndarray] = {}
        self.own_s = 0.0
        # no step measured yet: nothing is known about the estimates' error, so count it as 100%
        errors = planner.estimate_errors
        self.uncertainty = float(np.median(errors)) if errors else 1.0
        nodes = planner.cluster.nodes
        self.fleet = sum(n.num_gpus for n in nodes if not n.name.startswith("burst")) // planner.gpus_per_actor

    def candidates(self, bounds: tuple[int, int]) -> list[int]:
        """The scaler's candidate counts, checked to be distinct and within ``bounds``."""
        lo, hi = bounds

        def check(c: Any) -> list[int]:
            cands = [whole(x, "scaler candidate") for x in c]
            if not cands or len(set(cands)) != len(cands) or min(cands) < lo or max(cands) > hi:
                raise InvalidPolicyOutput(f"scaler candidates {cands} are empty, repeated or outside [{lo}, {hi}]")
            return cands

        return self.planner.call("scaler", self.fallbacks, lambda p: p.candidates(lo, hi), check)

    def assign(self, n: int) -> np.ndarray:
        """The assigner's assignment of the batch to ``n`` actors, asked once."""
        if n not in self.assignments:
            batch, pred = self.batch, self.pred
            self.assignments[n] = self.planner.call(
                "assigner", self.fallbacks, lambda p: p.assign(batch, pred, n), lambda o: check_assignment(o, batch, n)
            )
        return self.assignments[n]

    def checked_at(self, n: int) -> CandidateEstimate:
        """The check model's estimate at ``n`` actors (per sample), with the estimates' error and burst marked."""
        t0 = time.perf_counter()
        e = self.planner.checked_estimate(self.batch, self.pred, self.assign(n), n, self.prefill, self.length_caps)
        self.own_s += time.perf_counter() - t0
        return e.model_copy(update={"uncertainty": self.uncertainty, "burst": n > self.fleet})

    def check_choice(self, c: Any) -> int:
        if whole(c, "scaler choice") not in self.assignments:
            raise InvalidPolicyOutput(
                f"scaler chose {c}, not one of its estimated candidates {sorted(self.assignments)}"
            )
        return int(c)

    def search(self, candidates: list[int]) -> tuple[int, list[CandidateEstimate]]:
        """The scaler's ``search`` over the counts (the baseline, after a failed search, chooses among every
        count); the scaler is charged its own time, not the planner's estimating."""
        planner, scaler = self.planner, self.planner.policies["scaler"]
        space = CandidateSearch(candidates, self.checked_at, self.fleet, self.uncertainty)

        def search(p: Any) -> Any:
            return p.search(space) if p is scaler else p.choose(tuple(space(n) for n in space.counts))

        chosen = planner.call("scaler", self.fallbacks, search, self.check_choice)
        calls, spent = planner.spent.get("scaler", (0, 0.0))
        planner.spent["scaler"] = (calls, max(spent - self.own_s, 0.0))
        return chosen, list(space.estimated)
