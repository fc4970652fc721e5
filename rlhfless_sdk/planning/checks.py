"""What every policy's output is checked against before a plan uses it (one check per kind), and how a policy's
failure is told (``InvalidPolicyOutput``, ``PolicyExit``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlhfless_sdk.api.batch import PromptBatch, readonly
from rlhfless_sdk.api.errors import PluginError, RlhflessError
from rlhfless_sdk.api.records import (
    Actor,
    ActorPlacement,
    Cluster,
    PrefillPlan,
)


class InvalidPolicyOutput(RlhflessError):
    """A policy returned something its protocol forbids."""


class PolicyExit(PluginError):
    """A policy ended the process (``sys.exit``: SystemExit): a plugin bug, which stops the run naming it."""


def whole(x: Any, what: str) -> int:
    """``x`` as an int when it is a whole number (an int, a numpy integer, an integral float); anything else,
    ``3.9`` or ``True``, is an invalid output, never silently truncated."""
    if isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_):
        return int(x)
    if isinstance(x, float | np.floating) and math.isfinite(x) and float(x).is_integer():
        return int(x)
    raise InvalidPolicyOutput(f"{what} {x!r} is not a whole number of actors")


def _reason(exc: BaseException) -> str:
    """Why a policy's call failed, in words: a write to its read-only inputs says so."""
    text = str(exc)
    if isinstance(exc, ValueError) and ("read-only" in text or "WRITEABLE" in text):
        return f"it wrote to its read-only inputs ({text}); a policy must copy an array to change it"
    return text


# -- output checks, one per kind --------------------------------------------------------------------------
#: No response is predicted longer than this (tokens): a larger value is a broken predictor, not a forecast.
MAX_PREDICTED_TOKENS = 10_000_000


def check_predictions(pred: Any, batch: PromptBatch) -> np.ndarray:
    """The predictions as a read-only copy (a policy keeping a reference cannot change them later)."""
    try:
        arr = np.array(pred, dtype=np.float64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidPolicyOutput(f"predicted lengths are not numbers: {exc}") from None
    if arr.shape != (len(batch),):
        raise InvalidPolicyOutput(f"predicted lengths have shape {arr.shape}, expected ({len(batch)},)")
    if arr.size and not (np.isfinite(arr).all() and arr.min() >= 0 and arr.max() <= MAX_PREDICTED_TOKENS):
        raise InvalidPolicyOutput(f"predicted lengths must be finite, >= 0 and <= {MAX_PREDICTED_TOKENS:,} tokens")
    return readonly(arr)


def check_prefill(plan: Any, batch: PromptBatch) -> PrefillPlan:
    if not isinstance(plan, PrefillPlan):
        raise InvalidPolicyOutput(f"prefill planner returned {type(plan).__name__}, expected PrefillPlan")
    if plan.prompt_group:
        if len(plan.prompt_group) != len(batch):
            raise InvalidPolicyOutput(
                f"prefill plan groups {len(plan.prompt_group)} prompts, the batch has {len(batch)}: "
                "a prompt would be lost or duplicated"
            )
        prefix = np.asarray(plan.group_prefix_tokens, dtype=np.int64)[np.asarray(plan.prompt_group)]
        if (prefix > batch.prompt_lengths).any():
            raise InvalidPolicyOutput("a group's shared prefix is longer than one of its prompts")
    return plan


def check_assignment(assigned: Any, batch: PromptBatch, num_actors: int) -> np.ndarray:
    """The decode actor of every sample (samples in prompt order), from a per-prompt or per-sample array."""
    arr = np.asarray(assigned)
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidPolicyOutput(f"assignment has dtype {arr.dtype}, expected integers")
    arr = arr.astype(np.int64)  # a copy: the policy may reuse its own array
    if arr.shape == (len(batch),):
        per_sample = np.repeat(arr, batch.n_samples)
    elif arr.shape == (batch.total_samples,):
        per_sample = arr
    else:
        raise InvalidPolicyOutput(
            f"assignment has shape {arr.shape} for {len(batch)} prompts / {batch.total_samples} samples: "
            "a sample would be lost or duplicated"
        )
    if per_sample.size and (per_sample.min() < 0 or per_sample.max() >= num_actors):
        raise InvalidPolicyOutput(f"assignment names actors outside [0, {num_actors})")
    return readonly(per_sample)


def check_order(order: Any, batch: PromptBatch) -> np.ndarray:
    """A dispatch order: every sample exactly once."""
    arr = np.asarray(order)
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidPolicyOutput(f"dispatch order has dtype {arr.dtype}, expected integers")
    arr = arr.astype(np.int64)
    s = batch.total_samples
    if arr.shape != (s,) or (s and not np.array_equal(np.sort(arr), np.arange(s))):
        raise InvalidPolicyOutput(f"dispatch order is not a permutation of the {s} samples: one would be lost")
    return arr


def check_placement(
    placements: Any, cluster: Cluster, num_actors: int, gpus_per_actor: int, extra: Sequence[Actor]
) -> list[ActorPlacement]:
    if not isinstance(placements, list) or not all(isinstance(p, ActorPlacement) for p in placements):
        raise InvalidPolicyOutput("placer must return a list of ActorPlacement")
    nodes = {n.name: n.num_gpus for n in cluster.nodes}
    want = {(a.role, a.actor_id) for a in extra} | {("decode", i) for i in range(num_actors)}
    got = [(p.actor.role, p.actor.actor_id) for p in placements]
    if len(got) != len(set(got)) or set(got) != want:
        raise InvalidPolicyOutput(f"placer placed {len(got)} actors, expected exactly {len(want)} distinct ones")
    used: set[tuple[str, int]] = set()
    for p in placements:
        if p.node not in nodes:
            raise InvalidPolicyOutput(f"placer used unknown node {p.node!r}")
        if p.actor.role == "decode" and p.actor.num_gpus != gpus_per_actor:
            raise InvalidPolicyOutput(f"decode actor {p.actor.actor_id} has {p.actor.num_gpus} GPUs")
        for g in p.gpu_indices:
            if g >= nodes[p.node] or (p.node, g) in used:
                raise InvalidPolicyOutput(f"GPU {g} of node {p.node!r} is out of range or used twice")
            used.add((p.node, g))
    return placements
