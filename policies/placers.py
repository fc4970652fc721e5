"""Actor placers: put the learner, the prefill actor and the decode actors onto nodes and GPUs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from rlhfless_policies._base import Parameterless

from rlhfless_sdk import Actor, ActorPlacement, Cluster, RlhflessError


class _Allocator:
    """Hands out GPUs node by node; an actor's GPUs always come from one node. Free GPUs only shrink, so the
    first node that can still fit a k-GPU actor only moves forward: each take is O(1) amortised."""

    def __init__(self, cluster: Cluster) -> None:
        self.order = [n.name for n in cluster.nodes]
        self.free = {n.name: list(range(n.num_gpus)) for n in cluster.nodes}
        self.cursor: dict[int, int] = {}  # GPUs per actor -> first node index that may still fit one

    def _grab(self, actor: Actor, node: str) -> ActorPlacement:
        k = actor.num_gpus
        gpus, self.free[node] = self.free[node][:k], self.free[node][k:]
        return ActorPlacement(actor=actor, node=node, gpu_indices=gpus)

    def take(self, actor: Actor, prefer: str | None = None) -> ActorPlacement:
        k = actor.num_gpus
        if prefer is not None and len(self.free[prefer]) >= k:
            return self._grab(actor, prefer)
        i = self.cursor.get(k, 0)
        while i < len(self.order) and len(self.free[self.order[i]]) < k:
            i += 1
        self.cursor[k] = i
        if i == len(self.order):
            raise RlhflessError(f"no node has {k} free GPU(s) left for {actor.role} actor {actor.actor_id}")
        return self._grab(actor, self.order[i])


class _Placer(Parameterless):
    """What both placers share: no parameters, and a fresh allocator for each ``place`` call."""

    def place(
        self, decode_loads: np.ndarray, cluster: Cluster, gpus_per_actor: int, extra: Sequence[Actor]
    ) -> list[ActorPlacement]:
        return self._place(_Allocator(cluster), decode_loads, cluster, gpus_per_actor, extra)

    def _place(
        self, alloc: _Allocator, decode_loads: np.ndarray, cluster: Cluster, gpus_per_actor: int, extra: Sequence[Actor]
    ) -> list[ActorPlacement]:
        """Place the step's actors with ``alloc``, which hands out ``cluster``'s GPUs (fresh for this call)."""
        raise NotImplementedError


class PackPlacer(_Placer):
    """OpenRLHF's PACK placement group order: decode actors 0..N-1 fill node after node, then the others."""

    description = "OpenRLHF's PACK order: fill node after node"
    reads_predictions = False  # consults no predicted length

    def _place(
        self, alloc: _Allocator, decode_loads: np.ndarray, cluster: Cluster, gpus_per_actor: int, extra: Sequence[Actor]
    ) -> list[ActorPlacement]:
        out = [alloc.take(Actor(actor_id=i, num_gpus=gpus_per_actor)) for i in range(len(decode_loads))]
        return out + [alloc.take(a) for a in extra]


class LocalityAwarePlacer(_Placer):
    """The paper's placement: learner and prefill actor on the first node, the heaviest decode actors beside
    them, lighter ones on later (further) nodes, so KV and weight transfers of the big actors stay on-node."""

    description = "learner, prefill and heaviest decode actors on one node (RLHFless)"

    def _place(
        self, alloc: _Allocator, decode_loads: np.ndarray, cluster: Cluster, gpus_per_actor: int, extra: Sequence[Actor]
    ) -> list[ActorPlacement]:
        home = max(cluster.nodes, key=lambda n: n.num_gpus).name  # first of the largest nodes
        out = [alloc.take(a, prefer=home) for a in sorted(extra, key=lambda a: a.role != "learner")]
        for i in np.argsort(-np.asarray(decode_loads, dtype=np.float64), kind="stable").tolist():
            out.append(alloc.take(Actor(actor_id=i, num_gpus=gpus_per_actor), prefer=home))
        return out
