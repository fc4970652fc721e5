"""Building rollout engines with OpenRLHF's own ``create_vllm_engines``, using RLHFless's engine class.

``create_vllm_engines`` looks ``RolloutRayActor`` up when it is called, so a drop-in with the same
``.options(...).remote(**kwargs)`` surface swaps the class for the duration of the call. On a CPU machine the
drop-in also fixes what vLLM's CPU build needs: float32 weights (OpenRLHF hard-codes bfloat16), a KV cache
size, and each engine bound to its own cores (by default all engines would share core 0).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from rlhfless_openrlhf.engine import RlhflessRolloutActor

from rlhfless_sdk.api.records import Actor, Cluster, Node


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


def ray_cluster() -> tuple[Cluster, dict[str, str]]:
    """The live Ray cluster's GPU nodes as a ``Cluster`` (largest first), and node name -> node IP."""
    import ray

    alive = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("GPU", 0) >= 1]
    alive.sort(key=lambda n: -n["Resources"]["GPU"])
    ips = {f"node{i}": n["NodeManagerAddress"] for i, n in enumerate(alive)}
    nodes = [Node(name=f"node{i}", num_gpus=int(n["Resources"]["GPU"])) for i, n in enumerate(alive)]
    return Cluster(nodes=nodes), ips


def placer_bundles(num_engines: int, placer: Any) -> list[dict[str, float]]:
    """One ``{"GPU": 1, "CPU": 1}`` bundle per engine, pinned with Ray's ``node:<ip>`` resource where the placer
    puts it; engine i gets bundle i. The learner's GPU is kept on the placer's home node when there is room."""
    cluster, ips = ray_cluster()
    extra = [Actor(actor_id=0, role="learner")] if cluster.total_gpus > num_engines else []
    loads = np.arange(num_engines, 0, -1, dtype=np.float64)  # the planner fills engine 0 first
    placed = {p.actor.actor_id: p.node for p in placer.place(loads, cluster, 1, extra) if p.actor.role == "decode"}
    return [{"GPU": 1, "CPU": 1, f"node:{ips[placed[i]]}": 0.001} for i in range(num_engines)]


@contextmanager
def _hooks(engine_cls: Any, placer: Any | None, num_engines: int) -> Iterator[None]:
    """Swap OpenRLHF's engine class and, with a placer, the bundles of its PACK placement group, for one call."""
    from openrlhf.trainer.ray import vllm_engine

    original_cls, original_pg = vllm_engine.RolloutRayActor, vllm_engine.placement_group
    vllm_engine.RolloutRayActor = engine_cls
    if placer is not None:
        bundles = placer_bundles(num_engines, placer)

        def placement_group(requested: list, strategy: str = "PACK", **kw: Any) -> Any:
            if len(requested) != len(bundles):  # tensor-parallel engines: keep OpenRLHF's own bundles
                return original_pg(requested, strategy=strategy, **kw)
            return original_pg(bundles, strategy=strategy, **kw)

        vllm_engine.placement_group = placement_group
    try:
        yield
    finally:
        vllm_engine.RolloutRayActor, vllm_engine.placement_group = original_cls, original_pg


def create_engines(
    num_engines: int,
    model: str,
    *,
    cpu: bool = False,
    max_model_len: int = 2048,
    enable_prefix_caching: bool = True,
    seed: int = 0,
    placer: Any | None = None,
    **create_kwargs: Any,
) -> list[Any]:
    """``num_engines`` RLHFless rollout engines, created by OpenRLHF's ``create_vllm_engines`` and placed by
    ``placer`` (an ``ActorPlacer``) when one is given."""
    from openrlhf.trainer.ray import vllm_engine

    overrides: dict[str, Any] = {}
    if cpu:
        overrides = {"dtype": "float32", "block_size": 32}
        create_kwargs.setdefault("gpu_memory_utilization", 0.5)
    drop_in = _DropIn(RlhflessRolloutActor, overrides, cpu_binds(num_engines) if cpu else None)
    with _hooks(drop_in, placer, num_engines):
        return vllm_engine.create_vllm_engines(
            num_engines, 1, model, seed, False, enable_prefix_caching, True, max_model_len, **create_kwargs
        )


def create_vllm_engines_with_rlhfless(
    num_engines: int, tensor_parallel_size: int, pretrain: str, *args: Any, **kwargs: Any
) -> list[Any]:
    """Signature-compatible replacement for OpenRLHF's ``create_vllm_engines`` (used by the launcher): the
    engine class is RLHFless's and the placement group is built by the scheduler's placer."""
    from openrlhf.trainer.ray import vllm_engine

    placer = None
    name = os.environ.get("RLHFLESS_PLACER")
    if name:
        from rlhfless_sdk.api.plugins import get_plugin_manager

        placer = get_plugin_manager().registry.create("placer", name)
    with _hooks(_DropIn(RlhflessRolloutActor, {}, None), placer, num_engines):
        return vllm_engine.create_vllm_engines(num_engines, tensor_parallel_size, pretrain, *args, **kwargs)
