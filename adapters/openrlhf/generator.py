"""RLHFless's samples generator: OpenRLHF's ``SamplesGenerator`` with the rollout driven by the SDK's step drivers.

OpenRLHF calls ``_generate_vllm`` once per training batch. The generator hands the step to the SDK's driver of its
scheduler's mode (``rlhfless_sdk.rollout.drivers``: plain, tail rounds or a batch cut), the same code the simulator
runs, through ``EnginesIO``: prompts from OpenRLHF's dataloader, tokenized into the planner's batch, the plan run by
the SDK's ``StepController`` on OpenRLHF's vLLM engines (``ray_backend.RayBackend``) under the driver's end rule.
What is left here is OpenRLHF's side: experiences from the responses that train, the checkpoint of carried work
and deferred prompts, the trace and the report as JSON lines, and ``rlhfless/*`` metrics for OpenRLHF's logs.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import ray
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator
from rlhfless_openrlhf.capabilities import BACKEND, BACKEND_KEY, runs
from rlhfless_openrlhf.carried import tensor_to_json
from rlhfless_openrlhf.messages import CutSample, SharedTokenizer
from rlhfless_openrlhf.ray_backend import (
    BackendSettings,
    EnginePool,
    RolloutEngineLost,
    engine_gpus,
)
from rlhfless_openrlhf.run_modes import CarriedRun, ModeRun, PlainRun, RoundsRun, plain_step
from rlhfless_openrlhf.stream import StreamRun
from vllm import SamplingParams

from rlhfless_sdk.api.batch import PromptBatch
from rlhfless_sdk.api.config import SchedulerConfig
from rlhfless_sdk.api.errors import RlhflessError
from rlhfless_sdk.api.plugins import Registry, get_plugin_manager
from rlhfless_sdk.api.records import Cluster, StepPlan, StepReport, TimePerTokenProfile
from rlhfless_sdk.planning.planner import planner_for
from rlhfless_sdk.rollout.controller import StepOutcome
from rlhfless_sdk.rollout.drivers import Driven, refusal
from rlhfless_sdk.rollout.modes import BATCH_CUT, STREAM, Mode, planned_mode
from rlhfless_sdk.rollout.run_log import RunLog, fresh_uid, prompt_uid
from rlhfless_sdk.workloads.replay import LengthReplay

__all__ = ["RlhflessSamplesGenerator", "RolloutEngineLost", "log_lines", "merge_metrics", "prompt_uid"]
from rlhfless_openrlhf.launch_split import learner_gpus as launch_learner_gpus
from rlhfless_openrlhf.step_io import EnginesIO

log = logging.getLogger("rlhfless.openrlhf")


def log_lines() -> None:
    """Show the adapter's INFO lines (placement, refill rounds, engines woken) in this process's stderr, once."""
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


class RlhflessSamplesGenerator(SamplesGenerator):
    """Drop-in for OpenRLHF's ``SamplesGenerator`` (same constructor, plus the scheduler)."""

    def __init__(
        self,
        strategy: Any,
        prompts_dataloader: Any,
        eval_dataloader: Any,
        tokenizer: Any,
        vllm_engines: list,
        *,
        scheduler: SchedulerConfig,
        profile: TimePerTokenProfile,
        report_path: str | Path | None = None,
        trace_path: str | Path | None = None,
        replay: LengthReplay | None = None,
        check_interval_s: float = 0.5,
        carry_timeout_s: float = 120.0,
        gpus_per_node: int = 8,
        registry: Registry | None = None,
        mode: Mode | None = None,
        learner_gpus: int | None = None,
        fill_engines: list | None = None,
    ) -> None:
        """``mode``: the scheduler's (a launch plan's; default: asked of the planner's straggler policy);
        ``learner_gpus``: the GPUs OpenRLHF's learner holds beside the engines (default: read from OpenRLHF's args,
        0 where a tool stands in for the learner); ``fill_engines``: the stream's fill engines the launcher built
        (``rlhfless_openrlhf.fill``)."""
        super().__init__(strategy, prompts_dataloader, eval_dataloader, tokenizer, vllm_engines)
        self._plan_on_engines(scheduler, profile, gpus_per_node, registry or get_plugin_manager().registry)
        registry = self.planner.registry
        mode = mode or planned_mode(self.planner)
        refused = refusal(self.planner.config, mode, runs(registry), BACKEND, registry)
        if refused is not None:
            raise RlhflessError(refused)
        # the step count, the reports and the trace; length replay: each sample stops at a length from a trace, EOS
        # ignored (the scheduler is not told)
        self.log = RunLog(report_path, trace_path, replay)
        self.check_interval_s = check_interval_s
        self.carry_timeout_s = carry_timeout_s  # how long a step's end waits for its carried samples' calls
        self.keeps_tokens = mode.keeps_tokens
        self._read_openrlhf_flags()
        self.last_cuts: list[tuple[int, int, CutSample]] = []
        self.last_trained_groups: list[int] = []  # the groups of the last step's experiences
        self._shared_tokenizer: tuple[Any, SharedTokenizer] | None = None  # (tokenizer, its reference), put once
        self._held: list[tuple[str, Any, Any]] = []  # drawn from a dataloader batch, not yet taken (``take_prompts``)
        self._engine_profile: TimePerTokenProfile | None = None  # ``engine_profile``, read from the engines once
        if learner_gpus is None:
            learner_gpus = launch_learner_gpus(self.args) if hasattr(self.args, "actor") else 0
        # how its batches run, chosen once: the mode's own object (``run_modes``), which holds the mode's state
        self.run = run_for(self, mode, registry, learner_gpus=learner_gpus, fill_engines=fill_engines)

    def _plan_on_engines(
        self, scheduler: SchedulerConfig, profile: TimePerTokenProfile, gpus_per_node: int, registry: Registry
    ) -> None:
        """The engine pool and the planner of ``scheduler`` on the engines OpenRLHF created, one decode actor each:
        never more (real engines do not burst), at the KV watermark the engine builder set."""
        self.pool = EnginePool(self.vllm_engines)
        self.pool.drafting = scheduler.policy("drafter").name != "none"  # the engines were built with it
        n = len(self.vllm_engines)
        config = scheduler.derive(burst=1.0, max_actors=min(scheduler.max_actors or n, n))
        self.cluster = Cluster.of_gpus(n * profile.gpus_per_actor, gpus_per_node)
        self.profile = profile.model_copy(update={"watermark": scheduler.kv_watermark})
        self.planner = planner_for(config, self.profile, self.cluster, registry, prefill_actor=False)
        self.planner.warm_actors = n  # OpenRLHF started them before the first step

    def _read_openrlhf_flags(self) -> None:
        """What OpenRLHF's flags say for every scheduler alike: dedup prefill rides on vLLM's prefix cache (the
        user's setting holds); a scheduler that trains stale tokens without the importance correction is warned."""
        self.prefix_caching = bool(getattr(self.args.vllm, "enable_prefix_caching", True))
        if not self.prefix_caching:
            log.info("prefix caching is off (--vllm.enable_prefix_caching): the dedup prefill plan is not applied")
        if self.keeps_tokens and self.args.algo.advantage.is_correction_level == "off":
            log.warning(
                "rlhfless: scheduler %s trains carried tokens one weight update stale, but importance-sampling "
                "correction is off (--algo.advantage.is_correction_level): they train without an importance weight",
                self.planner.config.name,
            )

    @property
    def step(self) -> int:
        """The step (or stream batch) under way."""
        return self.log.step

    @step.setter
    def step(self, value: int) -> None:
        self.log.step = value

    @property
    def replay(self) -> LengthReplay | None:
        return self.log.replay

    @property
    def last_report(self) -> StepReport | None:
        return self.log.last_report

    @property
    def last_metrics(self) -> dict[str, float]:
        return self.log.last_metrics

    @property
    def backend_settings(self) -> BackendSettings:
        """What a step's backend needs, read when the step starts (OpenRLHF's args may change between steps)."""
        return BackendSettings(
            tokenizer=self.shared_tokenizer(),
            prefix_caching=self.prefix_caching,
            check_interval_s=self.check_interval_s,
            carry_timeout_s=self.carry_timeout_s,
            gpus_per_engine=engine_gpus(self.args),
            max_num_seqs=self.engine_profile.max_num_seqs,
            kv_capacity_tokens=self.engine_profile.kv_capacity_tokens,
        )

    @property
    def engine_profile(self) -> TimePerTokenProfile:
        """The profile with the KV capacity, sequences at once and KV watermark of the engines themselves (read
        from them once: the least of the live ones, the watermark's most), not the profile's: on another GPU,
        ``--vllm.gpu_memory_utilization`` or model the profile's could be off by 2x. What the stream holds each
        engine to (``KvSlots``) and what the KV-aware consolidation moves by come from here; an engine that does not
        say keeps the profile's figure."""
        if self._engine_profile is None:
            stats = self.pool.stats(self.pool.live())
            kv = min((s.kv_capacity_tokens for s in stats.values() if s.kv_capacity_tokens > 0), default=0)
            seqs = min((s.max_num_seqs for s in stats.values() if s.max_num_seqs > 0), default=0)
            prof = self.profile
            update = {
                "kv_capacity_tokens": kv or prof.kv_capacity_tokens,
                "max_num_seqs": seqs or prof.max_num_seqs,
                "watermark": max((s.watermark for s in stats.values()), default=prof.watermark),
            }
            if kv and abs(kv - prof.kv_capacity_tokens) > 0.1 * prof.kv_capacity_tokens:
                log.info(
                    "rlhfless: the engines' KV caches hold %d tokens each (profile %r: %d); the in-flight cap and "
                    "KV-aware moves follow the engines",
                    kv,
                    prof.name,
                    prof.kv_capacity_tokens,
                )
            self._engine_profile = prof.model_copy(update=update)
        return self._engine_profile

    def shared_tokenizer(self) -> SharedTokenizer:
        """The tokenizer in Ray's object store, put there once per tokenizer (see ``SharedTokenizer``): the engine
        calls carry a reference, not a pickled tokenizer each."""
        held = self._shared_tokenizer
        if held is None or held[0] is not self.tokenizer:
            held = self._shared_tokenizer = (self.tokenizer, SharedTokenizer(ray.put(self.tokenizer)))
        return held[1]

    @property
    def dead(self) -> set[int]:
        """Rollout engines that died."""
        return self.pool.dead

    # -- the step ------------------------------------------------------------------------------------------
    def generate_samples(self, **generate_kwargs):  # type: ignore[override]
        """OpenRLHF's entry point, unchanged, except that a step in which a rollout engine died is not handed to
        training (see ``dead_engine_error``), and that a mode forming its own batches (the stream) forms them."""
        out = self.run.own_batches(generate_kwargs)
        if out is None:
            out = super().generate_samples(**generate_kwargs)
        error = self.dead_engine_error()
        if error is not None:
            raise RolloutEngineLost(error)
        return out

    def dead_engine_error(self) -> str | None:
        """Why the run cannot go on after a rollout engine died, or None if none did."""
        return self.pool.dead_engine_error(self.step - 1)

    def _generate_vllm(self, dataloader_iter, num_prompts: int, dynamic_filtering, **generate_kwargs):  # type: ignore[override]
        """One training batch, as the mode runs it (``self.run``). Evaluation rollouts take OpenRLHF's own path:
        they are not the workload the scheduler plans for and never enter the length history or the step count."""
        if dataloader_iter is not None and dataloader_iter is getattr(self, "_eval_dataloader_iter", None):
            return super()._generate_vllm(dataloader_iter, num_prompts, dynamic_filtering, **generate_kwargs)
        return self.run.batch(dataloader_iter, num_prompts, bool(dynamic_filtering), generate_kwargs)

    def generate_step(self, prompts: list[str], labels: list[Any], *, images: list | None = None, **kw: Any) -> list:
        """One plain step of ``prompts``, whatever the mode (a tool's step, outside OpenRLHF's loop): every sample
        generated under the plan, to its end; experiences grouped by prompt, in order."""
        return plain_step(self, list(zip(prompts, labels, images or [None] * len(prompts), strict=True)), kw)

    def finish_driven(self, io: EnginesIO, driven: Driven) -> list:
        """A step that trains whole groups of its own batch (plain, or a session's): the experiences of the groups
        that train, their trace, the report."""
        n, kw = io.n, io.kw
        outcome = driven.outcome
        rows = driven.trained_rows
        experiences = [
            self._process_response_into_experience(outcome.outputs[sid], **kw)
            for g in rows
            for sid in range(g * n, (g + 1) * n)
        ]
        assert io.backend is not None
        self.last_cuts = io.backend.cut_log  # (sample in batch order, engine, CutSample): what each cut kept
        self.last_trained_groups = rows
        self.log.trace(
            (
                driven.batch.uids[i],
                io.metas[i][3],
                [outcome.samples[sid].response_length for sid in range(i * n, (i + 1) * n)],
            )
            for i in rows
        )
        report = outcome.report.model_copy(update=driven.fields)
        self.finish_step(report, outcome, driven.plan)
        return experiences

    # -- what a checkpoint keeps -------------------------------------------------------------------------------
    def carry_snapshot(self) -> dict[str, Any] | None:
        """What the generator holds between steps, as plain data for OpenRLHF's checkpoint (``client_states``): the
        mode's (``ModeRun.snapshot``: partial rollouts' open groups and carried samples with their tokens and
        logprobs; the prompts drawn and not trained yet, in order, of a session's rounds or of the stream) and, for
        any mode, the rest of a dataloader batch drawn in part (``take_prompts``). None when nothing is held."""
        held = self.run.snapshot()
        if not held and not self._held:
            return None
        snapshot: dict[str, Any] = {"version": 1, "step": self.step}
        if self._held:  # the rest of a dataloader batch a partial-rollout step drew part of
            snapshot["held"] = [[prompt, label] for prompt, label, _image in self._held]
        snapshot.update(held)
        # plain JSON data, whatever the checkpoint format pickles or not; a tensor (a response's reward) keeps its
        # shape and dtype, for OpenRLHF builds the experience from it as it is
        return json.loads(json.dumps(snapshot, default=tensor_to_json))

    def restore_carry(self, snapshot: dict[str, Any] | None) -> int:
        """Take back what ``carry_snapshot`` saved; returns the number of carried samples and deferred prompts
        restored. What this generator's mode cannot continue (another scheduler's, another format) is dropped with
        a logged count."""
        if not snapshot:
            return 0
        version_ok = snapshot.get("version") == 1
        run = self.run if version_ok else ModeRun(self)  # another format: what it holds is dropped, counted
        held = snapshot.get("held", []) if version_ok else []
        self._held = [(prompt, label, None) for prompt, label in held] + self._held
        restored = len(held)
        if snapshot.get("deferred"):
            restored += run.restore_deferred(snapshot["deferred"], int(snapshot.get("step", self.step)))
        if "groups" in snapshot:
            restored += run.restore_carried(snapshot)
        return restored

    def take_prompts(self, dataloader_iter: Any, k: int) -> tuple[list[tuple[str, Any, Any]], bool]:
        """Up to ``k`` (prompt, label, image) from OpenRLHF's dataloader, the rest of a dataloader batch held for
        the next call (OpenRLHF's own ``_collect_prompt_batch`` drops it: a step that draws other than whole
        dataloader batches, as partial rollouts do, would lose prompts); exhausted: the dataloader ran dry and
        nothing is held."""
        out, self._held = self._held[:k], self._held[k:]
        exhausted = False
        while len(out) < k:
            try:
                _, prompts, labels, images = next(dataloader_iter)
            except StopIteration:
                exhausted = True
                break
            batch = list(zip(prompts, labels, images or [None] * len(prompts), strict=True))
            need = k - len(out)
            out += batch[:need]
            self._held = batch[need:] + self._held
        return out, exhausted and not self._held

    def _tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer(text=prompt, add_special_tokens=False)["input_ids"]

    def _prompt_batch(self, prompts: list[str], n: int, taken: set[str] | None = None) -> tuple[list, PromptBatch]:
        """The prompts tokenized, as the planner's ``PromptBatch`` of n samples each. A prompt's uid is a hash of
        its text (its length-history key); the same prompt twice, or one already in ``taken`` (open groups), gets
        ``#k`` appended, which the history key drops."""
        token_ids = [self._tokenize(p) for p in prompts]
        taken = set(taken or ())
        uids = []
        for p in prompts:
            uids.append(fresh_uid(p, taken))
        lengths = np.array([len(t) for t in token_ids], dtype=np.int64)
        batch = PromptBatch(
            uids=uids,
            prompt_lengths=lengths,
            n_samples=np.full(len(prompts), n, dtype=np.int64),
            token_flat=np.fromiter((t for ids in token_ids for t in ids), dtype=np.int64, count=int(lengths.sum())),
        )
        return token_ids, batch

    def _sampling_params(self, **kw: Any) -> SamplingParams:
        return SamplingParams(
            temperature=kw.get("temperature", 1.0),
            top_p=kw.get("top_p", 1.0),
            top_k=kw.get("top_k", -1),
            max_tokens=kw.get("max_new_tokens"),
            min_tokens=kw.get("min_new_tokens", 1),
            skip_special_tokens=kw.get("skip_special_tokens", False),
            logprobs=1 if self.args.algo.advantage.is_correction_level != "off" else None,
        )

    # -- after the step ------------------------------------------------------------------------------------
    def async_lag(self) -> int:
        """Batches OpenRLHF's async mode (``--train.async_enable``) generates ahead of training: the weight updates
        every token of a batch after the first is behind, on top of what the straggler policy carries (0: sync)."""
        train = getattr(self.args, "train", None)
        if not getattr(train, "async_enable", False):
            return 0
        return int(getattr(train, "async_queue_size", 1) or 1)

    def finish_step(self, report: StepReport, outcome: StepOutcome, plan: StepPlan) -> None:
        lag = self.async_lag()
        if lag and self.log.finished and report.response_tokens:  # OpenRLHF's own lag (an upper bound)
            report = report.model_copy(
                update={"max_token_age_steps": report.max_token_age_steps + lag, "stale_token_fraction": 1.0}
            )
        report = self.log.replayed(report)
        lengths = np.array([s.response_length for s in outcome.samples], dtype=np.float64)
        pred = np.array([s.predicted_length or 0.0 for s in outcome.samples], dtype=np.float64)
        self.log.record(
            report,
            {
                "rlhfless/predicted_length_mean": float(pred.mean()) if pred.size else 0.0,
                "rlhfless/actual_length_mean": float(lengths.mean()) if lengths.size else 0.0,
                "rlhfless/prediction_mae": report.prediction_mae or 0.0,
                "rlhfless/active_engines": float(plan.num_actors),
                "rlhfless/engines_idle": float(len(self.pool.live()) - plan.num_actors),
                "rlhfless/idle_fraction": report.idle_fraction,
                "rlhfless/gpu_seconds": report.gpu_seconds,
                "rlhfless/migrations": float(report.migrations),
                "rlhfless/dedup_prefill_tokens_saved": float(report.prefill_tokens_saved),
                "rlhfless/planner_ms": plan.planner_ms,
                **{
                    f"rlhfless/engine{e}_busy_s": u.busy_s
                    for e, u in enumerate(outcome.usage.engines)
                    if e not in self.dead
                },
            },
        )

    def filter_groups(self, experiences: list, n: int) -> list:
        """The groups of ``experiences`` (n each) OpenRLHF's dynamic filter keeps: mean score inside its range."""
        min_r, max_r = self.args.algo.dynamic_filtering_range
        kept = []
        for g in range(0, len(experiences), n):
            group = experiences[g : g + n]
            if all(e.scores is not None for e in group):
                avg = sum(e.scores[0].item() for e in group) / len(group)
                if not (min_r < avg < max_r):
                    continue
            kept.extend(group)
        return kept


def run_for(gen: RlhflessSamplesGenerator, mode: Mode, registry: Registry, **stream: Any) -> ModeRun:
    """The generator's ``ModeRun`` for ``mode``, chosen once: the one its pipeline or driver spec brings for OpenRLHF
    (a plugin's, ``backends["openrlhf"]``); the stream's and the batch cut's own; else plain steps for a driver
    without a session, a session's rounds for one that carries no tokens (``capabilities.runs``); ``stream``: the
    stream's launch inputs (learner GPUs, fill engines)."""
    spec = registry.pipelines.get(mode.name) if mode.pipelined else registry.drivers.get(mode.name)
    own = None if spec is None else spec.backends.get(BACKEND_KEY)
    if own is not None:
        return own(gen)
    if mode.name == STREAM:
        return StreamRun(gen, **stream)
    if mode.name == BATCH_CUT:
        return CarriedRun(gen)
    spec = registry.drivers[mode.name]
    return PlainRun(gen, mode.name) if spec.session is None else RoundsRun(gen, mode.name)


def merge_metrics(logs_dict: dict[str, Any] | None, generator: Any) -> dict[str, Any] | None:
    """Add the generator's ``rlhfless/*`` metrics of the latest step to OpenRLHF's logs dict (wandb/TensorBoard
    write every numeric entry of it); OpenRLHF's own keys are never overwritten."""
    if logs_dict is not None:
        for key, value in getattr(generator, "last_metrics", {}).items():
            logs_dict.setdefault(key, value)
    return logs_dict
