"""The OpenRLHF internals the adapter relies on, checked by name and signature before anything starts.

Another OpenRLHF release may rename or reshape any of them; then the launcher stops with a message naming
what changed instead of failing deep inside a Ray actor an hour into a run.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

from rlhfless_openrlhf import OpenRLHFMismatch, check_openrlhf_version
from rlhfless_openrlhf.requirements import openrlhf_install


@dataclass(frozen=True)
class Expect:
    module: str
    qualname: str  # "Class.method", a function, or a remote class with .__ray_actor_class__
    params: tuple[str, ...]  # parameter names that must exist, in this order (self excluded)
    needs_gpu_install: bool = False  # importing it needs flash-attn/deepspeed (the learning side)


ROLLOUT: tuple[Expect, ...] = (
    Expect(
        "openrlhf.trainer.ppo_utils.samples_generator",
        "SamplesGenerator.__init__",
        ("strategy", "prompts_dataloader", "eval_dataloader", "tokenizer", "vllm_engines"),
    ),
    Expect("openrlhf.trainer.ppo_utils.samples_generator", "SamplesGenerator.generate_samples", ()),
    Expect(
        "openrlhf.trainer.ppo_utils.samples_generator",
        "SamplesGenerator._generate_vllm",
        ("dataloader_iter", "num_prompts", "dynamic_filtering"),
    ),
    Expect(
        "openrlhf.trainer.ppo_utils.samples_generator",
        "SamplesGenerator._process_response_into_experience",
        ("response",),
    ),
    Expect(
        "openrlhf.trainer.ray.vllm_engine",
        "RolloutRayActor.generate",
        ("prompt_token_ids", "sampling_params", "multi_modal_data"),
    ),
    Expect(
        "openrlhf.trainer.ray.vllm_engine",
        "RolloutRayActor.generate_responses",
        ("prompt", "label", "sampling_params", "max_length", "hf_tokenizer", "num_samples", "images"),
    ),
    Expect("openrlhf.trainer.ray.vllm_engine", "RolloutRayActor.sleep", ("level",)),
    Expect("openrlhf.trainer.ray.vllm_engine", "RolloutRayActor.wake_up", ("tags",)),
    Expect(
        "openrlhf.trainer.ray.vllm_engine",
        "create_vllm_engines",
        (
            "num_engines",
            "tensor_parallel_size",
            "pretrain",
            "seed",
            "full_determinism",
            "enable_prefix_caching",
            "enforce_eager",
            "max_model_len",
            "shared_pg",
            "gpu_memory_utilization",
            "vllm_enable_sleep",
        ),
    ),
    Expect(
        "openrlhf.utils.agent",
        "SingleTurnAgentExecutor.execute",
        ("prompt", "label", "sampling_params", "max_length", "hf_tokenizer", "llm_engine", "images"),
    ),
    Expect("openrlhf.utils.config", "hierarchize", ()),
)

LEARNING: tuple[Expect, ...] = (
    Expect(
        "openrlhf.trainer.ppo_trainer",
        "PPOTrainer.__init__",
        (
            "pretrain",
            "strategy",
            "actor_model_group",
            "critic_model_group",
            "reward_model_group",
            "reference_model_group",
            "vllm_engines",
        ),
        needs_gpu_install=True,
    ),
    Expect(
        "openrlhf.trainer.ppo_trainer",
        "PPOTrainer.save_logs_and_checkpoints",
        ("global_step", "logs_dict", "client_states"),
        needs_gpu_install=True,
    ),
    Expect(
        "openrlhf.trainer.ppo_trainer",
        "PPOTrainer.save_best_checkpoint",
        ("eval_metrics", "global_step", "client_states"),
        needs_gpu_install=True,
    ),
    Expect(
        "openrlhf.trainer.ppo_trainer",
        "PPOTrainer._detect_eval_metric_key",
        ("eval_metrics",),
        needs_gpu_install=True,
    ),
    Expect("openrlhf.trainer.ppo_trainer", "PPOTrainer.broadcast_to_vllm", (), needs_gpu_install=True),
    Expect("openrlhf.trainer.ppo_trainer", "PPOTrainer.init_checkpoint_states", (), needs_gpu_install=True),
    Expect(
        "openrlhf.trainer.ppo_trainer_async",
        "GenerateSamplesActor.__init__",
        ("pretrain", "strategy", "vllm_engines"),
        needs_gpu_install=True,
    ),
    Expect("openrlhf.trainer.ppo_trainer_async", "TrainingActor.broadcast_to_vllm", (), needs_gpu_install=True),
    Expect("openrlhf.trainer.ppo_trainer_async", "PPOTrainerAsync.__init__", (), needs_gpu_install=True),
)


# Module globals a function must look up when it runs (the launcher swaps them in the actor's own process).
LOOKS_UP: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("openrlhf.trainer.ppo_trainer_async", "PPOTrainerAsync.__init__", ("GenerateSamplesActor", "TrainingActor")),
)


def _resolve(e: Expect) -> Callable:
    module = importlib.import_module(e.module)
    obj: object = module
    for part in e.qualname.split("."):
        obj = getattr(obj, part)
        obj = getattr(obj, "__ray_actor_class__", obj)  # a remote class: look at the plain one
    return obj  # type: ignore[return-value]


def unshippable_methods(cls: type) -> list[str]:
    """The methods of ``cls`` that Ray cannot ship to a worker: those that call ``super()`` and are inherited from
    an OpenRLHF class its module no longer names (``@ray.remote`` put an ``ActorClass`` under the name). Ray ships
    an actor class by value with every method on it; such a method's ``super()`` cell then holds a copy of its
    class, not a base of the actor built from the real one, and the call fails with ``TypeError: super(type, obj):
    obj must be an instance or subtype of type`` (OpenRLHF 0.11.2's ``TrainingActor.__init__`` under Ray 2.55). A
    method defined here and calling ``super()`` from here is looked up at run time instead. The launcher's
    classes must have none (``check_internals`` checks them)."""
    out = []
    for name in dir(cls):
        fn = getattr(cls, name, None)
        code = getattr(fn, "__code__", None)
        if code is None or "__class__" not in code.co_freevars:
            continue
        owner = next(c for c in cls.__mro__ if name in vars(c))
        module = importlib.import_module(owner.__module__)
        if getattr(module, owner.__qualname__, None) is not owner:
            out.append(f"{owner.__module__}.{owner.__qualname__}.{name}")
    return out


def swapped_classes() -> list[type]:
    """Every class the launcher swaps into OpenRLHF that Ray builds as an actor (needs the learning side)."""
    from rlhfless_openrlhf import engine_actor, trainer

    return [
        trainer.RlhflessPPOTrainerImpl,
        trainer.RlhflessPPOTrainerAsyncImpl,
        trainer.RlhflessGenerateSamplesActorImpl,
        trainer.RlhflessTrainingActorImpl,
        engine_actor.RlhflessRolloutActorImpl,
    ]


def check_internals(*, learning: bool = False) -> list[str]:
    """Check the version and every expected name and signature; returns what was checked.

    Raises OpenRLHFMismatch naming each missing or reshaped piece. ``learning`` also checks the trainer side,
    which can only be imported where OpenRLHF's GPU dependencies (flash-attn, deepspeed) are installed.
    """
    check_openrlhf_version()
    problems, checked = [], []
    for e in ROLLOUT + (LEARNING if learning else ()):
        where = f"{e.module}.{e.qualname}"
        try:
            fn = _resolve(e)
        except ImportError as exc:
            hint = f"; install OpenRLHF's learning side {openrlhf_install()}" if e.needs_gpu_install else ""
            problems.append(f"{where}: cannot import ({exc}){hint}")
            continue
        except AttributeError:
            problems.append(f"{where}: not found")
            continue
        if e.params:
            names = [p for p in inspect.signature(fn).parameters if p != "self"]
            positions = [names.index(p) if p in names else -1 for p in e.params]
            if -1 in positions or positions != sorted(positions):
                problems.append(f"{where}: expected parameters {list(e.params)}, found {names}")
                continue
        checked.append(where)
    for module, qualname, names in LOOKS_UP if learning else ():
        if f"{module}.{qualname}" in checked:
            used = _resolve(Expect(module, qualname, ())).__code__.co_names
            missing = [n for n in names if n not in used]
            if missing:
                problems.append(f"{module}.{qualname}: no longer looks up {missing} when it runs")
    if learning and not problems:
        for cls in swapped_classes():
            for method in unshippable_methods(cls):
                problems.append(
                    f"{cls.__module__}.{cls.__qualname__} inherits {method}, which calls super() from a class Ray "
                    "ships by value: the actor cannot be built or the call fails; override it in the adapter"
                )
    if problems:
        raise OpenRLHFMismatch(
            "the installed OpenRLHF does not have what the rlhfless adapter relies on:\n  " + "\n  ".join(problems)
        )
    return checked
