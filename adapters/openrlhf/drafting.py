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
from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

log = logging.getLogger("rlhfless.drafting")
ENV = "RLHFLESS_DRAFTER"
PROPOSER = "rlhfless_openrlhf.drafting.EngineProposer"


def _registry() -> Any:
    from rlhfless_sdk.api.plugins import get_plugin_manager

    return get_plugin_manager().registry


def speculative_config(ref: Any, device: str = "gpu", budget: Sequence[int] | None = None) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` for the drafter ``ref`` (a name or ``PolicyRef``) on engines of ``device``
    (``gpu`` or ``cpu``); sets ``RLHFLESS_DRAFTER`` for the engines started after it. None for ``none``, and for a
    drafter that does not draft on ``device`` (``drafts_on``). ``budget``: draft tokens a step at 1, 2, ...
    running sequences (the last entry beyond), priced by the launch; without it, the drafter's own."""
    from rlhfless_policies.drafters import batch_size_schedule

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
        config = dict(method())
        if budget is not None:  # vLLM's batch-size schedule, at most the drafter's own tokens
            config["num_speculative_tokens"] = max(max(budget), 1)
            config["num_speculative_tokens_per_batch_size"] = batch_size_schedule(budget)
        return config
    os.environ[ENV] = drafter_env(ref, budget)
    most = max(int(drafter.draft_tokens(1, None)), 1) if budget is None else max(max(budget), 1)
    return {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": most}


def drafter_env(ref: Any, budget: Sequence[int] | None = None) -> str:
    """What ``RLHFLESS_DRAFTER`` holds: the drafter's reference, and the launch's priced budget where there is one."""
    from rlhfless_sdk.api.config import PolicyRef

    raw = PolicyRef.model_validate(ref).model_dump(mode="json")
    return json.dumps(raw if budget is None else {**raw, "budget": [int(k) for k in budget]})


class PromptTable:
    """The prompts an engine's proposer may meet, within ``max_tokens`` tokens (the least recently told go first).
    A carried sample runs with its earlier tokens after its prompt: it is told as those tokens with the prompt's
    length, so a row is found by the tokens it starts with and grouped with its siblings by its prompt's own key."""

    def __init__(self, max_tokens: int = 4_000_000) -> None:
        self.max_tokens = max_tokens
        # told tokens' key -> (their length, the prompt's key, the prompt's tokens)
        self._known: OrderedDict[bytes, tuple[int, bytes, list[int]]] = OrderedDict()
        self._lengths: Counter[int] = Counter()  # how many told token lists have each length
        self._held = 0

    def __len__(self) -> int:
        return len(self._known)

    def add(self, tokens: Sequence[int], prompt_length: int | None = None) -> None:
        from rlhfless_policies.drafters import prompt_key

        toks = [int(t) for t in tokens]
        key = prompt_key(toks)
        if key in self._known:
            self._known.move_to_end(key)
            return
        prompt = toks if prompt_length is None or prompt_length >= len(toks) else toks[:prompt_length]
        self._known[key] = (len(toks), key if prompt is toks else prompt_key(prompt), prompt)
        self._lengths[len(toks)] += 1
        self._held += len(toks)
        while self._held > self.max_tokens and len(self._known) > 1:
            _, (length, _, _) = self._known.popitem(last=False)
            self._held -= length
            self._lengths[length] -= 1
            if not self._lengths[length]:
                del self._lengths[length]

    def find(self, row: np.ndarray, hint: bytes | None = None) -> tuple[bytes, bytes, list[int]] | None:
        """The told tokens ``row`` starts with: (their key, the prompt's key, the prompt). ``hint``: a key found
        for this row before, checked first (one digest)."""
        from rlhfless_policies.drafters import prompt_key

        told = self._known.get(hint) if hint is not None else None
        if told is not None and told[0] < row.size and prompt_key(row[: told[0]]) == hint:
            return hint, told[1], told[2]
        for length in self._lengths:
            if length < row.size:
                key = prompt_key(row[:length])
                hit = self._known.get(key)
                if hit is not None:
                    return key, hit[1], hit[2]
        return None


def _continues(now: np.ndarray, before: np.ndarray) -> bool:
    """Whether the response ``now`` goes on from ``before`` (checked at its first, middle and last token)."""
    n = before.size
    return now.size >= n and (
        n == 0 or (now[0] == before[0] and now[n // 2] == before[n // 2] and now[n - 1] == before[n - 1])
    )


class SiblingMemory:
    """What a group's finished samples wrote, for its running ones: each step's running responses are kept (copied)
    until the next; one that no running response goes on from has finished, and is kept whole until its group is
    observed (at most ``max_tokens`` tokens of finished responses; the oldest groups go first)."""

    def __init__(self, max_tokens: int = 2_000_000) -> None:
        self.max_tokens = max_tokens
        self._last: dict[bytes, list[np.ndarray]] = {}
        self._finished: OrderedDict[bytes, list[np.ndarray]] = OrderedDict()
        self._held = 0

    def step(self, running: dict[bytes, list[np.ndarray]]) -> None:
        """This step's running responses by prompt key."""
        for key, before in self._last.items():
            now = running.get(key, ())
            for response in before:
                if not any(_continues(r, response) for r in now):
                    self._finished.setdefault(key, []).append(response)
                    self._held += response.size
        self._last = {key: [r.copy() for r in rs] for key, rs in running.items()}
        self._evict()

    def add(self, key: bytes, responses: Sequence[np.ndarray]) -> None:
        """Finished responses of ``key``'s group that ran on another engine (the stream splits groups)."""
        held = self._finished.setdefault(key, [])
        for response in responses:
            held.append(response)
            self._held += response.size
        self._evict()

    def _evict(self) -> None:
        while self._held > self.max_tokens and self._finished:
            _, gone = self._finished.popitem(last=False)
            self._held -= sum(r.size for r in gone)

    def finished(self, key: bytes) -> list[np.ndarray]:
        return self._finished.get(key, [])

    def forget(self, key: bytes) -> None:
        """The group was observed whole (its responses are the drafter's history now)."""
        self._held -= sum(r.size for r in self._finished.pop(key, ()))
        self._last.pop(key, None)


class EngineProposer:
    """vLLM's ``custom_class`` proposer running an RLHFless drafter in an engine's worker."""

    def __init__(self, vllm_config: Any) -> None:
        from rlhfless_sdk.api.config import PolicyRef

        raw = os.environ.get(ENV)
        if not raw:
            raise RuntimeError(f"{PROPOSER}: {ENV} is not set; build the engine with speculative_config(ref)")
        told = json.loads(raw)
        self.budget: list[int] | None = told.pop("budget", None)  # the launch's priced budget (None: the drafter's)
        self.ref = PolicyRef.model_validate(told)
        self.drafter = _registry().create("drafter", self.ref)
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        self.prompts = PromptTable()
        self.siblings = SiblingMemory()
        self._rows: dict[int, bytes] = {}  # row -> the told tokens' key it started with, last step
        self.failed: str | None = None
        self.active = True  # off: no drafts (plain decoding steps), e.g. for a scheduler that runs without it
        # steps: a running row's decode (or verification) steps; tokens: what they sampled (1 + the accepted drafts)
        # told: finished samples of this engine's groups that ran on another engine (``finished_elsewhere``)
        self.stats = {"steps": 0, "tokens": 0, "drafts": 0, "drafted_tokens": 0, "told": 0}

    def activate(self, on: bool) -> None:
        self.active = bool(on)

    def load_model(self, *args: Any, **kwargs: Any) -> None:  # vLLM's CPU runner calls it; nothing to load
        return None

    # -- fed by the step core -------------------------------------------------------------------------------
    def expect(self, prompts: Sequence[Sequence[int] | tuple[Sequence[int], int]]) -> None:
        """Prompts that may run next (a row's prompt is found among them): token ids, or, for a carried sample,
        (its prompt and earlier tokens, the prompt's length)."""
        for p in prompts:
            if isinstance(p, tuple):
                self.prompts.add(p[0], int(p[1]))
            else:
                self.prompts.add(p)

    def observe(self, groups: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]]) -> None:
        """Finished groups: (prompt token ids, the responses' token ids)."""
        from rlhfless_policies.drafters import prompt_key

        if self.failed:
            return
        try:
            for prompt, responses in groups:
                self.drafter.observe(prompt, responses)
                self.siblings.forget(prompt_key(prompt))
        except Exception as exc:
            self._fail("observe", exc)

    def finished_elsewhere(self, groups: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]]) -> None:
        """Finished samples of groups running here that ran on other engines: (prompt token ids, the responses'
        token ids), held as finished siblings until the group is observed."""
        from rlhfless_policies.drafters import prompt_key

        if self.failed:
            return
        try:
            for prompt, responses in groups:
                key = prompt_key([int(t) for t in prompt])
                self.siblings.add(key, [np.asarray(r, dtype=np.int64) for r in responses])
                self.stats["told"] += len(responses)
        except Exception as exc:
            self._fail("finished_elsewhere", exc)

    def finished_siblings(self, prompt: Sequence[int]) -> list[list[int]]:
        """The finished responses of ``prompt`` held for its running samples (until its group is observed)."""
        from rlhfless_policies.drafters import prompt_key

        return [r.tolist() for r in self.siblings.finished(prompt_key([int(t) for t in prompt]))]

    def _fail(self, where: str, exc: BaseException) -> None:
        self.failed = f"{type(exc).__name__}: {exc}"
        log.warning(
            "rlhfless: drafter %r raised in %s (%s); speculative decoding is off (drafter none) from here",
            self.ref.name,
            where,
            self.failed,
        )

    def _prompt_of(self, i: int, row: np.ndarray) -> tuple[bytes, list[int]] | None:
        """Row ``i``'s prompt (its key and tokens): found by the tokens it was told with, the ones it had last
        step checked first."""
        hit = self.prompts.find(row, self._rows.get(i))
        if hit is None:
            self._rows.pop(i, None)
            return None
        self._rows[i] = hit[0]
        return hit[1], hit[2]

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
            found = [self._prompt_of(i, s) if sampled_token_ids[i] else None for i, s in enumerate(seqs)]
            groups: dict[bytes, list[int]] = {}  # prompt key -> its running rows
            for i, hit in enumerate(found):
                if hit is not None:
                    groups.setdefault(hit[0], []).append(i)
            responses = {i: seqs[i][len(hit[1]) :] for i, hit in enumerate(found) if hit is not None}  # views
            self.siblings.step({key: [responses[i] for i in group] for key, group in groups.items()})
            running = sum(1 for s in sampled_token_ids if s)
            for key, group in groups.items():
                for i in group:
                    out[i] = self._draft(found[i][1], responses, group, i, running, self.siblings.finished(key))
        except Exception as exc:
            self._fail("propose", exc)
            return [[] for _ in range(rows)]
        return out

    def _draft(
        self,
        prompt: list[int],
        responses: dict[int, np.ndarray],
        group: list[int],
        i: int,
        running: int,
        finished: list[np.ndarray],
    ) -> list[int]:
        """Row ``i``'s draft: its budget at ``running`` sequences, its siblings the group's other running rows
        and its finished responses."""
        response = responses[i]
        remaining = getattr(self.drafter, "predicted_remaining", lambda *_: None)(prompt, len(response))
        k = min(int(self.drafter.draft_tokens(running, remaining)), self.k)
        if self.budget:  # where the launch priced no gain at this running count, no draft
            k = min(k, self.budget[min(running, len(self.budget)) - 1])
        if k <= 0:
            return []
        siblings = [responses[j] for j in group if j != i] + finished
        draft = [int(t) for t in self.drafter.propose(prompt, response, k, siblings)][:k]
        self.stats["drafts"] += bool(draft)
        self.stats["drafted_tokens"] += len(draft)
        return draft


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
