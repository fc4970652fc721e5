"""The learning side's checkpoints, through OpenRLHF 0.11.2's own ``PPOTrainer.fit`` on a CPU.

OpenRLHF's ``fit`` builds one ``client_states`` dict per step and hands it to ``save_logs_and_checkpoints`` (a
regular checkpoint every ``--ckpt.save_steps``) and then to ``save_best_checkpoint`` (a ``best_global_step*``
checkpoint whenever an evaluation beats the best so far). Both write it, through the policy actor group's
``save_checkpoint``, into the checkpoint a resumed run reads back (``init_checkpoint_states``). What runs here is
OpenRLHF's real ``fit``, ``save_logs_and_checkpoints``, ``save_best_checkpoint`` and ``init_checkpoint_states``
with RLHFless's trainer subclass and samples generator; what needs GPUs is stood in for: the learning step
(``train_step``: DeepSpeed), evaluation's rollout (``evaluate``), the rollout itself (``generate_samples``: vLLM
engines; the generator's carried work is put in place from a snapshot), and the policy actor group, which keeps
each checkpoint's ``client_states`` and hands them back as the real one does.
"""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("openrlhf", reason="the adapter's tests need openrlhf 0.11.2 (installed by the test command)")


@pytest.fixture
def learning(openrlhf_learning, monkeypatch):
    pytest.importorskip("datasets")
    import openrlhf.trainer.ppo_trainer as ppo_trainer

    # the stand-in actor group's calls return their results, not Ray object refs: ray.get hands them through
    monkeypatch.setattr(ppo_trainer, "ray", SimpleNamespace(get=lambda refs: refs))
    return ppo_trainer


class PolicyGroup:
    """Stands in for OpenRLHF's policy actor group (DeepSpeed, GPUs): keeps the ``client_states`` each
    ``save_checkpoint`` writes, by tag, and returns one of them from ``get_checkpoint_states`` (a resumed run)."""

    def __init__(self, load: dict | None = None) -> None:
        self.saved: dict[str, dict] = {}
        self.load = load

    def async_run_method(self, method_name: str, **kwargs):
        if method_name == "save_checkpoint":
            self.saved[kwargs["tag"]] = copy.deepcopy(kwargs["client_states"])
            return []
        if method_name == "get_checkpoint_states":
            return [copy.deepcopy(self.load)]
        raise AssertionError(f"unexpected call {method_name}")


class Loader:
    """OpenRLHF's prompt dataloader, as ``fit`` uses it (its length and state)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def __len__(self) -> int:
        return self.steps

    def state_dict(self) -> dict:
        return {"consumed": "some"}

    def load_state_dict(self, state: dict) -> None:
        pass


def openrlhf_args(tmp_path, *, save_steps: int, load: bool = False) -> SimpleNamespace:
    from rlhfless_openrlhf.rollout_actor import rollout_args

    args = rollout_args(2, batch_size=1)
    args.algo.kl = SimpleNamespace(target=None, init_coef=0.0)
    args.algo.advantage.estimator = "group_norm"
    args.logger = SimpleNamespace(wandb=SimpleNamespace(key=None), tensorboard_dir=None, logging_steps=1)
    args.ckpt = SimpleNamespace(save_steps=save_steps, best_metric_key="", path=str(tmp_path), load_enable=load)
    args.eval = SimpleNamespace(steps=1, temperature=0.6, n_samples_per_prompt=1)
    args.train = SimpleNamespace(num_episodes=1)
    return args


# What partial rollouts (rlhfless-fast) and tail batching (rlhfless-onpolicy) hold between two steps: an open
# group with one sample ended and one carried with its tokens and logprobs; two prompts drawn and not trained.
CARRIED = {
    "version": 1,
    "step": 3,
    "launched": 2,
    "carried": [
        {
            "group": 1,
            "uid": "u1",
            "sample_index": 1,
            "prompt_length": 3,
            "generated": 2,
            "predicted": 9.0,
            "steps": [[2, 2]],
        }
    ],
    "groups": {"1": {"uid": "u1", "n": 2, "prompt_length": 3, "lengths": {"0": 5}, "steps": {"0": [[2, 5]]}}},
    "group_meta": {"1": ["Tom has 3 apples.", "3", None, "u1", [11, 12, 13]]},
    "carry_state": [[1, 1, [7, 8], [-0.5, -0.25]]],
    "ended": [[1, 0, {"observation_tokens": [11, 12, 13, 4, 5, 6, 7, 8], "action_ranges": [[3, 8]], "reward": 1.0}]],
}
DEFERRED = {"version": 1, "step": 3, "deferred": [["Tom has 3 apples.", "3"], ["Ann has 2 pears.", "2"]]}
HELD = {"rlhfless-fast": CARRIED, "rlhfless-onpolicy": DEFERRED}


def generator(args, preset: str):
    """RLHFless's samples generator for ``preset`` (no engine is ever called here)."""
    from rlhfless_openrlhf.generator import RlhflessSamplesGenerator

    from rlhfless_sdk import get_plugin_manager
    from rlhfless_sdk.api.profiles import load_profile

    return RlhflessSamplesGenerator(
        SimpleNamespace(args=args),
        None,
        None,
        None,
        [object(), object()],
        scheduler=get_plugin_manager().registry.scheduler(preset),
        profile=load_profile("qwen2.5-3b-l40s"),
    )


def trainer(ppo_trainer, args, gen, group: PolicyGroup, *, steps: int, evals: list[float] | None = None):
    """RLHFless's ``PPOTrainer`` subclass around ``gen``, constructed as OpenRLHF's base trainer is; the GPU work
    of a step stood in for (see the module docstring)."""
    from rlhfless_openrlhf.trainer import RlhflessPPOTrainerImpl

    t = RlhflessPPOTrainerImpl.__new__(RlhflessPPOTrainerImpl)
    ppo_trainer.BasePPOTrainer.__init__(t, SimpleNamespace(args=args), group, None, None, None, None, None)
    t.samples_generator = gen
    t.prompts_dataloader = Loader(steps)
    t.eval_dataloader = ["eval"] if evals else None
    t.generate_kwargs = {}
    t.train_step = lambda rollout_samples, global_step: ({"policy_loss": 0.1}, global_step + 1)
    t.evaluate = lambda global_step, **kw: {"eval_gsm8k_pass1": evals[global_step - 1]}
    made = iter(range(steps))
    gen.generate_samples = lambda **kw: (["experience"], None, 1, next(made) == steps - 1)
    return t


def count_snapshots(gen) -> list[int]:
    calls: list[int] = []
    real = gen.carry_snapshot

    def snapshot():
        calls.append(gen.step)
        return real()

    gen.carry_snapshot = snapshot
    return calls


@pytest.mark.parametrize("preset", ["rlhfless-fast", "rlhfless-onpolicy"])
def test_best_checkpoints_hold_the_carried_work_and_a_run_resumed_from_one_gets_it_back(learning, tmp_path, preset):
    """Regular checkpoints every 2 steps, an evaluation every step (0.1, 0.3, 0.2): OpenRLHF's ``fit`` writes
    best_global_step1 (no regular save at step 1), global_step2 and best_global_step2 (one dict), nothing at step
    3. Every one holds what the straggler policy carries (the dataloader state in it counts those prompts as
    consumed); a run resumed from a best checkpoint takes it back. The snapshot is taken at the two steps that
    write a checkpoint, once each."""
    held = HELD[preset]
    args = openrlhf_args(tmp_path, save_steps=2)
    gen = generator(args, preset)
    assert gen.restore_carry(copy.deepcopy(held)) > 0
    snapshots = count_snapshots(gen)
    group = PolicyGroup()
    trainer(learning, args, gen, group, steps=3, evals=[0.1, 0.3, 0.2]).fit()
    assert sorted(group.saved) == ["best_global_step1", "best_global_step2", "global_step2"]
    for tag, states in group.saved.items():
        assert states.get("rlhfless_carry") == held, tag
        assert json.loads(json.dumps(states["rlhfless_carry"])) == held  # plain data
    assert len(snapshots) == 2
    # resuming from the best checkpoint of step 1 (OpenRLHF's --ckpt.load_enable with that checkpoint)
    (tmp_path / "_actor").mkdir()
    args = openrlhf_args(tmp_path, save_steps=2, load=True)
    resumed = generator(args, preset)
    states = trainer(learning, args, resumed, PolicyGroup(load=group.saved["best_global_step1"]), steps=1)
    assert states.init_checkpoint_states()["global_step"] == 1
    assert resumed.carry_snapshot() == held


def test_the_carried_work_is_snapshotted_only_at_steps_that_save_a_checkpoint(learning, tmp_path):
    """No evaluation, a regular checkpoint every 2 of 5 steps: two snapshots (steps 2 and 4), not five."""
    args = openrlhf_args(tmp_path, save_steps=2)
    gen = generator(args, "rlhfless-fast")
    gen.restore_carry(copy.deepcopy(CARRIED))
    snapshots = count_snapshots(gen)
    group = PolicyGroup()
    trainer(learning, args, gen, group, steps=5).fit()
    assert sorted(group.saved) == ["global_step2", "global_step4"]
    assert all(states["rlhfless_carry"] == CARRIED for states in group.saved.values())
    assert len(snapshots) == 2


class Lock:
    """OpenRLHF's ``VLLMLock`` actor as the async loops call it (``ray.get(lock.acquire.remote())``)."""

    def __init__(self) -> None:
        import threading

        self.lock = threading.Lock()
        self.acquire = SimpleNamespace(remote=self.lock.acquire)
        self.release = SimpleNamespace(remote=self.lock.release)


@pytest.fixture
def async_learning(learning, monkeypatch):
    from openrlhf.trainer import ppo_trainer_async

    # the loops' Ray calls (ray.get on a lock's or an actor group's calls) hand their results through
    monkeypatch.setattr(ppo_trainer_async, "ray", SimpleNamespace(get=lambda refs: refs))
    return ppo_trainer_async


def async_run(learning, args, gen, group: PolicyGroup, *, steps: int, queue_size: int = 1):
    """OpenRLHF's async loops, ``GenerateSamplesActor.fit`` and ``TrainingActor.fit`` (RLHFless's subclasses),
    each in its own thread over one rollout queue and its slots, as ``PPOTrainerAsync`` runs them in two actors; the
    GPU work stood in for as in ``trainer``. Returns the generator actor."""
    import queue
    import threading

    from rlhfless_openrlhf.trainer import CarryingQueue, RlhflessGenerateSamplesActorImpl, RlhflessTrainingActorImpl

    rollout, slots, lock = queue.Queue(maxsize=queue_size), queue.Queue(maxsize=queue_size), Lock()
    for _ in range(queue_size):
        slots.put(0)
    maker = RlhflessGenerateSamplesActorImpl.__new__(RlhflessGenerateSamplesActorImpl)
    maker.args, maker.samples_generator, maker.generate_kwargs = args, gen, {}
    maker.prompts_dataloader, maker.eval_dataloader, maker.max_steps = Loader(steps), None, steps
    maker.vllm_lock, maker._partial_rollout, maker.rollout_slots = lock, False, slots
    maker.rollout_queue = CarryingQueue(rollout, gen)
    maker._last_eval_step, maker._eval_just_done = -1, False
    made = iter(range(steps))
    gen.generate_samples = lambda **kw: (["experience"], None, 1, next(made) == steps - 1)
    learner = RlhflessTrainingActorImpl.__new__(RlhflessTrainingActorImpl)
    learning.BasePPOTrainer.__init__(learner, SimpleNamespace(args=args), group, None, None, None, None, None)
    learner.vllm_lock, learner._partial_rollout, learner.rollout_queue, learner.rollout_slots = (
        lock,
        False,
        rollout,
        slots,
    )
    learner.train_step = lambda rollout_samples, global_step: ({"policy_loss": 0.1}, global_step + 1)
    thread = threading.Thread(target=maker.fit, kwargs={"episode": 0, "total_consumed_prompts": 0}, daemon=True)
    thread.start()
    learner.fit(global_step=0)
    thread.join(timeout=60)
    assert not thread.is_alive()
    return maker


def test_async_checkpoints_hold_the_carried_work_and_a_resumed_generator_actor_gets_it_back(async_learning, tmp_path):
    """``--train.async_enable`` with partial rollouts: the generator lives in its own actor, which never sees a
    checkpoint written, so each batch it queues carries its snapshot inside the dataloader state; OpenRLHF's
    TrainingActor writes it into every regular checkpoint (``--ckpt.save_steps 2`` of 4 steps), and a resumed run's
    generator actor takes it back from the dataloader state OpenRLHF hands it (``load_state_dict``), the loader
    getting its own state without it."""
    args = openrlhf_args(tmp_path, save_steps=2)
    gen = generator(args, "rlhfless-fast")
    gen.restore_carry(copy.deepcopy(CARRIED))
    group = PolicyGroup()
    async_run(async_learning, args, gen, group, steps=4)
    assert sorted(group.saved) == ["global_step2", "global_step4"]
    for tag, states in group.saved.items():
        loader = states["data_loader_state_dict"]
        assert loader["rlhfless_carry"] == CARRIED and loader["consumed"] == "some", tag
        assert json.loads(json.dumps(loader)) == loader  # plain data
    from rlhfless_openrlhf.trainer import RlhflessGenerateSamplesActorImpl

    resumed = generator(args, "rlhfless-fast")
    actor = RlhflessGenerateSamplesActorImpl.__new__(RlhflessGenerateSamplesActorImpl)
    seen: list[dict] = []
    actor.samples_generator = resumed
    actor.prompts_dataloader = SimpleNamespace(load_state_dict=seen.append)
    actor.load_state_dict(copy.deepcopy(group.saved["global_step2"]["data_loader_state_dict"]))
    assert seen == [{"consumed": "some"}]  # the dataloader's own state, without the carried work
    assert resumed.carry_snapshot() == CARRIED
    plain = RlhflessGenerateSamplesActorImpl.__new__(RlhflessGenerateSamplesActorImpl)
    plain.samples_generator, plain.prompts_dataloader = (
        generator(args, "rlhfless-fast"),
        SimpleNamespace(load_state_dict=seen.append),
    )
    plain.load_state_dict({"consumed": "none"})  # a checkpoint of a run that carried nothing
    assert seen[-1] == {"consumed": "none"} and plain.samples_generator.carry_snapshot() is None
