"""Each trainer class the launcher swaps into OpenRLHF, built through Ray: ``wrap_trainers()`` makes the launcher's
trainer classes return from ``remote`` only once Ray built the actor and the actors it holds, and print their
classes' names (``built through Ray: ...``) for a test to read. Used by the CPU launch and training runners."""

from __future__ import annotations


def _class_name(actor):
    return type(actor).__name__


def _built(handle) -> list[str]:
    import ray

    """Wait until Ray built ``handle``'s actor and the actors it holds; the names of their classes."""
    names = [ray.get(handle.__ray_call__.remote(_class_name), timeout=300)]
    inner = ray.get(
        handle.__ray_call__.remote(
            lambda actor: [getattr(actor, a) for a in ("generator_actor", "trainer_actor") if hasattr(actor, a)]
        ),
        timeout=300,
    )
    for h in inner:
        names.append(ray.get(h.__ray_call__.remote(_class_name), timeout=300))
    return names


class BuiltThroughRay:
    """The launcher's trainer actor class, whose ``remote`` returns only once Ray built the actor (and its own)."""

    def __init__(self, actor_class) -> None:
        self.actor_class = actor_class

    def remote(self, *args, **kwargs):
        handle = self.actor_class.remote(*args, **kwargs)
        print(f"built through Ray: {', '.join(_built(handle))}", flush=True)
        return handle

    def __getattr__(self, name):
        return getattr(self.actor_class, name)


def launch(argv: list[str], env: dict[str, str], setup_hook: str) -> None:
    """The drop-in launcher on a local Ray (``RLHFLESS_CPU_LAUNCH_GPUS`` logical GPUs, default 2: one per learner
    rank or engine) whose workers get ``env`` and run ``setup_hook`` first, with the trainer classes wrapped and the
    engines on vLLM's CPU build."""
    import os

    import ray

    os.environ.update(env)
    ray.init(
        num_cpus=8,
        num_gpus=int(os.environ.get("RLHFLESS_CPU_LAUNCH_GPUS", "2")),
        include_dashboard=False,
        runtime_env={"env_vars": env, "worker_process_setup_hook": setup_hook},
    )
    from rlhfless_openrlhf.train_ppo_ray import main

    wrap_trainers()
    main(argv, cpu=True)


def wrap_trainers() -> None:
    """The launcher's two trainer classes, wrapped (before the launcher installs them into OpenRLHF)."""
    import rlhfless_openrlhf.trainer as trainer_module

    trainer_module.RlhflessPPOTrainer = BuiltThroughRay(trainer_module.RlhflessPPOTrainer)
    trainer_module.RlhflessPPOTrainerAsync = BuiltThroughRay(trainer_module.RlhflessPPOTrainerAsync)


#: The line a launch prints once Ray built its trainer actor (and, async, the two it holds), by mode.
BUILT = {
    "sync": "built through Ray: RlhflessPPOTrainerImpl",
    "async": "built through Ray: "
    + ", ".join(["RlhflessPPOTrainerAsyncImpl", "RlhflessGenerateSamplesActorImpl", "RlhflessTrainingActorImpl"]),
}
