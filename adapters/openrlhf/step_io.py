"""OpenRLHF's side of a driven step (``rlhfless_sdk.rollout.drivers.StepIO``) for the samples generator: prompts
from its dataloader or tail batching's rounds, tokenized into the planner's batch; the plan run by the step
controller on the engines (``RayBackend``) under the driver's end rule; a carried sample's tokens and logprobs kept
for its next step."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Any, Protocol

from rlhfless_openrlhf.carried import CarriedWork
from rlhfless_openrlhf.ray_backend import BackendSettings, EnginePool, EngineRequest, RayBackend

from rlhfless_sdk.api.batch import PromptBatch
from rlhfless_sdk.api.records import StepPlan
from rlhfless_sdk.planning.planner import StepPlanner
from rlhfless_sdk.rollout.controller import StepController
from rlhfless_sdk.rollout.drivers import Ran
from rlhfless_sdk.workloads.replay import LengthReplay


class GeneratorSide(Protocol):
    """What a driven step reads of the samples generator (``RlhflessSamplesGenerator``): OpenRLHF's args, the
    engines, the planner, the step count, the length replay, and how it draws, tokenizes and samples prompts."""

    args: Any
    pool: EnginePool
    planner: StepPlanner
    step: int
    replay: LengthReplay | None
    backend_settings: BackendSettings

    def take_prompts(self, dataloader_iter: Any, k: int) -> tuple[list[tuple[str, Any, Any]], bool]: ...

    def _prompt_batch(self, prompts: list[str], n: int, taken: set[str] | None = None) -> tuple[list, PromptBatch]: ...

    def _sampling_params(self, **kw: Any) -> Any: ...


class EnginesIO:
    """OpenRLHF's side of a driven step (``rlhfless_sdk.rollout.drivers.StepIO``): prompts from its dataloader (or
    tail batching's rounds), tokenized; the plan run by the step controller on the engines under the driver's end
    rule; a carried sample's tokens and logprobs kept for its next step."""

    def __init__(
        self,
        gen: GeneratorSide,
        kw: dict[str, Any],
        source: Any = None,
        dataloader_iter: Any = None,
        carried: CarriedWork | None = None,
        draw: Callable[[int | None], list[Hashable]] | None = None,
    ) -> None:
        """``source``: prompt reference -> (prompt, label, image) (a session's ``DrawnPrompts``); ``draw``: the
        driver's ``draw`` (k prompts, None: a batch's worth) as references into it; default the prompts taken from
        ``dataloader_iter``, by position. ``carried``: the work partial rollouts carry between steps (a batch-cut
        step's; None: nothing is carried)."""
        self.gen, self.kw, self.source, self.dataloader_iter = gen, kw, source, dataloader_iter
        self.carried, self._draw = carried, draw
        self.refs: list[Hashable] = []  # the references of the last batch's prompts, by position
        self.n = int(kw.get("n_samples_per_prompt", gen.args.rollout.n_samples_per_prompt))
        self.exhausted = False
        self.drawn: list[tuple[str, Any, Any]] = []  # prompt, label, image of each prompt drawn this step
        self.metas: list[tuple[str, Any, Any, list[int]]] = []  # per batch prompt: prompt, label, image, token ids
        self.new_uids: list[str] = []
        self.backend: RayBackend | None = None
        self.t_start = time.time()

    # -- the driver's calls -----------------------------------------------------------------------------------
    def draw(self, k: int | None) -> list[Hashable]:
        if self._draw is not None:
            return self._draw(k)
        if k is None or k <= 0:
            return []
        self.drawn, self.exhausted = self.gen.take_prompts(self.dataloader_iter, k)
        self.source = self.drawn
        return list(range(len(self.drawn)))

    def batch(self, prompts: list[Hashable]) -> PromptBatch:
        """The prompts (references into ``source``) as a batch, their uids distinct from the open groups' (a
        carrying step's) too."""
        gen = self.gen
        metas = [self.source[k] for k in prompts]
        self.refs = list(prompts)
        taken: set[str] = set()
        if self.carried is not None:
            work = self.carried
            taken = {p.uid for p in work.book.carried} | {work.prompts[g][3] for g in work.book.open_group_ids()}
        token_ids, batch = gen._prompt_batch([m[0] for m in metas], self.n, taken)
        self.drawn = [(m[0], m[1], m[2]) for m in metas]
        self.metas = [(m[0], m[1], m[2], ids) for m, ids in zip(metas, token_ids, strict=True)]
        self.new_uids = list(batch.uids)
        return batch

    def execute(self, batch: PromptBatch, plan: StepPlan, stop: Any, observe: bool) -> Ran:
        gen = self.gen
        prefix: dict[int, tuple[list[int], list[float] | None]] = {}
        if self.carried is not None:  # the batch: carried samples (one prompt each), then the new groups
            work = self.carried
            pieces = work.book.step_pieces
            n_carried = len(pieces) - self.n * len(self.new_uids)
            for i, (prompt, label, image, ids) in enumerate(self.metas):  # the new groups, in launch order
                work.prompts[pieces[n_carried + i * self.n].group] = (prompt, label, image, self.new_uids[i], ids)
            firsts = pieces[:n_carried] + pieces[n_carried :: self.n]
            self.metas = [(m[0], m[1], m[2], m[4]) for m in (work.prompts[p.group] for p in firsts)]
            prefix = {
                sid: work.tokens[(p.group, p.sample_index)]
                for sid, p in enumerate(pieces[:n_carried])
                if (p.group, p.sample_index) in work.tokens
            }
        if not gen.pool.live():
            raise RuntimeError("every rollout engine has died; cannot generate")
        req = EngineRequest(
            prompts=[m[0] for m in self.metas],
            labels=[m[1] for m in self.metas],
            images=[m[2] for m in self.metas],
            token_ids=[m[3] for m in self.metas],
            keys=[f"{batch.uids[i]}/{k}" for i in range(len(batch)) for k in range(int(batch.n_samples[i]))],
            prompt_of=[i for i in range(len(batch)) for _ in range(int(batch.n_samples[i]))],
            params=gen._sampling_params(**self.kw),
            max_length=self.kw.get("max_len", 2048),
            prefix=prefix,
            forced=self.forced(batch),
        )
        self.backend = backend = RayBackend(gen.pool, req, plan, self.t_start, gen.backend_settings)
        history = [self.history_key(u) for u in batch.uids]  # a prompt repeated in the batch shares its history
        controller = StepController(gen.planner, backend, batch, plan, step=gen.step, history_uids=history)
        outcome = controller.run(observe=observe, stop=stop)
        backend.collect_carried()  # the calls of samples cut at the end return what they have (or are dropped)
        return Ran(outcome, controller.done_prompts())

    def forced(self, batch: PromptBatch) -> dict[int, int]:
        """Length replay: each sample's length from the trace (by its group's uid, stable while it is carried or
        deferred), or nothing without a replay."""
        replay = self.gen.replay
        if replay is None:
            return {}
        if self.carried is not None:  # a carried sample is one prompt of its own: its group says which sample
            meta = self.carried.prompts
            return {
                sid: replay.lengths(meta[p.group][3], self.n)[p.sample_index]
                for sid, p in enumerate(self.carried.book.step_pieces)
            }
        out, sid = {}, 0
        for i, uid in enumerate(batch.uids):
            n = int(batch.n_samples[i])
            for length in replay.lengths(uid, n):
                out[sid] = length
                sid += 1
        return out

    def tokens(self, ran: Ran, stop_s: float) -> tuple[list[int], list[bool]]:
        assert self.backend is not None
        carried = set(ran.outcome.carried)
        made, ended = [], []
        for sid, s in enumerate(ran.outcome.samples):
            kept = sid not in carried or sid in self.backend.carried_out  # a carried sample whose engine died: none
            made.append(s.response_length if kept else 0)
            ended.append(sid not in carried)
        return made, ended

    def step_number(self, step: int) -> int:
        return step  # the generator's count: OpenRLHF's dataloader has no step numbers of its own

    def history_key(self, uid: str) -> str:
        return uid.split("#")[0]
