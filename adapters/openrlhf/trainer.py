"""The learning side (needs OpenRLHF's GPU install): OpenRLHF's trainers with the RLHFless samples generator.

OpenRLHF builds ``SamplesGenerator`` inside a Ray actor (``PPOTrainer``; with ``--train.async_enable``,
``GenerateSamplesActor`` inside ``PPOTrainerAsync``), so the swap must happen inside that actor: the classes here
(importable by every Ray worker) replace the generator after OpenRLHF's own constructor ran. The synchronous
trainer also adds the ``rlhfless/*`` metrics to what OpenRLHF logs to wandb / TensorBoard; in async mode the
generator lives in another actor than the logger, so each batch carries its metrics through OpenRLHF's rollout
queue (inside its ``client_states``, ``CarryingQueue``) to the training actor, which adds them to what it logs.

What a straggler policy holds between steps (carried samples, deferred prompts) goes into every checkpoint
OpenRLHF writes, the regular ones (``--ckpt.save_steps``) and the best ones (``--ckpt.best_metric_key``), inside
the ``client_states`` OpenRLHF saves with the policy actor; it is snapshotted only at a step that writes one. In
async mode the generator lives in its own actor, which never sees a checkpoint being written: it snapshots with
every batch it queues (``CarryingQueue``), inside the dataloader state that OpenRLHF hands back to it on resume.

A rollout engine that dies is survived for the step it dies in (its samples are regenerated elsewhere), but not
after: OpenRLHF broadcasts weights to every engine over one NCCL group sized for all of them, which would hang. So
the generator refuses to hand that step to training, and every weight broadcast first checks that each engine is
alive, and again while the broadcast runs (one that dies during it would leave it waiting); either way the run
stops with a message naming the engine, at OpenRLHF's last checkpoint.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

import ray
from openrlhf.trainer import ppo_trainer_async
from openrlhf.trainer.ppo_trainer import PPOTrainer
from rlhfless_openrlhf.generator import RlhflessSamplesGenerator, log_lines, merge_metrics
from rlhfless_openrlhf.plan import BoundActor, LaunchPlan

#: The key of the carried work inside OpenRLHF's checkpoint ``client_states``.
CARRY_KEY = "rlhfless_carry"
#: Where a queued batch carries its metrics to the training actor, in its ``client_states`` (taken out before a
#: checkpoint)
METRICS_KEY = "rlhfless_metrics"


def swap_generator(
    strategy: Any, old: Any, plan: LaunchPlan, fill_engines: list | None = None
) -> RlhflessSamplesGenerator:
    """RLHFless's generator over OpenRLHF's dataloaders, tokenizer and engines (those of ``old``), running the launch
    ``plan`` (handed to the trainer actor by the launcher) with the stream's ``fill_engines``."""
    log_lines()
    correction = getattr(strategy.args.algo.advantage, "is_correction_level", "off")
    print(
        f"rlhfless: the {type(old).__name__} of OpenRLHF is replaced by RlhflessSamplesGenerator "
        f"(scheduler {plan.name}, report {plan.request.report}, importance correction {correction})",
        flush=True,
    )
    return RlhflessSamplesGenerator(
        strategy,
        old.prompts_dataloader,
        old.eval_dataloader,
        old.tokenizer,
        old.vllm_engines,
        scheduler=plan.scheduler,
        profile=plan.profile,
        report_path=plan.request.report,
        trace_path=plan.request.trace,
        carry_timeout_s=plan.request.carry_timeout_s,
        mode=plan.mode,
        learner_gpus=plan.learner_gpus,
        fill_engines=fill_engines,
    )


def add_carry(generator: Any, client_states: dict | None) -> dict:
    """``client_states`` (a new dict for None) with the generator's carried work in it, snapshotted once per dict
    (a step's regular and best checkpoints share OpenRLHF's one dict). Updated in place: OpenRLHF hands the
    caller's dict, not a copy, to every checkpoint of the step."""
    states = {} if client_states is None else client_states
    if CARRY_KEY not in states:
        carry = generator.carry_snapshot()  # carried work, deferred prompts
        if carry is not None:
            states[CARRY_KEY] = carry
    return states


#: How often a weight broadcast in progress checks that each rollout engine is still alive.
BROADCAST_WATCH_S = 5.0


def broadcast_checked(engines: list | None, broadcast: Any) -> None:
    """OpenRLHF's weight ``broadcast``, after checking that each rollout engine is alive, and watched while it runs:
    an engine that dies during it leaves the collective waiting for it for good (NCCL's timeout, or gloo's), so
    every ``BROADCAST_WATCH_S`` each engine is checked again, and a dead one is named as before a broadcast. The
    broadcast runs in a thread of its own that the error leaves behind (the run stops)."""
    check_engines_alive(engines)
    done: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(broadcast())
        except BaseException as exc:  # handed to the waiting thread as it is
            done.set_exception(exc)

    threading.Thread(target=run, name="rlhfless-broadcast", daemon=True).start()
    while True:
        try:
            return done.result(timeout=BROADCAST_WATCH_S)
        except concurrent.futures.TimeoutError:
            check_engines_alive(engines)
        except ray.exceptions.RayError:
            check_engines_alive(engines)
            raise


def check_engines_alive(engines: list | None) -> None:
    """Raise, naming them, if any rollout engine is dead (its actor, or vLLM's EngineCore under a live actor) or
    does not answer: a weight broadcast to it would hang in NCCL."""
    if not engines:
        return
    refs = [e.rl_alive.remote() for e in engines]
    dead = []
    for i, ref in enumerate(refs):
        try:
            alive = ray.get(ref, timeout=60)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError, ray.exceptions.GetTimeoutError):
            alive = False
        if not alive:
            dead.append(i)
    if dead:
        raise RuntimeError(
            f"rlhfless: rollout engine(s) {', '.join(map(str, dead))} are dead or unresponsive; OpenRLHF's weight "
            "broadcast spans every engine over one NCCL group and would hang, so the run stops before it. Resume "
            "from the last checkpoint with --ckpt.load_enable."
        )


class RlhflessPPOTrainerImpl(PPOTrainer.__ray_actor_class__):  # type: ignore[name-defined,misc]
    def __init__(
        self, pretrain: str, strategy: Any, *args: Any, launch_plan: LaunchPlan, fill_engines: list, **kwargs: Any
    ) -> None:
        super().__init__(pretrain, strategy, *args, **kwargs)
        self.samples_generator = swap_generator(strategy, self.samples_generator, launch_plan, fill_engines)

    def broadcast_to_vllm(self) -> None:
        return broadcast_checked(self.vllm_engines, super().broadcast_to_vllm)

    def save_logs_and_checkpoints(self, global_step: int, logs_dict=None, client_states=None) -> None:
        merge_metrics(logs_dict, self.samples_generator)
        if global_step % self.args.ckpt.save_steps == 0:  # OpenRLHF writes a checkpoint at this step
            client_states = add_carry(self.samples_generator, client_states)
        return super().save_logs_and_checkpoints(global_step, logs_dict, client_states)

    def save_best_checkpoint(self, eval_metrics, global_step, client_states=None):
        """OpenRLHF's, with the carried work in the best checkpoint too (OpenRLHF's ``fit`` hands it the step's
        ``client_states``, which a step that is no regular save step has not had it put into)."""
        if self._saves_best(eval_metrics):
            client_states = add_carry(self.samples_generator, client_states)
        return super().save_best_checkpoint(eval_metrics, global_step, client_states)

    def _saves_best(self, eval_metrics) -> bool:
        """Whether OpenRLHF 0.11.2's ``save_best_checkpoint`` writes a checkpoint for these metrics (a new best)."""
        if not eval_metrics:
            return False
        key = self._detect_eval_metric_key(eval_metrics)
        return key is not None and key in eval_metrics and eval_metrics[key] > self.best_eval_metric_value

    def init_checkpoint_states(self) -> dict:
        states = super().init_checkpoint_states()
        if states.get("global_step", 0):  # resuming: take back the carried work, or say it is dropped
            restored = self.samples_generator.restore_carry(states.get(CARRY_KEY))
            print(f"rlhfless: resumed with {restored} carried sample(s) or deferred prompt(s)", flush=True)
        return states


class CarryingQueue:
    """OpenRLHF's rollout queue as the async generator actor puts batches into it, each batch's ``client_states``
    given the generator's carried work, inside ``data_loader_state_dict``: the one part of them a resumed run hands
    back to the generator actor (``load_state_dict``). Snapshotted when the batch is queued, with the dataloader's
    state of the same instant, so a checkpoint written after training that batch resumes the generator as it was
    then (a batch it generated after is regenerated: it never trained). Everything else is the queue's own."""

    def __init__(self, queue: Any, generator: Any) -> None:
        self.queue, self.generator = queue, generator

    def put(self, payload: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(payload, tuple) and len(payload) == 4 and isinstance(payload[1], dict):
            states = payload[1]
            states[METRICS_KEY] = dict(getattr(self.generator, "last_metrics", {}))  # this batch's, for the logger
            carry = self.generator.carry_snapshot()
            if carry is not None:
                states["data_loader_state_dict"] = {**(states.get("data_loader_state_dict") or {}), CARRY_KEY: carry}
        return self.queue.put(payload, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.queue, name)


def take_carry(generator: Any, loader_state: dict | None) -> tuple[dict | None, int]:
    """The dataloader's own state (without the carried work) and how many carried samples or deferred prompts
    ``generator`` took back from it."""
    if not loader_state or CARRY_KEY not in loader_state:
        return loader_state, 0
    state = dict(loader_state)
    return state, generator.restore_carry(state.pop(CARRY_KEY))


class RlhflessGenerateSamplesActorImpl(ppo_trainer_async.GenerateSamplesActor.__ray_actor_class__):  # type: ignore[misc]
    def __init__(
        self,
        pretrain: str,
        strategy: Any,
        vllm_engines: list,
        *,
        launch_plan: LaunchPlan,
        fill_engines: list,
        **kwargs: Any,
    ) -> None:
        super().__init__(pretrain, strategy, vllm_engines, **kwargs)
        self.samples_generator = swap_generator(strategy, self.samples_generator, launch_plan, fill_engines)
        self.rollout_queue = CarryingQueue(self.rollout_queue, self.samples_generator)

    def load_state_dict(self, state_dict: Any) -> None:
        state, restored = take_carry(self.samples_generator, state_dict)
        super().load_state_dict(state)
        if restored:
            print(f"rlhfless: resumed with {restored} carried sample(s) or deferred prompt(s)", flush=True)


class RlhflessTrainingActorImpl(ppo_trainer_async.TrainingActor.__ray_actor_class__):  # type: ignore[misc]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """OpenRLHF's, called from here (``rlhfless_openrlhf.internals.unshippable_methods`` says why)."""
        super().__init__(*args, **kwargs)

    def broadcast_to_vllm(self) -> None:
        return broadcast_checked(self.vllm_engines, super().broadcast_to_vllm)

    def save_logs_and_checkpoints(self, global_step: int, logs_dict=None, client_states=None) -> None:
        """OpenRLHF's, with the batch's ``rlhfless/*`` metrics (come through the queue, ``CarryingQueue``) added to
        what it logs, and taken out of what it checkpoints."""
        metrics = (client_states or {}).pop(METRICS_KEY, None) or {}
        if logs_dict is not None:
            for key, value in metrics.items():
                logs_dict.setdefault(key, value)
        return super().save_logs_and_checkpoints(global_step, logs_dict, client_states)


RlhflessPPOTrainer = ray.remote(RlhflessPPOTrainerImpl)
RlhflessGenerateSamplesActor = ray.remote(RlhflessGenerateSamplesActorImpl)
RlhflessTrainingActor = ray.remote(RlhflessTrainingActorImpl)


class RlhflessPPOTrainerAsyncImpl(ppo_trainer_async.PPOTrainerAsync.__ray_actor_class__):  # type: ignore[misc]
    """OpenRLHF's async trainer, building RLHFless's generator and training actors. Its constructor looks the two
    actor classes up in its module when it runs, in this actor's own process; they are swapped there, the generating
    one built with the launch plan and the fill engines."""

    def __init__(self, *args: Any, launch_plan: LaunchPlan, fill_engines: list, **kwargs: Any) -> None:
        bound = {"launch_plan": launch_plan, "fill_engines": fill_engines}
        ppo_trainer_async.GenerateSamplesActor = BoundActor(RlhflessGenerateSamplesActor, lambda: bound)
        ppo_trainer_async.TrainingActor = RlhflessTrainingActor
        super().__init__(*args, **kwargs)


RlhflessPPOTrainerAsync = ray.remote(RlhflessPPOTrainerAsyncImpl)
