"""Returning samples to the trainer: each prompt's n samples adjacent, prompts in batch order.

Group advantage estimators (GRPO group_norm, RLOO, Dr. GRPO) reshape rewards by list position into rows of
n, so a backend must hand back exactly the samples it was given, regrouped, whatever order they finished
in and wherever they were migrated.
"""

from __future__ import annotations

from collections.abc import Iterable

from rlhfless_sdk.api.batch import PromptBatch
from rlhfless_sdk.api.errors import RlhflessError
from rlhfless_sdk.api.records import FinishedSample


class SampleAccountingError(RlhflessError):
    """A sample is missing, duplicated or unknown: the step's output would corrupt training."""


def regroup(batch: PromptBatch, samples: Iterable[FinishedSample]) -> list[FinishedSample]:
    """``samples`` in prompt order, sample_index order within a prompt; every expected sample exactly once."""
    index = {uid: i for i, uid in enumerate(batch.uids)}
    if len(index) != len(batch):
        raise SampleAccountingError("prompt uids repeat within the batch; make them unique per step")
    offsets = batch.sample_offsets
    slots: list[FinishedSample | None] = [None] * batch.total_samples
    for s in samples:
        i = index.get(s.uid)
        if i is None or s.sample_index >= batch.n_samples[i]:
            raise SampleAccountingError(f"sample {s.uid!r}#{s.sample_index} belongs to no prompt of this step")
        pos = int(offsets[i]) + s.sample_index
        if slots[pos] is not None:
            raise SampleAccountingError(f"sample {s.uid!r}#{s.sample_index} was returned twice")
        slots[pos] = s
    missing = [pos for pos, s in enumerate(slots) if s is None]
    if missing:
        first = missing[0]
        i = int(batch.sample_prompt_index()[first])
        raise SampleAccountingError(
            f"{len(missing)} sample(s) missing, the first {batch.uids[i]!r}#{first - int(offsets[i])}"
        )
    return slots  # type: ignore[return-value]
