"""Building rollout engines with OpenRLHF's own ``create_vllm_engines``, using RLHFless's engine class.

``create_vllm_engines`` looks ``RolloutRayActor`` up when it is called, so a drop-in with the same
``.options(...).remote(**kwargs)`` surface swaps the class for the duration of the call. On a CPU machine the
drop-in also fixes what vLLM's CPU build needs: float32 weights (OpenRLHF hard-codes bfloat16), a KV cache
size, and each engine bound to its own cores (by default all engines would share core 0).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
from rlhfless_openrlhf.cpu import CPU_OVERRIDES, cpu_binds
from rlhfless_openrlhf.engine_actor import RlhflessRolloutActor

from rlhfless_sdk.api.records import Actor, Cluster, Node

log = logging.getLogger("rlhfless.openrlhf")


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


def ray_cluster(free: bool = False) -> tuple[Cluster | None, dict[str, str]]:
    """The live Ray cluster's GPU nodes as a ``Cluster`` (most GPUs first), and node name -> node IP. With
    ``free``, each node counts only the GPUs no placement group holds (OpenRLHF reserves the actor/ref group
    before it builds the engines when ``--train.colocate_actor_ref`` is on). None: no node has a GPU to offer."""
    import ray
    from ray.util.placement_group import placement_group_table

    held: dict[str, float] = defaultdict(float)
    if free:
        for pg in placement_group_table().values():
            if pg.get("state") == "REMOVED":
                continue
            where = pg.get("bundles_to_node_id") or {}
            for index, bundle in (pg.get("bundles") or {}).items():
                if where.get(index):
                    held[where[index]] += float(bundle.get("GPU", 0.0))
    alive = []
    for n in ray.nodes():
        gpus = int(n.get("Resources", {}).get("GPU", 0) - held[n.get("NodeID", "")]) if n.get("Alive") else 0
        if gpus >= 1:
            alive.append((gpus, n["NodeManagerAddress"]))
    alive.sort(key=lambda g: -g[0])
    ips = {f"node{i}": ip for i, (_, ip) in enumerate(alive)}
    nodes = [Node(name=f"node{i}", num_gpus=gpus) for i, (gpus, _) in enumerate(alive)]
    return (Cluster(nodes=nodes) if nodes else None), ips


def placer_bundles(num_engines: int, placer: Any, reserve: int = 0) -> list[dict[str, float]] | None:
    """One ``{"GPU": 1, "CPU": 1}`` bundle per engine, pinned with Ray's ``node:<ip>`` resource where the placer
    puts it (engine i gets bundle i), on GPUs no placement group holds yet. The ``reserve`` GPUs of the learner
    groups OpenRLHF builds after the engines are placed too, as one-GPU learner actors (the locality-aware placer
    puts them on its home node, beside the busiest engines), so the engines leave them free. None when the free
    GPUs cannot hold the engines (then OpenRLHF's own bundles are kept and Ray's scheduler decides)."""
    cluster, ips = ray_cluster(free=True)
    if cluster is None or cluster.total_gpus < num_engines:
        return None
    if cluster.total_gpus < num_engines + reserve:
        log.info(
            "rlhfless: %d free GPUs cannot hold %d engines and a %d-GPU learner",
            cluster.total_gpus,
            num_engines,
            reserve,
        )
        reserve = 0
    learner = [Actor(actor_id=i, role="learner") for i in range(reserve)]
    loads = np.arange(num_engines, 0, -1, dtype=np.float64)  # the planner fills engine 0 first
    placed = {p.actor.actor_id: p.node for p in placer.place(loads, cluster, 1, learner) if p.actor.role == "decode"}
    return [{"GPU": 1, "CPU": 1, f"node:{ips[placed[i]]}": 0.001} for i in range(num_engines)]


@contextmanager
def _hooks(engine_cls: Any, placer: Any | None, num_engines: int, reserve: int = 0) -> Iterator[None]:
    """Swap OpenRLHF's engine class and, with a placer, the bundles of the PACK placement group it builds for
    the engines, for one call. OpenRLHF builds no group of its own under ``--train.colocate_all`` (the engines
    share the learner's) and asks for other bundles with tensor parallelism > 1: then its placement is kept."""
    from openrlhf.trainer.ray import vllm_engine

    original_cls, original_pg = vllm_engine.RolloutRayActor, vllm_engine.placement_group
    vllm_engine.RolloutRayActor = engine_cls
    if placer is not None:

        def placement_group(requested: list, strategy: str = "PACK", **kw: Any) -> Any:
            bundles = None
            if len(requested) == num_engines and all(b.get("GPU") == 1 for b in requested):
                bundles = placer_bundles(num_engines, placer, reserve)
            if bundles is None:
                log.info("rlhfless: the placer cannot pin %d engine bundles here; OpenRLHF's are kept", len(requested))
                return original_pg(requested, strategy=strategy, **kw)
            log.info("rlhfless: engines placed by the scheduler's placer: %s", bundles)
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
    max_num_seqs: int | None = None,
    drafter: Any = None,
    watermark: float = 0.0,
    **create_kwargs: Any,
) -> list[Any]:
    """``num_engines`` RLHFless rollout engines, created by OpenRLHF's ``create_vllm_engines`` and placed by
    ``placer`` (an ``ActorPlacer``) when one is given; ``max_num_seqs``: vLLM's bound on the sequences an engine
    runs at once (default: vLLM's), e.g. the one the planners' profile assumes; ``drafter``: a drafter's name or
    ``PolicyRef`` for speculative decoding on the engines (``rlhfless_openrlhf.drafting``); ``watermark``: vLLM's
    KV watermark (a scheduler's ``kv_watermark``)."""
    from openrlhf.trainer.ray import vllm_engine

    overrides: dict[str, Any] = {}
    if cpu:
        overrides = dict(CPU_OVERRIDES)
        create_kwargs.setdefault("gpu_memory_utilization", 0.5)
    if max_num_seqs is not None:
        overrides["max_num_seqs"] = int(max_num_seqs)
    overrides.update(engine_overrides(drafter, watermark, "cpu" if cpu else "gpu"))
    drop_in = _DropIn(RlhflessRolloutActor, overrides, cpu_binds(num_engines) if cpu else None)
    with _hooks(drop_in, placer, num_engines):
        return vllm_engine.create_vllm_engines(
            num_engines, 1, model, seed, False, enable_prefix_caching, True, max_model_len, **create_kwargs
        )


def build_launch_engines(
    plan: Any,
    groups: list[Any],
    cpu: bool,
    num_engines: int,
    tensor_parallel_size: int,
    pretrain: str,
    *args: Any,
    **kwargs: Any,
) -> tuple[list[Any], list[Any]]:
    """OpenRLHF's ``create_vllm_engines`` for a launch's ``plan`` (``rlhfless_openrlhf.plan.LaunchPlan``; the rest is
    its signature): the engine class is RLHFless's; where OpenRLHF builds a placement group of its own for the
    engines (no ``--train.colocate_all``, tensor parallelism 1), the plan's placer pins its bundles to nodes; a stream
    with fill engines (``plan.fill``) gets them in the learner's placement group, the last of ``groups`` (those
    OpenRLHF built so far). ``cpu``: vLLM's CPU build (a machine without a GPU). Returns the engines and the fill
    engines."""
    from openrlhf.trainer.ray import vllm_engine

    shared = args[5] if len(args) > 5 else kwargs.get("shared_pg")
    placer = launch_placer(plan, shared, tensor_parallel_size)
    drafter = plan.scheduler.drafter
    if drafter.name != "none" and tensor_parallel_size > 1:
        from rlhfless_sdk.api.errors import RlhflessError

        raise RlhflessError(
            f"drafter {drafter.name!r} with --vllm.tensor_parallel_size {tensor_parallel_size}: the drafter runs in "
            "one-GPU engines only (a tensor-parallel engine's Ray workers are not handed it); use "
            "--vllm.tensor_parallel_size 1 or drop --scheduler.drafter"
        )
    overrides = engine_overrides(drafter, plan.scheduler.kv_watermark, "cpu" if cpu else "gpu", plan.draft_budget)
    if cpu:
        overrides = {**CPU_OVERRIDES, **overrides}
    with _hooks(_DropIn(RlhflessRolloutActor, overrides, cpu_binds(num_engines) if cpu else None), placer,
                num_engines, plan.learner_gpus):  # fmt: skip
        engines = vllm_engine.create_vllm_engines(num_engines, tensor_parallel_size, pretrain, *args, **kwargs)
    if plan.fill is None or shared is not None or not groups:
        return engines, []
    from rlhfless_openrlhf import fill

    binds = cpu_binds(num_engines + plan.fill.engines)[num_engines:] if cpu else None
    with _hooks(_DropIn(RlhflessRolloutActor, overrides, binds), None, plan.fill.engines):
        created = (num_engines, 1, pretrain, *args)
        filled = fill.build(vllm_engine.create_vllm_engines, groups[-1], plan.fill, created, kwargs, sleep_mode=not cpu)
    return engines, filled


def launch_placer(plan: Any, shared: Any, tensor_parallel_size: int) -> Any:
    """The plan's placer, where OpenRLHF builds the engines a placement group of their own (no shared group, tensor
    parallelism 1); else None, and one line says why OpenRLHF places them itself."""
    if shared is None and tensor_parallel_size == 1:
        from rlhfless_sdk.api.plugins import get_plugin_manager

        return get_plugin_manager().registry.create("placer", plan.scheduler.placer)
    why = "they share the learner's placement group (--train.colocate_all)" if shared is not None else (
        f"tensor parallelism {tensor_parallel_size} > 1")  # fmt: skip
    log.info("rlhfless: OpenRLHF places the engines itself: %s", why)
    return None


def engine_overrides(
    drafter: Any, watermark: float = 0.0, device: str = "gpu", budget: Sequence[int] | None = None
) -> dict[str, Any]:
    """The engine arguments a scheduler sets on engines of ``device``: its drafter's (``drafter_overrides``, with
    the launch's priced ``budget``) and its ``kv_watermark`` as vLLM's scheduler ``watermark`` (nothing at 0,
    vLLM's default)."""
    out = drafter_overrides(drafter, device, budget)
    if float(watermark or 0.0) > 0.0:
        out["watermark"] = float(watermark)
    return out


def drafter_overrides(drafter: Any, device: str = "gpu", budget: Sequence[int] | None = None) -> dict[str, Any]:
    """The engine arguments for speculative decoding with ``drafter`` (a name, a ``PolicyRef`` or its dict; None
    or ``none``: nothing) on engines of ``device``: vLLM's ``speculative_config``, and the drafter for the engine
    actor to hand its workers (nothing where the drafter does not draft on ``device``)."""
    from rlhfless_openrlhf.drafting import drafter_env, speculative_config

    from rlhfless_sdk.api.config import PolicyRef

    if drafter is None:
        return {}
    ref = PolicyRef.model_validate(drafter)
    spec = speculative_config(ref, device, budget)
    if spec is None:
        return {}
    return {"speculative_config": spec, "rlhfless_drafter": drafter_env(ref, budget)}
