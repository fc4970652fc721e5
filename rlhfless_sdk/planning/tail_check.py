"""Whether tail batching pays for the next round, from the predicted lengths (a straggler policy's ``tail_margin``).

Tail batching starts (1 + x) x B groups, trains the first B to complete and defers the rest, which run later in
rounds of B deferred groups each. Per trained group that costs ``(k * short + long) / ((k + 1) * B)``, with
``short`` the time until the B-th group of a short round completes, ``long`` a round of B groups like the ones it
defers, and ``k = B / deferred`` short rounds per long one; a plain step costs ``plain / B``, its first B groups
run to their end. Each is the engine model (``EngineModel``) run on the check model's lengths for these prompts
(the predictions with the learned spread and runaway share, ``EngineCostModel.lengths``), samples dealt round
robin to the engines. Where the long rounds are as slow as the steps they spare (a runaway in every fifth group,
say), tail batching only adds the aborted tokens, and the check says so; so a better predictor makes the choice
better.

With a migrator that evens out the tail's KV (``balance``), a round that runs to its end ends nearer the mean
engine's work, or its longest sample's own decode steps, whichever is later, than round robin's slowest engine:
the migrator's ``balanced_share`` of the gap between the two, for samples of the run's length cap (``balance``
moves a sample only while it may decode ``min_left`` more tokens, so under a short cap it moves none).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from rlhfless_sdk.api.records import TimePerTokenProfile
from rlhfless_sdk.planning.engine_model import EngineModel, EngineSamples, run_engines


@dataclass(frozen=True)
class TailEstimate:
    """The predicted seconds per trained group with and without tail batching, and the round times they come from."""

    plain_s: float
    short_s: float
    long_s: float
    train: int
    deferred: int

    @property
    def per_group_plain(self) -> float:
        return self.plain_s / self.train

    @property
    def per_group_tail(self) -> float:
        if self.deferred <= 0:
            return self.short_s / self.train
        k = self.train / self.deferred  # short rounds per long round
        return (k * self.short_s + self.long_s) / ((k + 1) * self.train)

    def pays(self, margin: float) -> bool:
        """Whether tail batching is at least ``margin`` faster per trained group."""
        return self.per_group_tail <= (1.0 - margin) * self.per_group_plain


def _run(
    profile: TimePerTokenProfile, engines: int, groups: list[np.ndarray], prompt_len: list[int]
) -> tuple[np.ndarray, list[EngineModel]]:
    """Each group's completion time when ``groups`` (response lengths of each group's samples) run together, and
    the engines that ran them."""
    sizes = [len(g) for g in groups]
    group = np.repeat(np.arange(len(groups)), sizes)
    index = np.concatenate([np.arange(n) for n in sizes]) if groups else np.zeros(0, dtype=np.int64)
    target = np.concatenate(groups) if groups else np.zeros(0, dtype=np.int64)
    n = len(target)
    s = EngineSamples(
        group.tolist(),
        index.tolist(),
        np.repeat(np.asarray(prompt_len), sizes).tolist(),
        [0] * n,
        target.astype(np.int64).tolist(),
        [],
        (np.arange(n) % engines).tolist(),
    )
    models = run_engines(profile, s, engines, range(n))
    finish = np.asarray(s.finish_time, dtype=np.float64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return (np.maximum.reduceat(finish, offsets[:-1]) if n else np.zeros(0)), models


def _round_s(
    profile: TimePerTokenProfile, engines: int, groups: list[np.ndarray], prompt_len: list[int], balanced: float
) -> float:
    """Seconds until the last of ``groups`` completes: the slowest engine's end, less the share ``balanced`` of its
    gap to the balanced end (the mean engine's work or the longest sample's own decode steps, whichever is
    longer)."""
    done, models = _run(profile, engines, groups, prompt_len)
    slowest = float(done.max(initial=0.0))
    if balanced <= 0.0 or not len(done):
        return slowest
    longest = max(int(g.max(initial=0)) for g in groups)
    even = max(float(np.mean([m.busy for m in models])), longest * profile.decode_base_s)
    return slowest - min(balanced, 1.0) * max(slowest - even, 0.0)


def estimate_tail(
    profile: TimePerTokenProfile,
    lengths: list[np.ndarray],
    prompt_len: list[int],
    train: int,
    engines: int,
    balanced: float = 0.0,
) -> TailEstimate:
    """The estimate for a short round of the groups ``lengths`` (each group's samples' response lengths, in
    start order; ``prompt_len`` each group's prompt), B = ``train``, on ``engines`` engines; ``balanced``: the share
    of the rounds run to their end (the plain step and the long round) whose imbalance a migrator evens out."""
    if not 0 < train <= len(lengths) or engines < 1:
        raise ValueError(f"a round of {len(lengths)} groups cannot train {train} on {engines} engines")
    plain = _round_s(profile, engines, lengths[:train], prompt_len[:train], balanced)
    done, _ = _run(profile, engines, lengths, prompt_len)
    order = np.argsort(done, kind="stable")
    short = float(done[order[train - 1]])
    deferred = [int(g) for g in order[train:]]
    if not deferred:
        return TailEstimate(plain, short, 0.0, train, 0)
    reps = math.ceil(train / len(deferred))
    tiled = (deferred * reps)[:train]  # a long round: B groups like the ones deferred
    long = _round_s(profile, engines, [lengths[g] for g in tiled], [prompt_len[g] for g in tiled], balanced)
    return TailEstimate(plain, short, long, train, len(deferred))
