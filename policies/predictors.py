"""Length predictors: EWMA over each prompt's history (the paper), prompt length (naive), oracle (a bound)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import Field, PositiveInt

from rlhfless_sdk.batch import PromptBatch
from rlhfless_sdk.errors import RlhflessError
from rlhfless_sdk.records import FinishedSample, NoParams, Record


class EwmaParams(Record):
    alpha: float = Field(default=0.5, gt=0.0, le=1.0, description="Weight of the newest observation.")
    window: PositiveInt = Field(default=1, description="Past steps kept per prompt (the paper: 1 is enough).")
    cold_start: Literal["mean", "prompt-length", "constant"] = Field(
        default="mean", description="Prediction for a prompt never seen; see EwmaPredictor."
    )
    default_length: float = Field(default=512.0, ge=0.0, description="Used before anything has been observed.")


class EwmaPredictor:
    """Predicts a prompt's response length as an EWMA of its mean length in its last ``window`` steps.

    ``observe`` is called once per step with that step's finished samples; the n samples of a prompt are
    averaged into one observation. Cold start (a uid never observed): ``mean`` uses the mean length of the most
    recent step observed (``default_length`` before any), ``prompt-length`` uses the prompt's own length,
    ``constant`` always uses ``default_length``.
    """

    def __init__(self, params: EwmaParams | None = None) -> None:
        self.params = params or EwmaParams()
        self.history: dict[str, deque[float]] = {}
        self._estimate: dict[str, float] = {}
        self._recent_mean = self.params.default_length

    def _smooth(self, values: deque[float]) -> float:
        it = iter(values)
        est = next(it)
        for x in it:
            est = self.params.alpha * x + (1.0 - self.params.alpha) * est
        return est

    def predict(self, batch: PromptBatch) -> np.ndarray:
        p = self.params
        out = np.empty(len(batch), dtype=np.float64)
        if p.cold_start == "prompt-length":
            cold = batch.prompt_lengths.astype(np.float64)
        else:
            cold = np.full(len(batch), p.default_length if p.cold_start == "constant" else self._recent_mean)
        est = self._estimate
        for i, uid in enumerate(batch.uids):
            out[i] = est.get(uid, cold[i])
        return out

    def observe(self, samples: Sequence[FinishedSample]) -> None:
        if not samples:
            return
        sums: dict[str, list[float]] = {}
        for s in samples:
            acc = sums.setdefault(s.uid, [0.0, 0.0])
            acc[0] += s.response_length
            acc[1] += 1.0
        for uid, (total, count) in sums.items():
            hist = self.history.setdefault(uid, deque(maxlen=self.params.window))
            hist.append(total / count)
            self._estimate[uid] = self._smooth(hist)
        self._recent_mean = float(np.mean([s.response_length for s in samples]))


class PromptLengthParams(Record):
    scale: float = Field(default=1.0, ge=0.0, description="Predicted response length = scale * prompt length.")


class PromptLengthPredictor:
    """Naive baseline: a response is predicted to be ``scale`` times as long as its prompt."""

    def __init__(self, params: PromptLengthParams | None = None) -> None:
        self.scale = (params or PromptLengthParams()).scale

    def predict(self, batch: PromptBatch) -> np.ndarray:
        return batch.prompt_lengths.astype(np.float64) * self.scale

    def observe(self, samples: Sequence[FinishedSample]) -> None:
        return None


class OraclePredictor:
    """The true mean length of each prompt's samples: an upper bound for simulations, never a real policy."""

    def __init__(self, params: NoParams | None = None) -> None:
        pass

    def predict(self, batch: PromptBatch) -> np.ndarray:
        if batch.true_lengths is None:
            raise RlhflessError(
                "the oracle predictor needs the true response lengths (PromptBatch.true_lengths), which only a "
                "simulator knows; use it in `rlhfless simulate`, not in training"
            )
        return batch.true_lengths.astype(np.float64)

    def observe(self, samples: Sequence[FinishedSample]) -> None:
        return None
