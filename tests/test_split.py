"""The rollout/learner split picked for the user (``rlhfless_sdk.simulation.split``), by the simulator, `plan` and
the OpenRLHF launcher, and what ``rlhfless`` runs in an async launch."""

from __future__ import annotations

import json
import logging
import re
from types import SimpleNamespace

import pytest
import rlhfless_test_helpers as H  # registered by conftest.py
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfless_sdk.api.plugins import get_plugin_manager
from rlhfless_sdk.api.profiles import load_profile
from rlhfless_sdk.api.records import Cluster
from rlhfless_sdk.cli.main import main
from rlhfless_sdk.simulation.simulator import Simulator
from rlhfless_sdk.simulation.split import Restart, SplitChoice, choose_split, descend
from rlhfless_sdk.workloads.synthetic import SyntheticWorkload
from rlhfless_sdk.workloads.traces import synthetic_workload

PROFILE = load_profile("qwen2.5-7b-l40s").model_copy(update={"learner": None})  # a learner fits on any GPU count


@settings(max_examples=200, deadline=None)
@given(
    st.integers(min_value=1, max_value=30).flatmap(
        lambda n: st.tuples(
            st.just(n),
            st.integers(min_value=0, max_value=n - 1),
            st.lists(st.floats(0.1, 100.0), min_size=n, max_size=n),
        )
    ),
    st.integers(min_value=0, max_value=29),
)
def test_descend_finds_the_bottom_of_a_valley_from_any_start(case, start):
    """Step time against the split is one valley: from any start, the walk ends at its bottom, having tried each
    split at most once per call of the time function it caches."""
    n, bottom, steps = case
    splits = list(range(1, n + 1))
    # a valley: strictly decreasing to ``bottom``, strictly increasing after it
    times = {splits[bottom]: 1.0}
    for i in range(bottom - 1, -1, -1):
        times[splits[i]] = times[splits[i + 1]] + steps[i]
    for i in range(bottom + 1, n):
        times[splits[i]] = times[splits[i - 1]] + steps[i]
    assert descend(splits, times.__getitem__, start=splits[start % n]) == splits[bottom]


def test_the_choice_says_its_split_gain_and_whether_a_restart_pays():
    choice = SplitChoice("rlhfless-stream", 16, 7, 5000.0, 10, "a trace", {6: 5200.0, 7: 5000.0, 8: 5100.0}, 8, 6000.0)
    choice.restart_checked = [2, 5, 7]
    line = choice.line()
    assert "7 rollout GPUs, 9 learner GPUs (of 16)" in line and "1.20x OpenRLHF async" in line
    assert "no restart at another split pays" in line
    choice.restart = Restart(5, 9, 300.0, 128.0)
    assert "restarting the learner at 9 rollout GPUs before step 5 would save 300 s after its 128 s restart" in (
        choice.line()
    )
    assert choice.as_dict()["tried"][0] == {"rollout_gpus": 6, "time_s": 5200.0}


def _growing(steps: int = 4, growth: float = 4.0, seed: int = 1):
    shape = SyntheticWorkload(48, 4, median_length=800, sample_sigma=0.5, max_length=4096, runaway=0.03, seed=seed)
    return synthetic_workload(shape, steps, growth)


def test_the_split_is_the_fastest_tried_and_each_restart_checked_is_priced():
    """``choose_split`` keeps the fastest split it tried (its neighbours tried and slower), measures OpenRLHF's
    async mode at its own best split on the same workload, and checks a restart at a quarter, half and
    three-quarters of the run, charging the profile's restart."""
    registry = get_plugin_manager().registry
    sim = Simulator(PROFILE, Cluster.of_gpus(6, 6), registry=registry)
    choice = choose_split(sim, registry.scheduler("rlhfless-stream"), _growing(), "a test workload")
    r, tried = choice.rollout_gpus, choice.tried
    assert tried[r] == min(tried.values()) == choice.time_s
    assert all(tried[n] >= tried[r] for n in (r - 1, r + 1) if n in tried or 1 <= n <= 5)
    assert choice.baseline_split is not None and choice.baseline_s > 0
    assert choice.restart_checked == [1, 2, 3]
    if choice.restart is not None:
        assert choice.restart.rollout_gpus != r and choice.restart.saves_s > 0


def test_simulate_runs_rlhfless_as_each_launch_does_and_plans_the_streams_split_on_an_earlier_run():
    args = ["simulate", "--prompts", "32", "--samples", "4", "--steps", "3", "--gpus", "8", "--no-frontier"]
    out = CliRunner().invoke(main, [*args, "--scheduler", "openrlhf", "--scheduler", "rlhfless", "--launch", "both"])
    assert out.exit_code == 0, out.output
    assert "split for rlhfless.async: " in out.output and "chosen on an earlier run of the same workload (seed 1)" in (
        out.output
    )
    out = CliRunner().invoke(main, [*args, "--scheduler", "rlhfless", "--launch", "async", "--json"])
    assert out.exit_code == 0, out.output
    (row,) = json.loads(out.output)["schedulers"]
    assert row["name"] == "rlhfless.async" and row["max_token_age_steps"] <= 2
    assert row["rollout_gpus"] == row["split_plan"]["rollout_gpus"]


def test_plan_prints_the_split_a_launch_picks():
    out = CliRunner().invoke(
        main, ["plan", "--gpus", "16", "--prompts", "32", "--scheduler", "rlhfless-stream", "--split-steps", "3"]
    )
    assert out.exit_code == 0, out.output
    assert "split for rlhfless-stream: " in out.output and "learner GPUs (of 16)" in out.output


def _launch_args(engines: int = 2, learner: int = 6) -> SimpleNamespace:
    return SimpleNamespace(
        vllm=SimpleNamespace(num_engines=engines, tensor_parallel_size=1),
        actor=SimpleNamespace(num_nodes=1, num_gpus_per_node=learner),
        ref=SimpleNamespace(num_nodes=1, num_gpus_per_node=learner),
        rollout=SimpleNamespace(batch_size=32, n_samples_per_prompt=4, max_new_tokens=2048, micro_batch_size=1),
        train=SimpleNamespace(async_enable=True, colocate_actor_ref=False, batch_size=128, micro_batch_size=1),
        data=SimpleNamespace(prompt_dataset="", input_key="input", max_len=2304),
        ds=SimpleNamespace(ring_attn_size=1, tensor_parallel_size=1),
    )


def test_an_async_launch_of_rlhfless_streams_at_the_split_the_launcher_picks(caplog):
    """Through the launcher's own functions (no Ray): ``rlhfless`` under ``--train.async_enable`` runs its async
    form, and the stream's split resizes OpenRLHF's engines and learner within the GPUs they were given, in one
    log line; ``--scheduler.split keep`` leaves the flags and says what it would pick."""
    import dataclasses

    from rlhfless_openrlhf.decide import launched_form
    from rlhfless_openrlhf.launch_split import plan_split, split_problem
    from rlhfless_openrlhf.plan import LaunchPlan
    from rlhfless_openrlhf.train_ppo_ray import resolve

    from rlhfless_sdk import get_plugin_manager

    registry = get_plugin_manager().registry
    request = dataclasses.replace(resolve({"--scheduler": "rlhfless"}), profile=PROFILE)
    args = _launch_args()
    with caplog.at_level(logging.INFO, logger="rlhfless.openrlhf"):
        launched = launched_form(args, LaunchPlan.of(request), registry)
        assert launched.name == "rlhfless-stream" and launched.launched_as == "rlhfless"
        assert launched.mode.pipeline == "stream"
        choice, sized = plan_split(args, launched)
    given_s, broken = choice.tried.get(2), split_problem(_launch_args(), 6, 2, 1)
    # the user's 2 engines stand unless the choice beats them or they would not start
    applied = broken is not None or given_s is None or given_s > choice.time_s
    engines = choice.rollout_gpus if applied else 2
    assert args.vllm.num_engines == engines and args.actor.num_gpus_per_node == 8 - engines
    assert {f.path: f.value for f in sized.flags} == (
        {"vllm.num_engines": engines, "actor.num_gpus_per_node": 8 - engines} if applied else {}
    )
    lines = [r.getMessage() for r in caplog.records if "split for rlhfless-stream" in r.getMessage()]
    assert len(lines) == 1 and "chosen on this launch's flags" in lines[0]
    assert ("; applied: " in lines[0]) == applied and ("not applied: no split" in lines[0]) == (not applied)
    kept = _launch_args()
    keep = dataclasses.replace(launched, request=dataclasses.replace(request, split="keep"))
    assert plan_split(kept, keep)[0].rollout_gpus == choice.rollout_gpus
    assert (kept.vllm.num_engines, kept.actor.num_gpus_per_node) == (2, 6)
    sync = _launch_args()
    sync.train.async_enable = False
    plain = LaunchPlan.of(request)
    assert launched_form(sync, plain, registry) is plain  # a sync launch runs rlhfless itself


# -- the split a launch applies is one DeepSpeed and OpenRLHF accept ----------------------------------------------
#: Common 16-GPU async launches of a 7B model: engines and learner GPUs given 8 + 8 or 4 + 12, GRPO with 8 samples a
#: prompt, power-of-two rollout and train batches, micro batch 1 (the learner's DeepSpeed batch check is where an
#: unchecked split broke: 128 is not 1 x 11 x 11).
LAUNCH_SHAPES = [
    (engines, learner, prompts, train_batch)
    for engines, learner in ((8, 8), (4, 12))
    for prompts in (32, 64, 128)
    for train_batch in (64, 128, 256)
]


def _launched_args(monkeypatch, tmp_path, argv: list[str]):
    """OpenRLHF's own args for ``argv`` after its parser and the launcher's hook (which plans the split), taken just
    before ``train()`` starts Ray, and the launch plan."""
    import importlib
    import sys

    import openrlhf.trainer.ppo_trainer as ppo_trainer_module
    import openrlhf.trainer.ppo_trainer_async as ppo_trainer_async_module
    import openrlhf.trainer.ray as ray_pkg
    import openrlhf.utils.config as config_module
    import ray
    from rlhfless_openrlhf.launch import Launch
    from rlhfless_openrlhf.train_ppo_ray import main as launch

    class BeforeRay(Exception):
        pass

    def no_ray(*_args, **_kwargs):
        raise BeforeRay

    pg_module = importlib.import_module("ray.util.placement_group")
    for module, name in (
        (config_module, "hierarchize"),
        (pg_module, "placement_group"),
        (ray_pkg, "create_vllm_engines"),
        (ppo_trainer_module, "PPOTrainer"),
        (ppo_trainer_async_module, "PPOTrainerAsync"),
    ):
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    hierarchized = []
    hierarchize = Launch.hierarchize

    def recorded(self, args):
        out = hierarchize(self, args)
        hierarchized.append((out, self.plan))
        return out

    monkeypatch.setattr(Launch, "hierarchize", recorded)
    monkeypatch.setattr(ray, "init", no_ray)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input": f"Tom has {i} apples and buys {i} more. How many?"}) + "\n"
                            for i in range(64)))  # fmt: skip
    with pytest.raises(BeforeRay):
        launch([*argv, "--actor.model_name_or_path", "m", "--data.prompt_dataset", str(data)])
    return hierarchized[-1]


def deepspeed_accepts(train_batch: int, micro: int, ranks: int) -> bool:
    """DeepSpeed's own batch check (``DeepSpeedConfig._configure_train_batch_size``) on the batch OpenRLHF sets."""
    from deepspeed.runtime.config import DeepSpeedConfig

    config = SimpleNamespace(
        train_batch_size=train_batch, train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=None,
        world_size=ranks,
    )  # fmt: skip
    for method in ("_set_batch_related_parameters", "_batch_assertion"):
        setattr(config, method, getattr(DeepSpeedConfig, method).__get__(config))
    try:
        DeepSpeedConfig._configure_train_batch_size(config)
    except AssertionError:
        return False
    return True


@pytest.mark.parametrize("profile", ["qwen2.5-7b-l40s", "qwen2.5-7b-h100"])
@pytest.mark.parametrize(("engines", "learner", "prompts", "train_batch"), LAUNCH_SHAPES)
def test_the_split_a_launch_applies_is_one_deepspeed_and_openrlhf_accept(
    monkeypatch, tmp_path, caplog, openrlhf_learning, profile, engines, learner, prompts, train_batch
):
    """Through OpenRLHF's own parser and the launcher's hook: whatever split the stream's planner applies, the
    learner passes DeepSpeed's own batch check, fits a node (8 GPUs, or the learner's own count given), keeps the
    GPUs given, and the reference colocated with it keeps its size; where it keeps the user's flags it says why."""
    argv = [
        "--scheduler", "rlhfless", "--scheduler.profile", profile, "--train.async_enable",
        "--vllm.num_engines", str(engines), "--actor.num_nodes", "1", "--actor.num_gpus_per_node", str(learner),
        "--ref.num_gpus_per_node", str(learner), "--train.colocate_actor_ref", "--algo.kl.init_coef", "0.01",
        "--rollout.batch_size", str(prompts), "--rollout.n_samples_per_prompt", "8",
        "--train.batch_size", str(train_batch), "--train.micro_batch_size", "1", "--rollout.micro_batch_size", "8",
        "--rollout.max_new_tokens", "2048", "--data.max_len", "2560", "--algo.advantage.estimator", "group_norm",
        "--reward.remote_url", "reward.py",
    ]  # fmt: skip
    with caplog.at_level(logging.INFO, logger="rlhfless.openrlhf"):
        args, _plan = _launched_args(monkeypatch, tmp_path, argv)
    ranks = args.actor.num_nodes * args.actor.num_gpus_per_node
    (line,) = [r.getMessage() for r in caplog.records if "split for rlhfless-stream" in r.getMessage()]
    name = f"{profile} {engines}+{learner} {prompts}x8 train batch {train_batch}"
    H.note_figures("split", name, {"launched": [args.vllm.num_engines, ranks], "line": line})
    assert args.vllm.num_engines + ranks == engines + learner
    assert deepspeed_accepts(args.train.batch_size, args.train.micro_batch_size, ranks), (args.vllm.num_engines, ranks)
    assert args.actor.num_gpus_per_node <= max(8, learner)
    assert (args.ref.num_nodes, args.ref.num_gpus_per_node) == (args.actor.num_nodes, args.actor.num_gpus_per_node)
    assert "applied:" in line or "kept:" in line or "not applied: no split" in line, line


def _pinned(split: int, *flags: str) -> list[str]:
    return [
        "--scheduler", "rlhfless", "--train.async_enable", "--scheduler.split", str(split), "--actor.num_nodes", "1",
        "--rollout.batch_size", "32", "--rollout.n_samples_per_prompt", "8", "--rollout.micro_batch_size", "8",
        "--train.micro_batch_size", "1", "--rollout.max_new_tokens", "512", "--data.max_len", "1024", *flags,
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("node_gpus", "why"),
    [
        ("8", "11 learner GPUs on a node, more than the 8 a node has (--scheduler.node_gpus)"),
        ("16", "DeepSpeed needs the train batch (128) to be a whole multiple of --train.micro_batch_size x "
         "learner GPUs (1 x 11)"),
    ],
)  # fmt: skip
def test_a_pinned_split_openrlhf_or_deepspeed_would_refuse_is_refused_before_ray(
    monkeypatch, tmp_path, openrlhf_learning, node_gpus, why
):
    """``--scheduler.split N`` is checked as a picked split is: 5 rollout GPUs of 16 leave 11 learner GPUs, more than
    an 8-GPU node holds; on 16-GPU nodes, a train batch of 128 is not 1 x 11 x anything. Either way the launch stops
    in one line before Ray starts."""
    argv = _pinned(5, "--vllm.num_engines", "8", "--actor.num_gpus_per_node", "8", "--train.batch_size", "128",
                   "--algo.advantage.estimator", "group_norm", "--reward.remote_url", "reward.py",
                   "--scheduler.node_gpus", node_gpus)  # fmt: skip
    with pytest.raises(SystemExit) as refused:
        _launched_args(monkeypatch, tmp_path, argv)
    assert str(refused.value.code) == f"error: --scheduler.split 5: {why}"


def test_the_models_openrlhf_places_with_the_actor_follow_its_size(monkeypatch, tmp_path, openrlhf_learning):
    """Under ``--train.colocate_all`` in an async launch, with KL on, a critic and a reward model: OpenRLHF puts the
    reference, the critic and the reward model in the actor's placement group (and asserts the reference's size),
    so a split that resizes the actor resizes them with it."""
    argv = _pinned(2, "--vllm.num_engines", "4", "--actor.num_gpus_per_node", "4", "--ref.num_gpus_per_node", "4",
                   "--critic.num_gpus_per_node", "4", "--reward.num_gpus_per_node", "4", "--train.colocate_all",
                   "--algo.kl.init_coef", "0.01", "--algo.advantage.estimator", "gae", "--critic.model_name_or_path",
                   "m", "--reward.model_name_or_path", "m", "--train.batch_size", "192")  # fmt: skip
    args, _plan = _launched_args(monkeypatch, tmp_path, argv)
    sizes = {g: getattr(args, g).num_gpus_per_node for g in ("actor", "ref", "critic", "reward")}
    assert args.vllm.num_engines == 2 and sizes == {"actor": 6, "ref": 6, "critic": 6, "reward": 6}
    assert deepspeed_accepts(192, 1, 6)


# -- never slower: the launch runs whichever of its plan and OpenRLHF's own its model prices faster ----------------
#: The example script's shape (``examples/openrlhf/grpo_gsm8k_qwen2.5-3b.sh``: Qwen2.5-3B GRPO, 128 prompts x 8, on 8
#: H100) as an async launch, its 8 GPUs given half to the engines and half to the learner.
EXAMPLE_ASYNC = [
    "--scheduler", "rlhfless", "--scheduler.profile", "qwen2.5-3b-h100", "--train.async_enable",
    "--vllm.num_engines", "4", "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "4",
    "--ref.num_gpus_per_node", "4", "--train.colocate_actor_ref", "--algo.kl.init_coef", "0.01",
    "--rollout.batch_size", "128", "--rollout.n_samples_per_prompt", "8", "--train.batch_size", "1024",
    "--train.micro_batch_size", "4", "--rollout.micro_batch_size", "8", "--rollout.max_new_tokens", "1024",
    "--data.max_len", "2048", "--algo.advantage.estimator", "group_norm", "--reward.remote_url", "reward.py",
]  # fmt: skip


@pytest.mark.parametrize("force", [False, True])
def test_the_example_scripts_shape_launches_whichever_its_model_prices_faster(
    monkeypatch, tmp_path, caplog, openrlhf_learning, force
):
    """Through OpenRLHF's parser and the launcher's hook: the stream's split plan is priced against OpenRLHF's async
    loop with the same flags (4 engines, 4 learner GPUs); the launch runs the faster, one line saying which and why.
    ``--scheduler.force`` runs the stream whatever the price."""
    with caplog.at_level(logging.INFO, logger="rlhfless.openrlhf"):
        args, plan = _launched_args(monkeypatch, tmp_path, [*EXAMPLE_ASYNC, *(["--scheduler.force"] if force else [])])
    (line,) = [r.getMessage() for r in caplog.records if "split for rlhfless-stream" in r.getMessage()]
    fell = [r.getMessage() for r in caplog.records if "is priced slower than OpenRLHF's" in r.getMessage()]
    H.note_figures("never-slower", f"example async force={force}", {"line": line, "fell_back": fell})
    plan_s = float(line.split(" s for 5 steps expected")[0].rsplit(": ", 1)[1].replace(",", ""))
    loop_s = float(line.split("OpenRLHF async at its best split (4 rollout GPUs, ")[1].split(" s)")[0].replace(",", ""))
    if plan_s >= loop_s and not force:  # OpenRLHF's async loop, at the flags given, as OpenRLHF runs it
        assert plan.name == "openrlhf" and plan.fell_back.scheduler
        assert (args.vllm.num_engines, args.actor.num_gpus_per_node) == (4, 4) and "not applied" in line
        assert len(fell) == 1 and "with these flags" in fell[0] and "--scheduler.force runs" in fell[0]
    else:
        assert plan.name == "rlhfless-stream" and args.train.partial_rollout_enable
        assert not fell and plan.fell_back is None


#: A synchronous launch where a plan cannot gain: one engine, a handful of prompts, short responses.
SYNC_TINY = [
    "--scheduler", "rlhfless", "--scheduler.profile", "qwen2.5-3b-h100", "--vllm.num_engines", "1",
    "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "1", "--rollout.batch_size", "4",
    "--rollout.n_samples_per_prompt", "2", "--train.batch_size", "8", "--train.micro_batch_size", "2",
    "--rollout.micro_batch_size", "2", "--rollout.max_new_tokens", "16", "--data.max_len", "256",
    "--algo.advantage.estimator", "group_norm", "--reward.remote_url", "reward.py",
]  # fmt: skip


def test_a_sync_launch_its_model_prices_no_faster_runs_openrlhfs_step(monkeypatch, tmp_path, caplog, openrlhf_learning):
    """A synchronous launch where the plan cannot gain (one engine, a handful of prompts, short responses: nothing
    to balance) is priced against OpenRLHF's step on the same flags and runs that step, one line saying so;
    ``--scheduler.force`` runs the plan."""
    with caplog.at_level(logging.INFO, logger="rlhfless.openrlhf"):
        _args, plan = _launched_args(monkeypatch, tmp_path, SYNC_TINY)
    said = " | ".join(r.getMessage() for r in caplog.records)
    priced = [r.getMessage() for r in caplog.records if "priced on" in r.getMessage()]
    assert len(priced) == 1, said
    ours, theirs = (float(x) for x in re.search(r": (\d+) s against OpenRLHF's step's (\d+) s", priced[0]).groups())
    assert ours * 1.01 >= theirs - 1  # here the plan cannot gain 1% (the line rounds), so ...
    assert plan.name == "openrlhf", said  # ... OpenRLHF's step runs
    assert "is priced slower than OpenRLHF's step with these flags" in said


def test_a_forced_sync_launch_runs_its_plan_unpriced(monkeypatch, tmp_path, caplog, openrlhf_learning):
    argv = [*SYNC_TINY, "--scheduler.force"]
    with caplog.at_level(logging.INFO, logger="rlhfless.openrlhf"):
        _args, plan = _launched_args(monkeypatch, tmp_path, argv)
    assert plan.name == "rlhfless"
    assert not [r for r in caplog.records if "priced" in r.getMessage()]
