"""RLHFless's rollout engine: OpenRLHF's ``RolloutRayActor`` plus what a scheduler needs from a vLLM engine.

It adds, without changing how OpenRLHF calls it:
- ``generate_group``: the n samples of one prompt (or a planner-chosen subset), each under a sample key, so
  the engine can report per-sample progress and cut one sample without touching the others;
- ``cut`` / ``continue_sample`` / ``deliver``: cut-and-migrate by tokens. The cut request is aborted in vLLM,
  its partial tokens (and logprobs) are handed back; another engine continues from prompt + partial tokens
  with the remaining budget; the continuation is delivered to the first engine, whose pending ``generate``
  returns the stitched output, so OpenRLHF's executor builds the same response dict as for any sample and the
  group stays together and in order;
- ``warm_prefixes``: prefill shared prefixes once (prefix caching on) before the batch;
- ``rl_stats``: per-sample progress, busy time, first/last token times and vLLM's own cached-token counts.

Ray forbids subclassing a remote class, so this subclasses the plain class behind it and is made remote here.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
import uuid
from copy import deepcopy
from types import SimpleNamespace
from typing import Any

import ray
from openrlhf.trainer.ray.vllm_engine import RolloutRayActor
from rlhfless_openrlhf.messages import Continuation, CutSample, EngineStats
from vllm.inputs import TokensPrompt

_SAMPLE_KEY: contextvars.ContextVar[str | None] = contextvars.ContextVar("rlhfless_sample_key", default=None)


class RlhflessRolloutActorImpl(RolloutRayActor.__ray_actor_class__):  # type: ignore[name-defined,misc]
    async def __init__(self, *args: Any, **kwargs: Any) -> None:
        await super().__init__(*args, **kwargs)
        self._rl_request: dict[str, str] = {}
        self._rl_progress: dict[str, int] = {}
        self._rl_cut: dict[str, asyncio.Future] = {}
        self._rl_partial: dict[str, asyncio.Future] = {}
        self._rl_inflight = 0
        self._rl_busy = 0.0
        self._rl_busy_since: float | None = None
        self._rl_first: float | None = None
        self._rl_last: float | None = None
        self._rl_prompt_tokens = 0
        self._rl_cached_tokens = 0
        self._rl_generated = 0

    # -- accounting --------------------------------------------------------------------------------------
    def _start(self) -> None:
        now = time.time()
        if self._rl_inflight == 0:
            self._rl_busy_since = now
        if self._rl_first is None:
            self._rl_first = now
        self._rl_inflight += 1

    def _stop(self) -> None:
        self._rl_inflight -= 1
        now = time.time()
        self._rl_last = now
        if self._rl_inflight == 0 and self._rl_busy_since is not None:
            self._rl_busy += now - self._rl_busy_since
            self._rl_busy_since = None

    async def _run(self, prompt_token_ids: list[int], params: Any, key: str | None, mm: Any = None) -> Any:
        request_id = f"rlhfless-{key or 'x'}-{uuid.uuid4().hex[:12]}"
        prompt = TokensPrompt(prompt_token_ids=prompt_token_ids)
        if mm:
            prompt["multi_modal_data"] = mm
        if key is not None:
            self._rl_request[key] = request_id
            self._rl_progress[key] = 0
        self._start()
        final = None
        try:
            async for out in self.llm.generate(prompt, deepcopy(params), request_id=request_id):
                final = out
                if key is not None:
                    self._rl_progress[key] = len(out.outputs[0].token_ids)
        finally:
            self._stop()
        if final is not None:
            self._rl_prompt_tokens += len(prompt_token_ids)
            self._rl_cached_tokens += int(getattr(final, "num_cached_tokens", 0) or 0)
            self._rl_generated += len(final.outputs[0].token_ids)
        return final

    # -- OpenRLHF's entry point, keyed ----------------------------------------------------------------------
    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):  # type: ignore[override]
        key = _SAMPLE_KEY.get()
        if key is None:
            return await super().generate(prompt_token_ids, sampling_params, multi_modal_data)
        final = await self._run(prompt_token_ids, sampling_params, key, multi_modal_data)
        out = final.outputs[0]
        cut = self._rl_cut.get(key)
        if cut is None or out.finish_reason != "abort":
            self._rl_progress.pop(key, None)
            if key in self._rl_partial and not self._rl_partial[key].done():
                self._rl_partial[key].set_result(None)  # it finished before the cut landed
            return final
        # Cut: hand the partial tokens to the controller, wait for the continuation, stitch.
        partial = list(out.token_ids)
        budget = (sampling_params.max_tokens or 0) - len(partial)
        self._rl_partial[key].set_result(
            CutSample(
                prompt_token_ids=list(prompt_token_ids),
                partial=partial,
                partial_logprobs=None if out.logprobs is None else list(out.logprobs),
                remaining=max(budget, 0),
                sampling_params=sampling_params,
            )
        )
        cont: Continuation = await cut
        self._rl_cut.pop(key, None)
        self._rl_partial.pop(key, None)
        self._rl_progress.pop(key, None)
        logprobs = None
        if out.logprobs is not None and cont.logprobs is not None:
            logprobs = list(out.logprobs) + list(cont.logprobs)
        stitched = SimpleNamespace(
            token_ids=partial + list(cont.token_ids),
            text="",
            finish_reason=cont.finish_reason,
            logprobs=logprobs,
        )
        return SimpleNamespace(outputs=[stitched], prompt_token_ids=list(prompt_token_ids), migrated=True)

    async def generate_group(
        self,
        prompt: str,
        label: Any,
        sampling_params: Any,
        max_length: int,
        hf_tokenizer: Any,
        keys: list[str],
        images: Any = None,
    ) -> list[dict[str, Any]]:
        """Like ``generate_responses``, one sample per key, results in key order."""

        async def one(key: str) -> dict[str, Any]:
            _SAMPLE_KEY.set(key)  # each gather task runs in its own copy of the context
            response = await self.executor.execute(
                prompt=prompt,
                label=label,
                sampling_params=sampling_params,
                max_length=max_length,
                hf_tokenizer=hf_tokenizer,
                llm_engine=self,
                images=images,
            )
            response["rlhfless_key"] = key
            return response

        return list(await asyncio.gather(*(one(k) for k in keys)))

    # -- cut-and-migrate -------------------------------------------------------------------------------------
    async def cut(self, key: str) -> CutSample | None:
        """Abort sample ``key``; its prompt, partial tokens and remaining budget, or None if it already ended."""
        request_id = self._rl_request.get(key)
        if request_id is None or key not in self._rl_progress:
            return None
        loop = asyncio.get_running_loop()
        self._rl_cut[key] = loop.create_future()
        self._rl_partial[key] = loop.create_future()
        await self.llm.abort(request_id)
        info = await self._rl_partial[key]
        if info is None:
            self._rl_cut.pop(key, None)
            self._rl_partial.pop(key, None)
        return info

    async def continue_sample(self, prompt_token_ids: list[int], sampling_params: Any, remaining: int) -> Continuation:
        """Generate the rest of a migrated sample: ``remaining`` more tokens after ``prompt_token_ids``."""
        params = deepcopy(sampling_params)
        params.max_tokens = max(int(remaining), 1)
        params.min_tokens = min(getattr(params, "min_tokens", 0) or 0, params.max_tokens)
        final = await self._run(prompt_token_ids, params, None)
        out = final.outputs[0]
        return Continuation(
            token_ids=list(out.token_ids),
            logprobs=None if out.logprobs is None else list(out.logprobs),
            finish_reason=out.finish_reason,
        )

    async def deliver(self, key: str, continuation: Continuation) -> bool:
        fut = self._rl_cut.get(key)
        if fut is None or fut.done():
            return False
        fut.set_result(continuation)
        return True

    async def fail_cut(self, key: str, message: str) -> None:
        """The continuation could not be produced: let the cut sample return what it had (marked truncated)."""
        fut = self._rl_cut.get(key)
        if fut is not None and not fut.done():
            fut.set_result(Continuation(token_ids=[], logprobs=None, finish_reason="length", error=message))

    # -- prefixes and stats ------------------------------------------------------------------------------------
    async def warm_prefixes(self, prefixes: list[list[int]], sampling_params: Any) -> int:
        """Prefill each shared prefix once, so the batch's requests hit the prefix cache; returns tokens."""
        params = deepcopy(sampling_params)
        params.max_tokens, params.min_tokens, params.logprobs = 1, 0, None
        await asyncio.gather(*(self._run(list(p), params, None) for p in prefixes if p))
        return sum(len(p) for p in prefixes)

    def rl_stats(self) -> EngineStats:
        busy = self._rl_busy + (time.time() - self._rl_busy_since if self._rl_busy_since is not None else 0.0)
        return EngineStats(
            progress=dict(self._rl_progress),
            running=self._rl_inflight,
            busy_s=busy,
            first=self._rl_first,
            last=self._rl_last,
            prompt_tokens=self._rl_prompt_tokens,
            cached_tokens=self._rl_cached_tokens,
            generated_tokens=self._rl_generated,
        )

    def rl_reset_stats(self) -> None:
        self._rl_busy, self._rl_first, self._rl_last = 0.0, None, None
        self._rl_prompt_tokens = self._rl_cached_tokens = self._rl_generated = 0


RlhflessRolloutActor = ray.remote(RlhflessRolloutActorImpl)
