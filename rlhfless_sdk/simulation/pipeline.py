"""OpenRLHF's asynchronous training loop (``--train.async_enable``) as a timeline: when each batch is generated,
trained and its weights broadcast, given how long each part takes.

Two processes share the rollout engines, as in OpenRLHF 0.11.2's ``PPOTrainerAsync``:

- the generator takes a slot from a pool of ``queue_size`` (the bound on batches generated ahead), generates
  batch k and queues it;
- the trainer takes batch k from the queue (returning its slot, so the generator may start the next batch),
  trains on it, then broadcasts the new weights to the engines.

Without partial rollout a vLLM lock keeps generation and broadcast apart: a broadcast waits for the batch
being generated to finish, and a batch waits for a broadcast under way. With partial rollout the generator
takes no lock: the broadcast pauses the engines, and generation goes on with the new weights afterwards.

Weights start at version 0; the broadcast after training batch j installs version j + 1. Batch k trains on
version k, so a token generated under version v is ``k - v`` updates old.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass
class BatchTimes:
    """One batch's life on the pipeline's clock (seconds from the start of the run)."""

    gen_start: float = 0.0
    gen_end: float = 0.0
    train_start: float = 0.0
    train_end: float = 0.0
    sync_start: float = 0.0
    sync_end: float = 0.0
    version: int = 0  # weights the engines held when the batch started generating
    pauses: list[tuple[float, float]] = field(default_factory=list)  # broadcasts (start, end) while it generated


#: generate(k, start, pauses) -> when batch k's last sample finished, its generation started at ``start`` and
#: paused for each broadcast in ``pauses`` (absolute (start, end), partial rollout only) still running then.
Generate = Callable[[int, float, list[tuple[float, float]]], float]


def partial_pipeline(
    steps: int, generate: Generate, train_s: Sequence[float], sync_s: float, queue_size: int
) -> list[BatchTimes]:
    """Partial rollout: no lock, so the trainer's broadcasts depend only on batches generated before; each
    batch is generated through the broadcasts that fall in its window."""
    out: list[BatchTimes] = []
    for k in range(steps):
        b = BatchTimes()
        slot = out[k - queue_size].train_start if k >= queue_size else 0.0
        b.gen_start = max(out[k - 1].gen_end if k else 0.0, slot)
        b.version = sum(1 for j in out if j.sync_end <= b.gen_start)
        b.pauses = [(j.sync_start, j.sync_end) for j in out if j.sync_end > b.gen_start]
        b.gen_end = generate(k, b.gen_start, b.pauses)
        b.train_start = max(b.gen_end, out[k - 1].sync_end if k else 0.0)
        b.train_end = b.train_start + train_s[k]
        b.sync_start, b.sync_end = b.train_end, b.train_end + sync_s
        out.append(b)
    return out


def locked_pipeline(
    steps: int, generate: Generate, train_s: Sequence[float], sync_s: float, queue_size: int
) -> list[BatchTimes]:
    """No partial rollout: generation and broadcast hold one FIFO lock, so each is atomic; a small event loop."""
    out = [BatchTimes() for _ in range(steps)]
    events: list[tuple[float, int, str, int]] = []
    seq = 0

    def push(t: float, kind: str, k: int = -1) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, k))
        seq += 1

    slots, queue, waiting = queue_size, deque[int](), deque[tuple[str, int]]()
    holder: tuple[str, int] | None = None
    next_batch, version, trainer_idle, wants_slot = 0, 0, True, False

    def grant(who: tuple[str, int], now: float) -> None:
        nonlocal holder, next_batch
        holder = who
        kind, k = who
        if kind == "gen":
            b = out[k]
            b.gen_start, b.version = now, version
            b.gen_end = generate(k, now, [])
            push(b.gen_end, "gen_done", k)
        else:
            out[k].sync_start = now
            push(now + sync_s, "sync_done", k)

    def lock(who: tuple[str, int], now: float) -> None:
        if holder is None:
            grant(who, now)
        else:
            waiting.append(who)

    def unlock(now: float) -> None:
        nonlocal holder
        holder = None
        if waiting:
            grant(waiting.popleft(), now)

    def try_train(now: float) -> None:
        nonlocal trainer_idle, slots, wants_slot
        if trainer_idle and queue:
            k = queue.popleft()
            trainer_idle = False
            slots += 1
            if wants_slot:
                wants_slot = False
                push(now, "gen_ready")
            out[k].train_start = now
            out[k].train_end = now + train_s[k]
            push(out[k].train_end, "train_done", k)

    push(0.0, "gen_ready")
    while events:
        now, _, kind, k = heapq.heappop(events)
        if kind == "gen_ready":
            if next_batch == steps:
                continue
            if slots == 0:
                wants_slot = True
                continue
            slots -= 1
            lock(("gen", next_batch), now)
            next_batch += 1
        elif kind == "gen_done":
            unlock(now)
            queue.append(k)
            try_train(now)
            push(now, "gen_ready")
        elif kind == "train_done":
            lock(("sync", k), now)
        elif kind == "sync_done":
            out[k].sync_end = now
            version += 1
            unlock(now)
            trainer_idle = True
            try_train(now)
    return out


def token_ages(batch: int, version: int, tokens_before_pauses: Sequence[int], total: int) -> tuple[int, int]:
    """(stale tokens, largest age) of batch ``batch`` that started under weights ``version`` and was paused for a
    broadcast after ``tokens_before_pauses[i]`` of its ``total`` tokens (each pause installs the next version)."""
    bounds = [*tokens_before_pauses, total]
    stale, oldest, prev = 0, 0, 0
    for i, upto in enumerate(bounds):
        n = upto - prev
        age = batch - (version + i)
        if n > 0 and age > 0:
            stale += n
            oldest = max(oldest, age)
        prev = upto
    return stale, oldest
