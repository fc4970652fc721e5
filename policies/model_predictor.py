"""Model-based length prediction: a ridge regression on hashed token n-grams, trained online on CPU.

Features of a prompt: counts of its token unigrams and bigrams (and trigrams with ``ngram=3``) hashed into
``features`` buckets and L2-normalised, plus a bias and log(prompt length). The target is log(1 + mean response
length of the prompt's samples). Training keeps the sufficient statistics (X'X, X'y) of everything observed,
so each step refits exactly in one small solve; a smearing factor corrects the bias of predicting through the
log. Nothing is downloaded: the model is built from the prompts' own token ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pydantic import Field, PositiveInt

from rlhfless_sdk import FinishedSample, PromptBatch, Record

_K1, _K2, _K3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D


class ModelParams(Record):
    features: PositiveInt = Field(default=1024, le=1 << 16, description="Hashed n-gram buckets.")
    ngram: int = Field(default=2, ge=1, le=3, description="Longest n-gram hashed.")
    ridge: float = Field(default=1.0, gt=0.0, description="L2 penalty of the regression.")
    default_length: float = Field(default=512.0, ge=0.0, description="Prediction before any training.")


class HashedNgramRegressor:
    """The regression itself, usable by any predictor (``model``, ``hybrid``, plugins)."""

    def __init__(self, params: ModelParams | None = None) -> None:
        self.params = params or ModelParams()
        d = self.params.features + 2
        self.xtx = np.zeros((d, d))
        self.xty = np.zeros(d)
        self.coef: np.ndarray | None = None
        self.smear = 1.0
        self.observations = 0

    def features(self, batch: PromptBatch, rows: np.ndarray | None = None) -> np.ndarray:
        """(len(rows), features + 2) matrix for the given prompt indices (default: all)."""
        rows = np.arange(len(batch)) if rows is None else np.asarray(rows, dtype=np.int64)
        d = self.params.features
        x = np.zeros((len(rows), d + 2))
        x[:, d] = 1.0
        x[:, d + 1] = np.log1p(batch.prompt_lengths[rows])
        if batch.token_flat is None or len(rows) == 0:
            return x
        lengths = batch.prompt_lengths[rows]
        starts = batch.token_offsets[rows]
        owner = np.repeat(np.arange(len(rows)), lengths)
        pos = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        tok = batch.token_flat[np.repeat(starts, lengths) + pos].astype(np.uint64)
        grams = [(tok * np.uint64(_K1)) % np.uint64(d)]
        with np.errstate(over="ignore"):
            if self.params.ngram >= 2:
                ok = pos[1:] > 0
                h = (tok[:-1] * np.uint64(_K1) + tok[1:] * np.uint64(_K2)) % np.uint64(d)
                grams.append(np.where(ok, h, np.uint64(d)))
            if self.params.ngram >= 3:
                ok = pos[2:] > 1
                h = (tok[:-2] * np.uint64(_K1) + tok[1:-1] * np.uint64(_K2) + tok[2:] * np.uint64(_K3)) % np.uint64(d)
                grams.append(np.where(ok, h, np.uint64(d)))
        for k, g in enumerate(grams):  # bucket d collects the n-grams that would straddle two prompts
            who = owner[k:]
            counts = np.bincount(who * (d + 1) + g.astype(np.int64), minlength=len(rows) * (d + 1))
            x[:, :d] += counts.reshape(len(rows), d + 1)[:, :d]
        norm = np.linalg.norm(x[:, :d], axis=1, keepdims=True)
        x[:, :d] /= np.maximum(norm, 1.0)
        return x

    def fit_add(self, x: np.ndarray, lengths: np.ndarray, weights: np.ndarray) -> None:
        """Add observations (one row per prompt, its mean length, its sample count) and refit."""
        y = np.log1p(lengths)
        xw = x * weights[:, None]
        self.xtx += x.T @ xw
        self.xty += xw.T @ y
        self.observations += int(weights.sum())
        reg = self.params.ridge * np.eye(self.xtx.shape[0])
        reg[-2, -2] = 0.0  # no penalty on the bias
        self.coef = np.linalg.solve(self.xtx + reg, self.xty)
        resid = y - x @ self.coef
        self.smear = float(np.average(np.exp(resid), weights=weights))  # Duan's smearing estimate

    def predict(self, x: np.ndarray) -> np.ndarray:
        if self.coef is None:
            return np.full(x.shape[0], self.params.default_length)
        return np.maximum(np.expm1(x @ self.coef) * self.smear, 0.0)


class ModelPredictor:
    """``model``: response length regressed on the prompt's hashed token n-grams, trained online each step.

    It learns from every prompt it has seen (not only the same uid), so it also predicts prompts never seen.
    ``observe`` uses the features of the latest batch it predicted; a sample of another prompt contributes
    through its prompt length only.
    """

    description = "ridge regression on hashed token n-grams of the prompt, trained online"

    def __init__(self, params: ModelParams | None = None) -> None:
        self.model = HashedNgramRegressor(params)
        self._batch: PromptBatch | None = None
        self._index: dict[str, int] = {}

    def remember(self, batch: PromptBatch) -> None:
        self._batch = batch
        self._index = {u: i for i, u in enumerate(batch.uids)}

    def predict(self, batch: PromptBatch) -> np.ndarray:
        self.remember(batch)
        out = np.empty(len(batch))
        for lo in range(0, len(batch), 4096):  # bounded memory for very large batches
            rows = np.arange(lo, min(lo + 4096, len(batch)))
            out[rows] = self.model.predict(self.model.features(batch, rows))
        return out

    def observe(self, samples: Sequence[FinishedSample]) -> None:
        if not samples:
            return
        groups: dict[str, list[int]] = {}
        plen: dict[str, int] = {}
        for s in samples:
            groups.setdefault(s.uid, []).append(s.response_length)
            plen[s.uid] = s.prompt_length
        uids = list(groups)
        known = [u for u in uids if self._batch is not None and u in self._index]
        known_set = set(known)
        unknown = [u for u in uids if u not in known_set]
        rows = []
        if known:
            assert self._batch is not None
            rows.append(self.model.features(self._batch, np.array([self._index[u] for u in known])))
        if unknown:
            lone = PromptBatch(
                uids=unknown,
                prompt_lengths=np.array([plen[u] for u in unknown], dtype=np.int64),
                n_samples=np.ones(len(unknown), dtype=np.int64),
            )
            rows.append(self.model.features(lone))
        order = known + unknown
        x = np.vstack(rows)
        self.model.fit_add(
            x,
            np.array([np.mean(groups[u]) for u in order]),
            np.array([len(groups[u]) for u in order], dtype=np.float64),
        )
