"""A learner's state and what resizing it costs: the profile's ``learner`` block (``LearnerState``)."""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field, NonNegativeFloat, PositiveFloat

from rlhfless_sdk.api.base import Record

#: Bytes a learner holds per model parameter under ZeRO-3 with Adam in mixed precision: the trained models' bf16
#: weights (2), fp32 master weights (4), Adam's two moments (8) and bf16 gradients (2); frozen models, bf16 weights
#: (2). GRPO-style: the actor trained, a reference frozen. PPO: actor and critic trained, reference and reward frozen.
LEARNER_BYTES_PER_PARAM = {"grpo": 16 + 2, "ppo": 16 + 16 + 2 + 2}


#: GB a second process's CUDA context (the driver's state and the framework's loaded kernels) takes on a GPU: the
#: learner's, beside a fill engine's. A round figure, not measured here (no GPU): NVIDIA documents no size, and
#: PyTorch's own reports of an empty process under ``nvidia-smi`` run 0.3-0.6 GB on recent GPUs.
CUDA_CONTEXT_GB = 0.5


class LearnerState(Record):
    """What a DeepSpeed ZeRO-3 learner of this model holds and what resizing it costs. A DeepSpeed learner's
    data-parallel size is fixed at ``deepspeed.initialize`` (and a framework's actor groups at launch), so moving
    it to another GPU count is a restart from checkpoint: save the state, restart the Ray actors, reload and reshard
    it, rebuild the weight-sync group."""

    params_b: PositiveFloat = Field(description="Model parameters, in billions.")
    gpu_memory_gb: PositiveFloat = Field(description="One GPU's memory, GB.")
    usable_fraction: float = Field(default=0.9, gt=0, le=1, description="Share of a GPU's memory DeepSpeed may fill.")
    activations_gb: NonNegativeFloat = Field(default=2.0, description="Activations and buffers per GPU, GB.")
    checkpoint_write_gbps: PositiveFloat = Field(description="Saving the learner's state, GB/s (all ranks).")
    checkpoint_read_gbps: PositiveFloat = Field(description="Reloading it, GB/s (all ranks).")
    restart_fixed_s: NonNegativeFloat = Field(
        description="A restart's fixed part: Ray actors, DeepSpeed's initialize, the weight-sync group."
    )

    def state_gb(self, algo: str) -> float:
        """The learner's state for ``algo`` (``LEARNER_BYTES_PER_PARAM``), GB."""
        if algo not in LEARNER_BYTES_PER_PARAM:
            raise ValueError(f"unknown algorithm {algo!r}: expected one of {', '.join(LEARNER_BYTES_PER_PARAM)}")
        return self.params_b * LEARNER_BYTES_PER_PARAM[algo]

    def min_gpus(self, algo: str) -> int:
        """The fewest GPUs the learner's state fits on (each GPU holds its shard and its activations)."""
        per_gpu = self.gpu_memory_gb * self.usable_fraction - self.activations_gb
        return max(1, math.ceil(self.state_gb(algo) / per_gpu - 1e-9))

    def shard_gb(self, algo: str, gpus: int) -> float:
        """What one of ``gpus`` learner GPUs holds of the state (ZeRO-3 shards it evenly), GB."""
        return self.state_gb(algo) / max(gpus, 1)

    def beside_fraction(self, algo: str, gpus: int) -> float:
        """The share of one learner GPU's memory an engine may take beside its shard, its activations and the
        learner process's CUDA context (``CUDA_CONTEXT_GB``): vLLM's ``gpu_memory_utilization`` for an engine started
        there before the learner loads (what the launcher sets); 0 when none is left."""
        left = (
            self.gpu_memory_gb * self.usable_fraction
            - self.activations_gb
            - CUDA_CONTEXT_GB
            - self.shard_gb(algo, gpus)
        )
        return max(left / self.gpu_memory_gb, 0.0)

    def restart_s(self, algo: str) -> float:
        """Seconds a resize takes: the state saved and reloaded, plus the fixed part."""
        state = self.state_gb(algo)
        return state / self.checkpoint_write_gbps + state / self.checkpoint_read_gbps + self.restart_fixed_s


def beside_learner(profile: Any, algo: str, gpus: int) -> Any | None:
    """``profile`` (a ``TimePerTokenProfile`` of a dedicated engine) for an engine on the GPUs of a learner of
    ``gpus`` GPUs, beside its state, with the memory the launcher gives it (vLLM's ``gpu_memory_utilization`` at
    ``LearnerState.beside_fraction``): a dedicated engine's KV cache is what vLLM's default share
    (``usable_fraction``) leaves of a GPU after the weights, so this one's is that less the difference, the
    learner's shard, activations and CUDA context. None when the profile has no ``learner`` block or what is left
    is not worth a sample of ``max_num_seqs``' share (a tenth of the dedicated cache)."""
    learner = profile.learner
    if learner is None:
        return None
    given_gb = learner.beside_fraction(algo, gpus) * learner.gpu_memory_gb
    lost = (learner.gpu_memory_gb * learner.usable_fraction - given_gb) * 1e9 * profile.gpus_per_actor
    lost /= profile.kv_bytes_per_token
    kv = int(profile.kv_capacity_tokens - lost)
    if kv < profile.kv_capacity_tokens // 10:
        return None
    return profile.model_copy(update={"name": f"{profile.name}-beside-learner", "kv_capacity_tokens": kv})
