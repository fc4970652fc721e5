"""Running RLHFless's rollout without OpenRLHF's trainer: a Ray actor that owns the samples generator.

OpenRLHF's ``PPOTrainer`` actor holds the generator during training (that needs a GPU); this actor holds it
for rollout-only work on any machine: the CPU demo, benchmarks, and tests that need the generator to live in
its own Ray worker, as it does inside OpenRLHF.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import ray
from rlhfless_openrlhf.messages import RolloutStepResult


def rollout_args(
    n_samples: int,
    *,
    batch_size: int = 1,
    logprobs: bool = True,
    enable_sleep: bool = False,
    prefix_caching: bool = True,
    dynamic_filtering: tuple[float, float] | None = None,
) -> Any:
    """The slice of OpenRLHF's hierarchized ``args`` that the samples generator reads."""
    return SimpleNamespace(
        rollout=SimpleNamespace(n_samples_per_prompt=n_samples, batch_size=batch_size, vllm_generate_batch_size=None),
        algo=SimpleNamespace(
            advantage=SimpleNamespace(is_correction_level="tis" if logprobs else "off"),
            dynamic_filtering_enable=dynamic_filtering is not None,
            dynamic_filtering_range=dynamic_filtering or (0.0, 1.0),
        ),
        vllm=SimpleNamespace(enable_sleep=enable_sleep, enable_prefix_caching=prefix_caching),
    )


@ray.remote(num_cpus=0)
class GeneratorActor:
    """Owns an ``RlhflessSamplesGenerator`` over the given engines; ``step`` generates one batch of prompts."""

    def __init__(
        self,
        engines: list,
        tokenizer_dir: str,
        scheduler: dict,
        profile: dict,
        *,
        n_samples: int,
        report_path: str | None = None,
        trace_path: str | None = None,
        logprobs: bool = True,
    ) -> None:
        from rlhfless_openrlhf.generator import RlhflessSamplesGenerator
        from transformers import AutoTokenizer

        from rlhfless_sdk.api.config import SchedulerConfig
        from rlhfless_sdk.api.records import TimePerTokenProfile

        self.generator = RlhflessSamplesGenerator(
            SimpleNamespace(args=rollout_args(n_samples, logprobs=logprobs)),
            None,
            None,
            AutoTokenizer.from_pretrained(tokenizer_dir),
            engines,
            scheduler=SchedulerConfig.model_validate(scheduler),
            profile=TimePerTokenProfile.model_validate(profile),
            report_path=report_path,
            trace_path=trace_path,
        )

    def step(
        self, prompts: list[str], labels: list[Any], logs: dict[str, Any] | None = None, **generate_kwargs: Any
    ) -> RolloutStepResult:
        from rlhfless_openrlhf.generator import merge_metrics

        experiences = self.generator.generate_step(prompts, labels, **generate_kwargs)
        return RolloutStepResult(
            prompts=[e.prompts[0] for e in experiences],
            response_lengths=[int(e.response_length[0]) for e in experiences],
            report=self.generator.last_report,
            logs=merge_metrics(dict(logs or {}), self.generator),
        )
