"""RLHFless's samples generator: OpenRLHF's ``SamplesGenerator`` with the rollout driven by a step plan.

Each step it tokenizes the prompts, asks the planner for a plan (predictor, dedup prefill, assignment for each
candidate engine count, scaler, placer), warms each engine's shared prefixes once, dispatches each prompt's
samples to the engines of the plan (the scaler's N is the active subset), runs cut-and-migrate while the
samples decode, survives an engine that dies (its prompts are regenerated on the others, nothing lost or
duplicated), returns each prompt's n samples adjacent and in order, feeds the observed lengths back to the
predictor, and writes a step report (JSON lines) whose ``rlhfless/*`` metrics OpenRLHF's loggers pick up.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import ray
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator, _collect_prompt_batch
from vllm import SamplingParams

from rlhfless_sdk.api.batch import PromptBatch
from rlhfless_sdk.api.config import SchedulerConfig
from rlhfless_sdk.api.plugins import Registry, get_plugin_manager
from rlhfless_sdk.api.records import (
    ActorProgress,
    Cluster,
    FinishedSample,
    SampleProgress,
    StepProgress,
    StepReport,
    TimePerTokenProfile,
)
from rlhfless_sdk.planning.costmodel import AnalyticCostModel
from rlhfless_sdk.planning.planner import StepPlanner

log = logging.getLogger("rlhfless.openrlhf")

_DEAD = (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError)


def prompt_uid(prompt: str) -> str:
    """A stable id for a prompt's text: its length history follows it across epochs."""
    return hashlib.sha1(prompt.encode("utf-8")).hexdigest()[:16]


class _Piece:
    """Some samples of one prompt, dispatched to one engine in one Ray call."""

    def __init__(self, prompt_index: int, keys: list[str], engine: int) -> None:
        self.prompt_index, self.keys, self.engine = prompt_index, keys, engine
        self.ref: Any = None
        self.result: list[dict[str, Any]] | None = None


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
        self.profile = profile
        self.report_path = None if report_path is None else Path(report_path)
        self.check_interval_s = check_interval_s
        self.dead: set[int] = set()
        self.asleep: set[int] = set()
        self._continuations: dict[Any, tuple[str, int, int, dict[str, Any]]] = {}
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
        images = images or [None] * len(prompts)
        params = self._sampling_params(**kw)
        max_length = kw.get("max_len", 2048)
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
        live = [e for e in range(len(self.vllm_engines)) if e not in self.dead]
        if not live:
            raise RuntimeError("every rollout engine has died; cannot generate")
        engine_of = {a: live[a % len(live)] for a in range(plan.num_actors)}  # plan actor -> live engine
        self._scale(set(engine_of.values()), live)
        for e in live:  # a fresh per-step account of busy time and cached tokens
            self._call(e, "rl_reset_stats")

        # Deduplicated prefill: each engine prefills its prompts' shared prefixes once (prefix caching on).
        warm_refs = []
        if plan.prefill.prompt_group:
            prefix_len = np.asarray(plan.prefill.group_prefix_tokens)[np.asarray(plan.prefill.prompt_group)]
            per_engine: dict[int, dict[tuple, list[int]]] = defaultdict(dict)
            for i in range(len(prompts)):
                e = engine_of[plan.assignment[int(batch.sample_offsets[i])]]
                pre = token_ids[i][: int(prefix_len[i])]
                per_engine[e][tuple(pre)] = pre
            for e, prefixes in per_engine.items():
                warm_refs.append(self.vllm_engines[e].warm_prefixes.remote(list(prefixes.values()), params))
            ray.get(warm_refs)

        pieces: list[_Piece] = []
        for i in range(len(prompts)):
            by_engine: dict[int, list[str]] = defaultdict(list)
            for k in range(n):
                by_engine[engine_of[plan.assignment[int(batch.sample_offsets[i]) + k]]].append(f"{uids[i]}/{k}")
            for e, keys in by_engine.items():
                pieces.append(_Piece(i, keys, e))
        for piece in pieces:
            self._dispatch(piece, prompts, labels, images, params, max_length, kw)

        migrations = self._drive(pieces, batch, plan, prompts, labels, images, params, max_length, kw)
        # Regroup: each prompt's samples adjacent and in sample order, prompts in batch order.
        by_key = {r["rlhfless_key"]: r for p in pieces for r in (p.result or [])}
        ordered = [by_key[f"{uids[i]}/{k}"] for i in range(len(prompts)) for k in range(n)]
        experiences = [self._process_response_into_experience(r, **kw) for r in ordered]
        self._finish_step(batch, plan, ordered, live, migrations, t_start)
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

    # -- dispatch, migration, failure --------------------------------------------------------------------------
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

    def _dispatch(self, piece: _Piece, prompts, labels, images, params, max_length, kw) -> None:
        i = piece.prompt_index
        piece.ref = self.vllm_engines[piece.engine].generate_group.remote(
            prompt=prompts[i],
            label=labels[i],
            sampling_params=params,
            max_length=max_length,
            hf_tokenizer=self.tokenizer,
            keys=piece.keys,
            images=images[i],
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

    def _drive(self, pieces, batch, plan, prompts, labels, images, params, max_length, kw) -> int:
        pending = {p.ref: p for p in pieces}
        migrations, controller = 0, self.planner.migration
        migrate = self.planner.config.migrator.name != "none"
        predicted = {
            f"{batch.uids[i]}/{k}": plan.predicted_lengths[i] for i in range(len(batch)) for k in range(n_of(batch, i))
        }
        migrated_count: dict[str, int] = defaultdict(int)
        finished_lengths: dict[str, list[int]] = defaultdict(list)
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=self.check_interval_s)
            for ref in ready:
                piece = pending.pop(ref)
                try:
                    piece.result = ray.get(ref)
                    for r in piece.result:
                        finished_lengths[r["rlhfless_key"].rsplit("/", 1)[0]].append(_response_length(r))
                except (*_DEAD, ray.exceptions.RayTaskError) as exc:
                    if isinstance(exc, ray.exceptions.RayTaskError) and not _engine_dead(exc):
                        raise
                    self._mark_dead(piece.engine, exc)
                    live = [e for e in range(len(self.vllm_engines)) if e not in self.dead]
                    if not live:
                        raise RuntimeError("every rollout engine has died; cannot generate") from exc
                    piece.engine = min(live, key=lambda e: sum(len(p.keys) for p in pending.values() if p.engine == e))
                    self._dispatch(piece, prompts, labels, images, params, max_length, kw)
                    pending[piece.ref] = piece
            self._check_continuations()
            if migrate and pending:
                migrations += self._migrate(pending, predicted, migrated_count, finished_lengths, batch, controller)
        return migrations

    def _check_continuations(self) -> None:
        """A continuation whose engine died is run again on a live engine (or, with none left, the cut sample
        keeps what it had), so the engine waiting to stitch it is never left hanging."""
        if not self._continuations:
            return
        ready, _ = ray.wait(list(self._continuations), num_returns=len(self._continuations), timeout=0)
        for ref in ready:
            key, source, target, info = self._continuations.pop(ref)
            try:
                ray.get(ref)
            except (*_DEAD, ray.exceptions.RayTaskError) as exc:
                self._mark_dead(target, exc)
                live = [e for e in range(len(self.vllm_engines)) if e not in self.dead and e != source]
                if live:
                    self._continue(key, source, live[0], info)
                else:
                    self.vllm_engines[source].fail_cut.remote(key, f"continuation engine died: {exc!r}")

    def _continue(self, key: str, source: int, target: int, info: dict[str, Any]) -> None:
        cont = self.vllm_engines[target].continue_sample.remote(
            info["prompt_token_ids"] + info["partial"], info["sampling_params"], info["remaining"]
        )
        self._continuations[cont] = (key, source, target, info)
        self.vllm_engines[source].deliver.remote(key, cont)

    def _migrate(self, pending, predicted, migrated_count, finished_lengths, batch, controller) -> int:
        live = sorted({p.engine for p in pending.values()} | ({e for e in range(len(self.vllm_engines))} - self.dead))
        refs = {e: self.vllm_engines[e].rl_stats.remote() for e in live}  # ask every engine at once
        stats = {}
        for e, ref in refs.items():
            try:
                stats[e] = ray.get(ref)
            except _DEAD as exc:
                self._mark_dead(e, exc)
        if not stats:
            return 0
        planned = defaultdict(float)
        for p in pending.values():
            for key in p.keys:
                planned[p.engine] += predicted[key]
        actors, unfinished = [], []
        for e, st in stats.items():
            running = len(st["progress"])
            actors.append(
                ActorProgress(
                    actor_id=e,
                    planned_tokens=planned[e],
                    generated_tokens=st["generated_tokens"] + sum(st["progress"].values()),
                    running=running,
                    free_slots=max(0, self.profile.max_num_seqs - running),
                )
            )
            for key, tokens in st["progress"].items():
                uid, k = key.rsplit("/", 1)
                unfinished.append(
                    SampleProgress(
                        uid=uid,
                        sample_index=int(k),
                        actor_id=e,
                        tokens_generated=tokens,
                        predicted_length=predicted.get(key, 0.0),
                        planned_length=predicted.get(key, 0.0),
                        max_tokens=4096,
                        migrations=migrated_count[key],
                    )
                )
        progress = StepProgress(
            step=self.step,
            total_samples=batch.total_samples,
            actors=actors,
            unfinished=unfinished,
            finished=dict(finished_lengths),
        )
        moved = 0
        for d in controller.decide(progress):
            key = f"{d.uid}/{d.sample_index}"
            info = self._call(d.from_actor, "cut", key)
            if info is None:
                continue  # it finished before the cut landed
            self._continue(key, d.from_actor, d.to_actor, info)
            migrated_count[key] += 1
            moved += 1
        return moved

    # -- after the step ------------------------------------------------------------------------------------
    def _finish_step(self, batch, plan, ordered, live, migrations, t_start) -> None:
        stats = {e: self._call(e, "rl_stats") for e in live if e not in self.dead}
        stats = {e: s for e, s in stats.items() if s is not None}
        generation_s = time.time() - t_start
        lengths = np.array([_response_length(r) for r in ordered], dtype=np.float64)
        n = batch.n_samples
        pred = np.repeat(np.asarray(plan.predicted_lengths, dtype=np.float64), n)
        index = {u: i for i, u in enumerate(batch.uids)}
        samples = []
        for idx, r in enumerate(ordered):
            uid, k = r["rlhfless_key"].rsplit("/", 1)
            samples.append(
                FinishedSample(
                    uid=uid.split("#")[0],  # a prompt repeated in the batch shares its history
                    sample_index=int(k),
                    prompt_length=int(batch.prompt_lengths[index[uid]]),
                    response_length=int(lengths[idx]),
                    predicted_length=float(pred[idx]),
                    finish_reason="length" if r.get("truncated") else "stop",
                )
            )
        self.planner.observe(samples)
        busy = {e: float(s["busy_s"]) for e, s in stats.items()}
        used = [e for e, s in stats.items() if s["first"] is not None]
        gpu_s = sum((stats[e]["last"] - stats[e]["first"]) for e in used) + len(used) * self.profile.cold_start_s
        busy_sum = sum(busy[e] for e in used)
        idle = 1.0 - busy_sum / (max(len(used), 1) * generation_s) if generation_s > 0 else 0.0
        mean_busy = busy_sum / max(len(used), 1)
        cached = sum(int(s["cached_tokens"]) for s in stats.values())
        report = StepReport(
            step=self.step,
            scheduler=self.planner.config.name,
            time_s=generation_s,
            generation_s=generation_s,
            gpu_seconds=gpu_s,
            gpu_seconds_serverful=len(self.vllm_engines) * generation_s,
            idle_fraction=min(max(idle, 0.0), 1.0),
            imbalance=max(max((busy[e] for e in used), default=0.0) / mean_busy if mean_busy > 0 else 1.0, 1.0),
            prefill_tokens_saved=cached,
            migrations=migrations,
            num_actors=plan.num_actors,
            samples=len(ordered),
            actor_busy_s=[busy.get(e, 0.0) for e in range(len(self.vllm_engines))],
            prediction_mae=float(np.abs(pred - lengths).mean()) if lengths.size else 0.0,
            planner_ms=plan.planner_ms,
            fallbacks=plan.fallbacks,
        )
        self.last_report = report
        self.last_metrics = {
            "rlhfless/predicted_length_mean": float(pred.mean()) if pred.size else 0.0,
            "rlhfless/actual_length_mean": float(lengths.mean()) if lengths.size else 0.0,
            "rlhfless/prediction_mae": report.prediction_mae or 0.0,
            "rlhfless/active_engines": float(plan.num_actors),
            "rlhfless/engines_asleep": float(len(self.asleep)),
            "rlhfless/idle_fraction": report.idle_fraction,
            "rlhfless/gpu_seconds": report.gpu_seconds,
            "rlhfless/migrations": float(migrations),
            "rlhfless/cached_prefill_tokens": float(cached),
            "rlhfless/planner_ms": plan.planner_ms,
            **{f"rlhfless/engine{e}_busy_s": b for e, b in busy.items()},
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


def n_of(batch: PromptBatch, i: int) -> int:
    return int(batch.n_samples[i])


def _response_length(response: dict[str, Any]) -> int:
    return int(sum(end - start for start, end in response["action_ranges"]))


def _engine_dead(exc: BaseException) -> bool:
    """vLLM's engine process died under a live Ray actor: treat it as a dead engine."""
    text = repr(exc)
    return "EngineDeadError" in text or ("EngineCore" in text and "died" in text)
