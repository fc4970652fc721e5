"""OpenRLHF's vLLM engines as a rollout backend of the SDK's step controller, over Ray.

``EnginePool`` holds the engines a run has (OpenRLHF creates them once): their Ray handles, the ones that died,
one call with a death handled, and the start of a step (fresh stats, every engine awake). ``RayBackend`` is what
the step controller drives for one step: it starts, cuts (one at a time for a migration, all at once at a step's
end), continues and polls work on the pool's engines, and bills the step from each engine's stats. It knows
nothing of OpenRLHF's trainer: the samples generator (``generator.py``) builds its requests and reads its results.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
from rlhfless_openrlhf.messages import CARRIED, Continuation, CutSample, EngineStats
from vllm import SamplingParams

from rlhfless_sdk.api.records import StepPlan
from rlhfless_sdk.rollout.billing import EngineUsage, StepUsage
from rlhfless_sdk.rollout.controller import EngineStatus, Finished, Lost, Poll

log = logging.getLogger("rlhfless.openrlhf")

_DEAD = (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError)
#: What an engine call raises when the engine is gone: its actor died, or (a ``RayTaskError`` that ``engine_lost``
#: tells from a bug) vLLM's EngineCore died under a live actor (CUDA OOM, a GPU fault).
ENGINE_ERRORS = (*_DEAD, ray.exceptions.RayTaskError)


def engine_lost(exc: BaseException) -> bool:
    """Whether an engine call failed because the engine is gone (its actor, or its EngineCore under a live actor),
    not because of a bug, which must surface."""
    return isinstance(exc, _DEAD) or (isinstance(exc, ray.exceptions.RayTaskError) and _engine_dead(exc))


class RolloutEngineLost(RuntimeError):
    """A rollout engine died: the run cannot go on (OpenRLHF's weight broadcast would hang)."""


class EnginePool:
    """The run's rollout engines (Ray handles of RLHFless's engine class), the ones that died, and calls to them."""

    def __init__(self, handles: list) -> None:
        self.handles = handles
        self.dead: set[int] = set()
        # the stream's fill engines once stopped, dead or alive: no more work, and outside OpenRLHF's broadcast
        self.retired: set[int] = set()
        self.drafting = False  # the engines run a drafter: finished responses feed its history
        self.history: list[tuple[list[int], list[int]]] = []  # finished (prompt, response) not yet shared
        self._lock = threading.Lock()
        self.told: list = []  # calls sending a finished sample to the engines running its siblings, not yet answered

    def finished(self, response: dict[str, Any], siblings_on: Sequence[int] = ()) -> None:
        """A finished sample's response (OpenRLHF's dict): kept for the drafters' history when they run, and sent
        at once to the drafters of ``siblings_on``, the engines running its group's other samples (the stream
        splits a group across engines; each engine holds the finished siblings it ran itself)."""
        if not self.drafting:
            return
        tokens, ranges = response.get("observation_tokens"), response.get("action_ranges")
        if not (tokens and ranges):
            return
        start, end = ranges[0][0], ranges[-1][1]
        prompt, made = list(tokens[:start]), list(tokens[start:end])
        with self._lock:  # the stream's feeder thread calls this; its generator's thread shares the history
            self.history.append((prompt, made))
        if siblings_on:
            self._reap_told()
            payload = ray.put([(prompt, [made])])  # once, not once per engine
            refs = [self.handles[e].rl_drafter_siblings.remote(payload) for e in siblings_on]
            with self._lock:
                self.told += refs

    def _reap_told(self, wait: bool = False) -> None:
        """Drop the answered calls of ``finished``'s sends (all of them, waited for, with ``wait``). A sibling is
        only a hint to a drafter: one that failed is said, never raised; an engine lost meanwhile is left to the
        calls that mark it dead."""
        with self._lock:
            refs, self.told = self.told, []
        if not refs:
            return
        done, left = ray.wait(refs, num_returns=len(refs), timeout=None if wait else 0)
        with self._lock:
            self.told += left
        for ref in done:
            try:
                ray.get(ref)
            except ENGINE_ERRORS as exc:  # a lost engine is marked dead by the calls that need it
                if not engine_lost(exc):
                    log.warning("rlhfless: a finished sibling did not reach an engine's drafter (%s)", exc)

    def share_history(self) -> None:
        """Every finished response since the last call, grouped by prompt, to every live engine's drafter (so a
        prompt's history reaches whichever engine runs it next), after the finished siblings sent before it."""
        self._reap_told(wait=True)
        with self._lock:
            history, self.history = self.history, []
        if not history:
            return
        groups: dict[tuple[int, ...], list[list[int]]] = {}
        for prompt, response in history:
            groups.setdefault(tuple(prompt), []).append(response)
        payload = ray.put([(list(p), rs) for p, rs in groups.items()])  # once, not once per engine
        self.gather("rl_drafter_observe", self.live(), payload)

    def gather(self, method: str, engines: Sequence[int], *args: Any) -> dict[int, Any]:
        """``method(*args)`` on each of ``engines`` at once, each one's answer; an engine lost meanwhile is marked
        dead and left out."""
        refs = {e: getattr(self.handles[e], method).remote(*args) for e in engines}
        out: dict[int, Any] = {}
        for e, ref in refs.items():
            try:
                out[e] = ray.get(ref)
            except ENGINE_ERRORS as exc:
                if not engine_lost(exc):
                    raise
                self.mark_dead(e, exc)
        return out

    def live(self) -> list[int]:
        """Engines that can take work, in order."""
        return [e for e in range(len(self.handles)) if e not in self.dead and e not in self.retired]

    def call(self, engine: int, method: str, *args: Any) -> Any:
        """``method(*args)`` on ``engine``, waited for; None if the engine died (it is marked dead)."""
        try:
            return ray.get(getattr(self.handles[engine], method).remote(*args))
        except ENGINE_ERRORS as exc:
            if not engine_lost(exc):
                raise
            self.mark_dead(engine, exc)
            return None

    def mark_dead(self, engine: int, exc: BaseException | str) -> None:
        if engine not in self.dead:
            self.dead.add(engine)
            why = exc if isinstance(exc, str) else type(exc).__name__
            log.warning(
                "rollout engine %d died (%s); no more work goes to it, and what it held is regenerated elsewhere",
                engine,
                why,
            )

    def stats(self, engines: Sequence[int]) -> dict[int, EngineStats]:
        """Each of ``engines``' stats, asked of all at once; a dead one (its actor, or its vLLM EngineCore under a
        live actor: the actor still answers, from its client-side state) is marked and left out."""
        out: dict[int, EngineStats] = {}
        for e, st in self.gather("rl_stats", engines).items():
            if st.engine_alive:
                out[e] = st
            else:
                self.mark_dead(e, "its vLLM EngineCore died")
        return out

    def begin_step(self, live: list[int]) -> None:
        """Fresh per-step stats on every live engine, and every one awake. OpenRLHF wakes all engines before a
        step (``--vllm.enable_sleep``) and sleeps them after; RLHFless never sleeps one in between, since under
        ``--train.colocate_all`` (which OpenRLHF's sleep mode is for) the memory it would free has no other user
        during rollout. An engine found asleep (e.g. a step run outside OpenRLHF's loop) is woken before any work
        reaches it; an engine only paused (OpenRLHF's keep-pause around a partial-rollout broadcast) is left as it
        is. Engines outside the scaler's active subset simply get no work this step."""
        self.share_history()
        for e, awake in self.gather("rl_begin_step", live, self.drafting).items():
            if not awake:
                log.info("rollout engine %d was asleep at the start of a step; waking it", e)
                self.call(e, "wake_up")

    def dead_engine_error(self, step: int) -> str | None:
        """Why the run cannot go on after a rollout engine died in ``step``, or None if none did (a fill engine
        dying is not a reason: OpenRLHF's broadcast never reaches one)."""
        dead = self.dead - self.retired
        if not dead:
            return None
        names = ", ".join(str(e) for e in sorted(dead))
        return (
            f"rlhfless: rollout engine(s) {names} died during step {step}; the step's samples were "
            "regenerated on the other engines, but OpenRLHF's weight broadcast spans every engine over one NCCL "
            "group and would hang, so the run stops here, before training on the step. Resume from the last "
            "checkpoint with --ckpt.load_enable (--ckpt.save_steps 1 keeps at most one step at risk)."
        )


@dataclass(frozen=True)
class BackendSettings:
    """What a step's backend needs of the generator: the tokenizer its engines decode with (a ``SharedTokenizer``:
    put in Ray's object store once, not pickled into every call), whether the dedup
    prefill is applied (vLLM's prefix cache on), how often it polls, how long a step's end waits for carried
    samples, the GPUs each engine holds and how many sequences it runs at once."""

    tokenizer: Any
    prefix_caching: bool
    check_interval_s: float
    carry_timeout_s: float
    gpus_per_engine: int
    max_num_seqs: int
    kv_capacity_tokens: int = 0  # tokens one engine's KV holds, as the profile models it (0: not known)


@dataclass
class EngineRequest:
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
    forced: dict[int, int] = field(default_factory=dict)  # sample -> the length it stops at (length replay)


class _Call:
    """Some samples of one prompt, dispatched to one engine in one Ray call, each under its own work key."""

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

    def __init__(
        self, pool: EnginePool, req: EngineRequest, plan: StepPlan, t_start: float, settings: BackendSettings
    ) -> None:
        self.pool, self.req, self.plan, self.t_start, self.settings = pool, req, plan, t_start, settings
        self.max_num_seqs = settings.max_num_seqs
        self.kv_capacity_tokens = settings.kv_capacity_tokens
        self.max_tokens = int(req.params.max_tokens or req.max_length)
        self.sid = {key: sid for sid, key in enumerate(req.keys)}
        self.pending: dict[Any, _Call] = {}
        self.seq = [0] * len(req.keys)  # pieces issued per sample: keys are never reused within a step
        self.root: list[str | None] = [None] * len(req.keys)  # key of the current attempt's first piece
        self.now_key: list[str | None] = [None] * len(req.keys)  # key of the piece running now
        self.chain: list[list[_Link]] = [[] for _ in req.keys]
        self.continuations: dict[Any, tuple[int, int]] = {}  # ref -> (sample, link index)
        self.cut_log: list[tuple[int, int, CutSample]] = []  # every cut of the step: (sample, engine, what it kept)
        self.carried: set[int] = set()  # samples cut at the step's end, their tokens kept for a later step
        self.carried_out: dict[int, dict[str, Any]] = {}  # sample -> its engine's response with what it has
        self.engine_of: list[int] = [-1] * len(req.keys)  # the engine running the sample's piece ``now_key``
        self.started = False

    @property
    def handles(self) -> list:
        return self.pool.handles

    def engines(self) -> list[int]:
        return self.pool.live()

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
            self.pool.begin_step(self.engines())
            self._warm(samples, engines)
        calls: dict[tuple[int, int], _Call] = {}
        for sid, e in zip(samples, engines, strict=True):
            i = self.req.prompt_of[sid]
            call = calls.setdefault((i, e), _Call(i, [], e))
            call.samples.append(sid)
            self.chain[sid] = []
            key = self._new_key(sid)
            self.root[sid] = key
            self.engine_of[sid] = e
            call.keys.append(key)
        for call in calls.values():
            self._dispatch(call)

    def _warm(self, samples: Sequence[int], engines: Sequence[int]) -> None:
        """Deduplicated prefill: each engine prefills its prompts' shared prefixes once (prefix caching on)."""
        pf = self.plan.prefill
        if not pf.prompt_group or not self.settings.prefix_caching:
            return
        prefix_len = np.asarray(pf.group_prefix_tokens)[np.asarray(pf.prompt_group)]
        per_engine: dict[int, dict[tuple, list[int]]] = defaultdict(dict)
        for sid, e in zip(samples, engines, strict=True):
            i = self.req.prompt_of[sid]
            pre = self.req.token_ids[i][: int(prefix_len[i])]
            per_engine[e][tuple(pre)] = pre
        refs = [self.handles[e].warm_prefixes.remote(list(p.values()), self.req.params) for e, p in per_engine.items()]
        ray.get(refs)

    def _dispatch(self, call: _Call) -> None:
        r, i = self.req, call.prompt_index
        call.ref = self.handles[call.engine].generate_group.remote(
            prompt=r.prompts[i],
            label=r.labels[i],
            sampling_params=r.params,
            max_length=r.max_length,
            hf_tokenizer=self.settings.tokenizer,
            keys=call.keys,
            images=r.images[i],
            carried={k: r.prefix[s] for s, k in zip(call.samples, call.keys, strict=True) if s in r.prefix} or None,
            forced={k: r.forced[s] for s, k in zip(call.samples, call.keys, strict=True) if s in r.forced} or None,
        )
        self.pending[call.ref] = call

    # -- poll ------------------------------------------------------------------------------------------------
    def _returned(self, ref: Any) -> tuple[_Call, list[dict[str, Any]] | None]:
        """A dispatched call that came back: the call and the responses, or None if its engine died."""
        call = self.pending.pop(ref)
        try:
            return call, ray.get(ref)
        except ENGINE_ERRORS as exc:
            if not engine_lost(exc):
                raise
            self.pool.mark_dead(call.engine, exc)
            return call, None

    def poll(self) -> Poll:
        out = Poll()
        if self.pending:
            ready, _ = ray.wait(
                list(self.pending), num_returns=len(self.pending), timeout=self.settings.check_interval_s
            )
            for ref in ready:
                call, results = self._returned(ref)
                if results is None:
                    out.dead_engines.append(call.engine)
                    for sid, key in zip(call.samples, call.keys, strict=True):
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
                    self.pool.finished(resp)
                    reason = "length" if resp.get("truncated") else "stop"
                    had = len(self.req.prefix[sid][0]) if sid in self.req.prefix else 0
                    made = _response_length(resp) - had  # this step's tokens (a carried sample had some before)
                    out.finished.append(Finished(sid, made, output=resp, finish_reason=reason))
        else:  # every call returned, so every sample finished or was reported lost and re-dispatched
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
                self.pool.mark_dead(chain[depth].cont_engine, exc)
                del chain[depth + 1 :]
                chain[depth].cont, self.now_key[sid] = None, None
                out.lost.append(Lost(sid, chain[depth].kept))

    # -- progress, cut, continue -----------------------------------------------------------------------------
    def progress(self) -> dict[int, EngineStatus]:
        live = sorted({p.engine for p in self.pending.values()} | set(self.engines()))
        status = {}
        for e, st in self.pool.stats(live).items():
            running = {}
            for key, tokens in st.progress.items():
                sid = self._sample_of(key)
                if self.now_key[sid] == key:  # a piece orphaned by an engine death is not the sample's
                    running[sid] = self._kept(sid) + tokens
            status[e] = EngineStatus(st.generated_tokens + sum(st.progress.values()), running)
        return status

    def cut(self, engine: int, sample: int) -> int | None:
        key = self.now_key[sample]
        info = None if key is None else self.pool.call(engine, "cut", key)
        return self._kept_after(sample, engine, key, info)

    def cut_all(self, running: Sequence[tuple[int, int]]) -> list[int | None]:
        """The step ends: cut every (engine, sample) of ``running`` in one round: each engine gets all its cuts at
        once and one ``ray.get`` waits for them all (not one round trip per sample). A cut that comes back empty
        (the sample finished before it landed, or its engine died) is None."""
        work = [(self.engine_of[sid], sid, self.now_key[sid]) for _e, sid in running]
        calls = [(e, sid, key, self.handles[e].cut.remote(key)) for e, sid, key in work if key is not None]
        try:
            infos = dict(zip([sid for _e, sid, _k, _r in calls], ray.get([r for *_x, r in calls]), strict=True))
        except ENGINE_ERRORS as exc:  # an engine died: its cuts come back empty, the others' as they are
            if not engine_lost(exc):
                raise
            infos = {}
            for e, sid, _key, ref in calls:
                try:
                    infos[sid] = ray.get(ref)
                except ENGINE_ERRORS as exc2:
                    if not engine_lost(exc2):
                        raise
                    self.pool.mark_dead(e, exc2)
                    infos[sid] = None
        return [self._kept_after(sid, e, key, infos.get(sid)) for e, sid, key in work]

    def _kept_after(self, sample: int, engine: int, key: str | None, info: CutSample | None) -> int | None:
        """Record a cut of ``sample`` on ``engine`` (its piece ``key``); the response tokens it kept, or None if
        there was nothing to cut."""
        if info is None or key is None:
            return None  # it finished before the cut landed (or the engine died)
        first = self.chain[sample][0].cut if self.chain[sample] else info
        kept = len(info.prompt_token_ids) + len(info.partial) - len(first.prompt_token_ids)
        self.chain[sample].append(_Link(engine, key, info, kept))
        self.cut_log.append((sample, engine, info))
        self.now_key[sample] = None
        return kept

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
        timeout_s = self.settings.carry_timeout_s if timeout_s is None else timeout_s
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
                _call, results = self._returned(ref)
                for resp in results or ():  # None: its engine died, the carried samples start over
                    sid = self._sample_of(resp["rlhfless_key"])
                    if sid not in self.carried:
                        raise RuntimeError(f"rollout backend: sample {sid} came back after its step ended (a bug)")
                    self.carried_out[sid] = resp

    def now(self) -> float:
        return time.time() - self.t_start

    def usage(self) -> StepUsage:
        stats = self.pool.stats(self.engines())
        usage = step_usage(time.time() - self.t_start, stats, len(self.handles), self.settings.gpus_per_engine)
        usage.plan_s = self.plan.planner_ms / 1000.0  # in the step's time since its start, as in the simulator
        return usage


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


def _response_length(response: dict[str, Any]) -> int:
    return int(sum(end - start for start, end in response["action_ranges"]))


def _engine_dead(exc: BaseException) -> bool:
    """vLLM's engine process died under a live Ray actor: treat it as a dead engine."""
    text = repr(exc)
    return "EngineDeadError" in text or ("EngineCore" in text and "died" in text)
