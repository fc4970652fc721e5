"""``max-recent``: an example third-party rlhfless length predictor, registered through the entry point."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np
from pydantic import Field, PositiveInt

from rlhfless_sdk import FinishedSample, PolicySpec, PromptBatch, Record, hookimpl


class MaxRecentParams(Record):
    window: PositiveInt = Field(default=3, description="Steps of history per prompt.")
    default_length: float = Field(default=512.0, ge=0.0, description="Prediction before anything is observed.")


class MaxRecentPredictor:
    """The largest of a prompt's last ``window`` step means; unseen prompts get the latest step's largest mean."""

    def __init__(self, params: MaxRecentParams) -> None:
        self.params = params
        self.history: dict[str, deque[float]] = {}
        self.cold = params.default_length

    def predict(self, batch: PromptBatch) -> np.ndarray:
        return np.array([max(self.history[u]) if u in self.history else self.cold for u in batch.uids], dtype=float)

    def observe(self, samples: Sequence[FinishedSample]) -> None:
        groups: dict[str, list[int]] = {}
        for s in samples:
            groups.setdefault(s.uid, []).append(s.response_length)
        for uid, lengths in groups.items():
            self.history.setdefault(uid, deque(maxlen=self.params.window)).append(float(np.mean(lengths)))
        if groups:
            self.cold = max(float(np.mean(v)) for v in groups.values())


@hookimpl
def rlhfless_register_predictors(register):
    register(
        PolicySpec(
            name="max-recent",
            factory=MaxRecentPredictor,
            params=MaxRecentParams,
            description="largest of the last steps' mean lengths (example third-party plugin)",
        )
    )
