"""Hypothesis strategies shared by the policy tests (imported by file path, never as a package)."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from rlhfless_sdk.api.batch import PromptBatch
from rlhfless_sdk.api.records import ActorProgress, Cluster, Node, SampleProgress, StepProgress


@st.composite
def prompt_batches(draw, max_prompts: int = 30, with_tokens: bool | None = None, equal_n: bool | None = None):
    """Prompts that often share templates (small vocabulary, common prefixes), with varied or equal n."""
    p = draw(st.integers(0, max_prompts))
    tokens = draw(st.booleans()) if with_tokens is None else with_tokens
    same_n = draw(st.booleans()) if equal_n is None else equal_n
    n0 = draw(st.integers(1, 8))
    n = [n0] * p if same_n else draw(st.lists(st.integers(1, 8), min_size=p, max_size=p))
    templates = draw(st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=6), min_size=1, max_size=3))
    rows = []
    for _ in range(p):
        head = draw(st.sampled_from(templates))
        rows.append(head + draw(st.lists(st.integers(0, 3), max_size=5)))
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    flat = np.array([t for r in rows for t in r], dtype=np.int64) if tokens else None
    true = np.array(draw(st.lists(st.floats(0, 4096), min_size=p, max_size=p)))
    return PromptBatch(
        uids=[f"u{i}" for i in range(p)],
        prompt_lengths=lengths,
        n_samples=np.array(n, dtype=np.int64),
        token_flat=flat,
        true_lengths=true,
    )


def predictions(p: int):
    return st.lists(st.floats(0, 4096, allow_nan=False) | st.sampled_from([0.0, 100.0]), min_size=p, max_size=p).map(
        lambda x: np.array(x, dtype=np.float64)
    )


@st.composite
def clusters(draw, min_gpus: int = 1):
    nodes = draw(st.lists(st.integers(1, 8), min_size=1, max_size=5))
    if sum(nodes) < min_gpus:
        nodes.append(min_gpus - sum(nodes))
    return Cluster(nodes=[Node(name=f"n{i}", num_gpus=g) for i, g in enumerate(nodes)])


@st.composite
def step_progress(draw, kv=False):
    """A mid-step snapshot: actors with planned/generated tokens and free slots, unfinished samples on them;
    ``kv``: each actor also states the KV its running samples hold (their tokens and prompts) and its capacity."""
    num_actors = draw(st.integers(1, 8))
    unfinished = []
    for a in range(num_actors):
        for k in range(draw(st.integers(0, 5))):
            unfinished.append(
                SampleProgress(
                    uid=f"a{a}s{k}",
                    sample_index=draw(st.integers(0, 3)),
                    actor_id=a,
                    tokens_generated=draw(st.integers(0, 2000)),
                    predicted_length=draw(st.floats(0, 2000)),
                    max_tokens=4096,
                    migrations=draw(st.integers(0, 2)),
                )
            )
    actors = []
    for a in range(num_actors):
        mine = [s for s in unfinished if s.actor_id == a]
        extra = {}
        if kv:
            context = sum(s.tokens_generated + draw(st.integers(1, 300)) for s in mine)
            extra = {"context_tokens": context, "kv_capacity_tokens": context + draw(st.integers(1, 12_000))}
        actors.append(
            ActorProgress(
                actor_id=a,
                planned_tokens=draw(st.floats(0, 10_000)),
                generated_tokens=draw(st.integers(0, 12_000)),
                running=len(mine),
                waiting=draw(st.integers(0, 2)) if kv else 0,
                free_slots=draw(st.integers(0, 4)),
                **extra,
            )
        )
    total = len(unfinished) + draw(st.integers(0, 40))
    return StepProgress(step=0, total_samples=total, actors=actors, unfinished=unfinished)
