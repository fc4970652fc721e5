"""RLHFless's samples generator: OpenRLHF's ``SamplesGenerator`` with the rollout driven by the SDK's step
controller.

Each step it tokenizes the prompts and asks the planner for a plan (predictor, dedup prefill, assignment for
each candidate engine count, scaler, placer). The SDK's ``StepController`` then runs the step: dispatch to the
plan's engines, progress checks and cut-and-migrate, re-dispatch of what a dead engine held, regrouping of
each prompt's n samples in order, the ``StepReport`` and the predictor's observations, exactly as it does for
the simulator. ``RayBackend`` below is all this adapter adds: it starts, cuts, continues and polls work on
OpenRLHF's vLLM engines through Ray (sleeping inactive engines where allowed, warming each engine's shared
prefixes once). The generator writes the report as JSON lines and ``rlhfless/*`` metrics for OpenRLHF's logs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator, _collect_prompt_batch
from rlhfless_openrlhf.messages import CutSample, EngineStats
from vllm import SamplingParams

from rlhfless_sdk.api.batch import PromptBatch
from rlhfless_sdk.api.config import SchedulerConfig
from rlhfless_sdk.api.plugins import Registry, get_plugin_manager
from rlhfless_sdk.api.records import Cluster, StepPlan, StepReport, TimePerTokenProfile
from rlhfless_sdk.planning.costmodel import AnalyticCostModel
from rlhfless_sdk.planning.planner import StepPlanner
from rlhfless_sdk.rollout.controller import (
    EngineStatus,
    EngineUsage,
    Finished,
    Lost,
    Poll,
    StepController,
    StepOutcome,
    StepUsage,
)

log = logging.getLogger("rlhfless.openrlhf")

_DEAD = (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError)


def prompt_uid(prompt: str) -> str:
    """A stable id for a prompt's text: its length history follows it across epochs."""
    return hashlib.sha1(prompt.encode("utf-8")).hexdigest()[:16]


@dataclass
class _Request:
    """One step's prompts as the engines receive them."""

    prompts: list[str]
    labels: list[Any]
    images: list[Any]
    token_ids: list[list[int]]
    keys: list[str]  # per sample, batch order: "<uid>/<sample index>"
    prompt_of: list[int]  # per sample: its prompt's index
    params: SamplingParams
    max_length: int


class _Piece:
    """Some samples of one prompt, dispatched to one engine in one Ray call."""

    def __init__(self, prompt_index: int, samples: list[int], engine: int) -> None:
        self.prompt_index, self.samples, self.engine = prompt_index, samples, engine
        self.ref: Any = None


class RayBackend:
    """OpenRLHF's vLLM engines (RLHFless's engine class) as a rollout backend of the SDK's step controller."""

    def __init__(self, gen: RlhflessSamplesGenerator, req: _Request, plan: StepPlan, t_start: float) -> None:
        self.gen, self.req, self.plan, self.t_start = gen, req, plan, t_start
        self.max_num_seqs = gen.profile.max_num_seqs
        self.max_tokens = int(req.params.max_tokens or req.max_length)
        self.sid = {key: sid for sid, key in enumerate(req.keys)}
        self.pending: dict[Any, _Piece] = {}
        self.cuts: dict[int, tuple[int, CutSample]] = {}  # sample -> (engine holding it, what the cut returned)
        self.continuations: dict[Any, tuple[int, int, CutSample]] = {}  # ref -> (sample, engine, cut)
        self.started = False

    @property
    def handles(self) -> list:
        return self.gen.vllm_engines

    def engines(self) -> list[int]:
        return [e for e in range(len(self.handles)) if e not in self.gen.dead]

    # -- start -----------------------------------------------------------------------------------------------
    def start(self, samples: Sequence[int], engines: Sequence[int]) -> None:
        if not self.started:  # the step's first dispatch: wake/sleep, fresh stats, warm shared prefixes
            self.started = True
            live = self.engines()
            self.gen._scale(set(engines), live)
            for e in live:
                self.gen._call(e, "rl_reset_stats")
            self._warm(samples, engines)
        pieces: dict[tuple[int, int], _Piece] = {}
        for sid, e in zip(samples, engines, strict=True):
            i = self.req.prompt_of[sid]
            pieces.setdefault((i, e), _Piece(i, [], e)).samples.append(sid)
        for piece in pieces.values():
            self._dispatch(piece)

    def _warm(self, samples: Sequence[int], engines: Sequence[int]) -> None:
        """Deduplicated prefill: each engine prefills its prompts' shared prefixes once (prefix caching on)."""
        pf = self.plan.prefill
        if not pf.prompt_group:
            return
        prefix_len = np.asarray(pf.group_prefix_tokens)[np.asarray(pf.prompt_group)]
        per_engine: dict[int, dict[tuple, list[int]]] = defaultdict(dict)
        for sid, e in zip(samples, engines, strict=True):
            i = self.req.prompt_of[sid]
            pre = self.req.token_ids[i][: int(prefix_len[i])]
            per_engine[e][tuple(pre)] = pre
        refs = [self.handles[e].warm_prefixes.remote(list(p.values()), self.req.params) for e, p in per_engine.items()]
        ray.get(refs)

    def _dispatch(self, piece: _Piece) -> None:
        r, i = self.req, piece.prompt_index
        piece.ref = self.handles[piece.engine].generate_group.remote(
            prompt=r.prompts[i],
            label=r.labels[i],
            sampling_params=r.params,
            max_length=r.max_length,
            hf_tokenizer=self.gen.tokenizer,
            keys=[r.keys[s] for s in piece.samples],
            images=r.images[i],
        )
        self.pending[piece.ref] = piece

    # -- poll ------------------------------------------------------------------------------------------------
    def poll(self) -> Poll:
        out = Poll()
        if self.pending:
            ready, _ = ray.wait(list(self.pending), num_returns=len(self.pending), timeout=self.gen.check_interval_s)
            for ref in ready:
                piece = self.pending.pop(ref)
                try:
                    results = ray.get(ref)
                except (*_DEAD, ray.exceptions.RayTaskError) as exc:
                    if isinstance(exc, ray.exceptions.RayTaskError) and not _engine_dead(exc):
                        raise
                    self.gen._mark_dead(piece.engine, exc)
                    out.dead_engines.append(piece.engine)
                    for sid in piece.samples:  # the engine held them (and stitched any cut one): start over
                        self.cuts.pop(sid, None)
                        out.lost.append(Lost(sid, 0))
                    continue
                for resp in results:
                    sid = self.sid[resp["rlhfless_key"]]
                    self.cuts.pop(sid, None)
                    reason = "length" if resp.get("truncated") else "stop"
                    out.finished.append(Finished(sid, _response_length(resp), output=resp, finish_reason=reason))
        else:  # every piece returned, so every sample finished or was reported lost and re-dispatched
            raise RuntimeError("rollout backend: samples are unfinished but no engine holds any (a bug)")
        self._check_continuations(out)
        return out

    def _check_continuations(self, out: Poll) -> None:
        """A continuation whose engine died is lost from its cut: the controller resumes it elsewhere, so the
        engine waiting to stitch it is never left hanging."""
        if not self.continuations:
            return
        ready, _ = ray.wait(list(self.continuations), num_returns=len(self.continuations), timeout=0)
        for ref in ready:
            sid, target, cut = self.continuations.pop(ref)
            try:
                ray.get(ref)
            except (*_DEAD, ray.exceptions.RayTaskError) as exc:
                if self.cuts.get(sid, (None, None))[1] is not cut:
                    continue  # the sample was lost with its stitching engine, or finished
                self.gen._mark_dead(target, exc)
                out.lost.append(Lost(sid, len(cut.partial)))

    # -- progress, cut, continue -----------------------------------------------------------------------------
    def progress(self) -> dict[int, EngineStatus]:
        live = sorted({p.engine for p in self.pending.values()} | set(self.engines()))
        refs = {e: self.handles[e].rl_stats.remote() for e in live}  # ask every engine at once
        status = {}
        for e, ref in refs.items():
            try:
                st: EngineStats = ray.get(ref)
            except _DEAD as exc:
                self.gen._mark_dead(e, exc)
                continue
            running = {self.sid[k]: v for k, v in st.progress.items() if k in self.sid}
            status[e] = EngineStatus(st.generated_tokens + sum(st.progress.values()), running)
        return status

    def cut(self, engine: int, sample: int) -> int | None:
        info = self.gen._call(engine, "cut", self.req.keys[sample])
        if info is None:
            return None  # it finished before the cut landed (or the engine died)
        self.cuts[sample] = (engine, info)
        return len(info.partial)

    def resume(self, engine: int, sample: int, mode: str = "tokens") -> None:
        source, info = self.cuts[sample]  # by tokens: the target re-prefills prompt + partial tokens
        cont = self.handles[engine].continue_sample.remote(
            info.prompt_token_ids + info.partial, info.sampling_params, info.remaining
        )
        self.continuations[cont] = (sample, engine, info)
        self.handles[source].deliver.remote(self.req.keys[sample], cont)

    def now(self) -> float:
        return time.time() - self.t_start

    def usage(self) -> StepUsage:
        stats: dict[int, EngineStats] = {}
        for e in self.engines():
            st = self.gen._call(e, "rl_stats")
            if st is not None:
                stats[e] = st
        engines = []
        for e in range(len(self.handles)):
            st = stats.get(e)
            if st is None or st.first is None:
                engines.append(EngineUsage(st.busy_s if st else 0.0, None, 0.0))
            else:
                engines.append(EngineUsage(st.busy_s, st.first, st.last if st.last is not None else st.first))
        return StepUsage(
            generation_s=time.time() - self.t_start,
            engines=engines,
            gpus=len(self.handles),  # serverful: every engine OpenRLHF holds, for the whole step
            gpus_per_engine=1,  # OpenRLHF's engines stay up between steps: warm, no start-up to bill
            prefill_tokens_saved=sum(int(s.cached_tokens) for s in stats.values()),
        )


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
        check_interval_s: float = 0.5,
        gpus_per_node: int = 8,
        registry: Registry | None = None,
    ) -> None:
        super().__init__(strategy, prompts_dataloader, eval_dataloader, tokenizer, vllm_engines)
        registry = registry or get_plugin_manager().registry
        n = len(self.vllm_engines)
        self.cluster = Cluster.of_gpus(n, gpus_per_node)
        config = scheduler.model_copy(update={"max_actors": min(scheduler.max_actors or n, n)})
        self.planner = StepPlanner(
            config, cluster=self.cluster, cost_model=AnalyticCostModel(profile), registry=registry, learner_gpus=0
        )
        self.planner.warm_actors = len(vllm_engines)  # OpenRLHF started them before the first step
        self.profile = profile
        self.report_path = None if report_path is None else Path(report_path)
        self.check_interval_s = check_interval_s
        self.dead: set[int] = set()
        self.asleep: set[int] = set()
        self.sleep_supported = True
        self.step = 0
        self.last_report: StepReport | None = None
        self.last_metrics: dict[str, float] = {}

    # -- the step ------------------------------------------------------------------------------------------
    def _generate_vllm(self, dataloader_iter, num_prompts: int, dynamic_filtering, **generate_kwargs):  # type: ignore[override]
        prompts, labels, images, exhausted = _collect_prompt_batch(dataloader_iter, num_prompts)
        if not prompts:
            return [], 0, True
        experiences = self.generate_step(prompts, labels, images=images, **generate_kwargs)
        if dynamic_filtering:
            experiences = self._filter(experiences, self.args.rollout.n_samples_per_prompt)
        return experiences, len(prompts), exhausted

    def generate_step(self, prompts: list[str], labels: list[Any], *, images: list | None = None, **kw: Any) -> list:
        """Generate every sample of ``prompts`` under the plan; experiences grouped by prompt, in order."""
        t_start = time.time()
        n = int(kw.get("n_samples_per_prompt", self.args.rollout.n_samples_per_prompt))
        token_ids = [self.tokenizer(text=p, add_special_tokens=False)["input_ids"] for p in prompts]
        uids, seen = [], defaultdict(int)
        for p in prompts:  # the same prompt twice in one batch: distinct uids, shared history key
            base = prompt_uid(p)
            uids.append(base if seen[base] == 0 else f"{base}#{seen[base]}")
            seen[base] += 1
        lengths = np.array([len(t) for t in token_ids], dtype=np.int64)
        batch = PromptBatch(
            uids=uids,
            prompt_lengths=lengths,
            n_samples=np.full(len(prompts), n, dtype=np.int64),
            token_flat=np.fromiter((t for ids in token_ids for t in ids), dtype=np.int64, count=int(lengths.sum())),
        )
        plan = self.planner.plan(batch, step=self.step)
        if not [e for e in range(len(self.vllm_engines)) if e not in self.dead]:
            raise RuntimeError("every rollout engine has died; cannot generate")
        req = _Request(
            prompts=prompts,
            labels=labels,
            images=images or [None] * len(prompts),
            token_ids=token_ids,
            keys=[f"{uids[i]}/{k}" for i in range(len(prompts)) for k in range(n)],
            prompt_of=[i for i in range(len(prompts)) for _ in range(n)],
            params=self._sampling_params(**kw),
            max_length=kw.get("max_len", 2048),
        )
        backend = RayBackend(self, req, plan, t_start)
        history = [u.split("#")[0] for u in uids]  # a prompt repeated in the batch shares its history
        outcome = StepController(self.planner, backend, batch, plan, step=self.step, history_uids=history).run()
        experiences = [self._process_response_into_experience(r, **kw) for r in outcome.outputs]
        self._finish_step(outcome, plan)
        return experiences

    def _scale(self, active: set[int], live: list[int]) -> None:
        """Engines outside the scaler's active subset sleep where OpenRLHF allows it (``--vllm.enable_sleep``:
        engines built with vLLM's sleep mode, which OpenRLHF wakes before each generation and puts back to sleep
        after it), freeing their GPU memory; otherwise they idle for the step and are not billed."""
        for e in sorted(self.asleep & active):
            self._call(e, "wake_up")
            self.asleep.discard(e)
        if not self.sleep_supported or not self.args.vllm.enable_sleep:
            return
        for e in live:
            if e in active or e in self.asleep:
                continue
            try:
                ray.get(self.vllm_engines[e].sleep.remote())
                self.asleep.add(e)
            except _DEAD as exc:
                self._mark_dead(e, exc)
            except Exception as exc:  # e.g. "Sleep mode is not supported on current platform"
                self.sleep_supported = False
                log.info("rollout engines cannot sleep here (%s); inactive engines stay idle and unbilled", exc)
                return

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

    def _call(self, engine: int, method: str, *args: Any) -> Any:
        try:
            return ray.get(getattr(self.vllm_engines[engine], method).remote(*args))
        except _DEAD as exc:
            self._mark_dead(engine, exc)
            return None

    def _mark_dead(self, engine: int, exc: BaseException) -> None:
        if engine not in self.dead:
            self.dead.add(engine)
            log.warning("rollout engine %d died (%s); its prompts go to the other engines", engine, type(exc).__name__)

    # -- after the step ------------------------------------------------------------------------------------
    def _finish_step(self, outcome: StepOutcome, plan: StepPlan) -> None:
        report = outcome.report
        lengths = np.array([s.response_length for s in outcome.samples], dtype=np.float64)
        pred = np.array([s.predicted_length or 0.0 for s in outcome.samples], dtype=np.float64)
        self.last_report = report
        self.last_metrics = {
            "rlhfless/predicted_length_mean": float(pred.mean()) if pred.size else 0.0,
            "rlhfless/actual_length_mean": float(lengths.mean()) if lengths.size else 0.0,
            "rlhfless/prediction_mae": report.prediction_mae or 0.0,
            "rlhfless/active_engines": float(plan.num_actors),
            "rlhfless/engines_asleep": float(len(self.asleep)),
            "rlhfless/idle_fraction": report.idle_fraction,
            "rlhfless/gpu_seconds": report.gpu_seconds,
            "rlhfless/migrations": float(report.migrations),
            "rlhfless/cached_prefill_tokens": float(report.prefill_tokens_saved),
            "rlhfless/planner_ms": plan.planner_ms,
            **{
                f"rlhfless/engine{e}_busy_s": u.busy_s
                for e, u in enumerate(outcome.usage.engines)
                if e not in self.dead
            },
        }
        if self.report_path is not None:
            self.report_path.parent.mkdir(parents=True, exist_ok=True)
            with self.report_path.open("a", encoding="utf-8") as fh:
                fh.write(json.dumps(report.model_dump(mode="json")) + "\n")
        self.step += 1

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


def _response_length(response: dict[str, Any]) -> int:
    return int(sum(end - start for start, end in response["action_ranges"]))


def _engine_dead(exc: BaseException) -> bool:
    """vLLM's engine process died under a live Ray actor: treat it as a dead engine."""
    text = repr(exc)
    return "EngineDeadError" in text or ("EngineCore" in text and "died" in text)
