"""Synthetic GSM8K-style workloads: prompts sharing chat templates, long-tailed response lengths."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rlhfless_sdk.api.batch import PromptBatch
from rlhfless_sdk.api.records import FinishedSample


@dataclass(frozen=True)
class SyntheticWorkload:
    """Prompts built from a few shared templates plus a random question; lengths from a log-normal.

    Each prompt has a mean response length drawn around ``median_length`` (spread ``prompt_sigma``); at each
    training ``step`` that mean drifts (spread ``step_sigma``) and each sample varies around it (spread
    ``sample_sigma``); lengths are clipped to [1, max_length]. A ``runaway`` share of samples never stops and
    hits ``max_length`` (repetition loops; drawn from a stream of its own, so the other lengths do not change).
    The prompts depend on ``seed`` only, so every step replays the same prompts (epochs) with new lengths.
    """

    num_prompts: int
    n_samples: int = 8
    templates: int = 4
    template_tokens: int = 48
    question_tokens: tuple[int, int] = (32, 160)
    median_length: float = 300.0
    prompt_sigma: float = 0.6
    sample_sigma: float = 0.35
    max_length: int = 1024
    vocab: int = 32000
    seed: int = 0
    step: int = 0
    step_sigma: float = 0.15
    runaway: float = 0.0
    scale: float = 1.0  # this step's lengths grow by this factor (``synthetic_workload``'s length growth)

    def batch(self) -> tuple[PromptBatch, np.ndarray]:
        """The prompts (with token ids and true per-prompt mean lengths) and every sample's true length."""
        rng = np.random.default_rng(self.seed)
        p = self.num_prompts
        qlen = rng.integers(self.question_tokens[0], self.question_tokens[1] + 1, size=p)
        lengths = self.template_tokens + qlen
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        flat = rng.integers(0, self.vocab, size=int(lengths.sum()))
        templates = rng.integers(0, self.vocab, size=(self.templates, self.template_tokens))
        which = rng.integers(0, self.templates, size=p)
        flat[offsets[:, None] + np.arange(self.template_tokens)] = templates[which]
        mean = self.median_length * rng.lognormal(0.0, self.prompt_sigma, size=p)
        step_rng = np.random.default_rng([self.seed, self.step])
        mean = mean * step_rng.lognormal(0.0, self.step_sigma, size=p) * self.scale
        noise = step_rng.lognormal(0.0, self.sample_sigma, size=p * self.n_samples)
        per_sample = np.repeat(mean, self.n_samples) * noise
        per_sample = np.clip(np.rint(per_sample), 1, self.max_length).astype(np.int64)
        if self.runaway > 0:
            loops = np.random.default_rng([self.seed, self.step, 1]).random(per_sample.size) < self.runaway
            per_sample[loops] = self.max_length
        true_mean = per_sample.reshape(p, self.n_samples).mean(axis=1) if p else np.zeros(0)
        batch = PromptBatch(
            uids=[f"p{i}" for i in range(p)],
            prompt_lengths=lengths.astype(np.int64),
            n_samples=np.full(p, self.n_samples, dtype=np.int64),
            token_flat=flat.astype(np.int64),
            true_lengths=true_mean,
        )
        return batch, per_sample


def finished_samples(batch: PromptBatch, lengths: np.ndarray) -> list[FinishedSample]:
    """Records for every sample of ``batch`` with the given true lengths (samples in prompt order)."""
    prompt_of = batch.sample_prompt_index()
    first = batch.sample_offsets[:-1]
    out = []
    for s, (i, n) in enumerate(zip(prompt_of.tolist(), lengths.tolist(), strict=True)):
        out.append(
            FinishedSample.model_construct(
                uid=batch.uids[i],
                sample_index=s - int(first[i]),
                prompt_length=int(batch.prompt_lengths[i]),
                response_length=int(n),
                actor_id=None,
                migrations=0,
                finish_reason="stop",
                predicted_length=None,
            )
        )
    return out
