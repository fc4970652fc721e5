"""Length replay: real engines made to stop each sample at a length taken from a trace.

Serving benchmarks check a simulator on real engines by forcing output lengths from a dataset (ignore EOS, each
request's max tokens its length). ``LengthReplay`` does that for a rollout: each group a run starts is given the
next group of the trace (the trace's steps in order, its groups in order within a step, round again when every
group has been used), and sample ``j`` of it the length of the trace group's sample ``j mod n``. Lengths are
scaled by one factor so that the trace's longest response is at most the run's cap (``scale``), then clipped to
``[1, cap]``. The scheduler sees nothing of this: it predicts from history as always; only the engine's stopping
point comes from the trace.

A group keeps its lengths until it trains (``release``): a group whose samples are carried into a later step
(partial rollouts) or whose prompt is deferred and re-run from scratch (tail batching) stops at the same lengths
when it runs again, as the simulator replays it; a prompt that comes back after it trained (the next epoch) is a
new group and takes the next trace group.
"""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path
from typing import Any

import numpy as np

from rlhfless_sdk.api.errors import RlhflessError
from rlhfless_sdk.workloads.synthetic import SyntheticWorkload
from rlhfless_sdk.workloads.traces import Workload, load_trace

#: the synthetic long-reasoning replay input scaled to two CPU cores: log-normal lengths, runaways to the cap
LONG_REASONING = {"median": 0.18, "prompt_sigma": 0.6, "sample_sigma": 0.5, "runaway": 0.05}


class LengthReplay:
    """Each group of a run mapped onto a group of ``workload`` (a trace), its samples' lengths scaled to ``cap``."""

    def __init__(self, workload: Workload, cap: int, scale: float | None = None, name: str | None = None) -> None:
        if cap < 1:
            raise RlhflessError(f"length replay needs a response cap of at least 1 token; got {cap}")
        self.groups: list[np.ndarray] = []
        for ws in workload.steps:
            off = ws.batch.sample_offsets
            for i in range(len(ws.batch)):
                lengths = np.asarray(ws.lengths[int(off[i]) : int(off[i + 1])], dtype=np.int64)
                if lengths.size:
                    self.groups.append(lengths)
        if not self.groups:
            raise RlhflessError(f"length replay: {workload.name!r} holds no sample to take lengths from")
        longest = max(int(g.max()) for g in self.groups)
        if scale is None:
            scale = min(1.0, cap / longest) if longest > 0 else 1.0
        if not scale > 0:
            raise RlhflessError(f"length replay: the scale on the trace's lengths must be positive; got {scale}")
        self.cap, self.scale = int(cap), float(scale)
        self.name = name or workload.name
        self.steps = len(workload.steps)
        self.next = 0  # the trace group the next new run group takes
        self.used = 0  # trace groups handed out so far (rounds included)
        self.assigned: dict[Hashable, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.groups)

    def _group(self, k: int) -> np.ndarray:
        scaled = np.rint(self.groups[k].astype(np.float64) * self.scale)
        return np.clip(scaled, 1, self.cap).astype(np.int64)

    def lengths(self, key: Hashable, n: int) -> list[int]:
        """The ``n`` lengths of the run group ``key`` (its prompt's uid): the ones it was given, or the next trace
        group's."""
        got = self.assigned.get(key)
        if got is None:
            got = self._group(self.next)
            self.next = (self.next + 1) % len(self.groups)
            self.used += 1
            self.assigned[key] = got
        return _pick(got, n)

    def given(self, key: Hashable, n: int) -> list[int] | None:
        """The ``n`` lengths group ``key`` was given, or None if it was given none."""
        got = self.assigned.get(key)
        return None if got is None else _pick(got, n)

    def release(self, key: Hashable) -> None:
        """Group ``key`` trained: its prompt, when it comes back, is a new group."""
        self.assigned.pop(key, None)

    def describe(self) -> dict[str, Any]:
        """What the report and the plot say about the replay."""
        return {
            "lengths_from": self.name,
            "trace_groups": len(self.groups),
            "trace_steps": self.steps,
            "scale": self.scale,
            "cap": self.cap,
            "groups_used": self.used,
        }

    # -- snapshots (a checkpoint's) --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"next": self.next, "used": self.used, "assigned": {k: v.tolist() for k, v in self.assigned.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next, self.used = int(state["next"]) % len(self.groups), int(state["used"])
        self.assigned = {k: np.asarray(v, dtype=np.int64) for k, v in state["assigned"].items()}


def _pick(lengths: np.ndarray, n: int) -> list[int]:
    """``n`` samples' lengths from a group's: sample j takes the group's sample j mod its size."""
    return [int(lengths[j % lengths.size]) for j in range(n)]


def long_reasoning_workload(cap: int, prompts: int = 64, samples: int = 4, steps: int = 4, seed: int = 0) -> Workload:
    """The synthetic long-reasoning replay input at a small scale: median response ``LONG_REASONING['median']``
    of the cap, log-normal across prompts and within a group, a share of runaways that hit the cap."""
    from rlhfless_sdk.workloads.traces import synthetic_workload

    spec = LONG_REASONING
    synthetic = SyntheticWorkload(
        prompts,
        samples,
        median_length=spec["median"] * cap,
        prompt_sigma=spec["prompt_sigma"],
        sample_sigma=spec["sample_sigma"],
        max_length=cap,
        runaway=spec["runaway"],
        seed=seed,
    )
    out = synthetic_workload(synthetic, steps)
    out.name = f"long-reasoning-cap{cap}"
    return out


def replay_from(source: str | Path, cap: int, seed: int = 0) -> LengthReplay:
    """A replay from a trace file or folder, or ``long-reasoning`` (the synthetic input at ``cap``)."""
    if str(source) == "long-reasoning":
        return LengthReplay(long_reasoning_workload(cap, seed=seed), cap)
    path = Path(source)
    if not path.exists():
        raise RlhflessError(f"length replay: no trace at {path} (a trace file or folder, or 'long-reasoning')")
    return LengthReplay(load_trace(path), cap, name=path.name)
