"""Length predictors: EWMA over each prompt's history (the paper), prompt length (naive), oracle (a bound)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import Field, PositiveInt
from rlhfless_policies._base import Parameterless
from rlhfless_policies.model_predictor import ModelParams, ModelPredictor

from rlhfless_sdk import (
    FinishedSample,
    HistoryError,
    HistoryLocked,
    LengthHistory,
    PromptBatch,
    Record,
    RlhflessError,
    StepProgress,
)

log = logging.getLogger("rlhfless.predictors")


class EwmaParams(Record):
    alpha: float = Field(default=0.5, gt=0.0, le=1.0, description="Weight of the newest observation.")
    window: PositiveInt = Field(default=1, description="Past steps kept per prompt (the paper: 1 is enough).")
    cold_start: Literal["mean", "prompt-length", "constant"] = Field(
        default="mean", description="Prediction for a prompt never seen; see EwmaPredictor."
    )
    default_length: float = Field(default=512.0, ge=0.0, description="Used before anything has been observed.")
    history_path: str | None = Field(
        default=None,
        min_length=1,
        description="SQLite file for the length history (survives restarts, shared by processes); "
        "default: an in-memory SQLite store, private to this run.",
    )
    history_timeout_s: float = Field(
        default=60.0, gt=0.0, description="How long a write waits for another process's lock on the history file."
    )
    history_best_effort: bool = Field(
        default=False,
        description="A failed history write (locked, read-only) only warns, and the step's lengths are kept for "
        "this run only; by default it stops the run.",
    )


class EwmaPredictor:
    """Predicts a prompt's response length as an EWMA of its mean length in its last ``window`` steps.

    ``observe`` is called once per step with that step's finished samples; the n samples of a prompt are
    averaged into one observation, stored in the SQLite length history. Cold start (a uid with no history):
    ``mean`` uses the mean length of the most recent step observed (``default_length`` before any),
    ``prompt-length`` uses the prompt's own length, ``constant`` always uses ``default_length``.
    """

    description = "EWMA of each prompt's response length in its last steps (RLHFless)"

    def __init__(self, params: EwmaParams | None = None) -> None:
        self.params = params or EwmaParams()
        try:
            self.store = LengthHistory(self.params.history_path, timeout_s=self.params.history_timeout_s)
        except HistoryLocked as exc:
            if not self.params.history_best_effort:
                raise
            log.warning("%s; this run's lengths are kept for this run only (history_best_effort)", exc)
            self.store = LengthHistory(None)
        self._persistent = self.store.path is not None
        self._estimate: dict[str, float] = {}
        recent = self.store.last_step_mean()
        self._recent_mean = self.params.default_length if recent is None else recent

    def smooth(self, values: Sequence[float]) -> float:
        it = iter(values)
        est = next(it)
        for x in it:
            est = self.params.alpha * x + (1.0 - self.params.alpha) * est
        return est

    def known(self, uids: Sequence[str]) -> dict[str, float]:
        """Estimates of the uids that have a history (loading from a persistent store what is not cached)."""
        est = self._estimate
        if self._persistent:
            missing = [u for u in uids if u not in est]
            for uid, values in self.store.recent(missing, self.params.window).items():
                est[uid] = self.smooth(values)
        return est

    def predict(self, batch: PromptBatch) -> np.ndarray:
        p = self.params
        if p.cold_start == "prompt-length":
            cold = batch.prompt_lengths.astype(np.float64)
        else:
            cold = np.full(len(batch), p.default_length if p.cold_start == "constant" else self._recent_mean)
        est = self.known(batch.uids)
        out = np.empty(len(batch), dtype=np.float64)
        for i, uid in enumerate(batch.uids):
            out[i] = est.get(uid, cold[i])
        return out

    def observe(self, samples: Sequence[FinishedSample]) -> None:
        if not samples:
            return
        groups: dict[str, list[float]] = {}
        for s in samples:
            groups.setdefault(s.uid, []).append(float(s.response_length))
        try:
            self.store.record(groups)
        except HistoryError as exc:
            if not self.params.history_best_effort:
                raise
            log.warning("%s; this step's lengths are kept for this run only (history_best_effort)", exc)
        for uid, values in self.store.recent(list(groups), self.params.window).items():
            self._estimate[uid] = self.smooth(values)
        self._recent_mean = float(np.mean([s.response_length for s in samples]))


class PromptLengthParams(Record):
    scale: float = Field(default=1.0, ge=0.0, description="Predicted response length = scale * prompt length.")


class PromptLengthPredictor:
    """Naive baseline: a response is predicted to be ``scale`` times as long as its prompt."""

    description = "naive baseline: response length proportional to prompt length"

    def __init__(self, params: PromptLengthParams | None = None) -> None:
        self.scale = (params or PromptLengthParams()).scale

    def predict(self, batch: PromptBatch) -> np.ndarray:
        return batch.prompt_lengths.astype(np.float64) * self.scale

    def observe(self, samples: Sequence[FinishedSample]) -> None:
        return None


class OraclePredictor(Parameterless):
    """The true mean length of each prompt's samples: an upper bound for simulations, never a real policy."""

    description = "true lengths, for simulation bounds only"

    def predict(self, batch: PromptBatch) -> np.ndarray:
        if batch.true_lengths is None:
            raise RlhflessError(
                "the oracle predictor needs the true response lengths (PromptBatch.true_lengths), which only a "
                "simulator knows; use it in `rlhfless simulate`, not in training"
            )
        return batch.true_lengths.astype(np.float64)

    def observe(self, samples: Sequence[FinishedSample]) -> None:
        return None


class GroupParams(EwmaParams):
    prior: float = Field(default=1.0, ge=0.0, description="Weight, in samples, of the history in the blend.")


class GroupPredictor(EwmaPredictor):
    """Beyond the paper: EWMA before the step, then, during it, each GRPO group's finished samples re-estimate
    their unfinished siblings (``refine``; the migration controller calls it before the migrator).

    A sample still running after g tokens is predicted as the mean of its finished siblings that ran longer
    than g, blended with the history (``prior`` samples' weight); if every finished sibling was shorter,
    1.25 g. Samples without finished siblings keep their prediction.
    """

    description = "EWMA, refined mid-step from finished GRPO siblings (beyond the paper)"

    def __init__(self, params: GroupParams | None = None) -> None:
        super().__init__(params or GroupParams())
        self.prior = (params or GroupParams()).prior

    def refine(self, progress: StepProgress) -> StepProgress:
        if not progress.finished:
            return progress
        updated = []
        for s in progress.unfinished:
            done = progress.finished.get(s.uid)
            if not done:
                updated.append(s)
                continue
            base = s.planned_length if s.planned_length is not None else s.predicted_length
            g = s.tokens_generated
            longer = [x for x in done if x > g]
            if longer:
                est = (sum(longer) + self.prior * max(base, g + 1.0)) / (len(longer) + self.prior)
            else:
                est = max(base, 1.25 * g)
            updated.append(s.model_copy(update={"predicted_length": max(est, g + 1.0), "planned_length": base}))
        return progress.model_copy(update={"unfinished": updated})


class HybridParams(EwmaParams):
    features: PositiveInt = Field(default=1024, le=1 << 16)
    ngram: int = Field(default=2, ge=1, le=3)
    ridge: float = Field(default=1.0, gt=0.0)


class HybridPredictor:
    """Beyond the paper: a prompt's own history (EWMA) when it has one; the ``model`` regression otherwise."""

    description = "EWMA for prompts with a history, the model for new ones (beyond the paper)"

    def __init__(self, params: HybridParams | None = None) -> None:
        p = params or HybridParams()
        self.ewma = EwmaPredictor(EwmaParams(**{k: getattr(p, k) for k in EwmaParams.model_fields}))
        self.model = ModelPredictor(
            ModelParams(features=p.features, ngram=p.ngram, ridge=p.ridge, default_length=p.default_length)
        )

    def predict(self, batch: PromptBatch) -> np.ndarray:
        out = self.model.predict(batch)
        known = self.ewma.known(batch.uids)
        for i, uid in enumerate(batch.uids):
            if uid in known:
                out[i] = known[uid]
        return out

    def observe(self, samples: Sequence[FinishedSample]) -> None:
        self.ewma.observe(samples)
        self.model.observe(samples)
