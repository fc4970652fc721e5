"""A continuous-batching decode engine on a simulated clock: the simulator's engines, and the engine cost model's.

vLLM-style: at most ``max_num_seqs`` running sequences and ``kv_capacity_tokens`` of KV; FCFS admission with a
prefill pause per admission round; recompute preemption of the newest sequence when KV runs out. Between events
the batch is constant, so k decode steps cost ``k * (a + b*B + c*ctx) + c*B*k*(k-1)/2`` (the context grows by B a
step) and the engine jumps from event to event.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from rlhfless_sdk.api.batch import PromptBatch
from rlhfless_sdk.api.records import PrefillPlan, TimePerTokenProfile
from rlhfless_sdk.planning.costmodel import shared_prefix_per_prompt

QUEUED, RUNNING, DONE = 0, 1, 2


class EngineSamples:
    """Per-sample state of one step, as parallel lists (fast scalar access in the event loop)."""

    def __init__(
        self,
        prompt: Sequence[int],
        index_in_group: Sequence[int],
        prompt_len: Sequence[int],
        shared: Sequence[int],
        target: Sequence[int],
        predicted: Sequence[float],
        actor: Sequence[int],
    ) -> None:
        self.prompt = list(prompt)
        self.index_in_group = list(index_in_group)
        self.prompt_len = list(prompt_len)
        self.shared = list(shared)  # tokens of the prompt prefilled by the prefill actor
        self.target = list(target)  # response length: the sample finishes after this many tokens
        self.predicted = list(predicted)
        n = len(self.target)
        self.state = [QUEUED] * n
        self.generated = [0] * n  # tokens generated before the current admission
        self.admit_step = [0] * n
        self.actor = list(actor)
        self.ready_at = [0.0] * n
        self.prefilled = [False] * n  # first admission prefills only the part not shared via the prefill actor
        self.kv_cached = [False] * n  # migrated with its KV: admission needs no recompute
        self.finish_time = [0.0] * n
        self.cut_from = [0] * n  # the actor a migrated sample was cut from
        self.events: list[int] = []  # samples finished since the last poll, in order

    @classmethod
    def of_batch(
        cls,
        batch: PromptBatch,
        lengths: np.ndarray,
        plan_predicted: Sequence[float],
        assignment: Sequence[int],
        prefill: PrefillPlan,
    ) -> EngineSamples:
        """Samples of ``batch`` (prompt order) with response ``lengths``, the plan's per-prompt predictions."""
        prompt_of = batch.sample_prompt_index()
        pred = np.asarray(plan_predicted, dtype=np.float64)
        return cls(
            prompt_of.tolist(),
            (np.arange(batch.total_samples) - batch.sample_offsets[prompt_of]).tolist(),
            batch.prompt_lengths[prompt_of].tolist(),
            shared_prefix_per_prompt(batch, prefill)[prompt_of].tolist(),
            np.asarray(lengths).tolist(),
            pred[prompt_of].tolist() if len(pred) else [],
            assignment,
        )


@dataclass
class EngineModel:
    """One decode actor's continuous-batching engine (vLLM-like) on a simulated clock."""

    aid: int
    prof: TimePerTokenProfile
    node: str
    start: float
    t: float = 0.0
    S: int = 0  # decode steps so far
    B: int = 0  # running sequences
    ctx: int = 0  # KV tokens held by running sequences
    busy: float = 0.0
    generated: int = 0  # tokens generated on this actor
    planned: float = 0.0
    last_token: float = 0.0
    first: float = 0.0  # when it first admitted work: serverless billing starts here
    used: bool = False
    waiting: deque[int] = field(default_factory=deque)
    heap: list[tuple[int, int]] = field(default_factory=list)  # (finish step, sample)
    stack: list[int] = field(default_factory=list)  # running samples, newest last (preemption order)
    preemptions: int = 0
    blocked: bool = False  # after a preemption, admit nothing until a running sequence finishes

    def __post_init__(self) -> None:
        self.t = self.start

    def gen_now(self, s: EngineSamples, sid: int) -> int:
        return s.generated[sid] + (self.S - s.admit_step[sid])

    def _admit(self, s: EngineSamples) -> None:
        p = self.prof
        new_tok = cached_tok = 0
        admitted = 0
        if self.blocked and self.B > 0:
            return
        self.blocked = False
        while self.waiting and p.max_num_seqs > self.B:
            sid = self.waiting[0]
            if s.ready_at[sid] > self.t:
                if self.B == 0 and admitted == 0:
                    self.t = s.ready_at[sid]  # idle until the migrated sample's KV arrives
                else:
                    break
            need = s.prompt_len[sid] + s.generated[sid]
            if self.B > 0 and self.ctx + need > p.kv_capacity_tokens:
                break
            self.waiting.popleft()
            if s.kv_cached[sid]:
                cached_tok += need
                s.kv_cached[sid] = False
            elif not s.prefilled[sid]:
                new_tok += need - s.shared[sid]
                cached_tok += s.shared[sid]
            else:  # preempted or migrated by tokens: recompute prompt + generated
                new_tok += need
            s.prefilled[sid] = True
            s.state[sid] = RUNNING
            s.admit_step[sid] = self.S
            s.actor[sid] = self.aid
            heapq.heappush(self.heap, (self.S + max(s.target[sid] - s.generated[sid], 0), sid))
            self.stack.append(sid)
            self.B += 1
            self.ctx += need
            admitted += 1
        if admitted:
            if not self.used:
                self.first = self.t
            dt = p.prefill_base_s + p.prefill_per_new_token_s * new_tok + p.prefill_per_cached_token_s * cached_tok
            self.t += dt
            self.busy += dt
            self.used = True

    def _valid(self, s: EngineSamples, finish: int, sid: int) -> bool:
        return (
            s.state[sid] == RUNNING
            and s.actor[sid] == self.aid
            and finish == s.admit_step[sid] + max(s.target[sid] - s.generated[sid], 0)
        )

    def _remove_running(self, s: EngineSamples, sid: int) -> int:
        """Take a running sample off this actor (preemption or migration); returns its generated tokens."""
        g = self.gen_now(s, sid)
        s.generated[sid] = g
        s.state[sid] = QUEUED
        self.B -= 1
        self.ctx -= s.prompt_len[sid] + g
        self.stack.remove(sid)
        return g

    def idle(self) -> bool:
        return self.B == 0 and not self.waiting

    def run_until(self, s: EngineSamples, limit: float) -> None:
        """Advance this actor's engine until its clock reaches ``limit`` or it runs out of work."""
        p = self.prof
        while self.t < limit:
            self._admit(s)
            if self.B == 0:
                return
            while self.heap and not self._valid(s, *self.heap[0]):
                heapq.heappop(self.heap)
            k = self.heap[0][0] - self.S
            if k > 0 and self.B > 1 and self.ctx + self.B * k > p.kv_capacity_tokens:
                k = (p.kv_capacity_tokens - self.ctx) // self.B
                if k <= 0:  # KV full: preempt the newest sequence; it is recomputed once a sequence finishes
                    sid = self.stack[-1]
                    self._remove_running(s, sid)
                    self.waiting.appendleft(sid)
                    self.preemptions += 1
                    self.blocked = True
                    continue
            A = p.decode_base_s + p.decode_per_seq_s * self.B + p.decode_per_ctx_token_s * self.ctx
            C = p.decode_per_ctx_token_s * self.B
            dt = k * A + C * k * (k - 1) / 2.0
            if self.t + dt > limit:  # partial advance: the most whole steps that fit before the limit
                room = limit - self.t
                if C > 0:
                    h = A - C / 2.0
                    k = int((-h + math.sqrt(h * h + 2.0 * C * room)) / C)
                else:
                    k = int(room / A) if A > 0 else k
                k = max(0, min(k, self.heap[0][0] - self.S - 1))
                if k == 0:
                    return
                dt = k * A + C * k * (k - 1) / 2.0
            self.t += dt
            self.busy += dt
            self.S += k
            self.ctx += self.B * k
            self.generated += self.B * k
            while self.heap and self.heap[0][0] <= self.S:
                finish, sid = heapq.heappop(self.heap)
                if not self._valid(s, finish, sid):
                    continue
                s.state[sid] = DONE
                s.generated[sid] = s.target[sid]
                s.finish_time[sid] = self.t
                s.events.append(sid)
                self.B -= 1
                self.ctx -= s.prompt_len[sid] + s.target[sid]
                self.stack.remove(sid)
                self.last_token = self.t
                self.blocked = False
