"""Building rollout engines with OpenRLHF's own ``create_vllm_engines``, using RLHFless's engine class.

``create_vllm_engines`` looks ``RolloutRayActor`` up when it is called, so a drop-in with the same
``.options(...).remote(**kwargs)`` surface swaps the class for the duration of the call. On a CPU machine the
drop-in also fixes what vLLM's CPU build needs: float32 weights (OpenRLHF hard-codes bfloat16), a KV cache
size, and each engine bound to its own cores (by default all engines would share core 0).
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from rlhfless_openrlhf.cpu import cpu_binds
from rlhfless_openrlhf.engine_actor import RlhflessRolloutActor

from rlhfless_sdk.api.records import Actor, Cluster, Node

log = logging.getLogger("rlhfless.openrlhf")


CPU_OVERRIDES = {"dtype": "float32", "block_size": 32}  # what vLLM's CPU build needs instead of OpenRLHF's bf16


def learner_gpus(args: Any) -> int:
    """GPUs OpenRLHF's learner groups take after it built the engines (the placer leaves them free): actor and
    reference unless co-located (their group exists before the engines then), critic (GAE only) and reward
    model (unless remote). Read from OpenRLHF's own args when the engines are built, after its CLI settled them."""

    def gpus(role: str) -> int:
        r = getattr(args, role)
        return int(r.num_nodes) * int(r.num_gpus_per_node)

    if args.train.colocate_all:
        return 0
    total = 0
    if not args.train.colocate_actor_ref:
        total += gpus("actor") + (gpus("ref") if args.algo.kl.init_coef > 0 else 0)
    critic = gpus("critic") if args.critic.model_name_or_path and args.algo.advantage.estimator == "gae" else 0
    reward = 0 if args.reward.remote_url else gpus("reward")
    total += max(critic, reward) if args.train.colocate_critic_reward and critic else critic + reward
    return total


launch_args: Any = None  # OpenRLHF's args, set by the launcher's hierarchize hook
#: placement groups OpenRLHF's launcher built, in order (the launcher's hook records them): before the engines, the
#: learner's actor and reference group, where ``--train.colocate_actor_ref`` or ``--train.colocate_all`` builds one
launch_groups: list[Any] = []


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
    overrides.update(engine_overrides({"drafter": drafter, "kv_watermark": watermark}, "cpu" if cpu else "gpu"))
    drop_in = _DropIn(RlhflessRolloutActor, overrides, cpu_binds(num_engines) if cpu else None)
    with _hooks(drop_in, placer, num_engines):
        return vllm_engine.create_vllm_engines(
            num_engines, 1, model, seed, False, enable_prefix_caching, True, max_model_len, **create_kwargs
        )


def create_vllm_engines_with_rlhfless(
    num_engines: int, tensor_parallel_size: int, pretrain: str, *args: Any, **kwargs: Any
) -> list[Any]:
    """Signature-compatible replacement for OpenRLHF's ``create_vllm_engines`` (used by the launcher): the
    engine class is RLHFless's; where OpenRLHF builds a placement group of its own for the engines (no
    ``--train.colocate_all``, tensor parallelism 1), the scheduler's placer pins its bundles to nodes."""
    from openrlhf.trainer.ray import vllm_engine

    placer = None
    name = os.environ.get("RLHFLESS_PLACER")
    shared = args[5] if len(args) > 5 else kwargs.get("shared_pg")
    if name and shared is None and tensor_parallel_size == 1:
        from rlhfless_sdk.api.plugins import get_plugin_manager

        placer = get_plugin_manager().registry.create("placer", name)
    elif name:
        why = (
            "they share the learner's placement group (--train.colocate_all)"
            if shared is not None
            else (f"tensor parallelism {tensor_parallel_size} > 1")
        )
        log.info("rlhfless: OpenRLHF places the engines itself: %s", why)
    learner = learner_gpus(launch_args) if launch_args is not None else 0
    settings = getattr(launch_args, "rlhfless", None) or {}
    drafter = settings.get("scheduler", {}).get("drafter")
    if drafter and drafter.get("name", "none") != "none" and tensor_parallel_size > 1:
        from rlhfless_sdk.api.errors import RlhflessError

        raise RlhflessError(
            f"drafter {drafter['name']!r} with --vllm.tensor_parallel_size {tensor_parallel_size}: the drafter runs in "
            "one-GPU engines only (a tensor-parallel engine's Ray workers are not handed it); use "
            "--vllm.tensor_parallel_size 1 or drop --scheduler.drafter"
        )
    cpu = os.environ.get("RLHFLESS_CPU_ENGINES") == "1"  # the launcher's path on a machine without a GPU (tests)
    overrides = engine_overrides(settings.get("scheduler"), "cpu" if cpu else "gpu")  # drafter, KV watermark
    drop_in = _DropIn(RlhflessRolloutActor, overrides, None)
    if cpu:
        drop_in = _DropIn(RlhflessRolloutActor, {**CPU_OVERRIDES, **overrides}, cpu_binds(num_engines))
    with _hooks(drop_in, placer, num_engines, learner):
        engines = vllm_engine.create_vllm_engines(num_engines, tensor_parallel_size, pretrain, *args, **kwargs)
    plan = settings.get("fill")
    if plan and shared is None and launch_groups:  # the stream's fill engines, in the learner's group (``fill``)
        from rlhfless_openrlhf import fill

        binds = cpu_binds(num_engines + int(plan["engines"]))[num_engines:]
        fill_drop_in = _DropIn(drop_in.cls, drop_in.overrides, binds if drop_in.cpu_binds else None)
        with _hooks(fill_drop_in, None, int(plan["engines"])):
            launch_args.rlhfless_fill_engines = fill.build(
                vllm_engine.create_vllm_engines,
                launch_groups[-1],
                plan,
                (num_engines, 1, pretrain, *args),
                kwargs,
                sleep_mode=not cpu,
            )
    return engines


def engine_overrides(scheduler: dict[str, Any] | None, device: str = "gpu") -> dict[str, Any]:
    """The engine arguments a scheduler (its config as a dict) sets on engines of ``device``: its drafter's
    (``drafter_overrides``) and its ``kv_watermark`` as vLLM's scheduler ``watermark`` (nothing at 0, vLLM's
    default)."""
    scheduler = scheduler or {}
    out = drafter_overrides(scheduler.get("drafter"), device)
    watermark = float(scheduler.get("kv_watermark") or 0.0)
    if watermark > 0.0:
        out["watermark"] = watermark
    return out


def drafter_overrides(drafter: Any, device: str = "gpu") -> dict[str, Any]:
    """The engine arguments for speculative decoding with ``drafter`` (a name, a ``PolicyRef`` or its dict; None
    or ``none``: nothing) on engines of ``device``: vLLM's ``speculative_config``, and the drafter for the engine
    actor to hand its workers (nothing where the drafter does not draft on ``device``)."""
    import json

    from rlhfless_openrlhf.drafting import speculative_config

    from rlhfless_sdk.api.config import PolicyRef

    if drafter is None:
        return {}
    ref = PolicyRef.model_validate(drafter)
    spec = speculative_config(ref, device)
    if spec is None:
        return {}
    return {"speculative_config": spec, "rlhfless_drafter": json.dumps(ref.model_dump(mode="json"))}
