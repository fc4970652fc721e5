"""A discrete-event simulator of synchronous RLHF steps: a rollout backend like OpenRLHF's, driven by the same
planner and the same step controller (``rlhfless_sdk.rollout.controller``), on a simulated clock.

Each step: the scheduler's planner plans (its predictor has seen only earlier steps); the prefill actor, if
the plan deduplicates, prefills each shared prefix once and ships the KV to the decode actors; every decode
actor runs vLLM-style continuous batching (at most ``max_num_seqs`` sequences and ``kv_capacity_tokens`` of KV;
FCFS admission, a prefill pause per admission round, recompute preemption of the newest sequence when KV runs
out); at regular checkpoints the step controller may cut samples and move them, paying a re-prefill of
prompt + generated tokens (mode ``tokens``) or a KV transfer over the link between the two actors' nodes
(mode ``kv``); then scoring, learning and the weight sync take the time the profile gives. The finished
samples go back to the predictor, and a ``StepReport`` bills the step both serverless (each actor from its
first work to its last token) and serverful (every GPU for the whole step).

Start-up is charged once, to time and to GPU-seconds alike: an actor that did work in the previous step is
warm; a cold one (every actor in the first step, a new one when the scaler grows the fleet) starts
``cold_start_s`` late and is billed for those seconds. So billing serverless never exceeds billing serverful.

Between events a decode actor's batch is constant, so k decode steps cost
``k * (a + b*B + c*ctx) + c*B*k*(k-1)/2`` (context grows by B a step): the simulation jumps from event to event.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from rlhfless_sdk.api.config import SchedulerConfig
from rlhfless_sdk.api.errors import RlhflessError, UnknownPolicyError
from rlhfless_sdk.api.history import isolated_history
from rlhfless_sdk.api.kinds import KIND
from rlhfless_sdk.api.plugins import Registry
from rlhfless_sdk.api.profiles import load_acceptance
from rlhfless_sdk.api.records import (
    Cluster,
    StepPlan,
    StepReport,
    TimePerTokenProfile,
)
from rlhfless_sdk.api.speculation import Acceptance, Speculation, drafts_on
from rlhfless_sdk.planning.engine_model import priced_budget, steady_context, steady_step
from rlhfless_sdk.planning.planner import StepPlanner, planner_for
from rlhfless_sdk.rollout.billing import StepUsage, billing, held, stopped_at
from rlhfless_sdk.rollout.controller import StepController, StepOutcome
from rlhfless_sdk.rollout.drivers import Driven, PlainStep, session_for, steps_alone
from rlhfless_sdk.rollout.modes import BATCH_CUT, STREAM, TOKEN_BUDGET, Mode, mode_for, mode_names
from rlhfless_sdk.simulation.backend import SimulatedBackend, WorkloadIO
from rlhfless_sdk.simulation.bound import WorkBound, work_bound
from rlhfless_sdk.simulation.pipeline import AsyncRun
from rlhfless_sdk.simulation.results import OnStep, SimulatedStep, SimulationResult
from rlhfless_sdk.simulation.split import MIN_GAIN, runs_plan
from rlhfless_sdk.simulation.stream import StreamRun
from rlhfless_sdk.simulation.tail_prepare import TailUsage
from rlhfless_sdk.workloads.traces import Workload, WorkloadStep


def equal_peak(config: SchedulerConfig, fleet_actors: int) -> SchedulerConfig:
    """``config`` on the fleet only: no burst engine, at most the fleet's decode actors (``simulate``'s default:
    every scheduler compared on the same peak GPUs; the fidelity check's: on the real run's engines and no more)."""
    most = min(config.max_actors or fleet_actors, fleet_actors)
    return config.derive(burst=1.0, max_actors=max(most, config.min_actors))


#: Why a drafter is dropped (``DrafterPrice.lost``), as a line says it after "drafter NAME".
LOST_PER_COUNT = "is priced to lose at every running count"
LOST_STEPS = f"is priced to gain less than {MIN_GAIN:.0%} over the workload's first two steps"
LOST_STEADY = f"is priced to gain less than {MIN_GAIN:.0%} on the stream's steady token"


@dataclass(frozen=True)
class DrafterPrice:
    """A drafter priced on a simulator's engines: its speculation (None: the engines are built without one; a
    budget of zeros: dropped), why it was dropped (``LOST_*``, None where it drafts) and, where the first steps
    were run, their seconds with and without it (a stream: its steady token's)."""

    spec: Speculation | None
    lost: str | None = None
    times: tuple[float, float] | None = None

    @property
    def over_steps(self) -> bool:
        """Dropped over the workload's first steps (their seconds with and without it in ``times``)."""
        return self.lost == LOST_STEPS and self.times is not None

    def said(self) -> str | None:
        """Why it was dropped, as a line says it after "drafter NAME" (None: it drafts)."""
        if self.over_steps:
            return f"{self.lost}, {self.times[0]:,.1f} s with it and {self.times[1]:,.1f} s without"
        return self.lost


class Simulator(AsyncRun, StreamRun, TailUsage):
    """Runs a scheduler over a workload on a simulated cluster; see the module docstring for the model."""

    @property
    def modes(self) -> list[str]:
        """The modes this backend runs: every registered one (a driver through its session, a pipeline through its
        ``simulate``)."""
        return mode_names(self.registry)

    def __init__(
        self,
        profile: TimePerTokenProfile,
        cluster: Cluster,
        *,
        registry: Registry,
        max_tokens: int | None = None,
        checks_per_step: int = 40,
        algo: str | None = None,
        memory: str = "dedicated",
        split_probe_steps: int | None = 3,
        prefix_caching: bool = False,
        bound_profile: TimePerTokenProfile | None = None,
        split_plan: tuple[Workload, str] | None = None,
        acceptance: Acceptance | None = None,
        force: bool = False,
        plan_s: float | None = None,
    ) -> None:
        """``algo``: the learner's rates (``ppo`` or ``grpo``); default: what each workload implies. ``memory``:
        the KV capacity of a synchronous engine, which shares its GPUs with the learner (``colocated``, the
        profile's ``colocated_kv_capacity_tokens``) or has them to itself during generation (``dedicated``, the
        profile's ``kv_capacity_tokens``: the learner offloaded). Engines on GPUs of their own (an async
        pipeline's, burst engines) always get the dedicated capacity. ``prefix_caching``: vLLM's prefix cache is
        on, so a sample admitted to an engine that prefilled its prompt before (a group-mate's) reads it from the
        cache (OpenRLHF's default is off; its demo and the fidelity check run with it on). ``bound_profile``: the
        engine the work bound is computed on (default ``profile``; a sharded profile's one-GPU form, so that no
        engine shape beats the bound). ``split_plan``: the workload (and its description) a stream with no split set
        picks its split on, as a launch does (``rlhfless_sdk.simulation.split``); default: the workload it runs.
        ``acceptance``: what a scheduler's drafter achieves (``rlhfless_sdk.api.speculation``); default: the
        acceptance shipped for its name (measured on real rollouts). ``force``: a stream priced slower than
        OpenRLHF's async loop runs anyway (a launch's ``--scheduler.force``); by default that loop runs instead.
        ``plan_s``: seconds charged to each step for making its plan (its engines start after it); default: the
        plan's own wall time where it was made (``planner_ms``), as a launch pays it. A fixed figure makes runs
        repeat to the last digit (tests of the engine model's arithmetic)."""
        self.force = force
        self.plan_s = plan_s
        self.acceptance = acceptance
        self.memory = memory
        self.bound_profile = bound_profile or profile
        self.prefix_caching = prefix_caching  # vLLM's prefix cache on the engines (OpenRLHF's default: off)
        self.split_probe_steps = split_probe_steps  # async with no split set: steps each split is tried on
        self.split_plan = split_plan  # a stream with no split set: the workload its split is planned on
        self.dedicated = profile
        self.own_speculation = profile.speculation  # the profile's own (none unless it says), for runs of no drafter
        profile = profile.with_memory(memory)
        self.profile = profile
        self.algo = algo
        self.cluster = cluster
        self.registry = registry
        self.max_tokens = max_tokens
        self.checks_per_step = checks_per_step
        self.warm: frozenset[int] = frozenset()  # actors that worked in the previous step
        self.warm_prefill = False
        self.run_algo = algo or "ppo"
        self._bounds: dict[int, tuple[Workload, str, WorkBound]] = {}

    def planner(self, config: SchedulerConfig) -> StepPlanner:
        """``config``'s planner on the fleet (``planner_for``: plus burst nodes when the config allows more decode
        actors than the fleet holds)."""
        return planner_for(config, self.profile, self.cluster, self.registry)

    def run(
        self,
        config: SchedulerConfig,
        workload: Workload,
        on_step: OnStep = None,
        frontier: bool = False,
    ) -> SimulationResult:
        """Every step of ``workload`` under ``config``, with the workload's work bound on this cluster. A
        predictor's length history reads only what this run records (``isolated_history``): a replayed workload's
        later steps are never seen before their turn, whatever an earlier run left in a history file."""
        price = self.price_drafter(config, workload)
        spec = price.spec
        with isolated_history():
            result = self.drafting(spec, config.kv_watermark)._run(config, workload, on_step, frontier)
        drafted = None
        if spec is not None and max(spec.budget) == 0:  # priced to lose: the engines run without it
            drafted = {"name": config.policy("drafter").name, "acceptance": spec.acceptance.source, "drafts_at": None}
            drafted.update(assumption=spec.acceptance.assumption, lost=price.lost, lost_s=price.times)
        elif spec is not None:
            drafted_profile = self.bound_profile.model_copy(update={"speculation": spec})
            bound = work_bound(workload, drafted_profile, self.algo or workload.algo)
            acc = spec.acceptance
            drafted = {
                "name": config.policy("drafter").name,
                "acceptance": acc.source,
                "assumption": acc.assumption,
                "tokens_per_step": spec.tokens_per_step(),
                "best_tokens_per_step": spec.best_tokens_per_step(),
                "bound_gpu_s": bound.gpu_s,
                "drafts_at": spec.drafting_range(),
            }
        work = self.work_bound(workload)
        return replace(
            result, workload_steps=len(workload.steps), gpus=self.cluster.total_gpus, work=work, drafter=drafted
        )

    def speculation(self, config: SchedulerConfig, workload: Workload | None = None) -> Speculation | None:
        """What ``config``'s drafter does on these engines (``price_drafter``'s speculation)."""
        return self.price_drafter(config, workload).spec

    def price_drafter(self, config: SchedulerConfig, workload: Workload | None = None) -> DrafterPrice:
        """What ``config``'s drafter does on these engines, and why: its budget for each running count, kept where
        the priced gain is positive (``priced_budget``, at the context of ``workload``'s first step; without a
        workload, the drafter's own budget) and where engines with it beat plain ones by ``MIN_GAIN`` over
        ``workload``'s first steps (``_drafting_times``; ``runs_plan``, the rule any plan meets), and its
        acceptance (this simulator's, or the one shipped for its name); no speculation without a drafter, or with
        one that does not draft on these engines' device (``drafts_on``). The simulator and the launch decide with
        it."""
        ref = config.policy("drafter")
        if ref.name == KIND["drafter"].baseline:
            return DrafterPrice(None)
        try:
            acceptance = self.acceptance or load_acceptance(ref.name)
        except UnknownPolicyError:
            raise RlhflessError(
                f"scheduler {config.name!r}: no measured acceptance ships for drafter {ref.name!r}; give one "
                "(`rlhfless drafter-bench --drafter NAME --write-acceptance DIR`, then --acceptance DIR/NAME.yaml, or "
                "--acceptance geometric:A to assume one)"
            ) from None
        try:
            drafter = self.registry.create("drafter", ref)
            if not drafts_on(drafter, self.profile.device):
                return DrafterPrice(None)  # a drafter that drafts nothing on these engines (a GPU-only one on CPU)
            spec = Speculation.of_drafter(acceptance, drafter, self.profile.max_num_seqs)
        except Exception as exc:
            warnings.warn(
                f"drafter {ref.name!r} raised ({type(exc).__name__}: {exc}); scheduler {config.name!r} runs without "
                "speculative decoding (drafter none)",
                stacklevel=2,
            )
            return DrafterPrice(None)
        if workload is None or not workload.steps:
            return DrafterPrice(spec)
        first = workload.steps[0]
        prompt = np.repeat(first.batch.prompt_lengths, first.batch.n_samples)
        priced = priced_budget(
            self.profile.model_copy(update={"speculation": spec}), steady_context(prompt, first.lengths)
        )
        spec = spec.model_copy(update={"budget": priced})
        if max(priced) == 0:
            return DrafterPrice(spec, lost=LOST_PER_COUNT)
        drafted_s, plain_s = self._drafting_times(config, spec, workload, prompt, first.lengths)
        if not runs_plan(drafted_s, plain_s):  # the SDK's rule for any plan: it must gain MIN_GAIN on the model
            lost = LOST_STEADY if mode_for(config, self.registry).pipeline == STREAM else LOST_STEPS
            return DrafterPrice(spec.model_copy(update={"budget": [0] * len(priced)}), lost, (drafted_s, plain_s))
        return DrafterPrice(spec, None, (drafted_s, plain_s))

    def _drafting_times(
        self, config: SchedulerConfig, spec: Speculation, workload: Workload, prompt: np.ndarray, lengths: np.ndarray
    ) -> tuple[float, float]:
        """Engines with ``spec`` against plain ones on the workload's first steps, (drafted, plain) seconds: the
        first two steps run by ``config`` with and without the drafter, as they run in a longer run (the workload's
        third step follows them, unjudged: a scheduler that carries a step's tail into the next cuts both steps
        short, where a last step would run to its end); a stream's steady token (it keeps its engines full). An
        engine built with a drafter pays the lost async scheduling at every running count, so a budget that gains
        where few sequences run can still lose over the steps."""
        plain = self.profile.model_copy(update={"speculation": None})
        drafted = self.profile.model_copy(update={"speculation": spec})
        if mode_for(config, self.registry).pipeline == STREAM:
            return steady_step(drafted, prompt, lengths)[1], steady_step(plain, prompt, lengths)[1]
        judged = min(len(workload.steps), 2)
        first = replace(workload, steps=workload.steps[: judged + 1])  # one more: the judged steps run as in a run
        unplanned = copy.copy(self)  # planning takes as long either way: not charged, so the verdict is repeatable
        unplanned.plan_s = 0.0
        watermark = config.kv_watermark
        with isolated_history():
            runs = [unplanned.drafting(s, watermark)._run(config, first, None, False) for s in (spec, None)]
        with_it, without = (sum(r.time_s for r in run.reports[:judged]) for run in runs)
        return with_it, without

    def drafting(self, spec: Speculation | None, watermark: float = 0.0) -> Simulator:
        """This simulator with its engines under ``spec``'s speculative decoding (None: the profile's own) and vLLM's
        KV ``watermark`` (a scheduler's ``kv_watermark``), whatever this one drafts with (a stream's split is planned
        against a baseline that drafts nothing): a copy that shares its caches, or itself where nothing changes.
        The run goes on the copy; this one is left as it is."""
        if spec is not None and max(spec.budget) == 0:  # drafts nowhere: engines built without the drafter
            spec = None
        spec = spec if spec is not None else self.own_speculation
        if self.profile.speculation is spec and self.profile.watermark == watermark:
            return self
        other = copy.copy(self)
        update = {"speculation": spec, "watermark": watermark}
        other.profile = self.profile.model_copy(update=update)
        other.dedicated = self.dedicated.model_copy(update=update)
        return other

    def work_bound(self, workload: Workload) -> WorkBound:
        """The workload's work bound on this simulator's engines (computed once per workload)."""
        algo = self.algo or workload.algo
        cached = self._bounds.get(id(workload))
        if cached is None or cached[0] is not workload or cached[1] != algo:
            cached = self._bounds[id(workload)] = (workload, algo, work_bound(workload, self.bound_profile, algo))
        return cached[2]

    def refusal(self, config: SchedulerConfig, mode: Mode | None = None) -> str | None:
        """Why this simulator cannot run ``config`` (None: it can); ``run`` raises it, a command asks first.
        Scoring in the generation tail (``tail_prepare``) works on the groups a step completes from the samples it
        ran; a straggler policy that carries cut samples into the next step (partial rollouts) trains groups with
        samples of earlier steps, whose tail the model does not follow."""
        mode = mode or mode_for(config, self.registry)
        if not mode.tail or mode.driver not in (TOKEN_BUDGET, BATCH_CUT):
            return None
        fields = "pipeline.tail_prepare" + (" and tail_learn" if mode.tail == "learn" else "")
        return (
            f"scheduler {config.name!r}: {fields} (scoring complete groups on GPUs done decoding) cannot run with the "
            f"straggler policy {config.policy('straggler').name!r}, which carries cut samples into the next step "
            "(partial rollouts): use straggler none or tail-batch with it, or drop tail_prepare"
        )

    def _run(
        self,
        config: SchedulerConfig,
        workload: Workload,
        on_step: OnStep,
        frontier: bool,
    ) -> SimulationResult:
        mode = mode_for(config, self.registry)
        refused = self.refusal(config, mode)
        if refused is not None:
            raise RlhflessError(refused)
        self.begin(workload)
        if mode.pipelined:  # a registered pipeline runs itself on this simulator (the built-in ones too)
            spec = self.registry.pipeline(mode.pipeline)
            if spec.simulate is None:
                raise RlhflessError(f"pipeline {spec.name!r} (plugin {spec.plugin!r}) has no simulator run (simulate)")
            return spec.simulate(self, config, workload, on_step, mode)
        planner = self.planner(config)
        if steps_alone(mode.driver, self.registry):  # one step at a time, every sample to its end
            return self.run_plain(planner, workload, on_step, frontier)
        return self.run_driven(planner, workload, on_step, mode.driver)

    def begin(self, workload: Workload) -> None:
        """A fresh run of ``workload``: no warm engine, the learner's algorithm from the workload unless set."""
        self.warm, self.warm_prefill = frozenset(), False
        self.run_algo = self.algo or workload.algo

    def planned_split(
        self, config: SchedulerConfig, workload: Workload, on_step: OnStep, mode: Mode
    ) -> SimulationResult:
        """A stream at the split a launch picks for it (``choose_split`` on ``split_plan``, default this workload)."""
        from rlhfless_sdk.simulation.split import BASELINE, choose_split

        plan, source = self.split_plan or (workload, "the workload it replays")
        choice = choose_split(self, config, plan, source)
        self.begin(workload)
        if choice.priced_slower() and not self.force:  # never slower: what a launch does (``--scheduler.force``)
            choice.fallback = True
            baseline = self.registry.scheduler(BASELINE)
            drafted = self.drafting(self.speculation(baseline, workload), baseline.kv_watermark)
            res = drafted.pipeline_run(mode_for(baseline, self.registry))(
                baseline, workload, on_step, choice.baseline_split
            )
            res = replace(res, scheduler=config.name)
        else:
            res = self.pipeline_run(mode)(config, workload, on_step, choice.rollout_gpus)
        return replace(res, split_plan=choice.as_dict())

    def run_plain(
        self,
        planner: StepPlanner,
        workload: Workload,
        on_step: OnStep = None,
        frontier: bool = False,
    ) -> SimulationResult:
        """Every step of the workload, each sample run to its end in its step (``PlainStep``)."""
        steps = []
        for ws in workload.steps:
            sim = self.step(planner, ws, frontier=frontier)
            steps.append(sim)
            if on_step is not None:
                on_step(sim.report)
        return SimulationResult(planner.config.name, steps)

    # -- OpenRLHF's async mode ------------------------------------------------------------------------------
    def learner_floor(self) -> int:
        """The fewest GPUs this run's learner state fits on (the profile's ``learner``: a DeepSpeed ZeRO-3 learner
        of the model and algorithm); 1 for a profile that does not say."""
        learner = self.profile.learner
        return 1 if learner is None else learner.min_gpus(self.run_algo)

    def restart_s(self) -> float:
        """What resizing this run's learner costs: a restart from checkpoint (the profile's ``learner``)."""
        learner = self.profile.learner
        return 0.0 if learner is None else learner.restart_s(self.run_algo)

    def splits(self) -> list[int]:
        """Every rollout/learner split of the fleet: GPUs that generate, in whole engines, the rest (at least what
        the learner's state needs, ``learner_floor``) to learn."""
        g, gpa, floor = self.cluster.total_gpus, self.profile.gpus_per_actor, self.learner_floor()
        if g - floor < gpa:
            raise RlhflessError(
                f"a pipeline needs at least {gpa + floor} GPUs here (an engine of {gpa} and a {self.run_algo} "
                f"learner whose state needs {floor}, profile {self.profile.name!r}); got {g}"
            )
        return list(range(gpa, g - floor + 1, gpa))

    def rollout_gpus(self, config: SchedulerConfig) -> int | None:
        """The config's fixed split (checked), or None: find the best."""
        g, gpa, floor = self.cluster.total_gpus, self.profile.gpus_per_actor, self.learner_floor()
        fixed = config.pipeline.rollout_gpus
        if fixed is not None and (fixed % gpa or not gpa <= fixed <= g - floor):
            raise RlhflessError(
                f"scheduler {config.name!r}: rollout_gpus={fixed} must be a multiple of {gpa} (GPUs per "
                f"engine) and leave the learner {floor} of the {g} GPUs (what its {self.run_algo} state needs)"
            )
        return fixed

    def best_split(self, config: SchedulerConfig, workload: Workload, on_step: OnStep, mode: Mode) -> SimulationResult:
        """The async pipeline at the split a user tuning it would keep: every split is run on the first
        ``split_probe_steps`` steps (all of them when None) and the fastest there runs the whole workload."""
        probe_steps = self.split_probe_steps
        probe = workload if probe_steps is None else replace(workload, steps=workload.steps[:probe_steps])
        tried: list[dict] = []
        best: tuple[float, int, SimulationResult] | None = None
        for r in self.splits():
            res = self.pipeline_run(mode)(config, probe, None, r)
            t = sum(x.time_s for x in res.reports)
            tried.append({"rollout_gpus": r, "time_s": t})
            if best is None or t < best[0]:
                best = (t, r, res)
        assert best is not None
        _, r, res = best
        if probe is not workload:
            res = self.pipeline_run(mode)(config, workload, on_step, r)
        elif on_step is not None:
            for rep in res.reports:
                on_step(rep)
        return replace(res, split_search=tried)

    def pipeline_run(self, mode: Mode) -> Callable[[SchedulerConfig, Workload, OnStep, int], SimulationResult]:
        """The run of ``mode``'s pipeline at one split, called with (config, workload, on_step, rollout GPUs)."""
        spec = self.registry.pipeline(mode.pipeline)
        if spec.run_at is None:
            raise RlhflessError(f"pipeline {spec.name!r} (plugin {spec.plugin!r}) runs at no given split (run_at)")
        return lambda config, workload, on_step, r: spec.run_at(self, config, workload, on_step, r, mode)

    def hold(self, planner: StepPlanner, usage: StepUsage) -> StepUsage:
        """``usage`` of a finished step (its learning included), with each burst engine kept for the next step
        or released, as the planner decides on cost (``StepPlanner.keep_burst``). The fleet's engines live on
        GPUs the run holds for its learner anyway: once started they stay up (an engine that sits a step out is
        woken, not restarted), as OpenRLHF creates its engines once; kept burst engines stay warm too."""
        step_s = usage.step_s
        if step_s is None:
            step_s = usage.generation_s + usage.prepare_s + usage.learn_s + usage.sync_s
        engines = []
        for e in usage.engines:
            if e.burst and held(e):
                idle = step_s - (e.last_s if e.first_s is not None else 0.0)
                e = replace(e, kept=planner.keep_burst(idle))
            engines.append(e)
        fleet_actors = self.cluster.total_gpus // self.profile.gpus_per_actor
        burst = {a for a, e in enumerate(engines) if e.burst}
        self.warm = frozenset(
            {a for a in self.warm if a not in burst and (a < len(engines) or a < fleet_actors)}
            | {a for a, e in enumerate(engines) if not e.burst and e.first_s is not None}
            | {a for a, e in enumerate(engines) if e.burst and e.kept}
        )
        self.warm_prefill = self.warm_prefill or usage.prefill_s > 0
        return replace(usage, engines=engines)

    def _learning(self, tokens: float, gpus: int) -> tuple[float, float]:
        """(scoring, learning) seconds of ``tokens`` (prompt + response) on ``gpus`` GPUs, for the run's algorithm."""
        prepare, learn = self.profile.learner_rates(self.run_algo)
        return tokens * prepare / gpus, tokens * learn / gpus

    # -- the step drivers of the straggler policies (``rlhfless_sdk.rollout.drivers``) -------------------------
    def run_driven(
        self,
        planner: StepPlanner,
        workload: Workload,
        on_step: OnStep = None,
        mode: str = BATCH_CUT,
    ) -> SimulationResult:
        """Every step of a carrying or over-provisioning ``mode``, run by its driver session over the workload's
        prompts (B = the largest step's prompts a step). A step whose driver cuts it at some instant (tail batching's
        rounds, a batch cut) is simulated whole and cut there: what happens after it cannot change what happened
        before; what each sample had by then comes from the same engines run again up to it."""
        steps_in = workload.steps
        b = max((len(ws.batch) for ws in steps_in), default=0)
        if b == 0:
            return SimulationResult(planner.config.name, [])
        io = WorkloadIO(self, planner, steps_in)
        session = session_for(mode, planner, b, io.prompts())
        io.book = session.book
        out: list[SimulatedStep] = []
        r = 0
        while True:
            io.begin(r)
            driven = session.next(io, r)
            if driven is None:
                return SimulationResult(planner.config.name, out)
            out.append(self._settle_step(planner, driven, on_step))
            r += 1

    def _settle_step(self, planner: StepPlanner, driven: Driven, on_step: OnStep) -> SimulatedStep:
        """A driven step billed: the engines up to when it ended, the learner on the tokens (prompt + response)
        that train, burst engines kept or released; the report with the driver's fields."""
        rep, u = driven.outcome.report, driven.outcome.usage
        prepare_s, learn_s = self._learning(float(driven.trained_tokens), self.cluster.total_gpus)
        usage = stopped_at(u, driven.stop_s)
        usage = self._score_in_tail(planner, replace(usage, prepare_s=prepare_s, learn_s=learn_s), driven)
        usage = self.hold(planner, usage)
        report = rep.model_copy(update={**billing(usage), **driven.fields})
        sim = SimulatedStep.of(report, driven.plan, driven.outcome, usage=usage)
        if on_step is not None:
            on_step(report)
        return sim

    def _tokens_at(self, planner: StepPlanner, ws: WorkloadStep, plan: StepPlan, t: float, **kw: Any) -> list[int]:
        """Each sample's tokens at time ``t`` of a step dispatched as the step controller does (no migration);
        ``kw``: where its engines ran (``backend``'s)."""
        backend = self.backend(planner, ws, plan, **kw)
        StepController(planner, backend, ws.batch, plan, step=ws.step).dispatch()
        backend.advance_to(t)
        return backend.tokens_now()

    def step(self, planner: StepPlanner, ws: WorkloadStep, frontier: bool = False) -> SimulatedStep:
        """One step (``PlainStep``); the actors that worked in it stay warm for the next (``self.warm``)."""
        io = WorkloadIO(self, planner, [ws])
        io.begin(ws.step)
        driven = PlainStep(planner, ws.step).run(io, io.adopt(ws.batch, ws.lengths))
        plan, outcome = driven.plan, driven.outcome
        front = self.frontier(planner, ws, plan, outcome.report) if frontier else None
        usage = self.hold(planner, self._score_in_tail(planner, outcome.usage, driven))
        report = outcome.report.model_copy(update=billing(usage))
        return SimulatedStep.of(report, plan, outcome, front, usage)

    def backend(
        self,
        planner: StepPlanner,
        ws: WorkloadStep,
        plan: StepPlan,
        *,
        cluster: Cluster | None = None,
        pauses: Sequence[tuple[float, float]] = (),
        pause_frees_kv: bool = False,
        profile: TimePerTokenProfile | None = None,
    ) -> SimulatedBackend:
        """The simulated engines for one step of ``plan``, warm where the previous step left them (``profile``:
        the engines' model, default the synchronous engines'; ``pauses``, ``pause_frees_kv``: as
        ``SimulatedBackend`` takes them)."""
        return SimulatedBackend(
            profile or self.profile,
            cluster or self.cluster,
            ws,
            plan,
            max_tokens=self.max_tokens,
            checks_per_step=self.checks_per_step,
            migrates=planner.config.migrates(),
            warm=self.warm,
            warm_prefill=self.warm_prefill,
            algo=self.run_algo,
            pauses=pauses,
            pause_frees_kv=pause_frees_kv,
            burst_profile=self.dedicated,
            prefix_caching=self.prefix_caching,
            plan_s=plan.planner_ms / 1000.0 if self.plan_s is None else self.plan_s,
        )

    def execute(self, planner: StepPlanner, ws: WorkloadStep, plan: StepPlan, *, observe: bool = False) -> StepOutcome:
        """Run one step of ``plan`` through the step controller on the simulated backend."""
        backend = self.backend(planner, ws, plan)
        return StepController(planner, backend, ws.batch, plan, step=ws.step).run(observe=observe)

    def frontier(self, planner: StepPlanner, ws: WorkloadStep, plan: StepPlan, report: StepReport) -> list[dict]:
        """Every candidate actor count (those a searching scaler did not estimate too): the cost model's (time,
        GPU-seconds) and the simulated ones."""
        out = []
        lo, hi = planner.actor_range(planner.extra_actors(plan.prefill))
        known = {e.num_actors: e for e in plan.candidates}
        for n in sorted(known.keys() | set(planner.policies["scaler"].candidates(lo, hi))):
            if n == plan.num_actors:
                sim, e = report, known[n]
            else:
                variant = planner.plan(
                    ws.batch,
                    step=ws.step,
                    predicted=np.asarray(plan.predicted_lengths),
                    num_actors=n,
                    prefill=plan.prefill,
                )
                sim, e = self.execute(planner, ws, variant).report, known.get(n, variant.candidates[0])
            learner = self.cluster.total_gpus * (sim.prepare_s + sim.learn_s + self.profile.weight_sync_s)
            out.append(
                {
                    "num_actors": n,
                    # the cost model covers generation only; the simulated step adds scoring, learning, sync
                    "predicted_time_s": e.time_s,
                    "predicted_gpu_seconds": e.gpu_seconds,
                    "simulated_generation_s": sim.generation_s,
                    "simulated_generation_gpu_seconds": sim.gpu_seconds - learner,
                    "simulated_time_s": sim.time_s,
                    "simulated_gpu_seconds": sim.gpu_seconds,
                    "chosen": n == plan.num_actors,
                }
            )
        return out
