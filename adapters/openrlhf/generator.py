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
from rlhfless_openrlhf.capabilities import BACKEND, MODES
from rlhfless_openrlhf.carried import CarriedWork, tensor_to_json
from rlhfless_openrlhf.messages import CutSample, SharedTokenizer
from rlhfless_openrlhf.ray_backend import (
    BackendSettings,
    EnginePool,
    RolloutEngineLost,
    engine_gpus,
)
from rlhfless_openrlhf.stream import StreamGeneration
from vllm import SamplingParams

from rlhfless_sdk.api.batch import PromptBatch
from rlhfless_sdk.api.config import SchedulerConfig
from rlhfless_sdk.api.errors import RlhflessError
from rlhfless_sdk.api.plugins import Registry, get_plugin_manager
from rlhfless_sdk.api.records import Cluster, StepPlan, StepReport, TimePerTokenProfile
from rlhfless_sdk.planning.planner import planner_for
from rlhfless_sdk.rollout.controller import StepOutcome
from rlhfless_sdk.rollout.drivers import BatchCutSession, Driven, PlainStep, TailSession, refusal
from rlhfless_sdk.rollout.modes import BATCH_CUT, STREAM, TAIL_ROUNDS, Mode, planned_mode
from rlhfless_sdk.rollout.run_log import RunLog, fresh_uid, prompt_uid
from rlhfless_sdk.rollout.tail import TailRounds
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


class RlhflessSamplesGenerator(StreamGeneration, SamplesGenerator):
    """Drop-in for OpenRLHF's ``SamplesGenerator`` (same constructor, plus the scheduler)."""

    #: The step drivers it runs (``rlhfless_openrlhf.capabilities``); a scheduler needing another is refused.
    modes = MODES

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
        mode = mode or planned_mode(self.planner)
        self.mode = mode.name  # the step driver, or the stream
        refused = refusal(self.planner.config, mode, self.modes, BACKEND)
        if refused is not None:
            raise RlhflessError(refused)
        # the step count, the reports and the trace; length replay: each sample stops at a length from a trace, EOS
        # ignored (the scheduler is not told)
        self.log = RunLog(report_path, trace_path, replay)
        self.check_interval_s = check_interval_s
        self.carry_timeout_s = carry_timeout_s  # how long a step's end waits for its carried samples' calls
        self.keeps_tokens = mode.keeps_tokens
        self._read_openrlhf_flags()
        # tail batching: rounds of prompts from OpenRLHF's dataloader, the slowest groups' prompts deferred
        self.tail: TailRounds | None = None
        self.tail_session: TailSession | None = None
        self.tail_prompts: dict[int, tuple[str, Any, Any]] = {}  # prompt id -> prompt, label, image (not trained yet)
        self._tail_source: Any = None  # the dataloader iterator the rounds draw from
        self._tail_drawn = 0
        self._tail_pending: list[int] = []  # restored from a checkpoint, not yet in a round
        self.carried = CarriedWork()  # partial rollouts cut at B groups: what is carried between steps
        self.last_cuts: list[tuple[int, int, CutSample]] = []
        self.last_trained_groups: list[int] = []  # the groups of the last step's experiences
        self._shared_tokenizer: tuple[Any, SharedTokenizer] | None = None  # (tokenizer, its reference), put once
        self._held: list[tuple[str, Any, Any]] = []  # drawn from a dataloader batch, not yet taken (``take_prompts``)
        if learner_gpus is None:
            learner_gpus = launch_learner_gpus(self.args) if hasattr(self.args, "actor") else 0
        self.init_stream(learner_gpus, fill_engines)
        self._engine_profile: TimePerTokenProfile | None = None  # ``engine_profile``, read from the engines once

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
        training (see ``dead_engine_error``), and that a stream's batch (B groups, never more: ``GroupBook.form``)
        is the stream's own."""
        if self.mode == STREAM:
            out = self._stream_batch(**generate_kwargs)
        else:
            out = super().generate_samples(**generate_kwargs)
        error = self.dead_engine_error()
        if error is not None:
            raise RolloutEngineLost(error)
        return out

    def _stream_batch(self, **kw: Any) -> tuple[list, float | None, int, bool]:
        """OpenRLHF's ``generate_samples`` for the stream: (experiences, filter pass rate, prompts consumed,
        exhausted), one stream batch as it is: B groups (the last one: what is left)."""
        if getattr(self, "_dataloader_iter", None) is None:
            self._dataloader_iter = iter(self.prompts_dataloader)
        experiences, consumed, exhausted = self._generate_vllm(
            self._dataloader_iter, int(self.args.rollout.batch_size), False, **kw
        )
        if exhausted:
            self._dataloader_iter = None
        return experiences, None, consumed, exhausted

    def dead_engine_error(self) -> str | None:
        """Why the run cannot go on after a rollout engine died, or None if none did."""
        return self.pool.dead_engine_error(self.step - 1)

    def _generate_vllm(self, dataloader_iter, num_prompts: int, dynamic_filtering, **generate_kwargs):  # type: ignore[override]
        """One training batch. Evaluation rollouts take OpenRLHF's own path: they are not the workload the
        scheduler plans for and never enter the length history or the step count. With dynamic filtering, each
        group the filter drops is replaced by a fresh prompt from the dataloader, as OpenRLHF does, in refill rounds
        (each one a scheduled round of its own in the step report) until the batch is full or the data ends."""
        if dataloader_iter is not None and dataloader_iter is getattr(self, "_eval_dataloader_iter", None):
            return super()._generate_vllm(dataloader_iter, num_prompts, dynamic_filtering, **generate_kwargs)
        if self.mode in (BATCH_CUT, TAIL_ROUNDS, STREAM):
            if dynamic_filtering:  # refused at launch too: a dropped group would break "B groups a step"
                raise RuntimeError(
                    f"rlhfless: the {self.mode} step driver of scheduler {self.planner.config.name} cannot run with "
                    "dynamic filtering"
                )
            if self.mode == BATCH_CUT:
                return self._generate_batch_cut(dataloader_iter, num_prompts, **generate_kwargs)
            if self.mode == STREAM:
                return self._generate_stream(dataloader_iter, num_prompts, **generate_kwargs)
            return self._generate_tail_round(dataloader_iter, num_prompts, **generate_kwargs)
        n = int(generate_kwargs.get("n_samples_per_prompt", self.args.rollout.n_samples_per_prompt))
        accepted: list = []
        consumed, want, exhausted = 0, num_prompts, False
        while want > 0 and not exhausted:
            drawn, exhausted = self.take_prompts(dataloader_iter, want)
            prompts, labels, images = (list(x) for x in zip(*drawn, strict=True)) if drawn else ([], [], [])
            if not prompts:
                exhausted = True
                break
            consumed += len(prompts)
            experiences = self.generate_step(prompts, labels, images=images, **generate_kwargs)
            if not dynamic_filtering:
                return experiences, consumed, exhausted
            kept = self._filter(experiences, n)
            accepted.extend(kept)
            want = len(prompts) - len(kept) // n
            if want:
                log.info("dynamic filtering dropped %d of %d groups; refilling from the dataloader", want, len(prompts))
        return accepted, consumed, exhausted

    def generate_step(self, prompts: list[str], labels: list[Any], *, images: list | None = None, **kw: Any) -> list:
        """One plain step (``PlainStep``): every sample of ``prompts`` generated under the plan, to its end;
        experiences grouped by prompt, in order."""
        io = EnginesIO(self, kw, source=list(zip(prompts, labels, images or [None] * len(prompts), strict=True)))
        driven = PlainStep(self.planner, self.step).run(io, io.batch(list(range(len(prompts)))))
        return self._finish_driven(io, driven, kw)

    def _finish_driven(self, io: EnginesIO, driven: Driven, kw: dict[str, Any]) -> list:
        """A plain step or a tail round: the experiences of the groups that train, their trace, the report."""
        n = io.n
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
        self._finish_step(report, outcome, driven.plan)
        return experiences

    # -- carried work across OpenRLHF checkpoints ------------------------------------------------------------
    def carry_snapshot(self) -> dict[str, Any] | None:
        """What a straggler policy holds between steps, as plain data for OpenRLHF's checkpoint (``client_states``).
        Partial rollouts: the carry book's state (``CarryBook.state``: open groups, carried samples), each open
        group's prompt, the carried samples' tokens and logprobs, the samples already ended in open groups. Tail
        batching: the prompts drawn from the dataloader and not trained yet (``TailRounds.waiting``), in order. The
        stream: the prompts of its groups not trained yet (their tokens are not kept: a resumed run re-runs them
        from scratch under the restored weights). Any scheduler: the rest of a dataloader batch drawn in part
        (``take_prompts``). None when nothing is held."""
        book = self.carried.book
        waiting = ([] if self.tail is None else self.tail.waiting()) + self._tail_pending
        if self.stream is not None:  # the stream's groups in flight: re-run from scratch on a resume
            with self.stream.cond:  # its feeder draws nothing between the generator's calls; held all the same
                waiting += self.stream.untrained_prompts()
        if not book.groups and not waiting and not self._held:
            return None
        snapshot: dict[str, Any] = {"version": 1, "step": self.step}
        if self._held:  # the rest of a dataloader batch a partial-rollout step drew part of
            snapshot["held"] = [[prompt, label] for prompt, label, _image in self._held]
        if book.groups:
            snapshot.update(self.carried.state())
        if waiting:
            snapshot["deferred"] = [[self.tail_prompts[k][0], self.tail_prompts[k][1]] for k in waiting]
        # plain JSON data, whatever the checkpoint format pickles or not; a tensor (a response's reward) keeps its
        # shape and dtype, for OpenRLHF builds the experience from it as it is
        return json.loads(json.dumps(snapshot, default=tensor_to_json))

    def restore_carry(self, snapshot: dict[str, Any] | None) -> int:
        """Take back what ``carry_snapshot`` saved; returns the number of carried samples and deferred prompts
        restored. What this generator cannot continue (another scheduler, another format) is dropped with a
        logged count."""
        if not snapshot:
            return 0
        version_ok = snapshot.get("version") == 1
        held = snapshot.get("held", []) if version_ok else []
        self._held = [(prompt, label, None) for prompt, label in held] + self._held
        restored = len(held)
        deferred = snapshot.get("deferred", [])
        if deferred and (self.mode not in (TAIL_ROUNDS, STREAM) or not version_ok):
            log.warning(
                "rlhfless: the checkpoint holds %d deferred prompt(s) that scheduler %s does not re-run; they are "
                "dropped (their prompts were consumed: they will not train this epoch)",
                len(deferred),
                self.planner.config.name,
            )
        elif deferred:
            for prompt, label in deferred:
                k = self._tail_drawn
                self._tail_drawn += 1
                self.tail_prompts[k] = (prompt, label, None)
                self._tail_pending.append(k)
            self.step = int(snapshot["step"])
            restored += len(deferred)
            log.info("rlhfless: restored %d deferred prompt(s) from the checkpoint", len(deferred))
        if "groups" not in snapshot:
            return restored
        carried = len(snapshot.get("carried", []))
        if self.mode != BATCH_CUT or not version_ok:
            log.warning(
                "rlhfless: the checkpoint carries %d partial sample(s) in %d open group(s) that scheduler %s cannot "
                "continue; they are dropped (their prompts were consumed: they will not train this epoch)",
                carried,
                len(snapshot.get("groups", {})),
                self.planner.config.name,
            )
            return restored
        self.carried = CarriedWork.from_state(snapshot)
        book = self.carried.book
        self.step = int(snapshot["step"])
        log.info(
            "rlhfless: restored %d carried sample(s) in %d open group(s) from the checkpoint", carried, len(book.groups)
        )
        return restored + carried

    def _generate_batch_cut(self, dataloader_iter, b: int, **kw: Any) -> tuple[list, int, bool]:
        """One step of partial rollouts cut when B groups are complete (the SDK's ``BatchCutStep``, APRIL-style):
        every group carried from the step before, plus fresh prompts from OpenRLHF's dataloader up to
        (1 + over_provision) x B groups in flight; the step ends once the carried groups and ``B - carried`` fresh
        ones are complete, and every other sample is cut where it is and carried, with its tokens and their
        logprobs, into the next step, where it continues under the new weights on whichever engine the plan picks.
        A group trains once, complete, with all n samples in order; each carried token keeps the logprob of the
        policy that generated it, so OpenRLHF's rollout-logprob importance correction applies. Once the dataloader
        runs dry the last steps train what is left, B a step, and the epoch ends when nothing is carried. Returns
        (experiences, prompts taken from the dataloader, exhausted)."""
        work = self.carried
        io = EnginesIO(self, kw, dataloader_iter=dataloader_iter, carried=work)
        driven = BatchCutSession(self.planner, b, work.book).next(io, self.step)
        if driven is None:
            return [], 0, True
        assert driven.settled is not None and io.backend is not None
        outcome, settled, backend = driven.outcome, driven.settled, io.backend
        work.keep(outcome.outputs, set(outcome.carried), backend.carried_out)
        self.log.trace((work.prompts[tg.group][3], work.prompts[tg.group][4], tg.lengths) for tg in settled.trained)
        experiences = [
            self._process_response_into_experience(response, **kw)
            for tg in settled.trained
            for response in work.take(tg.group, len(tg.lengths))
        ]
        self.last_cuts = backend.cut_log
        self.last_trained_groups = driven.trained_rows  # the experiences' groups, in order
        self._finish_step(outcome.report.model_copy(update=driven.fields), outcome, driven.plan)
        return experiences, len(io.drawn), io.exhausted and not work.book.open_group_ids()

    # -- tail batching (a straggler policy that over-provisions and re-runs its slowest groups) -----------------
    def _prompt_stream(self, dataloader_iter):
        """Every prompt of OpenRLHF's dataloader, one at a time (none of a batch dropped), as an id; first any held
        from a batch drawn in part (``take_prompts``)."""
        while True:
            drawn, _exhausted = self.take_prompts(dataloader_iter, 1)
            if not drawn:
                return
            for prompt, label, image in drawn:
                k = self._tail_drawn
                self._tail_drawn += 1
                self.tail_prompts[k] = (prompt, label, image)
                yield k

    def _generate_tail_round(self, dataloader_iter, b: int, **kw: Any) -> tuple[list, int, bool]:
        """One round of tail batching (the SDK's ``TailRound``, RollPacker-style, on-policy), its ``TailRounds``
        drawing prompts from OpenRLHF's dataloader: a short round starts (1 + over_provision) x B groups and ends
        once B are complete; the others are aborted, their tokens dropped, their prompts deferred. Once B are
        deferred, a long round runs them, and only them, to the end. When the dataloader runs dry the deferred
        prompts fill the rounds and the last one trains what is left, so every prompt trains exactly once and no
        token from older weights reaches training. Returns (experiences, prompts taken from the dataloader,
        exhausted: the dataloader is dry and nothing is deferred)."""
        if self.tail is None or dataloader_iter is not self._tail_source:
            # a new epoch (the last one's rounds are done) or a resumed run: what was drawn and not trained stays
            left = self._tail_pending + ([] if self.tail is None else self.tail.waiting())
            self._tail_pending = []
            self.tail_session = TailSession(self.planner, b, self._prompt_stream(dataloader_iter), deferred=left)
            self.tail = self.tail_session.rounds
            self._tail_source = dataloader_iter
        rounds, drawn = self.tail, self._tail_drawn
        io = EnginesIO(self, kw, source=self.tail_prompts)
        driven = self.tail_session.next(io, self.step)
        if driven is None:
            return [], 0, True
        experiences = self._finish_driven(io, driven, kw)
        for i in driven.trained_rows:
            del self.tail_prompts[driven.prompts[i]]
        exhausted = rounds.done()  # may draw the next prompt, to see whether the dataloader is dry
        return experiences, self._tail_drawn - drawn, exhausted

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

    def _finish_step(self, report: StepReport, outcome: StepOutcome, plan: StepPlan) -> None:
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

    def _filter(self, experiences: list, n: int) -> list:
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


def merge_metrics(logs_dict: dict[str, Any] | None, generator: Any) -> dict[str, Any] | None:
    """Add the generator's ``rlhfless/*`` metrics of the latest step to OpenRLHF's logs dict (wandb/TensorBoard
    write every numeric entry of it); OpenRLHF's own keys are never overwritten."""
    if logs_dict is not None:
        for key, value in getattr(generator, "last_metrics", {}).items():
            logs_dict.setdefault(key, value)
    return logs_dict
