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
import math
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import ray
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator, _collect_prompt_batch
from rlhfless_openrlhf.messages import CARRIED, Continuation, CutSample, EngineStats
from vllm import SamplingParams

from rlhfless_sdk.api.batch import PromptBatch
from rlhfless_sdk.api.config import SchedulerConfig
from rlhfless_sdk.api.plugins import Registry, get_plugin_manager
from rlhfless_sdk.api.records import Cluster, StepPlan, StepReport, TimePerTokenProfile
from rlhfless_sdk.planning.costmodel import AnalyticCostModel
from rlhfless_sdk.planning.planner import StepPlanner
from rlhfless_sdk.rollout.batchcut import BatchCutStep, note_completed
from rlhfless_sdk.rollout.carry import CarryBook, Group, Piece
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
from rlhfless_sdk.rollout.tail import TailRounds, first_done, round_fields

log = logging.getLogger("rlhfless.openrlhf")


def log_lines() -> None:
    """Show the adapter's INFO lines (placement, refill rounds, engines woken) in this process's stderr, once."""
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


_DEAD = (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError)


class RolloutEngineLost(RuntimeError):
    """A rollout engine died: the run cannot go on (OpenRLHF's weight broadcast would hang)."""


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
    prefix: dict[int, tuple[list[int], list[float] | None]] = field(default_factory=dict)  # sample -> carried tokens


class _Piece:
    """Some samples of one prompt, dispatched to one engine in one Ray call, each under its own piece key."""

    def __init__(self, prompt_index: int, samples: list[int], engine: int) -> None:
        self.prompt_index, self.samples, self.engine = prompt_index, samples, engine
        self.keys: list[str] = []
        self.ref: Any = None


@dataclass
class _Link:
    """One cut of a sample: the engine that holds the cut piece (and will stitch the rest onto it), the piece's
    key there, what the cut kept, and the Ray call generating the rest (None until it is resumed)."""

    holder: int
    key: str
    cut: CutSample
    kept: int  # response tokens of the sample up to this cut, every earlier piece included
    cont: Any = None
    cont_engine: int = -1


class RayBackend:
    """OpenRLHF's vLLM engines (RLHFless's engine class) as a rollout backend of the SDK's step controller.

    Every piece of work has its own key, ``<prompt uid>/<sample>@<n>``: a sample's first piece (``generate_group``)
    and each continuation after a cut (``continue_sample``). A sample cut k times has a chain of k links; each
    continuation's result is delivered to the engine that cut it, so the first engine returns the stitched whole.
    """

    def __init__(self, gen: RlhflessSamplesGenerator, req: _Request, plan: StepPlan, t_start: float) -> None:
        self.gen, self.req, self.plan, self.t_start = gen, req, plan, t_start
        self.max_num_seqs = gen.profile.max_num_seqs
        self.max_tokens = int(req.params.max_tokens or req.max_length)
        self.sid = {key: sid for sid, key in enumerate(req.keys)}
        self.pending: dict[Any, _Piece] = {}
        self.seq = [0] * len(req.keys)  # pieces issued per sample: keys are never reused within a step
        self.root: list[str | None] = [None] * len(req.keys)  # key of the current attempt's first piece
        self.now_key: list[str | None] = [None] * len(req.keys)  # key of the piece running now
        self.chain: list[list[_Link]] = [[] for _ in req.keys]
        self.continuations: dict[Any, tuple[int, int]] = {}  # ref -> (sample, link index)
        self.cut_log: list[tuple[int, int, CutSample]] = []  # every cut of the step: (sample, engine, what it kept)
        self.carried: set[int] = set()  # samples cut at the step's end, their tokens kept for a later step
        self.carried_out: dict[int, dict[str, Any]] = {}  # sample -> its engine's response with what it has
        self.engine_of: list[int] = [-1] * len(req.keys)  # the engine running the sample's piece ``now_key``
        self.ending = False  # the step's end rule fired: the controller cuts every running sample now
        self.precut: dict[int, tuple[int, str, CutSample | None]] | None = None  # sample -> (engine, key, cut)
        self.started = False

    @property
    def handles(self) -> list:
        return self.gen.vllm_engines

    def engines(self) -> list[int]:
        return [e for e in range(len(self.handles)) if e not in self.gen.dead]

    def _new_key(self, sid: int) -> str:
        self.seq[sid] += 1
        key = f"{self.req.keys[sid]}@{self.seq[sid]}"
        self.now_key[sid] = key
        return key

    def _sample_of(self, key: str) -> int:
        return self.sid[key.rpartition("@")[0]]

    def _kept(self, sid: int) -> int:
        return self.chain[sid][-1].kept if self.chain[sid] else 0

    # -- start -----------------------------------------------------------------------------------------------
    def start(self, samples: Sequence[int], engines: Sequence[int]) -> None:
        if not self.started:  # the step's first dispatch: every engine awake, fresh stats, shared prefixes warm
            self.started = True
            self.gen._begin_step(self.engines())
            self._warm(samples, engines)
        pieces: dict[tuple[int, int], _Piece] = {}
        for sid, e in zip(samples, engines, strict=True):
            i = self.req.prompt_of[sid]
            piece = pieces.setdefault((i, e), _Piece(i, [], e))
            piece.samples.append(sid)
            self.chain[sid] = []
            key = self._new_key(sid)
            self.root[sid] = key
            self.engine_of[sid] = e
            piece.keys.append(key)
        for piece in pieces.values():
            self._dispatch(piece)

    def _warm(self, samples: Sequence[int], engines: Sequence[int]) -> None:
        """Deduplicated prefill: each engine prefills its prompts' shared prefixes once (prefix caching on)."""
        pf = self.plan.prefill
        if not pf.prompt_group or not self.gen.prefix_caching:
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
            keys=piece.keys,
            images=r.images[i],
            carried={k: r.prefix[s] for s, k in zip(piece.samples, piece.keys, strict=True) if s in r.prefix} or None,
        )
        self.pending[piece.ref] = piece

    # -- poll ------------------------------------------------------------------------------------------------
    def _returned(self, ref: Any) -> tuple[_Piece, list[dict[str, Any]] | None]:
        """A dispatched call that came back: its piece and the responses, or None if its engine died."""
        piece = self.pending.pop(ref)
        try:
            return piece, ray.get(ref)
        except (*_DEAD, ray.exceptions.RayTaskError) as exc:
            if isinstance(exc, ray.exceptions.RayTaskError) and not _engine_dead(exc):
                raise
            self.gen._mark_dead(piece.engine, exc)
            return piece, None

    def poll(self) -> Poll:
        out = Poll()
        if self.pending:
            ready, _ = ray.wait(list(self.pending), num_returns=len(self.pending), timeout=self.gen.check_interval_s)
            for ref in ready:
                piece, results = self._returned(ref)
                if results is None:
                    out.dead_engines.append(piece.engine)
                    for sid, key in zip(piece.samples, piece.keys, strict=True):
                        if self.root[sid] == key:  # the engine held it (and would stitch any cut): start over
                            self.chain[sid], self.root[sid], self.now_key[sid] = [], None, None
                            out.lost.append(Lost(sid, 0))
                    continue
                for resp in results:
                    key = resp["rlhfless_key"]
                    sid = self._sample_of(key)
                    if self.root[sid] != key:
                        raise RuntimeError(f"rollout backend: {key} returned; sample {sid} runs as {self.root[sid]}")
                    self.chain[sid], self.root[sid], self.now_key[sid] = [], None, None
                    if sid in self.carried:  # what it has, for a later step: not finished in this one
                        self.carried_out[sid] = resp
                        continue
                    reason = "length" if resp.get("truncated") else "stop"
                    had = len(self.req.prefix[sid][0]) if sid in self.req.prefix else 0
                    made = _response_length(resp) - had  # this step's tokens (a carried sample had some before)
                    out.finished.append(Finished(sid, made, output=resp, finish_reason=reason))
        else:  # every piece returned, so every sample finished or was reported lost and re-dispatched
            raise RuntimeError("rollout backend: samples are unfinished but no engine holds any (a bug)")
        self._check_continuations(out)
        return out

    def _check_continuations(self, out: Poll) -> None:
        """A continuation whose engine died (or whose engine held a later cut and died) is lost back to its cut:
        the controller resumes it elsewhere, so the engine waiting to stitch it is never left hanging."""
        if not self.continuations:
            return
        ready, _ = ray.wait(list(self.continuations), num_returns=len(self.continuations), timeout=0)
        for ref in ready:
            sid, depth = self.continuations.pop(ref)
            try:
                ray.get(ref)
            except (*_DEAD, ray.exceptions.RayTaskError) as exc:
                chain = self.chain[sid]
                if depth >= len(chain) or chain[depth].cont is not ref:
                    continue  # the sample finished, started over, or was resumed since
                self.gen._mark_dead(chain[depth].cont_engine, exc)
                del chain[depth + 1 :]
                chain[depth].cont, self.now_key[sid] = None, None
                out.lost.append(Lost(sid, chain[depth].kept))

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
            running = {}
            for key, tokens in st.progress.items():
                sid = self._sample_of(key)
                if self.now_key[sid] == key:  # a piece orphaned by an engine death is not the sample's
                    running[sid] = self._kept(sid) + tokens
            status[e] = EngineStatus(st.generated_tokens + sum(st.progress.values()), running)
        return status

    def cut(self, engine: int, sample: int) -> int | None:
        if self.ending and self.precut is None:  # the step ends: every running sample is cut, all at once
            self.precut = self._cut_running()
        if self.precut is not None and sample in self.precut:
            engine, key, info = self.precut.pop(sample)
        else:
            key = self.now_key[sample]
            info = None if key is None else self.gen._call(engine, "cut", key)
        if info is None:
            return None  # it finished before the cut landed (or the engine died)
        first = self.chain[sample][0].cut if self.chain[sample] else info
        kept = len(info.prompt_token_ids) + len(info.partial) - len(first.prompt_token_ids)
        self.chain[sample].append(_Link(engine, key, info, kept))
        self.cut_log.append((sample, engine, info))
        self.now_key[sample] = None
        return kept

    def _cut_running(self) -> dict[int, tuple[int, str, CutSample | None]]:
        """Cut every sample running now, in one round: each engine gets all its cuts at once, and one ``ray.get``
        waits for them all (not one round trip per sample). Per sample: (engine, piece key, what the cut kept;
        None: it finished before the cut landed, or its engine died)."""
        running = [(sid, self.engine_of[sid], key) for sid, key in enumerate(self.now_key) if key is not None]
        refs = [self.handles[e].cut.remote(key) for _sid, e, key in running]
        try:
            infos = ray.get(refs)
        except _DEAD:  # an engine died: its cuts come back empty, the others' as they are
            infos = []
            for (_sid, e, _key), ref in zip(running, refs, strict=True):
                try:
                    infos.append(ray.get(ref))
                except _DEAD as exc:
                    self.gen._mark_dead(e, exc)
                    infos.append(None)
        return {sid: (e, key, info) for (sid, e, key), info in zip(running, infos, strict=True)}

    def resume(self, engine: int, sample: int, mode: str = "tokens") -> None:
        link = self.chain[sample][-1]  # by tokens: the target re-prefills the prompt and every kept token
        info = link.cut
        cont = self.handles[engine].continue_sample.remote(
            self._new_key(sample),
            info.prompt_token_ids + info.partial,
            info.sampling_params,
            info.remaining,
            len(info.partial),
        )
        link.cont, link.cont_engine = cont, engine
        self.engine_of[sample] = engine
        self.continuations[cont] = (sample, len(self.chain[sample]) - 1)
        self.handles[link.holder].deliver.remote(link.key, cont)

    def carry(self, engine: int, sample: int) -> None:
        """The step ended: the engine that cut the sample last hands what it has back along the chain, so the
        first engine's call returns the sample's response so far (kept in ``carried_out``). The ``carried``
        finish reason tells the engine that this response will not train as it is: OpenRLHF's executor, and so
        its reward call, is skipped for it."""
        link = self.chain[sample][-1]
        logprobs = None if self.req.params.logprobs is None else []
        empty = Continuation(token_ids=[], logprobs=logprobs, finish_reason=CARRIED)
        self.handles[link.holder].deliver.remote(link.key, empty)
        self.carried.add(sample)

    def collect_carried(self, timeout_s: float | None = None) -> None:
        """After the step: wait for the calls still out (those of carried samples, which return what they have
        once ``carry`` released them) and keep their responses in ``carried_out``. A carried sample whose engine
        died comes back with nothing: it starts over in the next step. ``timeout_s`` (default the generator's
        ``carry_timeout_s``, ``--scheduler.carry_timeout``): how long to wait for them."""
        timeout_s = self.gen.carry_timeout_s if timeout_s is None else timeout_s
        deadline = time.time() + timeout_s
        while self.pending:
            ready, _ = ray.wait(
                list(self.pending), num_returns=len(self.pending), timeout=max(deadline - time.time(), 0)
            )
            if not ready:
                raise RuntimeError(
                    f"rollout backend: {len(self.pending)} call(s) of carried samples did not return within "
                    f"{timeout_s:g} s (--scheduler.carry_timeout)"
                )
            for ref in ready:
                _piece, results = self._returned(ref)
                for resp in results or ():  # None: its engine died, the carried samples start over
                    sid = self._sample_of(resp["rlhfless_key"])
                    if sid not in self.carried:
                        raise RuntimeError(f"rollout backend: sample {sid} came back after its step ended (a bug)")
                    self.carried_out[sid] = resp

    def now(self) -> float:
        return time.time() - self.t_start

    def usage(self) -> StepUsage:
        live = self.engines()
        refs = {e: self.handles[e].rl_stats.remote() for e in live}  # ask every engine at once
        stats: dict[int, EngineStats] = {}
        for e, ref in refs.items():
            try:
                stats[e] = ray.get(ref)
            except _DEAD as exc:
                self.gen._mark_dead(e, exc)
        return step_usage(time.time() - self.t_start, stats, len(self.handles), engine_gpus(self.gen.args))


def engine_gpus(args: Any) -> int:
    """GPUs one of OpenRLHF's rollout engines holds: its tensor parallel size (``--vllm.tensor_parallel_size``)."""
    return max(int(getattr(getattr(args, "vllm", None), "tensor_parallel_size", 1) or 1), 1)


def step_usage(generation_s: float, stats: dict[int, EngineStats], engines: int, gpus_per_engine: int) -> StepUsage:
    """The step's usage for the report from each live engine's stats (``engines`` in all, each on
    ``gpus_per_engine`` GPUs): an engine is billed on all its GPUs, and OpenRLHF holds every engine's."""
    usage = []
    for e in range(engines):
        st = stats.get(e)
        if st is None or st.first is None:
            usage.append(EngineUsage(st.busy_s if st else 0.0, None, 0.0))
        else:
            usage.append(EngineUsage(st.busy_s, st.first, st.last if st.last is not None else st.first))
    return StepUsage(
        generation_s=generation_s,
        engines=usage,
        gpus=engines * gpus_per_engine,  # serverful: every engine OpenRLHF holds, for the whole step
        gpus_per_engine=gpus_per_engine,  # OpenRLHF's engines stay up between steps: warm, no start-up to bill
        prefill_tokens_saved=sum(int(s.dedup_saved_tokens) for s in stats.values()),
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
        trace_path: str | Path | None = None,
        check_interval_s: float = 0.5,
        carry_timeout_s: float = 120.0,
        gpus_per_node: int = 8,
        registry: Registry | None = None,
    ) -> None:
        super().__init__(strategy, prompts_dataloader, eval_dataloader, tokenizer, vllm_engines)
        registry = registry or get_plugin_manager().registry
        n = len(self.vllm_engines)
        self.cluster = Cluster.of_gpus(n, gpus_per_node)
        config = scheduler.model_copy(update={"max_actors": min(scheduler.max_actors or n, n)})
        self.planner = StepPlanner(
            config,
            cluster=self.cluster,
            cost_model=AnalyticCostModel(profile),
            registry=registry,
            learner_gpus=0,  # OpenRLHF places its learner itself
            prefill_actor=False,  # each engine prefills its own prompts' shared prefixes: none is held back
        )
        self.planner.warm_actors = len(vllm_engines)  # OpenRLHF started them before the first step
        self.profile = profile
        self.report_path = None if report_path is None else Path(report_path)
        self.trace_path = None if trace_path is None else Path(trace_path)
        self.check_interval_s = check_interval_s
        self.carry_timeout_s = carry_timeout_s  # how long a step's end waits for its carried samples' calls
        self.dead: set[int] = set()
        # partial rollouts cut at B groups: what is carried between steps
        self.keeps_tokens = self.planner.keeps_tokens(0, [])
        if self.keeps_tokens and self.args.algo.advantage.is_correction_level == "off":
            log.warning(
                "rlhfless: scheduler %s trains carried tokens one weight update stale, but importance-sampling "
                "correction is off (--algo.advantage.is_correction_level): they train without an importance weight",
                config.name,
            )
        # tail batching: rounds of prompts from OpenRLHF's dataloader, the slowest groups' prompts deferred
        self.tails = not self.keeps_tokens and hasattr(self.planner.policies["straggler"], "over_provision")
        self.tail: TailRounds | None = None
        self.tail_prompts: dict[int, tuple[str, Any, Any]] = {}  # prompt id -> prompt, label, image (not trained yet)
        self._tail_source: Any = None  # the dataloader iterator the rounds draw from
        self._tail_drawn = 0
        self._tail_pending: list[int] = []  # restored from a checkpoint, not yet in a round
        self.book = CarryBook()
        self.group_meta: dict[int, tuple[str, Any, Any, str, list[int]]] = {}  # group -> prompt, label, image, uid, ids
        self.carry_state: dict[tuple[int, int], tuple[list[int], list[float] | None]] = {}  # sample -> tokens, logprobs
        self.ended_responses: dict[tuple[int, int], dict[str, Any]] = {}  # samples ended, their group still open
        # dedup prefill rides on vLLM's prefix cache; the user's setting holds for every scheduler alike
        self.prefix_caching = bool(getattr(self.args.vllm, "enable_prefix_caching", True))
        if not self.prefix_caching:
            log.info("prefix caching is off (--vllm.enable_prefix_caching): the dedup prefill plan is not applied")
        self.step = 0
        self.last_cuts: list[tuple[int, int, CutSample]] = []
        self.last_trained_groups: list[int] = []  # partial rollouts: the groups of the last step's experiences
        self.last_report: StepReport | None = None
        self.last_metrics: dict[str, float] = {}

    # -- the step ------------------------------------------------------------------------------------------
    def generate_samples(self, **generate_kwargs):  # type: ignore[override]
        """OpenRLHF's entry point, unchanged, except that a step in which a rollout engine died is not handed to
        training (see ``dead_engine_error``)."""
        out = super().generate_samples(**generate_kwargs)
        error = self.dead_engine_error()
        if error is not None:
            raise RolloutEngineLost(error)
        return out

    def _generate_vllm(self, dataloader_iter, num_prompts: int, dynamic_filtering, **generate_kwargs):  # type: ignore[override]
        """One training batch. Evaluation rollouts take OpenRLHF's own path: they are not the workload the
        scheduler plans for and never enter the length history or the step count. With dynamic filtering, each
        group the filter drops is replaced by a fresh prompt from the dataloader, as OpenRLHF does, in refill rounds
        (each one a scheduled round of its own in the step report) until the batch is full or the data ends."""
        if dataloader_iter is not None and dataloader_iter is getattr(self, "_eval_dataloader_iter", None):
            return super()._generate_vllm(dataloader_iter, num_prompts, dynamic_filtering, **generate_kwargs)
        if self.keeps_tokens:
            if dynamic_filtering:  # refused at launch too: a dropped group would break "B groups a step"
                raise RuntimeError("rlhfless: partial rollouts (partial-batch) cannot run with dynamic filtering")
            return self._generate_batch_cut(dataloader_iter, num_prompts, **generate_kwargs)
        if self.tails:
            if dynamic_filtering:  # refused at launch too: a dropped group would break "B groups a step"
                raise RuntimeError("rlhfless: tail batching (tail-batch) cannot run with dynamic filtering")
            return self._generate_tail_round(dataloader_iter, num_prompts, **generate_kwargs)
        n = int(generate_kwargs.get("n_samples_per_prompt", self.args.rollout.n_samples_per_prompt))
        accepted: list = []
        consumed, want, exhausted = 0, num_prompts, False
        while want > 0 and not exhausted:
            prompts, labels, images, exhausted = _collect_prompt_batch(dataloader_iter, want)
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

    # -- carried work across OpenRLHF checkpoints ------------------------------------------------------------
    def carry_snapshot(self) -> dict[str, Any] | None:
        """What a straggler policy holds between steps, as plain data for OpenRLHF's checkpoint (``client_states``).
        Partial rollouts: the open groups, the carried samples with their tokens and logprobs, the samples already
        ended in open groups. Tail batching: the prompts drawn from the dataloader and not trained yet (deferred or
        waiting), in order. None when nothing is held."""
        book = self.book
        waiting = [] if self.tail is None else [*self.tail.deferred, *self.tail.fresh]
        waiting += self._tail_pending
        if not book.groups and not waiting:
            return None
        snapshot: dict[str, Any] = {"version": 1, "step": self.step}
        if book.groups:
            snapshot.update(
                {
                    "launched": book._launched,
                    "carried": [asdict(p) for p in book.carried],
                    "groups": {str(g): asdict(grp) for g, grp in book.groups.items()},
                    "group_meta": {str(g): [m[0], m[1], None, m[3], list(m[4])] for g, m in self.group_meta.items()},
                    "carry_state": [[g, j, list(t), lp] for (g, j), (t, lp) in self.carry_state.items()],
                    "ended": [[g, j, r] for (g, j), r in self.ended_responses.items()],
                }
            )
        if waiting:
            snapshot["deferred"] = [[self.tail_prompts[k][0], self.tail_prompts[k][1]] for k in waiting]
        # plain JSON data (a reward's tensors become numbers), whatever the checkpoint format pickles or not
        return json.loads(json.dumps(snapshot, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))

    def restore_carry(self, snapshot: dict[str, Any] | None) -> int:
        """Take back what ``carry_snapshot`` saved; returns the number of carried samples and deferred prompts
        restored. What this generator cannot continue (another scheduler, another format) is dropped with a
        logged count."""
        if not snapshot:
            return 0
        restored = 0
        version_ok = snapshot.get("version") == 1
        deferred = snapshot.get("deferred", [])
        if deferred and (not self.tails or not version_ok):
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
        if not self.keeps_tokens or not version_ok:
            log.warning(
                "rlhfless: the checkpoint carries %d partial sample(s) in %d open group(s) that scheduler %s cannot "
                "continue; they are dropped (their prompts were consumed: they will not train this epoch)",
                carried,
                len(snapshot.get("groups", {})),
                self.planner.config.name,
            )
            return restored
        book = CarryBook()
        book._launched = int(snapshot["launched"])
        book.carried = [Piece(**{**p, "steps": [tuple(x) for x in p["steps"]]}) for p in snapshot["carried"]]
        for g, grp in snapshot["groups"].items():
            lengths = {int(k): int(v) for k, v in grp["lengths"].items()}
            steps = {int(k): [tuple(x) for x in v] for k, v in grp["steps"].items()}
            book.groups[int(g)] = Group(grp["uid"], int(grp["n"]), int(grp["prompt_length"]), lengths, steps)
        self.book = book
        self.group_meta = {int(g): (m[0], m[1], None, m[3], list(m[4])) for g, m in snapshot["group_meta"].items()}
        self.carry_state = {(int(g), int(j)): (list(t), lp) for g, j, t, lp in snapshot["carry_state"]}
        self.ended_responses = {(int(g), int(j)): r for g, j, r in snapshot["ended"]}
        self.step = int(snapshot["step"])
        log.info(
            "rlhfless: restored %d carried sample(s) in %d open group(s) from the checkpoint", carried, len(book.groups)
        )
        return restored + carried

    # -- partial rollouts cut at B groups (a straggler policy that keeps tokens) -------------------------------
    def _generate_batch_cut(self, dataloader_iter, b: int, **kw: Any) -> tuple[list, int, bool]:
        """One step of partial rollouts cut when B groups are complete (``partial-batch``), the SDK's
        ``BatchCutStep`` driving OpenRLHF's engines: every group carried from the step before, plus fresh prompts
        from OpenRLHF's dataloader up to (1 + over_provision) x B groups in flight; the step ends once the carried
        groups and ``B - carried`` fresh ones are complete, and every other sample is cut where it is and carried,
        with its tokens and their logprobs, into the next step, where it continues under the new weights on
        whichever engine the plan picks. A group trains once, complete, with all n samples in order; each carried
        token keeps the logprob of the policy that generated it, so OpenRLHF's rollout-logprob importance
        correction applies. Once the dataloader runs dry the last steps train what is left, B a step, and the
        epoch ends when nothing is carried. Returns (experiences, prompts taken from the dataloader, exhausted)."""
        t_start = time.time()
        n = int(kw.get("n_samples_per_prompt", self.args.rollout.n_samples_per_prompt))
        book = self.book
        step = BatchCutStep(self.planner, book, b, self.step)
        held = step.held
        want = step.fresh_wanted()
        prompts, labels, images, exhausted = [], [], [], False
        if want:
            prompts, labels, images, exhausted = _collect_prompt_batch(dataloader_iter, want)
        if not prompts and not held:
            return [], 0, True
        images = images or [None] * len(prompts)
        new, new_tokens = None, []
        if prompts:  # uids distinct from the open groups' too
            taken = {p.uid for p in book.carried} | {self.group_meta[g][3] for g in held}
            new_tokens, new = self._prompt_batch(prompts, n, taken)
        batch, plan = step.plan(new)
        pieces, n_carried = step.pieces, step.n_carried
        for i in range(len(prompts)):  # the new groups, in launch order
            g = pieces[n_carried + i * n].group
            self.group_meta[g] = (prompts[i], labels[i], images[i], new.uids[i], new_tokens[i])
        firsts = pieces[:n_carried] + pieces[n_carried::n]  # the batch's prompts: carried samples, then new groups
        metas = [self.group_meta[p.group] for p in firsts]
        if not [e for e in range(len(self.vllm_engines)) if e not in self.dead]:
            raise RuntimeError("every rollout engine has died; cannot generate")
        req = _Request(
            prompts=[m[0] for m in metas],
            labels=[m[1] for m in metas],
            images=[m[2] for m in metas],
            token_ids=[m[4] for m in metas],
            keys=[f"{batch.uids[i]}/{k}" for i in range(len(batch)) for k in range(int(batch.n_samples[i]))],
            prompt_of=[i for i in range(len(batch)) for _ in range(int(batch.n_samples[i]))],
            params=self._sampling_params(**kw),
            max_length=kw.get("max_len", 2048),
            prefix={
                sid: self.carry_state[(p.group, p.sample_index)]
                for sid, p in enumerate(pieces[:n_carried])
                if (p.group, p.sample_index) in self.carry_state
            },
        )
        backend = RayBackend(self, req, plan, t_start)
        controller = StepController(self.planner, backend, batch, plan, step=self.step)
        outcome = controller.run(observe=False, stop=_ending(backend, step.stop) if step.cuts() else None)
        step.scan(controller.done_prompts())  # groups that completed in the last poll (or all before a cut)
        backend.collect_carried()
        carried = set(outcome.carried)
        made, ended = [], []
        for sid, s in enumerate(outcome.samples):
            kept = sid not in carried or sid in backend.carried_out  # a carried sample whose engine died has nothing
            made.append(s.response_length if kept else 0)
            ended.append(sid not in carried)
        settled = step.settle(made, ended, step.end()[0], history_key=lambda uid: uid.split("#")[0])
        for sid, p in enumerate(pieces):
            key = (p.group, p.sample_index)
            if sid not in carried:
                self.ended_responses[key] = outcome.outputs[sid]
                self.carry_state.pop(key, None)
            elif sid in backend.carried_out:  # everything it has now, prompt excluded
                resp = backend.carried_out[sid]
                start = resp["action_ranges"][0][0]
                lps = resp["rollout_log_probs"]
                self.carry_state[key] = (list(resp["observation_tokens"][start:]), None if lps is None else lps[start:])
        self._trace_groups(
            (self.group_meta[tg.group][3], self.group_meta[tg.group][4], tg.lengths) for tg in settled.trained
        )
        experiences = []
        for tg in settled.trained:
            for j in range(len(tg.lengths)):
                response = self.ended_responses.pop((tg.group, j))
                experiences.append(self._process_response_into_experience(response, **kw))
            self.group_meta.pop(tg.group, None)
        report = outcome.report.model_copy(update=step.report_fields(settled))
        self.last_cuts = backend.cut_log
        self.last_trained_groups = [tg.group for tg in settled.trained]  # the experiences' groups, in order
        self._finish_step(replace(outcome, report=report), plan)
        return experiences, len(prompts), exhausted and not book.open_group_ids()

    # -- tail batching (a straggler policy that over-provisions and re-runs its slowest groups) -----------------
    def _prompt_stream(self, dataloader_iter):
        """Every prompt of OpenRLHF's dataloader, one at a time (none of a batch dropped), as an id."""
        for _, prompts, labels, images in dataloader_iter:
            for prompt, label, image in zip(prompts, labels, images, strict=True):
                k = self._tail_drawn
                self._tail_drawn += 1
                self.tail_prompts[k] = (prompt, label, image)
                yield k

    def _generate_tail_round(self, dataloader_iter, b: int, **kw: Any) -> tuple[list, int, bool]:
        """One round of tail batching (``tail-batch``, RollPacker-style, on-policy), the SDK's ``TailRounds``
        drawing prompts from OpenRLHF's dataloader: a short round starts (1 + over_provision) x B groups and
        ends once B are complete; the others are aborted, their tokens dropped, their prompts deferred. Once B are
        deferred, a long round runs them, and only them, to the end. When the dataloader runs dry the deferred
        prompts fill the rounds and the last one trains what is left, so every prompt trains exactly once and no
        token from older weights reaches training. Returns (experiences, prompts taken from the dataloader,
        exhausted: the dataloader is dry and nothing is deferred)."""
        if self.tail is None or dataloader_iter is not self._tail_source:
            # a new epoch (the last one's rounds are done) or a resumed run: what was drawn and not trained stays
            left = self._tail_pending + ([] if self.tail is None else [*self.tail.deferred, *self.tail.fresh])
            self._tail_pending = []
            self.tail = TailRounds(b, self._prompt_stream(dataloader_iter), deferred=left)
            self._tail_source = dataloader_iter
        rounds, drawn = self.tail, self._tail_drawn
        if rounds.done():
            return [], 0, True
        rnd = rounds.next(self.planner.over_provision(self.step, []))
        metas = [self.tail_prompts[k] for k in rnd.prompts]
        experiences = self.generate_step(
            [m[0] for m in metas],
            [m[1] for m in metas],
            images=[m[2] for m in metas],
            train=None if rnd.long else rnd.train,
            deferred=len(rounds.deferred) + len(rnd.prompts) - rnd.train,  # after this round
            **kw,
        )
        trained = [rnd.prompts[i] for i in self.last_trained_groups]
        rounds.settle(trained)
        for k in trained:
            del self.tail_prompts[k]
        exhausted = rounds.done()  # may draw the next prompt, to see whether the dataloader is dry
        return experiences, self._tail_drawn - drawn, exhausted

    def generate_step(
        self,
        prompts: list[str],
        labels: list[Any],
        *,
        images: list | None = None,
        train: int | None = None,
        deferred: int | None = None,
        **kw: Any,
    ) -> list:
        """Generate every sample of ``prompts`` under the plan; experiences grouped by prompt, in order.

        ``train`` (tail batching's short round): the step ends once that many groups are complete; the others are
        aborted (their tokens dropped) and only the first ``train`` to complete (ties in batch order) make
        experiences, enter the length history and the trace. ``last_trained_groups`` names them (batch
        positions, in order); ``deferred`` (a tail-batching round) is what the step report says waits to be re-run."""
        t_start = time.time()
        n = int(kw.get("n_samples_per_prompt", self.args.rollout.n_samples_per_prompt))
        token_ids, batch = self._prompt_batch(prompts, n)
        uids = batch.uids
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
        controller = StepController(self.planner, backend, batch, plan, step=self.step, history_uids=history)
        cut = train is not None and train < len(prompts)
        completed: dict[int, int] = {}  # group -> completion rank (groups seen complete at one poll tie)

        def stop(ctl: StepController) -> bool:
            note_completed(completed, ctl.done_prompts())
            return len(completed) >= train

        outcome = controller.run(observe=not cut, stop=_ending(backend, stop) if cut else None)
        rows = list(range(len(prompts)))
        if cut:
            stop(controller)  # groups that completed in the last poll
            backend.collect_carried()  # the aborted samples' calls return; their tokens are dropped
            done_at = np.array([completed.get(g, math.inf) for g in rows], dtype=np.float64)
            rows = first_done(done_at, train, False)[0].tolist()
            self.planner.observe([outcome.samples[sid] for g in rows for sid in range(g * n, (g + 1) * n)])
        if deferred is not None:  # a tail-batching round: the report counts what trains
            trained = [outcome.samples[sid] for g in rows for sid in range(g * n, (g + 1) * n)]
            fields = round_fields(trained, len(rows), deferred, cut)
            outcome = replace(outcome, report=outcome.report.model_copy(update=fields))
        experiences = [
            self._process_response_into_experience(outcome.outputs[sid], **kw)
            for g in rows
            for sid in range(g * n, (g + 1) * n)
        ]
        self.last_cuts = backend.cut_log  # (sample in batch order, engine, CutSample): what each cut kept
        self.last_trained_groups = rows
        self._write_trace(outcome, uids, token_ids, n, rows=rows)
        self._finish_step(outcome, plan)
        return experiences

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
            base, k = prompt_uid(p), 0
            while (uid := base if k == 0 else f"{base}#{k}") in taken:
                k += 1
            taken.add(uid)
            uids.append(uid)
        lengths = np.array([len(t) for t in token_ids], dtype=np.int64)
        batch = PromptBatch(
            uids=uids,
            prompt_lengths=lengths,
            n_samples=np.full(len(prompts), n, dtype=np.int64),
            token_flat=np.fromiter((t for ids in token_ids for t in ids), dtype=np.int64, count=int(lengths.sum())),
        )
        return token_ids, batch

    def _begin_step(self, live: list[int]) -> None:
        """Fresh per-step stats on every live engine, and every one awake. OpenRLHF wakes all engines before a
        step (``--vllm.enable_sleep``) and sleeps them after; RLHFless never sleeps one in between, since under
        ``--train.colocate_all`` (which OpenRLHF's sleep mode is for) the memory it would free has no other user
        during rollout. An engine found asleep (e.g. a step run outside OpenRLHF's loop) is woken before any work
        reaches it. Engines outside the scaler's active subset simply get no work this step."""
        refs = {e: self.vllm_engines[e].rl_begin_step.remote() for e in live}
        for e, ref in refs.items():
            try:
                awake = ray.get(ref)
            except _DEAD as exc:
                self._mark_dead(e, exc)
                continue
            if not awake:
                log.info("rollout engine %d was asleep at the start of step %d; waking it", e, self.step)
                self._call(e, "wake_up")

    def dead_engine_error(self) -> str | None:
        """Why the run cannot go on after a rollout engine died, or None if none did."""
        if not self.dead:
            return None
        names = ", ".join(str(e) for e in sorted(self.dead))
        return (
            f"rlhfless: rollout engine(s) {names} died during step {self.step - 1}; the step's samples were "
            "regenerated on the other engines, but OpenRLHF's weight broadcast spans every engine over one NCCL "
            "group and would hang, so the run stops here, before training on the step. Resume from the last "
            "checkpoint with --ckpt.load_enable (--ckpt.save_steps 1 keeps at most one step at risk)."
        )

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
    def _write_trace(
        self, outcome: StepOutcome, uids: list[str], token_ids: list[list[int]], n: int, rows: list[int] | None = None
    ) -> None:
        """Append the step's samples (of the groups ``rows``, default all) to the trace."""
        keep = range(len(uids)) if rows is None else rows  # tail batching: only the groups that trained
        self._trace_groups(
            (uids[i], token_ids[i], [outcome.samples[sid].response_length for sid in range(i * n, (i + 1) * n)])
            for i in keep
        )

    def _trace_groups(self, groups: Any) -> None:
        """Append groups (uid, prompt token ids, each sample's response length) as trained in this step to the
        trace, in the JSON-lines format ``rlhfless simulate --trace`` reads: the prompt's uid (stable across
        epochs; a prompt repeated within a batch gets ``#k``), the step, the sample index, prompt and response
        lengths, and the prompt's token ids (so a replay deduplicates prefixes). A replay's step is the groups
        that trained in it, each sample at its full length (a carried sample's pieces summed)."""
        if self.trace_path is None:
            return
        self.trace_path.parent.mkdir(parents=True, exist_ok=True)
        with self.trace_path.open("a", encoding="utf-8") as fh:
            for uid, prompt, lengths in groups:
                for k, length in enumerate(lengths):
                    row = {
                        "uid": uid,
                        "step": self.step,
                        "sample_idx": k,
                        "prompt_length": len(prompt),
                        "response_length": int(length),
                        "prompt": list(prompt),
                    }
                    fh.write(json.dumps(row) + "\n")

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
            "rlhfless/engines_idle": float(len(self.vllm_engines) - len(self.dead) - plan.num_actors),
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


def _ending(backend: RayBackend, rule: Any) -> Any:
    """The end rule ``rule`` for ``StepController.run(stop=...)``, telling ``backend`` when it fires: the controller
    then cuts every running sample, which the backend does in one round."""

    def stop(ctl: StepController) -> bool:
        if rule(ctl):
            backend.ending = True
            return True
        return False

    return stop


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
