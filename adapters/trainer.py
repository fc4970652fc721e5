"""The learning side (needs OpenRLHF's GPU install): OpenRLHF's PPOTrainer with the RLHFless samples generator.

OpenRLHF builds ``SamplesGenerator`` inside its ``PPOTrainer`` Ray actor, so the swap must happen inside that
actor: this module's class (importable by every Ray worker) replaces the generator after OpenRLHF's own
constructor ran, and adds the ``rlhfless/*`` metrics to what OpenRLHF logs to wandb / TensorBoard.
"""

from __future__ import annotations

from typing import Any

import ray
from openrlhf.trainer.ppo_trainer import PPOTrainer
from rlhfless_openrlhf.generator import RlhflessSamplesGenerator, merge_metrics

from rlhfless_sdk.api.config import SchedulerConfig
from rlhfless_sdk.api.records import TimePerTokenProfile


class RlhflessPPOTrainerImpl(PPOTrainer.__ray_actor_class__):  # type: ignore[name-defined,misc]
    def __init__(self, pretrain: str, strategy: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(pretrain, strategy, *args, **kwargs)
        rl = strategy.args.rlhfless  # put there by the launcher; it travels inside strategy.args
        old = self.samples_generator
        self.samples_generator = RlhflessSamplesGenerator(
            strategy,
            old.prompts_dataloader,
            old.eval_dataloader,
            old.tokenizer,
            old.vllm_engines,
            scheduler=SchedulerConfig.model_validate(rl["scheduler"]),
            profile=TimePerTokenProfile.model_validate(rl["profile"]),
            report_path=rl.get("report"),
        )

    def save_logs_and_checkpoints(self, global_step: int, logs_dict=None, client_states=None) -> None:
        merge_metrics(logs_dict, self.samples_generator)
        return super().save_logs_and_checkpoints(global_step, logs_dict, client_states)


RlhflessPPOTrainer = ray.remote(RlhflessPPOTrainerImpl)
