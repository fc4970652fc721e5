"""Building rollout engines with OpenRLHF's own ``create_vllm_engines``, using RLHFless's engine class.

``create_vllm_engines`` looks ``RolloutRayActor`` up when it is called, so a drop-in with the same
``.options(...).remote(**kwargs)`` surface swaps the class for the duration of the call. On a CPU machine the
drop-in also fixes what vLLM's CPU build needs: float32 weights (OpenRLHF hard-codes bfloat16), a KV cache
size, and each engine bound to its own cores (by default all engines would share core 0).
"""

from __future__ import annotations

import os
from typing import Any

from rlhfless_openrlhf.engine import RlhflessRolloutActor


class _DropIn:
    def __init__(self, cls: Any, overrides: dict[str, Any], cpu_binds: list[str] | None) -> None:
        self.cls, self.overrides, self.cpu_binds, self.count = cls, overrides, cpu_binds, 0

    def options(self, **opts: Any) -> Any:
        if self.cpu_binds:
            env = {"VLLM_CPU_OMP_THREADS_BIND": self.cpu_binds[self.count % len(self.cpu_binds)]}
            opts["runtime_env"] = {"env_vars": env}
        self.count += 1
        inner = self.cls.options(**opts)
        overrides = self.overrides

        class _Remote:
            @staticmethod
            def remote(**kwargs: Any) -> Any:
                return inner.remote(**{**kwargs, **overrides})

        return _Remote()


def cpu_binds(num_engines: int) -> list[str]:
    """One core range per engine, e.g. ['0', '1'] for two engines on two cores."""
    cores = os.cpu_count() or 1
    per = max(cores // max(num_engines, 1), 1)
    return [
        f"{(i * per) % cores}-{(i * per) % cores + per - 1}" if per > 1 else str(i % cores) for i in range(num_engines)
    ]


def create_engines(
    num_engines: int,
    model: str,
    *,
    cpu: bool = False,
    max_model_len: int = 2048,
    enable_prefix_caching: bool = True,
    seed: int = 0,
    **create_kwargs: Any,
) -> list[Any]:
    """``num_engines`` RLHFless rollout engines, created by OpenRLHF's ``create_vllm_engines``."""
    from openrlhf.trainer.ray import vllm_engine

    overrides: dict[str, Any] = {}
    if cpu:
        overrides = {"dtype": "float32", "block_size": 32}
        create_kwargs.setdefault("gpu_memory_utilization", 0.5)
    original = vllm_engine.RolloutRayActor
    vllm_engine.RolloutRayActor = _DropIn(RlhflessRolloutActor, overrides, cpu_binds(num_engines) if cpu else None)
    try:
        return vllm_engine.create_vllm_engines(
            num_engines,
            1,
            model,
            seed,
            False,
            enable_prefix_caching,
            True,
            max_model_len,
            **create_kwargs,
        )
    finally:
        vllm_engine.RolloutRayActor = original


def create_vllm_engines_with_rlhfless(
    num_engines: int, tensor_parallel_size: int, pretrain: str, *args: Any, **kwargs: Any
) -> list[Any]:
    """Signature-compatible replacement for OpenRLHF's ``create_vllm_engines`` (used by the launcher)."""
    from openrlhf.trainer.ray import vllm_engine

    original = vllm_engine.RolloutRayActor
    vllm_engine.RolloutRayActor = _DropIn(RlhflessRolloutActor, {}, None)
    try:
        return vllm_engine.create_vllm_engines(num_engines, tensor_parallel_size, pretrain, *args, **kwargs)
    finally:
        vllm_engine.RolloutRayActor = original
