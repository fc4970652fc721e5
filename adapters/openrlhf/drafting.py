"""A drafter policy inside vLLM's engines: speculative decoding with ``custom_class`` (or a built-in method).

``speculative_config(ref)`` is what an engine is built with: ``None`` for ``none``, vLLM's own config for a drafter
with ``engine_method()`` (``ngram``), else ``EngineProposer``, which vLLM loads in each engine's worker. The
proposer builds the drafter from the ``RLHFLESS_DRAFTER`` environment variable (the policy reference as JSON,
set before the engine starts so its worker process inherits it). vLLM hands it, each step, every running row's
token ids; a row's prompt is found among the prompts it was told of (``expect``), its siblings are the other
rows of the same prompt, and finished groups reach the drafter through ``observe`` (both sent to the worker with
``collective_rpc``). vLLM's rejection sampler verifies every draft against the target model, so what is sampled,
and the logprobs returned, are the target's. A drafter that raises is switched off (no drafts) with a warning
naming it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

log = logging.getLogger("rlhfless.drafting")
ENV = "RLHFLESS_DRAFTER"
PROPOSER = "rlhfless_openrlhf.drafting.EngineProposer"


def _registry() -> Any:
    from rlhfless_sdk.api.plugins import get_plugin_manager

    return get_plugin_manager().registry


def speculative_config(ref: Any, device: str = "gpu") -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` for the drafter ``ref`` (a name or ``PolicyRef``) on engines of ``device``
    (``gpu`` or ``cpu``); sets ``RLHFLESS_DRAFTER`` for the engines started after it. None for ``none``, and for a
    drafter that does not draft on ``device`` (``drafts_on``)."""
    from rlhfless_sdk.api.config import PolicyRef
    from rlhfless_sdk.api.speculation import drafts_on

    ref = PolicyRef.model_validate(ref)
    if ref.name == "none":
        os.environ.pop(ENV, None)
        return None
    drafter = _registry().create("drafter", ref)
    if not drafts_on(drafter, device):
        log.info(
            "rlhfless: drafter %r drafts nothing on %s engines; they run without speculative decoding", ref.name, device
        )
        os.environ.pop(ENV, None)
        return None
    method = getattr(drafter, "engine_method", None)
    if callable(method):
        return dict(method())
    os.environ[ENV] = json.dumps(ref.model_dump())
    most = max(int(drafter.draft_tokens(1, None)), 1)
    return {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": most}


class EngineProposer:
    """vLLM's ``custom_class`` proposer running an RLHFless drafter in an engine's worker."""

    def __init__(self, vllm_config: Any) -> None:
        from rlhfless_sdk.api.config import PolicyRef

        raw = os.environ.get(ENV)
        if not raw:
            raise RuntimeError(f"{PROPOSER}: {ENV} is not set; build the engine with speculative_config(ref)")
        self.ref = PolicyRef.model_validate(json.loads(raw))
        self.drafter = _registry().create("drafter", self.ref)
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        self.prompts: dict[int, dict[bytes, list[int]]] = {}  # prompt length -> key -> tokens
        self._rows: dict[int, tuple[bytes, list[int]]] = {}  # row -> its prompt's key and tokens, last step
        self.failed: str | None = None
        self.active = True  # off: no drafts (plain decoding steps), e.g. for a scheduler that runs without it
        # steps: a running row's decode (or verification) steps; tokens: what they sampled (1 + the accepted drafts)
        self.stats = {"steps": 0, "tokens": 0, "drafts": 0, "drafted_tokens": 0}

    def activate(self, on: bool) -> None:
        self.active = bool(on)

    def load_model(self, *args: Any, **kwargs: Any) -> None:  # vLLM's CPU runner calls it; nothing to load
        return None

    # -- fed by the step core -------------------------------------------------------------------------------
    def expect(self, prompts: Sequence[Sequence[int]]) -> None:
        """Prompts that may run next (a row's prompt is found among them)."""
        from rlhfless_policies.drafters import prompt_key

        for p in prompts:
            toks = [int(t) for t in p]
            self.prompts.setdefault(len(toks), {})[prompt_key(toks)] = toks

    def observe(self, groups: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]]) -> None:
        """Finished groups: (prompt token ids, the responses' token ids)."""
        if self.failed:
            return
        try:
            for prompt, responses in groups:
                self.drafter.observe(prompt, responses)
        except Exception as exc:
            self._fail("observe", exc)

    def _fail(self, where: str, exc: BaseException) -> None:
        self.failed = f"{type(exc).__name__}: {exc}"
        log.warning(
            "rlhfless: drafter %r raised in %s (%s); speculative decoding is off (drafter none) from here",
            self.ref.name,
            where,
            self.failed,
        )

    def _prompt_of(self, i: int, row: np.ndarray) -> list[int] | None:
        """Row ``i``'s prompt: the one it had last step if its tokens still start with it (one digest), else a
        search of the known prompts by length."""
        from rlhfless_policies.drafters import prompt_key

        cached = self._rows.get(i)
        if cached is not None and len(cached[1]) < row.size and prompt_key(row[: len(cached[1])]) == cached[0]:
            return cached[1]
        for length, known in self.prompts.items():
            if length < row.size:
                key = prompt_key(row[:length])
                hit = known.get(key)
                if hit is not None:
                    self._rows[i] = (key, hit)
                    return hit
        self._rows.pop(i, None)
        return None

    # -- vLLM's interface ---------------------------------------------------------------------------------------
    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
    ) -> list[list[int]]:
        rows = len(sampled_token_ids)
        out: list[list[int]] = [[] for _ in range(rows)]
        for sampled in sampled_token_ids:  # each row's last step sampled 1 token and the drafts it accepted
            if sampled:
                self.stats["steps"] += 1
                self.stats["tokens"] += len(sampled)
        if self.failed or not self.active:
            return out
        try:
            seqs = [token_ids_cpu[i, : int(num_tokens_no_spec[i])] for i in range(rows)]
            prompts = [self._prompt_of(i, s) if sampled_token_ids[i] else None for i, s in enumerate(seqs)]
            running = sum(1 for s in sampled_token_ids if s)
            by_prompt: dict[int, list[int]] = {}
            for i, p in enumerate(prompts):
                if p is not None:
                    by_prompt.setdefault(id(p), []).append(i)
            for i, p in enumerate(prompts):
                if p is None:
                    continue
                response = seqs[i][len(p) :]
                remaining = getattr(self.drafter, "predicted_remaining", lambda *_: None)(p, len(response))
                k = min(int(self.drafter.draft_tokens(running, remaining)), self.k)
                if k <= 0:
                    continue
                siblings = [seqs[j][len(p) :] for j in by_prompt[id(p)] if j != i]  # views, no copies
                draft = [int(t) for t in self.drafter.propose(p, response, k, siblings)][:k]
                out[i] = draft
                self.stats["drafts"] += bool(draft)
                self.stats["drafted_tokens"] += len(draft)
        except Exception as exc:
            self._fail("propose", exc)
            return [[] for _ in range(rows)]
        return out


def drafter_call(worker: Any, method: str, *args: Any) -> Any:
    """Run on each vLLM worker (``collective_rpc``): ``method`` of its ``EngineProposer``, if it has one."""
    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    if not isinstance(drafter, EngineProposer):
        return None
    if method == "stats":
        return {**drafter.stats, "failed": drafter.failed}
    return getattr(drafter, method)(*args)


def expect(llm: Any, prompts: Sequence[Sequence[int]]) -> None:
    """Tell a synchronous ``vllm.LLM``'s proposer the prompts it may run."""
    llm.collective_rpc(drafter_call, args=("expect", [list(map(int, p)) for p in prompts]))


def observe(llm: Any, groups: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]]) -> None:
    """Feed a synchronous ``vllm.LLM``'s proposer finished groups."""
    payload = [([int(t) for t in p], [[int(t) for t in r] for r in rs]) for p, rs in groups]
    llm.collective_rpc(drafter_call, args=("observe", payload))


def proposer_stats(llm: Any) -> dict[str, Any] | None:
    got = llm.collective_rpc(drafter_call, args=("stats",))
    return got[0] if got else None
