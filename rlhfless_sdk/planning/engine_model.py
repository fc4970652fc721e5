"""A continuous-batching decode engine on a simulated clock: the simulator's engines, and the engine cost model's.

vLLM-style: at most ``max_num_seqs`` running sequences and ``kv_capacity_tokens`` of KV; FCFS admission with a
prefill pause per admission round, which leaves the profile's ``watermark`` of the KV free while others run;
recompute preemption of the newest sequence when KV runs out. Between events
the batch is constant, so k decode steps cost ``k * (a + b*B + c*ctx) + c*B*k*(k-1)/2`` (the context grows by B a
step) and the engine jumps from event to event.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from rlhfless_sdk.api.batch import PromptBatch
from rlhfless_sdk.api.protocols import Candidate
from rlhfless_sdk.api.records import CandidateEstimate, PrefillPlan, TimePerTokenProfile
from rlhfless_sdk.planning.costmodel import shared_prefix_per_prompt, start_up_and_prefill

QUEUED, RUNNING, DONE = 0, 1, 2


#: Token steps an engine runs at most between two reads of its batch's positions, where a drafter's acceptance
#: depends on the position in the response (``Acceptance.by_position``): a sequence moves at most this far through
#: its slice before its price is read again.
POSITION_STEPS = 256


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
        # vLLM's prefix caching: a sample admitted where its prompt was prefilled before (a group-mate's) reads the
        # prompt's KV from the cache instead of computing it (off by default, as in OpenRLHF)
        self.prefix_cache = False
        self._final_kv: np.ndarray | None = None

    def final_kv(self) -> np.ndarray:
        """The KV tokens each sample holds when it finishes (prompt + response; neither changes once made)."""
        if self._final_kv is None or len(self._final_kv) != len(self.target):
            self._final_kv = np.add(self.prompt_len, self.target, dtype=np.int64)
        return self._final_kv

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


# design: one simulated engine's state, read and written as plain attributes by the event loop's hottest lines (the
# planner's check model runs it for every candidate count); grouping it would add an indirection to each of them
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
    seq_steps: float = 0.0  # decode steps summed over sequences (each yields 1 token, or tau with speculation)
    planned: float = 0.0
    last_token: float = 0.0
    first: float = 0.0  # when it first admitted work: serverless billing starts here
    used: bool = False
    waiting: deque[int] = field(default_factory=deque)
    heap: list[tuple[int, int]] = field(default_factory=list)  # (finish step, sample)
    stack: dict[int, None] = field(default_factory=dict)  # running samples, newest last (preemption order)
    preemptions: int = 0
    blocked: bool = False  # after a preemption, admit nothing until a running sequence finishes
    cached_prompts: set[int] = field(default_factory=set)  # prompts prefilled here this step (prefix caching)
    slots: int = 0  # at most this many running (a client holding samples back, ``KvSlots``); 0: max_num_seqs
    on_finish: Callable[[EngineModel], None] | None = None  # called when samples finish (a client topping it up)

    def __post_init__(self) -> None:
        self.t = self.start

    def gen_now(self, s: EngineSamples, sid: int) -> int:
        return s.generated[sid] + (self.S - s.admit_step[sid])

    # design: the event loop's hottest lines, kept in one frame with the samples' columns as locals (a call per
    # admitted sample costs the planner's check model, whose time every step is charged)
    def admit(self, s: EngineSamples) -> None:
        if self.blocked and self.B > 0:
            return
        self.blocked = False
        p = self.prof
        cap = min(self.slots, p.max_num_seqs) if self.slots > 0 else p.max_num_seqs
        waiting = self.waiting
        if not waiting or cap <= self.B:
            return
        room = p.kv_capacity_tokens - int(p.watermark * p.kv_capacity_tokens)  # beside running sequences (vLLM's)
        # the event loop's hottest lines: the samples' columns and this engine's counters as locals
        ready_at, prompt_len, generated, kv_cached = s.ready_at, s.prompt_len, s.generated, s.kv_cached
        prefilled, shared, state, admit_step, actor, target = (
            s.prefilled,
            s.shared,
            s.state,
            s.admit_step,
            s.actor,
            s.target,
        )
        prefix_cache, heap, stack, aid, S = s.prefix_cache, self.heap, self.stack, self.aid, self.S
        B, ctx = self.B, self.ctx
        new_tok = cached_tok = admitted = 0
        while waiting and cap > B:
            sid = waiting[0]
            if ready_at[sid] > self.t:
                if B == 0 and admitted == 0:
                    self.t = ready_at[sid]  # idle until the migrated sample's KV arrives
                else:
                    break
            g = generated[sid]
            need = prompt_len[sid] + g
            if B > 0 and ctx + need > room:
                break
            waiting.popleft()
            if kv_cached[sid]:
                cached_tok += need
                kv_cached[sid] = False
            elif not prefilled[sid]:
                plen = prompt_len[sid]
                if prefix_cache and s.prompt[sid] in self.cached_prompts:
                    new_tok += need - plen
                    cached_tok += plen
                else:
                    new_tok += need - shared[sid]
                    cached_tok += shared[sid]
                if prefix_cache:
                    self.cached_prompts.add(s.prompt[sid])
            else:  # preempted or migrated by tokens: recompute prompt + generated
                new_tok += need
            prefilled[sid] = True
            state[sid] = RUNNING
            admit_step[sid] = S
            actor[sid] = aid
            left = target[sid] - g
            heapq.heappush(heap, (S + (left if left > 0 else 0), sid))
            stack[sid] = None
            B += 1
            ctx += need
            admitted += 1
        self.B, self.ctx = B, ctx
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
        del self.stack[sid]
        return g

    def free_kv(self, s: EngineSamples) -> int:
        """A pause that frees the KV cache (vLLM's ``pause_generation`` with ``clear_cache=True``): every running
        sample is preempted, oldest first at the head of the queue, and re-prefills its prompt and tokens when it is
        admitted again; the prefix cache is emptied. Returns how many were preempted."""
        running = list(self.stack)
        for sid in running:
            self._remove_running(s, sid)
        self.waiting.extendleft(reversed(running))
        self.preemptions += len(running)
        self.blocked = False
        self.cached_prompts.clear()
        return len(running)

    def idle(self) -> bool:
        return self.B == 0 and not self.waiting

    def run_until(self, s: EngineSamples, limit: float) -> None:
        """Advance this actor's engine until its clock reaches ``limit`` or it runs out of work."""
        p = self.prof
        drains = limit == math.inf and self.on_finish is None and p.speculation is None
        while self.t < limit:
            self.admit(s)
            if self.B == 0:
                return
            if drains and not self.waiting:
                self._drain(s)
                if self.B == 0:
                    return
            while self.heap and not self._valid(s, *self.heap[0]):
                heapq.heappop(self.heap)
            k = self.heap[0][0] - self.S
            rate = self._rate(s) if p.speculation is not None else (1.0, 0.0)
            if p.speculation is not None and p.speculation.acceptance.by_position:
                k = min(k, POSITION_STEPS)  # the acceptance changes along a response: re-read the positions this often
            if k > 0 and self.B > 1 and self.ctx + self.B * k > p.kv_capacity_tokens:
                k = (p.kv_capacity_tokens - self.ctx) // self.B
                if k <= 0:  # KV full: preempt the newest sequence; it is recomputed once a sequence finishes
                    sid = next(reversed(self.stack))
                    self._remove_running(s, sid)
                    self.waiting.appendleft(sid)
                    self.preemptions += 1
                    self.blocked = True
                    continue
            if p.decode_overlap:
                dt = self._overlapped(k, rate)
                if self.t + dt > limit:  # the most whole steps that fit before the limit
                    k = self._steps_within(limit - self.t, min(k, self.heap[0][0] - self.S - 1), rate)
                    if k == 0:
                        return
                    dt = self._overlapped(k, rate)
                self._advance(s, k, dt, rate[0])
                continue
            tau, drafted = rate[0], rate[1]
            slow = 1.0 + p.speculation.sync_penalty if p.speculation is not None else 1.0  # async scheduling off
            c = (p.decode_per_ctx_token_s * slow + self._search_per_token()) / tau  # KV read, the proposer's search
            A = (
                p.decode_base_s * slow
                + self._draft_overhead()
                + (p.decode_per_seq_s * (1.0 + drafted) + p.decode_per_seq_comm_s) * self.B * slow
            ) / tau + c * self.ctx
            C = c * self.B
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
            self._advance(s, k, dt, tau)

    def _drain(self, s: EngineSamples) -> None:
        """Run the running samples on, while nothing waits to be admitted and nothing else can change the batch
        (no clock limit, no client topping the engine up, no drafting): between two finishes the batch is fixed,
        so every event's steps, batch, context and seconds follow from the sorted finish steps, in numpy, with the
        event loop's own arithmetic in its own order (the same clock to the last bit). It stops before the first
        event where the KV would run out (the event loop preempts there), having run every finish before it."""
        p = self.prof
        # every running sample has a live entry in the heap; any more are stale (a sample that left), or a copy:
        # one re-admitted after a preemption finishes at the step it first would have (the loop skips the copy)
        if len(self.heap) == self.B:
            entries = sorted(self.heap)
        else:
            entries = sorted({sid: (f, sid) for f, sid in self.heap if self._valid(s, f, sid)}.values())
        table = np.array(entries, dtype=np.int64).reshape(-1, 2)
        steps, first = np.unique(table[:, 0], return_index=True)
        leaving = np.diff(np.append(first, len(entries)))  # samples finishing at each event
        freed = np.add.reduceat(s.final_kv()[table[:, 1]], first)  # the KV they release
        k = np.diff(steps, prepend=self.S)
        batch = self.B - np.concatenate(([0], np.cumsum(leaving)[:-1]))
        # the context at each event's start: it grows by the batch each step and drops by what finished
        ctx = self.ctx + np.concatenate(([0], np.cumsum(batch[:-1] * k[:-1] - freed[:-1])))
        full = np.flatnonzero((k > 0) & (batch > 1) & (ctx + batch * k > p.kv_capacity_tokens))
        n = int(full[0]) if full.size else len(steps)  # events run here
        if n == 0:
            return
        k, batch, ctx = k[:n], batch[:n], ctx[:n]
        dt = self._event_seconds(k, batch, ctx)
        clock = np.add.accumulate(np.concatenate(([self.t], dt)))[1:]
        self.busy = float(np.add.accumulate(np.concatenate(([self.busy], dt)))[-1])
        work = int((batch * k).sum())
        self.seq_steps += work
        self.generated += work
        self.t = float(clock[-1])
        self.S = int(steps[n - 1])
        done = int(first[n]) if n < len(steps) else len(entries)
        state, generated, target, finish_time, stack = s.state, s.generated, s.target, s.finish_time, self.stack
        finished = table[:done, 1].tolist()
        for sid, t in zip(finished, np.repeat(clock, leaving[:n]).tolist(), strict=True):
            state[sid] = DONE
            generated[sid] = target[sid]
            finish_time[sid] = t
            del stack[sid]
        s.events.extend(finished)
        self.heap = entries[done:]  # sorted: a heap
        self.B -= done
        self.ctx = int(ctx[-1] + batch[-1] * k[-1] - freed[n - 1])
        self.last_token = self.t
        self.blocked = False

    def _event_seconds(self, k: np.ndarray, batch: np.ndarray, ctx: np.ndarray) -> np.ndarray:
        """Seconds of each event's ``k`` decode steps of ``batch`` sequences from context ``ctx``: ``_overlapped``
        and the event loop's serial formula, elementwise, their operations in the same order (no drafting)."""
        p = self.prof
        if p.decode_overlap:
            o = p.decode_overhead_s + p.decode_per_seq_comm_s * batch
            w = p.decode_base_s - p.decode_overhead_s
            c = p.decode_per_ctx_token_s
            compute = p.decode_per_seq_s * batch
            cb = c * batch
            gap = compute - w - c * ctx
            with np.errstate(divide="ignore", invalid="ignore"):
                bound = np.where(gap <= 0, 0, np.where(cb > 0, np.minimum(k, np.ceil(gap / cb)), k)).astype(np.int64)
            rest = k - bound
            mem = o + w + c * (ctx + batch * bound)
            return bound * (o + compute) + rest * mem + cb * rest * (rest - 1) / 2.0 + 0.0
        c = p.decode_per_ctx_token_s + 0.0
        a = p.decode_base_s + 0.0 + (p.decode_per_seq_s + p.decode_per_seq_comm_s) * batch + c * ctx
        return k * a + c * batch * k * (k - 1) / 2.0

    def _overlapped(self, k: int, rate: tuple[float, float] | None = None) -> float:
        """Seconds for k decode steps when memory reads and compute overlap: each step takes
        ``overhead + max(weights + c * context, b * B)``; the context grows by B a step, so the first steps may
        be compute-bound and the rest memory-bound. ``rate``: (tokens a step yields a sequence, draft tokens it
        computes), as ``_rate`` gives."""
        p = self.prof
        if rate is None:  # the whole batch at the overall acceptance
            rate = p.speculation.at(self.B) if p.speculation is not None else (1.0, 0.0)
        tau, drafted = rate[0], rate[1]
        slow = 1.0 + p.speculation.sync_penalty if p.speculation is not None else 1.0  # async scheduling off
        o = (p.decode_overhead_s + p.decode_per_seq_comm_s * self.B) * slow + self._draft_overhead()
        w = (p.decode_base_s - p.decode_overhead_s) * slow
        c = p.decode_per_ctx_token_s * slow / tau
        compute = p.decode_per_seq_s * self.B * (1.0 + drafted) * slow / tau
        o, w = o / tau, w / tau
        cb = c * self.B
        gap = compute - w - c * self.ctx  # > 0: compute-bound now
        if gap <= 0:
            bound = 0
        elif cb > 0:
            bound = min(k, math.ceil(gap / cb))
        else:
            bound = k
        rest = k - bound
        mem = o + w + c * (self.ctx + self.B * bound)
        h = self._search_per_token() / tau  # the proposer's search, on the host after the step: outside the max
        search = h * (k * self.ctx + self.B * k * (k - 1) / 2.0)
        return bound * (o + compute) + rest * mem + cb * rest * (rest - 1) / 2.0 + search

    def _rate(self, s: EngineSamples) -> tuple[float, float]:
        """(tokens a verification step yields a running sequence, draft tokens it computes) for this batch; where
        the acceptance depends on the position in the response, averaged over where each sequence is."""
        spec = self.prof.speculation
        ends = [piece.upto for piece in spec.acceptance.by_position]
        if not ends:
            return spec.at(self.B)
        counts = [0] * len(ends)
        generated, admit_step, target, S, last = s.generated, s.admit_step, s.target, self.S, len(ends) - 1
        for sid in self.stack:
            share = (generated[sid] + S - admit_step[sid]) / target[sid] if target[sid] > 0 else 0.0
            counts[min(bisect.bisect_right(ends, share), last)] += 1
        return spec.at_positions(self.B, counts)

    def _draft_overhead(self) -> float:
        """Host seconds a drafting step spends proposing, but for the per-context-token search."""
        spec = self.prof.speculation
        if spec is None or spec.draft_tokens(self.B) <= 0:
            return 0.0
        return spec.draft_overhead_s + spec.acceptance.search_s_per_seq * self.B

    def _search_per_token(self) -> float:
        """Host seconds of the proposer's search per context token of the running batch, on steps that draft."""
        spec = self.prof.speculation
        if spec is None or spec.draft_tokens(self.B) <= 0:
            return 0.0
        return spec.acceptance.search_s_per_token

    def _steps_within(self, room: float, most: int, rate: tuple[float, float] | None = None) -> int:
        lo, hi = 0, max(most, 0)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._overlapped(mid, rate) <= room:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _advance(self, s: EngineSamples, k: int, dt: float, tau: float = 1.0) -> None:
        """k decode steps of the running batch, taking dt seconds, each yielding ``tau`` tokens a sequence a
        verification step; finished samples leave it."""
        self.t += dt
        self.busy += dt
        spec = self.prof.speculation
        if spec is not None:
            steps = self.B * k / tau
            self.seq_steps += steps
            spec.tally(self.B * k, steps)
        else:
            self.seq_steps += self.B * k
        self.S += k
        self.ctx += self.B * k
        self.generated += self.B * k
        heap, stack, S, aid = self.heap, self.stack, self.S, self.aid
        state, actor, admit_step, generated, target = s.state, s.actor, s.admit_step, s.generated, s.target
        prompt_len, finish_time, events = s.prompt_len, s.finish_time, s.events
        finished = 0
        while heap and heap[0][0] <= S:
            finish, sid = heapq.heappop(heap)
            # a stale entry (``_valid``, inlined): the sample left this engine (preempted, cut, moved) since
            left = target[sid] - generated[sid]
            if state[sid] != RUNNING or actor[sid] != aid or finish != admit_step[sid] + (left if left > 0 else 0):
                continue
            finished += 1
            state[sid] = DONE
            generated[sid] = target[sid]
            finish_time[sid] = self.t
            events.append(sid)
            self.ctx -= prompt_len[sid] + target[sid]
            del stack[sid]
        if finished:
            self.B -= finished
            self.last_token = self.t
            self.blocked = False
            if self.on_finish is not None:
                self.on_finish(self)


def steady_context(prompt: np.ndarray, response: np.ndarray) -> float:
    """KV tokens a running sample holds on average in a stream of samples like ``prompt[i]`` + ``response[i]``: one
    is caught at a length-weighted point of its life, so ``p + E[L^2] / (2 E[L])``. 0 without a positive length."""
    p = np.asarray(prompt, dtype=np.float64)
    length = np.asarray(response, dtype=np.float64)
    mean = float(length.mean()) if length.size else 0.0
    if mean <= 0:
        return 0.0
    return float(p.mean()) + float((length**2).mean()) / (2.0 * mean)


def steady_step(profile: TimePerTokenProfile, prompt: np.ndarray, response: np.ndarray) -> tuple[float, float]:
    """(samples running, seconds per token of each: a decode step, or a verification step over the tokens it yields)
    on one engine of ``profile`` never short of work (a stream: no tail), for samples like ``prompt[i]`` +
    ``response[i]``. A running sample is caught at a length-weighted
    point of its life, so the KV it holds is ``p + E[L^2] / (2 E[L])`` on average; the engine runs as many as its KV
    and ``max_num_seqs`` allow, each decode step costing what the engine model says for that batch and context.
    (0, 0) without a positive length."""
    ctx = steady_context(prompt, response)
    if ctx <= 0:
        return 0.0, 0.0
    running = max(min(float(profile.max_num_seqs), profile.kv_capacity_tokens / max(ctx, 1.0)), 1.0)
    spec = profile.speculation
    if spec is None:
        return running, decode_step_s(profile, running, ctx)
    tau, drafted = spec.at(int(running))
    host = 0.0
    if drafted > 0:  # the proposer's host time: a step, each sequence, each context token
        acc = spec.acceptance
        host = spec.draft_overhead_s + (acc.search_s_per_seq + acc.search_s_per_token * ctx) * running
    return running, decode_step_s(profile, running, ctx, drafted, 1.0 + spec.sync_penalty, host) / tau


def decode_step_s(
    profile: TimePerTokenProfile,
    running: float,
    context: float,
    drafted: float = 0.0,
    slow: float = 1.0,
    host: float = 0.0,
) -> float:
    """Seconds one decode step of ``running`` sequences, each holding ``context`` KV tokens, takes on ``profile``:
    the engine model's step (overlapped roofline or additive), each sequence computing ``1 + drafted`` positions,
    the model's part ``slow`` times longer (an engine without async scheduling), plus the proposer's ``host``."""
    c = profile.decode_per_ctx_token_s * slow
    s = profile.decode_per_seq_s * slow * (1.0 + drafted)
    comm = profile.decode_per_seq_comm_s * running * slow
    if profile.decode_overlap:
        o = profile.decode_overhead_s * slow
        return o + host + comm + max(profile.decode_base_s * slow - o + c * context * running, s * running)
    return profile.decode_base_s * slow + host + comm + s * running + c * context * running


def token_cost(profile: TimePerTokenProfile, running: int, context: float, k: int | None) -> float:
    """Seconds a token of each of ``running`` sequences costs in one decode step on ``profile``, each holding
    ``context`` KV tokens: a plain engine's step (``k`` None), or, on an engine built with the profile's drafter,
    a verification step with ``k`` draft tokens (0: a step that drafts nothing, still without async scheduling),
    its proposer's host time included, over the tokens it yields a sequence. The engine model's step formula."""
    spec = profile.speculation
    if k is None or spec is None:
        return decode_step_s(profile, running, context)
    tau, drafted, host = 1.0, 0.0, 0.0
    if k > 0:
        acc = spec.acceptance
        tau, drafted = acc.tokens_per_step(k), acc.drafted(k)
        host = spec.draft_overhead_s + (acc.search_s_per_seq + acc.search_s_per_token * context) * running
    return decode_step_s(profile, running, context, drafted, 1.0 + spec.sync_penalty, host) / tau


def priced_budget(profile: TimePerTokenProfile, context: float) -> list[int]:
    """The profile's drafter budget (draft tokens a step at 1, 2, ... running sequences) kept where it pays: at
    each running count, the draft count up to the drafter's own whose token costs least on an engine built with
    the drafter (``token_cost``), where that beats a plain engine's token; 0 elsewhere. ``context``: KV tokens a
    running sequence holds (a workload's ``steady_context``)."""
    spec = profile.speculation
    if spec is None:
        return []
    out = []
    for running, most in enumerate(spec.budget, start=1):
        plain = token_cost(profile, running, context, None)
        best, cost = 0, plain
        for k in range(1, most + 1):
            priced = token_cost(profile, running, context, k)
            if priced < cost:
                best, cost = k, priced
        out.append(best)
    return out


def run_engines(
    profile: TimePerTokenProfile, s: EngineSamples, engines: int, order: Iterable[int]
) -> list[EngineModel]:
    """``engines`` engines of ``profile`` run to the end on the samples of ``s``, each queued on its engine
    (``s.actor``) in ``order``."""
    models = [EngineModel(a, profile, "", 0.0) for a in range(engines)]
    for sid in order:
        models[s.actor[sid]].waiting.append(sid)
    for m in models:
        m.run_until(s, math.inf)
    return models


def remaining_draw(seen: np.ndarray, so_far: np.ndarray, seed: int = 0) -> np.ndarray:
    """One draw of each running sample's remaining tokens: its final length drawn from the lengths ``seen`` that
    exceed what it has (``so_far``), so a long sample runs to the long lengths the run has seen (its runaways to
    the cap) as often as the run says; 1 for a sample longer than every length seen. The same ``seed`` gives the
    same draw, so candidates compare on equal terms."""
    seen = np.sort(np.asarray(seen, dtype=np.float64))
    so_far = np.asarray(so_far, dtype=np.float64)
    if not so_far.size:
        return np.zeros(0, dtype=np.int64)
    if not seen.size:
        return np.ones(so_far.shape, dtype=np.int64)
    lo = np.searchsorted(seen, so_far, side="right")
    u = np.random.default_rng(seed).random(so_far.shape)
    pick = np.minimum(lo + np.floor(u * (seen.size - lo)).astype(np.int64), seen.size - 1)
    final = np.where(lo < seen.size, seen[pick], so_far + 1.0)
    return np.maximum(np.rint(final - so_far), 1).astype(np.int64)


def drain_s(
    profile: TimePerTokenProfile, context: np.ndarray, remaining: np.ndarray, engines: int, kept: float = 1.0
) -> float:
    """Seconds until the last of these running samples (``context``: prompt + tokens so far; ``remaining``: tokens
    each has left) finishes on ``engines`` engines of ``profile``, dealt longest first across them. A share
    ``kept`` of them keeps its KV where it is; the others (moved off engines that leave) recompute their context."""
    context = np.asarray(context, dtype=np.int64)
    remaining = np.asarray(remaining, dtype=np.int64)
    if not remaining.size or engines <= 0:
        return 0.0
    order = np.argsort(-remaining, kind="stable")
    actor = np.empty(remaining.size, dtype=np.int64)
    actor[order] = np.arange(remaining.size) % engines
    n = remaining.size
    s = EngineSamples(range(n), [0] * n, context.tolist(), [0] * n, remaining.tolist(), [], actor.tolist())
    stay = round(kept * n)
    for i, sid in enumerate(order.tolist()):
        s.kv_cached[sid] = (i * stay) // n != ((i + 1) * stay) // n  # ``stay`` of them, spread over the ranks
    return max((m.last_token for m in run_engines(profile, s, engines, order.tolist()) if m.used), default=0.0)


def steady_rate(profile: TimePerTokenProfile, prompt: np.ndarray, response: np.ndarray) -> float:
    """Tokens a second one engine of ``profile`` generates when it is never short of work (``steady_step``)."""
    running, step = steady_step(profile, prompt, response)
    return running / step if step > 0 else 0.0


@dataclass(frozen=True)
class LengthSpread:
    """What the planner learned about true lengths against its predictions (from the previous step).

    ``cap``: the longest response seen (the run's length cap, if samples hit it); ``capped``: the share of
    samples that hit it (runaway samples that never stop, when more than one did). ``scale``: the factor on
    the predictions that, with that share of runaways, gives the step's true total (a biased predictor's
    correction). Below the cap, log(true / scaled prediction) spreads as ``sigma_group`` between prompts (what
    the predictor misses about a prompt: all its samples share it) plus ``sigma`` within a prompt's group.
    """

    scale: float = 1.0
    sigma: float = 0.0
    cap: int = 0
    capped: float = 0.0
    sigma_group: float = 0.0

    @classmethod
    def observe(
        cls,
        true: np.ndarray,
        predicted: np.ndarray,
        previous: LengthSpread | None = None,
        groups: np.ndarray | None = None,
    ) -> LengthSpread:
        """From a step's true and predicted lengths per sample; ``groups``: each sample's prompt (any ids)."""
        true = np.asarray(true, dtype=np.float64)
        predicted = np.asarray(predicted, dtype=np.float64)
        cap = max(int(true.max(initial=0)), previous.cap if previous else 0)
        at_cap = true >= cap
        # a share at the cap needs a cap: lengths that are all zero hit none (and say nothing of runaways)
        capped = float(at_cap.mean()) if cap > 0 and at_cap.sum() > 1 else 0.0
        ok = (predicted > 0) & (true > 0) & ~(at_cap if capped else np.zeros_like(at_cap))
        # the scale that makes the expected total match the step's: runaways at the cap, the rest scaled (only
        # where something was predicted: predictions of zero scale to nothing)
        rest = true.sum() - capped * true.size * cap
        total = (1.0 - capped) * float(predicted[predicted > 0].sum())
        scale = float(np.clip(rest / total, 0.05, 20.0)) if total > 0 else (previous or cls()).scale
        if ok.sum() < 2:
            return replace(previous or cls(), scale=scale, cap=cap, capped=capped)
        r = np.log(true[ok] / (scale * predicted[ok]))
        if groups is None:
            return cls(scale, float(np.clip(r.std(), 0.0, 3.0)), cap, capped)
        _, g = np.unique(np.asarray(groups)[ok], return_inverse=True)
        mean = np.bincount(g, weights=r) / np.bincount(g)
        within = float(np.clip((r - mean[g]).std(), 0.0, 3.0))
        between = float(np.clip(np.sqrt(max(r.var() - within**2, 0.0)), 0.0, 3.0))
        return cls(scale, within, cap, capped, between)

    def remaining(self, predicted: np.ndarray, generated: np.ndarray, draws: int = 512) -> np.ndarray:
        """Expected tokens still to come for samples predicted ``predicted`` long that already have ``generated``
        (the learned spread, conditioned on having outlived ``generated``: a carried sample is often a runaway)."""
        pred = np.asarray(predicted, dtype=np.float64)[:, None]
        gen = np.asarray(generated, dtype=np.float64)[:, None]
        f = self.factors(np.arange(draws), seed=12345)[None, :]
        cap = float(self.cap) if self.cap else np.inf
        length = np.minimum(self.scaled(pred, f, cap), cap)
        alive = length > gen
        count = alive.sum(axis=1)
        left = np.where(alive, length - gen, 0.0).sum(axis=1) / np.maximum(count, 1)
        fallback = np.maximum((cap if np.isfinite(cap) else 2.0 * gen[:, 0]) - gen[:, 0], 1.0)
        return np.where(count > 0, np.maximum(left, 1.0), fallback)

    def scaled(self, predicted: np.ndarray, factors: np.ndarray, cap: float) -> np.ndarray:
        """``predicted * scale * factors``, where an infinite factor (a runaway) means ``cap`` whatever the
        prediction: a prediction of zero runs to the cap too, never 0 x inf."""
        runaway = np.isinf(factors)
        out = predicted * self.scale * np.where(runaway, 1.0, factors)
        return np.where(runaway, cap, out)

    def factors(self, prompt_of: np.ndarray, seed: int = 0) -> np.ndarray:
        """Length factors with mean 1 for samples of the prompts ``prompt_of``: a lognormal factor per prompt
        (``sigma_group``) times one per sample (``sigma``); a ``capped`` share of them, at random, is infinite
        (those samples run to the cap). Random draws, not quantiles: how unevenly the long samples fall on the
        engines is part of what a step's slowest engine costs."""
        prompt_of = np.asarray(prompt_of, dtype=np.int64)
        count = prompt_of.size
        rng = np.random.default_rng(seed)
        per_prompt = rng.standard_normal(int(prompt_of.max(initial=-1)) + 1)
        z = self.sigma_group * per_prompt[prompt_of] + self.sigma * rng.standard_normal(count)
        f = np.exp(z - (self.sigma_group**2 + self.sigma**2) / 2.0)
        if self.capped > 0:
            f[rng.random(count) < self.capped] = np.inf
        return f


class EngineCostModel:
    """A per-sample cost model: every decode actor's engine run on the clock (``EngineModel``) with lengths made
    from the predictions and a ``LengthSpread`` (each sample's prediction times a lognormal factor with the
    learned spread, a learned share of runaway samples at the cap). Resampling the previous step's own
    residuals instead was tried: less accurate on the long-reasoning workloads.

    So a group's longest sample, the quadratic KV reads, KV pressure, preemption and admission waves are all
    counted, at the price of an event simulation per candidate (milliseconds for a few thousand samples).
    """

    def __init__(self, profile: TimePerTokenProfile) -> None:
        self.profile = profile

    def lengths(
        self,
        batch: PromptBatch,
        predicted: np.ndarray,
        spread: LengthSpread,
        caps: np.ndarray | None = None,
    ) -> np.ndarray:
        """Per-sample lengths (prompt order) for an estimate: the same draw for every candidate.
        ``caps`` (per prompt) bounds them further (a partial rollout's token budget)."""
        prompt_of = batch.sample_prompt_index()
        pred = np.asarray(predicted, dtype=np.float64)
        if pred.shape[0] == len(batch):  # one prediction per prompt: each of its samples
            pred = pred[prompt_of]
        cap = np.full(prompt_of.shape, float(max(spread.cap or int(self.profile.kv_capacity_tokens), 1)))
        if caps is not None:
            cap = np.minimum(cap, np.maximum(np.asarray(caps, dtype=np.float64)[prompt_of], 1.0))
        out = spread.scaled(pred, spread.factors(prompt_of), cap)
        return np.clip(np.rint(np.minimum(out, cap)), 0, cap).astype(np.int64)  # a response may be empty

    def _decode(self, c: Candidate, lengths: np.ndarray, actor: np.ndarray) -> tuple[float, float, list[int], float]:
        """(slowest engine's last token, billed engine-seconds, engines used, mean busy) for one draw."""
        s = EngineSamples.of_batch(c.batch, lengths, [], actor.tolist(), c.prefill)
        used = [e for e in run_engines(self.profile, s, c.num_actors, range(len(s.target))) if e.used]
        last = max((e.last_token for e in used), default=0.0)
        busy = float(np.mean([e.busy for e in used])) if used else 0.0
        return last, sum(e.last_token - e.first for e in used), [e.aid for e in used], busy

    def estimate(
        self,
        candidate: Candidate,
        migrates: bool = False,
        warm_actors: int = 0,
        spread: LengthSpread | None = None,
        caps: np.ndarray | None = None,
    ) -> CandidateEstimate:
        """One length draw (the same for every candidate, so candidates compare on equal terms). Taking the
        slowest of several draws per candidate was tried: it made a deadline scaler pick fewer engines, not more."""
        prof, batch, prefill = self.profile, candidate.batch, candidate.prefill
        actor = np.asarray(candidate.sample_actor, dtype=np.int64)
        if actor.shape[0] == len(batch) != batch.total_samples:
            actor = np.repeat(actor, batch.n_samples)
        lengths = self.lengths(batch, candidate.predicted, spread or LengthSpread(), caps=caps)
        decode, billed, used, busy = self._decode(candidate, lengths, actor)
        if migrates and used:  # cut-and-migrate sheds the slowest engine's tail down to the mean busy time
            decode = min(decode, max(busy, float(lengths.max(initial=0)) * prof.decode_base_s))
        cold = sum(1 for a in used if a >= warm_actors)
        start_up, prefill_actor_s, extra = start_up_and_prefill(prof, cold, prefill, warm_actors)
        gpu_seconds = prof.gpus_per_actor * billed + extra
        return CandidateEstimate(
            num_actors=candidate.num_actors, time_s=start_up + prefill_actor_s + decode, gpu_seconds=gpu_seconds
        )
