"""One launch of OpenRLHF's ``train_ppo_ray`` with an RLHFless scheduler: the hooks OpenRLHF calls, and what they
share (``Launch``).

OpenRLHF's launcher is a script: its ``train()`` reads its engine builder and Ray's ``placement_group`` from its own
module globals, parses its flags and calls ``hierarchize``, then builds the placement groups, the engines and the
trainer. The launch hooks exactly these names (``SWAPS``, the one list; docs/openrlhf.md shows it), each a bound
method of one ``Launch`` or a class that takes the plan as a constructor argument:

- ``hierarchize``: after OpenRLHF's own, the plan is decided once (``rlhfless_openrlhf.decide``) and its flags are
  set on OpenRLHF's args (``plan.apply``);
- ``placement_group``: each group OpenRLHF builds is recorded (the learner's is where the stream's fill engines go);
- ``create_vllm_engines``: RLHFless's engine class, placed by the plan's placer (``engine_factory``);
- ``PPOTrainer`` / ``PPOTrainerAsync``: RLHFless's trainers, built with ``launch_plan`` and ``fill_engines``
  (``BoundActor``); the async trainer swaps its two actor classes in its own process the same way
  (``rlhfless_openrlhf.trainer``).

Before OpenRLHF loads its models, each model actor gets the fixes of ``learner_fixes`` (ZeRO-3 under transformers 5).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

from rlhfless_openrlhf.plan import BoundActor, LaunchPlan, LaunchRequest

log = logging.getLogger("rlhfless.openrlhf")

#: Every module attribute of OpenRLHF (and Ray) a launch replaces: (module, name, in which process). The engine
#: builder also swaps ``vllm_engine.RolloutRayActor`` and ``vllm_engine.placement_group`` for the length of its own
#: call (``engine_factory._hooks``), and ``learner_fixes`` wraps ``RayActorGroup.async_init_model_from_pretrained``.
SWAPS: tuple[tuple[str, str, str], ...] = (
    ("openrlhf.utils.config", "hierarchize", "launcher"),
    ("ray.util.placement_group", "placement_group", "launcher"),
    ("openrlhf.trainer.ray", "create_vllm_engines", "launcher"),
    ("openrlhf.trainer.ppo_trainer", "PPOTrainer", "launcher"),
    ("openrlhf.trainer.ppo_trainer_async", "PPOTrainerAsync", "launcher"),
    ("openrlhf.trainer.ppo_trainer_async", "GenerateSamplesActor", "async trainer actor"),
    ("openrlhf.trainer.ppo_trainer_async", "TrainingActor", "async trainer actor"),
)


def original(function: Any) -> Any:
    """The function a hook of ours replaced (a hook keeps it as ``__wrapped__``), or ``function`` itself."""
    return getattr(function, "__wrapped__", function)


class Launch:
    """The state one launch's hooks share: the request (``--scheduler*`` flags, checked), the plan once OpenRLHF
    parsed its flags, the placement groups it built and the fill engines built beside its learner. ``cpu``: vLLM's
    CPU build serves the engines (a machine without a GPU: the test harness)."""

    def __init__(self, request: LaunchRequest, argv: Sequence[str] | None = None, *, cpu: bool = False) -> None:
        self.request, self.argv, self.cpu = request, argv, cpu
        self.plan: LaunchPlan | None = None
        self.groups: list[Any] = []
        self.fill_engines: list[Any] = []

    # -- the hooks ---------------------------------------------------------------------------------------------
    def hierarchize(self, args: Any) -> Any:
        """OpenRLHF's ``hierarchize``, then the plan decided on its result and applied to it."""
        import sys

        import openrlhf.utils.config as config_module
        from rlhfless_openrlhf.decide import decide
        from rlhfless_openrlhf.plan import apply

        out = original(config_module.hierarchize)(args)
        self.plan = decide(out, self.request, sys.argv[1:] if self.argv is None else self.argv, cpu=self.cpu)
        apply(self.plan, out)
        log.info("rlhfless: %s", self.plan.line())
        return out

    def placement_group(self, *args: Any, **kwargs: Any) -> Any:
        """Ray's ``placement_group``, each group recorded: the learner's is where the stream's fill engines go."""
        pg_module = importlib.import_module("ray.util.placement_group")
        group = original(pg_module.placement_group)(*args, **kwargs)
        self.groups.append(group)
        return group

    def create_vllm_engines(self, *args: Any, **kwargs: Any) -> list[Any]:
        """OpenRLHF's ``create_vllm_engines`` building the plan's engines (``engine_factory.build_launch_engines``)."""
        from rlhfless_openrlhf.engine_factory import build_launch_engines

        engines, self.fill_engines = build_launch_engines(self.decided, self.groups, self.cpu, *args, **kwargs)
        return engines

    def actor_kwargs(self) -> dict[str, Any]:
        """What a trainer class swapped in is built with: the plan and the fill engines."""
        return {"launch_plan": self.decided, "fill_engines": list(self.fill_engines)}

    @property
    def decided(self) -> LaunchPlan:
        if self.plan is None:
            raise RuntimeError("rlhfless: OpenRLHF built engines or a trainer before it parsed its flags")
        return self.plan

    # -- installing them ---------------------------------------------------------------------------------------
    def install(self, learning: bool = True) -> None:
        """Put the hooks into OpenRLHF for this process (``learning``: the trainers and learner fixes too, which need
        OpenRLHF's GPU dependencies)."""
        self.install_rollout_hooks()
        if not learning:
            return
        import openrlhf.trainer.ppo_trainer as ppo_trainer_module
        import openrlhf.trainer.ppo_trainer_async as ppo_trainer_async_module
        import rlhfless_openrlhf.trainer as trainer_module
        from rlhfless_openrlhf import learner_fixes

        learner_fixes.install()
        ppo_trainer_module.PPOTrainer = BoundActor(trainer_module.RlhflessPPOTrainer, self.actor_kwargs)
        ppo_trainer_async_module.PPOTrainerAsync = BoundActor(trainer_module.RlhflessPPOTrainerAsync, self.actor_kwargs)

    def install_rollout_hooks(self) -> None:
        """The hooks of OpenRLHF's rollout side: its flags, the placement groups and the engine builder."""
        import openrlhf.trainer.ray as ray_pkg
        import openrlhf.utils.config as config_module

        pg_module = importlib.import_module("ray.util.placement_group")  # the module (``ray.util`` names the function)
        for module, name, hook in (
            (config_module, "hierarchize", self.hierarchize),
            (pg_module, "placement_group", self.placement_group),
            (ray_pkg, "create_vllm_engines", self.create_vllm_engines),
        ):
            wrapper = _wrapping(original(getattr(module, name)), hook)
            setattr(module, name, wrapper)


def _wrapping(wrapped: Any, hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` as a plain function that keeps ``wrapped`` (the original) as ``__wrapped__``."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return hook(*args, **kwargs)

    call.__wrapped__ = wrapped  # type: ignore[attr-defined]
    call.__name__ = getattr(hook, "__name__", "hook")
    return call
