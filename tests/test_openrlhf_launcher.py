"""The drop-in launcher: flags, validation before Ray starts, the internals check and the hooks."""

from __future__ import annotations

import argparse
import importlib.metadata
from pathlib import Path

import pytest
import yaml

pytest.importorskip("openrlhf", reason="the adapter's tests need openrlhf 0.11.2 (installed by the test command)")

import rlhfless_test_helpers as H  # registered by conftest.py
from rlhfless_openrlhf import OpenRLHFMismatch, check_openrlhf_version
from rlhfless_openrlhf.internals import check_internals
from rlhfless_openrlhf.train_ppo_ray import main, resolve, split_args


def test_split_args_keeps_openrlhf_flags_in_order():
    ours, rest = split_args(
        [
            "--actor.model_name_or_path",
            "m",
            "--scheduler",
            "rlhfless",
            "--vllm.num_engines=4",
            "--scheduler.config=x.yaml",
            "--rollout.n_samples_per_prompt",
            "8",
        ]
    )
    assert ours == {"--scheduler": "rlhfless", "--scheduler.config": "x.yaml"}
    assert rest == ["--actor.model_name_or_path", "m", "--vllm.num_engines=4", "--rollout.n_samples_per_prompt", "8"]


def test_unknown_scheduler_fails_before_ray_starts(capsys):
    import ray

    with pytest.raises(SystemExit) as exit_info:
        main(["--scheduler", "rlhfles", "--actor.model_name_or_path", "m"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "no scheduler named 'rlhfles'" in err and "valid:" in err and "rlhfless" in err
    assert not ray.is_initialized()


def test_bad_config_fails_before_ray_starts(tmp_path, capsys):
    bad = tmp_path / "s.yaml"
    bad.write_text(
        "name: s\npredictor: ewma\nprefill_planner: dedup\nassigner: sorted\nmigrator: tau\n"
        "scaler: {name: cost-aware, params: {lambda: 2}}\nplacer: pack\n"
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["--scheduler", "rlhfless", "--scheduler.config", str(bad)])
    assert exit_info.value.code == 2
    assert "scaler.params.lambda (line 6)" in capsys.readouterr().err


def test_openrlhf_scheduler_leaves_openrlhf_unchanged():
    assert resolve({"--scheduler": "openrlhf"}) is None
    assert resolve({}) is None
    request = resolve({"--scheduler": "rlhfless", "--scheduler.profile": "qwen2.5-3b-h100"})
    assert request.scheduler.name == "rlhfless" and request.profile.name == "qwen2.5-3b-h100"


def test_the_carry_timeout_is_a_launcher_flag():
    assert resolve({"--scheduler": "rlhfless-fast"}).carry_timeout_s == 120.0
    assert resolve({"--scheduler": "rlhfless-fast", "--scheduler.carry_timeout": "600"}).carry_timeout_s == 600.0
    ours, rest = split_args(["--scheduler.carry_timeout=30", "--x", "1"])
    assert ours == {"--scheduler.carry_timeout": "30"} and rest == ["--x", "1"]
    for bad in ("0", "-5", "soon", "inf", "nan"):
        with pytest.raises(SystemExit, match=r"--scheduler\.carry_timeout takes a number of seconds > 0"):
            resolve({"--scheduler": "rlhfless-fast", "--scheduler.carry_timeout": bad})


def test_an_async_preset_is_refused_with_the_openrlhf_flags_to_use():
    with pytest.raises(SystemExit, match=r"--train\.async_enable"):
        resolve({"--scheduler": "openrlhf-async"})


SEGMENT_BUDGET = (
    "name: budgeted\npredictor: ewma\nprefill_planner: none\nassigner: sorted\nmigrator: none\n"
    "scaler: fixed\nplacer: pack\nstraggler: {name: partial, params: {segment_tokens: 64}}\n"
)


def test_straggler_presets_resolve_and_a_simulator_only_policy_is_refused(tmp_path):
    assert resolve({"--scheduler": "rlhfless-onpolicy"}).scheduler.straggler.name == "tail-batch"
    assert resolve({"--scheduler": "rlhfless-fast"}).scheduler.straggler.name == "partial-batch"
    # running a policy real engines cannot would silently drop it: refused at launch instead, naming it
    config = tmp_path / "budgeted.yaml"
    config.write_text(SEGMENT_BUDGET)
    with pytest.raises(SystemExit, match=r"straggler policy 'partial'.*rlhfless simulate"):
        resolve({"--scheduler": "rlhfless", "--scheduler.config": str(config)})


@pytest.mark.parametrize(("flag", "value"), [("algo.dynamic_filtering_enable", True)])
@pytest.mark.parametrize(
    ("preset", "straggler"), [("rlhfless-fast", "partial-batch"), ("rlhfless-onpolicy", "tail-batch")]
)
def test_straggler_policies_are_refused_where_openrlhf_cannot_carry_samples(
    monkeypatch, flag, value, preset, straggler
):
    _hooked(monkeypatch, preset)
    with pytest.raises(SystemExit, match=rf"--{flag} cannot carry samples or defer prompts.*'{straggler}'"):
        _hierarchized(**{flag: value})
    _hierarchized()  # without it, the straggler policy runs
    _hooked(monkeypatch, "rlhfless-slo")
    _hierarchized(**{flag: value})  # and the other schedulers run in that mode
    launch = _hooked(monkeypatch, "rlhfless")  # tail batching where it pays: here never
    _hierarchized(**{flag: value})
    assert launch.plan.scheduler.straggler.name == "none" and launch.plan.mode.driver == "plain"


def test_rollout_internals_of_the_installed_openrlhf():
    checked = check_internals()
    assert "openrlhf.trainer.ray.vllm_engine.RolloutRayActor.generate_responses" in checked
    assert check_openrlhf_version() == "0.11.2"


def test_a_reshaped_internal_is_named(monkeypatch):
    from openrlhf.trainer.ppo_utils import samples_generator

    def _generate_vllm(self, iterator, count):  # renamed parameters, as a future release might
        pass

    monkeypatch.setattr(samples_generator.SamplesGenerator, "_generate_vllm", _generate_vllm)
    with pytest.raises(OpenRLHFMismatch, match=r"SamplesGenerator\._generate_vllm: expected parameters"):
        check_internals()


def test_another_version_is_refused(monkeypatch):
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda n: "0.12.0" if n == "openrlhf" else real(n))
    with pytest.raises(
        OpenRLHFMismatch, match=r"openrlhf 0\.12\.0 is installed; the adapter is written against 0\.11\.2"
    ):
        check_openrlhf_version()


def test_learning_side_without_gpu_install_is_a_clear_error(capsys):
    try:
        import openrlhf.trainer.ppo_trainer  # noqa: F401
    except ImportError:
        with pytest.raises(SystemExit) as exit_info:
            main(["--scheduler", "rlhfless"])
        assert exit_info.value.code == 2
        assert "install OpenRLHF's learning side on a" in capsys.readouterr().err
    else:  # a machine with OpenRLHF's full install: the trainer side checks out too
        assert any("PPOTrainer" in c for c in check_internals(learning=True))


def test_the_hooks_decide_the_plan_once_openrlhf_parsed_its_flags_and_leave_args_alone(monkeypatch):
    """The launch's ``hierarchize`` hook decides the plan on OpenRLHF's parsed flags and sets only the flags the
    plan changes; nothing of the scheduler is put on ``args``."""
    import openrlhf.trainer.ray as ray_pkg
    import openrlhf.utils.config as config_module

    launch = _hooked(monkeypatch, "rlhfless")
    assert launch.plan is None
    flat = argparse.Namespace(**{"vllm.enable_prefix_caching": False, "rollout.n_samples_per_prompt": 8})
    args = config_module.hierarchize(flat)
    # the user's prefix-cache setting is kept: both schedulers run with the same one
    assert launch.plan.name == "rlhfless" and launch.plan.request.scheduler.name == "rlhfless"
    assert args.vllm.enable_prefix_caching is False and args.rollout.n_samples_per_prompt == 8
    assert not any("rlhfless" in name for name in vars(args))
    assert ray_pkg.create_vllm_engines.__name__ == "create_vllm_engines"
    assert ray_pkg.create_vllm_engines.__wrapped__.__module__ == "openrlhf.trainer.ray.vllm_engine"


def test_example_gsm8k_reward():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "openrlhf" / "reward_gsm8k.py"
    spec = importlib.util.spec_from_file_location("reward_gsm8k", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = module.reward_func(
        ["Q: 2+2? The answer is 4.", "Q: 10*10? I think 1,000", "Q: 7? 7 apples, then 8"],
        ["Q: 2+2?", "Q: 10*10?", "Q: 7?"],
        ["so #### 4", "#### 100", "#### 7"],
    )
    assert out["rewards"].tolist() == [1.0, 0.0, 0.0]


def test_example_launch_scripts_use_the_launcher():
    from pathlib import Path

    folder = Path(__file__).resolve().parent.parent / "examples" / "openrlhf"
    for script in ("grpo_gsm8k_qwen2.5-3b.sh", "one_gpu_step.sh"):
        text = (folder / script).read_text()
        assert "python -m rlhfless_openrlhf.train_ppo_ray" in text and "--scheduler" in text
    flags = set(split_args(["--scheduler", "rlhfless", "--scheduler.profile", "p"])[0])
    assert flags == {"--scheduler", "--scheduler.profile"}


def _script_launches(tmp_path, script: str, scheduler: str) -> list[list[str]]:
    """Every ``python`` command line the example ``script`` runs with ``SCHEDULER=scheduler`` (a stand-in
    ``python`` on PATH records them; nothing runs)."""
    import os
    import stat
    import subprocess

    calls = tmp_path / "calls"
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\037" "$@" >> "$CALLS"; echo >> "$CALLS"; cat > /dev/null\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}", "CALLS": str(calls)}
    env["SCHEDULER"] = scheduler
    folder = Path(__file__).resolve().parent.parent / "examples" / "openrlhf"
    run = subprocess.run(
        ["bash", str(folder / script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    return [line.split("\037")[:-1] for line in calls.read_text().splitlines()]


@pytest.mark.parametrize("script", ["grpo_gsm8k_qwen2.5-3b.sh", "one_gpu_step.sh"])
@pytest.mark.parametrize("scheduler", ["rlhfless", "rlhfless-fast", "rlhfless-onpolicy"])
def test_example_scripts_pass_importance_correction_for_stale_tokens(tmp_path, script, scheduler):
    """A launch whose scheduler trains stale tokens (partial rollouts) passes ``--algo.advantage.is_correction_level
    token`` itself (the launcher would turn it on, saying so); the others leave OpenRLHF's default."""
    from rlhfless_openrlhf.decide import IS_CORRECTION, passed

    launches = [c[2:] for c in _script_launches(tmp_path, script, scheduler) if c[:2] == ["-m", LAUNCHER]]
    names = []
    for argv in launches:
        ours, rest = split_args(argv)
        request = resolve(ours)
        names.append(ours["--scheduler"])
        if request is not None and request.mode.keeps_tokens:
            assert rest[rest.index(IS_CORRECTION) + 1] == "token", argv
        else:
            assert not passed(IS_CORRECTION, rest), argv
    assert scheduler in names  # the script ran the scheduler asked for


LAUNCHER = "rlhfless_openrlhf.train_ppo_ray"


# -- OpenRLHF modes: refused at launch, or sized right -------------------------------------------------------
def _hierarchized(**flat):
    """OpenRLHF's own hierarchized args from its CLI's defaults plus ``flat`` overrides (dotted names)."""
    import openrlhf.utils.config as config_module

    defaults = {
        "train.agent_func_path": None,
        "data.max_images_per_prompt": 0,
        "train.colocate_all": False,
        "train.colocate_actor_ref": False,
        "train.colocate_critic_reward": False,
        "actor.num_nodes": 1,
        "actor.num_gpus_per_node": 8,
        "ref.num_nodes": 1,
        "ref.num_gpus_per_node": 8,
        "critic.num_nodes": 1,
        "critic.num_gpus_per_node": 8,
        "critic.model_name_or_path": None,
        "reward.num_nodes": 1,
        "reward.num_gpus_per_node": 8,
        "reward.remote_url": None,
        "algo.kl.init_coef": 0.001,
        "algo.advantage.estimator": "group_norm",
    }
    return config_module.hierarchize(argparse.Namespace(**{**defaults, **flat}))


@pytest.mark.parametrize(("flag", "value"), [("train.agent_func_path", "agent.py"), ("data.max_images_per_prompt", 2)])
def test_an_unsupported_openrlhf_mode_is_refused_naming_its_flag(monkeypatch, flag, value):
    _hooked(monkeypatch, "rlhfless")
    refused = rf"--{flag} is not supported with --scheduler rlhfless .*--scheduler openrlhf"
    with pytest.raises(SystemExit, match=refused):
        _hierarchized(**{flag: value})
    _hierarchized()  # the defaults pass


def test_tensor_parallel_engines_are_planned_with_the_profile_sharded_to_their_size(monkeypatch, caplog):
    """``--vllm.tensor_parallel_size 2``: OpenRLHF's engines hold two GPUs each, so the planner's profile (the
    default, one GPU an engine, with a tensor_parallel block) is sharded two ways in the args the generator reads,
    with one line saying so; at size 1 it is left as it is; a profile that cannot be sharded is refused, naming
    both sizes."""
    import logging

    from rlhfless_openrlhf.decide import decide

    launch = _hooked(monkeypatch, "rlhfless", ["--actor.model_name_or_path", "m"])
    _hierarchized()
    assert launch.plan.profile.gpus_per_actor == 1
    with caplog.at_level(logging.INFO, logger="rlhfless.openrlhf"):
        args = _hierarchized(**{"vllm.tensor_parallel_size": 2})
    prof = launch.plan.profile
    assert prof.name == "qwen2.5-7b-l40s-tp2" and prof.gpus_per_actor == 2
    said = [r.getMessage() for r in caplog.records if "tensor_parallel_size" in r.getMessage()]
    assert len(said) == 1 and "sharded over 2 GPUs" in said[0]
    request = resolve({"--scheduler": "rlhfless", "--scheduler.profile": "qwen2.5-7b-h100"})
    args.vllm.tensor_parallel_size = 4
    with pytest.raises(SystemExit, match=r"size 4 runs engines of 4 GPUs, but profile 'qwen2\.5-7b-h100' cannot"):
        decide(args, request)
    request = resolve({"--scheduler": "rlhfless", "--scheduler.profile": "llama-70b-8xh100"})
    with pytest.raises(SystemExit, match="it models engines of 8 GPUs"):
        decide(args, request)


# -- importance-sampling correction for schedulers that train stale tokens -------------------------------------
IS_FLAG = "--algo.advantage.is_correction_level"


def _hooked(monkeypatch, preset, argv: list[str] = ()):
    """OpenRLHF's hierarchize with a launch's hooks for ``preset`` (a name or a ``LaunchRequest``), reading ``argv``
    as OpenRLHF's command line; the hooks are taken out after the test. Returns the ``Launch``: its ``plan`` is made
    when ``hierarchize`` runs."""
    import importlib

    import openrlhf.trainer.ray as ray_pkg
    import openrlhf.utils.config as config_module
    from rlhfless_openrlhf.launch import Launch

    pg_module = importlib.import_module("ray.util.placement_group")
    for module, name in (
        (config_module, "hierarchize"),
        (ray_pkg, "create_vllm_engines"),
        (pg_module, "placement_group"),
    ):
        monkeypatch.setattr(module, name, getattr(module, name))
    request = resolve({"--scheduler": preset}) if isinstance(preset, str) else preset
    launch = Launch(request, list(argv))
    launch.install_rollout_hooks()
    return launch


def _runnable_presets() -> list[str]:
    from rlhfless_sdk import get_plugin_manager

    registry = get_plugin_manager().registry
    from rlhfless_openrlhf.capabilities import adapter_refusal

    runs = [n for n in registry.names("scheduler") if adapter_refusal(registry.scheduler(n), registry) is None]
    return [n for n in runs if n != "openrlhf"]  # that one runs OpenRLHF unchanged: no hook at all


def _presets() -> list[str]:
    from rlhfless_sdk import get_plugin_manager

    registry = get_plugin_manager().registry
    return [n for n in registry.names("scheduler") if registry.scheduler(n).group == "preset"]


def test_every_preset_runs_through_the_launcher_and_nothing_else_is_a_preset():
    """What ``rlhfless plugins`` lists as a preset is exactly what the launcher runs: every preset resolves; every
    research config is refused; a baseline is OpenRLHF's own behaviour (``openrlhf`` runs it unchanged, its async
    modes are its own flags, ``verl`` is verl's dispatch)."""
    from rlhfless_openrlhf.capabilities import adapter_refusal

    from rlhfless_sdk import get_plugin_manager

    registry = get_plugin_manager().registry
    presets = _presets()
    assert {"rlhfless", "rlhfless-fast", "rlhfless-onpolicy", "rlhfless-stream", "rlhfless-paper"} <= set(presets)
    for name in registry.names("scheduler"):
        config = registry.scheduler(name)
        refused = adapter_refusal(config, registry)
        if config.group == "preset":
            assert refused is None, refused
            assert resolve({"--scheduler": name}) is not None
        elif config.group == "research":
            assert refused is not None and "research set" in refused


@pytest.mark.parametrize("launch", ["sync", "async"])
@pytest.mark.parametrize("preset", _presets())
def test_each_preset_launches_in_each_mode_it_supports(monkeypatch, preset, launch):
    """Every preset through the launcher's hook on OpenRLHF's own args, in a synchronous and an async launch: each
    runs in both, but the stream, which streams only in OpenRLHF's async loop and is refused in one line without it."""
    from rlhfless_sdk import get_plugin_manager

    streams = get_plugin_manager().registry.scheduler(preset).pipeline.mode == "stream"
    _hooked(monkeypatch, preset, ["--actor.model_name_or_path", "m"])
    flags = {"train.async_enable": True} if launch == "async" else {}
    if streams and launch == "sync":
        with pytest.raises(SystemExit, match=rf"'{preset}'.*streams.*--train\.async_enable"):
            _hierarchized(**flags)
        return
    args = _hierarchized(**flags)
    assert bool(getattr(args.train, "async_enable", False)) == (launch == "async")


@pytest.mark.parametrize("preset", _runnable_presets())
def test_a_scheduler_that_trains_stale_tokens_gets_importance_correction_by_default(monkeypatch, caplog, preset):
    """OpenRLHF's default is no correction (``off``). A preset whose straggler policy keeps a cut sample's tokens
    across a weight update (partial rollouts: rlhfless-fast) or generates on through one (the stream, in OpenRLHF's
    async loop) gets ``token``, with one line saying so; every other preset is left as OpenRLHF has it."""
    import logging

    request = resolve({"--scheduler": preset})
    streams = request.scheduler.pipeline.mode == "stream"
    stale = request.scheduler.straggler.name == "partial-batch" or streams
    assert request.mode.keeps_tokens is stale
    _hooked(monkeypatch, preset, ["--actor.model_name_or_path", "m"])
    with caplog.at_level(logging.INFO, logger="rlhfless.openrlhf"):
        args = _hierarchized(**{"algo.advantage.is_correction_level": "off", "train.async_enable": streams})
    said = [m for r in caplog.records if IS_FLAG in (m := r.getMessage()) and "launch plan" not in m]
    if stale:
        assert args.algo.advantage.is_correction_level == "token"
        assert len(said) == 1 and "importance-sampling correction on" in said[0] and preset in said[0]
    else:
        assert args.algo.advantage.is_correction_level == "off" and said == []


@pytest.mark.parametrize(("preset", "stale"), [("rlhfless-fast", True), ("rlhfless-onpolicy", False)])
def test_straggler_presets_run_in_openrlhfs_async_mode_with_their_age_bound_said(monkeypatch, caplog, preset, stale):
    """``--train.async_enable``: the generator actor keeps its carried samples and deferred prompts between the
    batches it generates ahead (and checkpoints them, test_openrlhf_trainer). Partial rollouts there train a token
    at most queue_size + 1 updates old: the correction goes on and one line says the bound."""
    import logging

    _hooked(monkeypatch, preset, ["--actor.model_name_or_path", "m"])
    with caplog.at_level(logging.INFO, logger="rlhfless.openrlhf"):
        args = _hierarchized(
            **{"algo.advantage.is_correction_level": "off", "train.async_enable": True, "train.async_queue_size": 2}
        )
    said = [r.getMessage() for r in caplog.records if "--train.async_enable" in r.getMessage()]
    if stale:
        assert args.algo.advantage.is_correction_level == "token"
        assert len(said) == 1 and "at most 3 weight updates old" in said[0] and "2 batch(es) ahead" in said[0]
    else:
        assert args.algo.advantage.is_correction_level == "off" and said == []


def test_the_stream_runs_only_in_openrlhfs_async_loop_with_partial_rollout_broadcasts(monkeypatch, caplog):
    """``rlhfless-stream``: refused in one line without ``--train.async_enable`` (its engines generate on while the
    learner trains), with sleeping engines or dynamic filtering; in the async loop the partial-rollout broadcast
    (pause, load, resume) is turned on with a line saying so, and the age bound and the correction are said."""
    import logging

    _hooked(monkeypatch, "rlhfless-stream", ["--actor.model_name_or_path", "m"])
    with pytest.raises(SystemExit, match=r"rlhfless-stream.*streams.*--train\.async_enable"):
        _hierarchized(**{"algo.advantage.is_correction_level": "off"})
    for flag in ("vllm.enable_sleep", "algo.dynamic_filtering_enable"):
        with pytest.raises(
            SystemExit, match=rf"--{flag.replace('.', '[.]')} cannot run with scheduler 'rlhfless-stream'"
        ):
            _hierarchized(**{"train.async_enable": True, flag: True})
    with caplog.at_level(logging.INFO, logger="rlhfless.openrlhf"):
        args = _hierarchized(**{"algo.advantage.is_correction_level": "off", "train.async_enable": True})
    said = [r.getMessage() for r in caplog.records]
    assert args.train.partial_rollout_enable is True and args.algo.advantage.is_correction_level == "token"
    assert any("--train.partial_rollout_enable on" in line for line in said)
    assert any("no token more than 2 weight updates old" in line for line in said)
    assert not any("elastic" in line for line in said)
    assert any("up to 2 weight updates stale" in line and "correction on" in line for line in said)
    assert any("queue 1)" in line and "up to 1 batch(es) ahead of training" in line for line in said)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rlhfless.openrlhf"):  # a deeper queue than the age bound uses
        _hierarchized(**{"train.async_enable": True, "train.async_queue_size": 3})
    said = [r.getMessage() for r in caplog.records]
    assert any("up to 2 batch(es) ahead" in line and "a queue above 2 adds nothing" in line for line in said)


#: Each research config: what its refusal names, and the preset OpenRLHF runs instead.
RESEARCH = {
    "research-elastic-stream": ("resizes the learner between batches", "rlhfless-stream"),
    "research-onpolicy-tail": ("tail_learn", "rlhfless-onpolicy"),
    "research-onpolicy-overlap": ("tail_prepare", "rlhfless-onpolicy"),
    "oracle": ("reads true lengths", "rlhfless"),
    "oracle-time": ("reads true lengths", "rlhfless"),
}


@pytest.mark.parametrize("name", sorted(RESEARCH))
def test_the_research_set_is_refused_at_launch_naming_why_and_the_preset_that_runs(name):
    """The research set (``group: research``, ``configs/research/``) is simulated only: the launcher refuses each
    one in one line, before OpenRLHF starts, naming its mechanism and the preset OpenRLHF runs instead."""
    with pytest.raises(SystemExit) as refused:
        resolve({"--scheduler": name})
    message = str(refused.value.code)
    why, instead = RESEARCH[name]
    assert "\n" not in message and f"'{name}' is in the research set" in message
    assert why in message and f"on OpenRLHF: {instead})" in message


def test_the_demo_and_fidelity_refuse_the_stream_naming_the_async_loop():
    """Steps run one after the other there: no learner trains while the engines generate."""
    from rlhfless_openrlhf.capabilities import adapter_refusal

    from rlhfless_sdk import get_plugin_manager

    registry = get_plugin_manager().registry
    config = registry.scheduler("rlhfless-stream")
    assert adapter_refusal(config, registry) is None
    why = adapter_refusal(config, registry, async_loop=False)
    assert why is not None and "--train.async_enable --train.partial_rollout_enable" in why


@pytest.mark.parametrize(
    ("preset", "option"), [("research-onpolicy-overlap", "tail_prepare"), ("research-onpolicy-tail", "tail_learn")]
)
def test_work_in_the_tail_is_refused_on_openrlhf_naming_the_preset_to_use(tmp_path, preset, option):
    """OpenRLHF scores and learns on its whole model groups at once: the launcher refuses a user's config that
    works in the tail (here the research set's, as the user's own group) in one line, naming the preset that runs."""
    from rlhfless_sdk import get_plugin_manager

    config = get_plugin_manager().registry.scheduler(preset).derive(name="mine", group="preset")
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    with pytest.raises(SystemExit, match=rf"'mine'.*{option}.*on OpenRLHF: rlhfless-onpolicy"):
        resolve({"--scheduler.config": str(path)})


@pytest.mark.parametrize("argv", [[IS_FLAG, "seq"], [f"{IS_FLAG}=seq"], ["--algo.advantage.is_correction_lev", "seq"]])
def test_a_correction_level_the_user_chose_is_kept(monkeypatch, argv):
    _hooked(monkeypatch, "rlhfless-fast", ["--rollout.n_samples_per_prompt", "8", *argv])
    assert _hierarchized(**{"algo.advantage.is_correction_level": "seq"}).algo.advantage.is_correction_level == "seq"


@pytest.mark.parametrize("argv", [[IS_FLAG, "off"], [f"{IS_FLAG}=off"]])
def test_an_explicit_correction_off_is_refused_for_stale_tokens(monkeypatch, argv):
    _hooked(monkeypatch, "rlhfless-fast", argv)
    with pytest.raises(SystemExit) as refused:
        _hierarchized(**{"algo.advantage.is_correction_level": "off"})
    message = str(refused.value.code)
    assert message.startswith(f"error: {IS_FLAG} off cannot run with scheduler 'rlhfless-fast'")
    assert "\n" not in message
    _hooked(monkeypatch, "rlhfless-onpolicy", argv)  # tail batching re-runs from scratch: off is the user's call
    assert _hierarchized(**{"algo.advantage.is_correction_level": "off"}).algo.advantage.is_correction_level == "off"


def test_an_explicit_correction_off_is_refused_through_openrlhfs_own_cli(monkeypatch, openrlhf_learning):
    """The launcher's whole path up to OpenRLHF's argument parser, in this process: OpenRLHF's CLI parses the
    flags, the hook refuses before ``train()`` (so before Ray starts) with one line, and no traceback."""
    import sys

    import openrlhf.trainer.ppo_trainer as ppo_trainer_module
    import openrlhf.trainer.ppo_trainer_async as ppo_trainer_async_module
    import openrlhf.trainer.ray as ray_pkg
    import openrlhf.utils.config as config_module
    import ray

    for module, name in (
        (config_module, "hierarchize"),
        (ray_pkg, "create_vllm_engines"),
        (ppo_trainer_module, "PPOTrainer"),
        (ppo_trainer_async_module, "PPOTrainerAsync"),
    ):
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    with pytest.raises(SystemExit) as refused:
        main(["--scheduler", "rlhfless-fast", "--actor.model_name_or_path", "m", IS_FLAG, "off"])
    assert str(refused.value.code).startswith(f"error: {IS_FLAG} off cannot run with scheduler 'rlhfless-fast'")
    assert not ray.is_initialized()


@pytest.mark.parametrize("preset", ["rlhfless-fast", "rlhfless-onpolicy", "rlhfless-stream"])
def test_oversampling_is_refused_for_a_scheduler_that_carries_work_or_streams(monkeypatch, preset):
    """OpenRLHF's ``--rollout.vllm_generate_batch_size`` above ``--rollout.batch_size`` (async only) trains the groups
    beyond a batch from a buffer a weight update later and leaves that buffer out of its checkpoints: a scheduler
    that carries samples or deferred prompts, or streams, is refused in one line naming both flags, before Ray
    starts. ``rlhfless-slo`` (synchronous, nothing carried) runs it as OpenRLHF does; so does any scheduler at equal
    sizes. ``rlhfless`` streams in an async launch, so it is refused too, naming the stream it runs."""
    over = {"train.async_enable": True, "rollout.batch_size": 8, "rollout.vllm_generate_batch_size": 16}
    _hooked(monkeypatch, preset, [])
    with pytest.raises(SystemExit) as refused:
        _hierarchized(**over)
    message = str(refused.value.code)
    assert message.startswith(
        f"error: --rollout.vllm_generate_batch_size 16 > --rollout.batch_size 8 cannot run with scheduler '{preset}'"
    )
    assert "\n" not in message and "drop --rollout.vllm_generate_batch_size" in message
    _hierarchized(**{**over, "rollout.vllm_generate_batch_size": 8})  # equal sizes: no oversampling
    _hooked(monkeypatch, "rlhfless", [])
    with pytest.raises(SystemExit, match="cannot run with scheduler 'rlhfless-stream'"):
        _hierarchized(**over)
    _hooked(monkeypatch, "rlhfless-slo", [])
    assert _hierarchized(**over).rollout.vllm_generate_batch_size == 16


def test_the_placer_keeps_the_learners_real_size_free():
    from rlhfless_openrlhf.launch_split import learner_gpus

    assert learner_gpus(_hierarchized(**{"train.colocate_all": True})) == 0  # engines share the learner's GPUs
    # GRPO, rule reward, no colocation: actor 8 + reference 8 (the reward model group is built too: 8)
    assert learner_gpus(_hierarchized()) == 24
    assert learner_gpus(_hierarchized(**{"reward.remote_url": "r.py"})) == 16
    assert learner_gpus(_hierarchized(**{"reward.remote_url": "r.py", "algo.kl.init_coef": 0.0})) == 8
    # actor and reference co-located: their group exists before the engines, so it is no longer free
    assert learner_gpus(_hierarchized(**{"reward.remote_url": "r.py", "train.colocate_actor_ref": True})) == 0
    # PPO with a critic: + critic; critic and reward co-located share one group
    gae = {"algo.advantage.estimator": "gae", "critic.model_name_or_path": "m", "actor.num_gpus_per_node": 4}
    assert learner_gpus(_hierarchized(**gae, **{"algo.kl.init_coef": 0.0})) == 4 + 8 + 8
    assert learner_gpus(_hierarchized(**gae, **{"algo.kl.init_coef": 0.0, "train.colocate_critic_reward": True})) == 12


def test_help_prints_the_launchers_flags_and_what_the_learning_side_needs():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "rlhfless_openrlhf.train_ppo_ray", "--help"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--scheduler.config FILE" in out.stdout and "--scheduler.report FILE" in out.stdout
    assert "--scheduler.carry_timeout S" in out.stdout
    # either OpenRLHF's own flags follow (its learning side imports here) or the line saying what it needs
    assert "--actor.model_name_or_path" in out.stdout or "Install OpenRLHF on a" in out.stdout
    assert "Traceback" not in out.stderr


# -- placement on a real multi-node Ray cluster ----------------------------------------------------------------
@pytest.mark.slow
def test_engines_are_pinned_to_free_gpus_on_a_multi_node_cluster():
    """Two Ray nodes with two GPUs each; OpenRLHF's actor/ref group (``--train.colocate_actor_ref``) holds the
    first node's two GPUs before the engines are built. Pinning by total GPUs would put the engines on the largest
    node regardless, and their placement group would never be ready; by free GPUs it is."""
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group, remove_placement_group
    from rlhfless_openrlhf.engine_factory import placer_bundles

    from rlhfless_sdk import get_plugin_manager

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 2})
    cluster.add_node(num_cpus=2, num_gpus=2)
    ray.init(address=cluster.address, include_dashboard=False)
    try:
        cluster.wait_for_nodes()
        placer = get_plugin_manager().registry.create("placer", "locality-aware")
        actor_ref = placement_group([{"GPU": 1, "CPU": 1}] * 2, strategy="PACK")
        ray.get(actor_ref.ready(), timeout=60)
        bundles = placer_bundles(2, placer)
        engines = placement_group(bundles, strategy="PACK")
        ray.get(engines.ready(), timeout=60)  # would time out if pinned to GPUs the actor/ref group holds
        assert len({next(k for k in b if k.startswith("node:")) for b in bundles}) == 1
        assert placer_bundles(1, placer) is None  # every GPU is held now: OpenRLHF's own bundles are kept
        remove_placement_group(engines)
        remove_placement_group(actor_ref)
        # no group yet, a 2-GPU learner to come: the placer keeps its GPUs free beside the engines' node
        bundles = placer_bundles(2, placer, reserve=2)
        engines = placement_group(bundles, strategy="PACK")
        ray.get(engines.ready(), timeout=60)
        learner = placement_group([{"GPU": 1, "CPU": 1}] * 2, strategy="STRICT_PACK")
        ray.get(learner.ready(), timeout=60)  # the learner still fits on one node
    finally:
        ray.shutdown()
        cluster.shutdown()


# -- the launcher's whole path, through OpenRLHF's own CLI, on a CPU --------------------------------------------
LAUNCH = Path(__file__).resolve().with_name("openrlhf_cpu_launch.py")
EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "openrlhf"


def _launch_inputs(tmp_path) -> tuple[Path, Path]:
    """A CPU launch's tiny model and its 8 GSM8K-style prompts (skipped without OpenRLHF's learning side)."""
    import json

    for module in ("peft", "deepspeed", "datasets", "torchdata"):
        pytest.importorskip(module, reason="OpenRLHF's learning side imports it (the README's test install has it)")
    from rlhfless_openrlhf.tools.tiny_model import tiny_model

    model = tiny_model(tmp_path / "cache")
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"input": f"Tom has {i} apples and buys {i} more. How many?", "label": str(2 * i)}) + "\n"
            for i in range(8)
        )
    )
    return model, data


def _cpu_launch(tmp_path, *extra: str, scheduler: str = "rlhfless") -> tuple[int, str, str]:
    """The drop-in launcher through ``openrlhf_cpu_launch.py`` with a tiny model and GSM8K-style prompts:
    (exit status, stdout, stderr)."""
    import sys

    model, data = _launch_inputs(tmp_path)
    flags = [
        "--scheduler", scheduler, "--scheduler.report", str(tmp_path / "steps.jsonl"),
        "--actor.model_name_or_path", str(model), "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "1",
        "--vllm.num_engines", "1", "--vllm.enable_prefix_caching", "--vllm.enforce_eager",
        "--algo.advantage.estimator", "group_norm",
        "--rollout.n_samples_per_prompt", "2", "--algo.kl.init_coef", "0",
        "--data.prompt_dataset", str(data), "--data.input_key", "input", "--data.label_key", "label",
        "--reward.remote_url", str(EXAMPLES / "reward_gsm8k.py"),
        "--rollout.batch_size", "4", "--train.batch_size", "8", "--rollout.micro_batch_size", "2",
        "--train.micro_batch_size", "2", "--rollout.max_new_tokens", "16", "--data.max_len", "256",
        "--train.num_episodes", "1", "--ckpt.output_dir", str(tmp_path / "out"), *extra,
    ]  # fmt: skip
    if scheduler != "openrlhf":  # the preset's own plan on this tiny shape, priced with a shipped profile (a tiny
        flags += ["--scheduler.force", "--scheduler.profile", "qwen2.5-7b-l40s"]  # model is near none of them)
    run = H.run_launch([sys.executable, str(LAUNCH), *flags], tmp_path)
    return run.returncode, run.stdout, run.stderr


BUILT = H.sibling("openrlhf_built").BUILT


# The launches a review rebuilt from OpenRLHF's README, each with RLHFless's presets: (name, OpenRLHF flags beyond
# the common ones, async only, logical GPUs the launch needs). ``{model}``, ``{data}`` and ``{reward}`` are filled in.
SHAPES = {
    "ppo-critic-reward-colocate-all": (
        ["--algo.advantage.estimator", "gae", "--critic.model_name_or_path", "{model}",
         "--reward.model_name_or_path", "{model}", "--train.colocate_all", "--vllm.num_engines", "1",
         "--actor.num_gpus_per_node", "1", "--critic.num_gpus_per_node", "1", "--reward.num_gpus_per_node", "1",
         "--ref.num_gpus_per_node", "1", "--algo.kl.init_coef", "0.01", "--rollout.n_samples_per_prompt", "1"],
        False, 2,  # async: the engine gets a GPU of its own
    ),
    "reinforce-baseline-async": (
        ["--algo.advantage.estimator", "reinforce_baseline", "--reward.remote_url", "{reward}", "--train.async_enable",
         "--vllm.num_engines", "1", "--actor.num_gpus_per_node", "1", "--algo.kl.init_coef", "0",
         "--rollout.n_samples_per_prompt", "2"],
        True, 2,
    ),
    "grpo-async-eval-colocate-actor-ref": (
        ["--algo.advantage.estimator", "group_norm", "--reward.remote_url", "{reward}", "--train.async_enable",
         "--eval.dataset", "{data}", "--eval.steps", "1", "--train.colocate_actor_ref", "--algo.kl.init_coef", "0.01",
         "--vllm.num_engines", "1", "--actor.num_gpus_per_node", "1", "--ref.num_gpus_per_node", "1",
         "--rollout.n_samples_per_prompt", "2"],
        True, 2,
    ),
    "grpo-tensor-parallel-2": (
        ["--algo.advantage.estimator", "group_norm", "--reward.remote_url", "{reward}", "--vllm.num_engines", "1",
         "--vllm.tensor_parallel_size", "2", "--actor.num_gpus_per_node", "1", "--algo.kl.init_coef", "0",
         "--rollout.n_samples_per_prompt", "2"],
        False, 3,
    ),
}  # fmt: skip
#: The presets OpenRLHF launches, in the modes they launch in.
LAUNCHED = [
    ("rlhfless", "sync"),
    ("rlhfless", "async"),
    ("rlhfless-fast", "sync"),
    ("rlhfless-fast", "async"),
    ("rlhfless-onpolicy", "sync"),
    ("rlhfless-onpolicy", "async"),
    ("rlhfless-stream", "async"),
]
#: What CI launches until CUDA: the shapes the CPU training harness cannot train (tensor-parallel engines: vLLM's
#: CPU build has no Ray executor) or does not train in CI (REINFORCE++-baseline async); the other two train to the
#: end in ``test_openrlhf_training.py``.
#: ``RLHFLESS_LAUNCH_MATRIX=full`` launches every preset and mode in every shape it runs in: 22 launches.
CI_LAUNCHES = [
    ("grpo-tensor-parallel-2", "rlhfless-fast", "sync"),
    ("reinforce-baseline-async", "rlhfless-onpolicy", "async"),
]


def _launch_matrix() -> list[tuple[str, str, str]]:
    import os

    if os.environ.get("RLHFLESS_LAUNCH_MATRIX") != "full":
        return CI_LAUNCHES
    return [
        (shape, scheduler, mode)
        for shape, (_flags, async_only, _gpus) in SHAPES.items()
        for scheduler, mode in LAUNCHED
        if mode == "async" or not async_only
    ]


@pytest.mark.slow
@pytest.mark.parametrize(("shape", "scheduler", "mode"), _launch_matrix())
def test_the_launches_openrlhfs_readme_shows_run_with_each_preset_until_cuda(tmp_path, shape, scheduler, mode):
    """OpenRLHF launches as its README shows them (PPO with a critic and a reward model under
    ``--train.colocate_all``; REINFORCE++-baseline async; GRPO async with evaluation and
    ``--train.colocate_actor_ref``; GRPO with tensor-parallel engines), each with an RLHFless preset, run through
    the launcher on a CPU: no error before CUDA, every class the launcher swaps in built through Ray. (A
    tensor-parallel engine cannot start on vLLM's CPU build: its Ray executor is GPU-only.) The stream builds its
    fill engine in the learner's placement group where ``--train.colocate_actor_ref`` makes one."""
    import os
    import sys

    model, data = _launch_inputs(tmp_path)
    flags, _async_only, gpus = SHAPES[shape]
    fill = {"model": str(model), "data": str(data), "reward": str(EXAMPLES / "reward_gsm8k.py")}
    extra = [f.format(**fill) for f in flags]
    if mode == "async" and "--train.async_enable" not in extra:
        extra.append("--train.async_enable")
    common = [
        "--scheduler", scheduler, "--scheduler.report", str(tmp_path / "steps.jsonl"),
        "--actor.model_name_or_path", str(model), "--actor.num_nodes", "1", "--vllm.enable_prefix_caching",
        "--vllm.enforce_eager", "--data.prompt_dataset", str(data), "--data.input_key", "input",
        "--data.label_key", "label",
        "--rollout.batch_size", "4", "--train.batch_size", "8", "--rollout.micro_batch_size", "2",
        "--train.micro_batch_size", "2", "--rollout.max_new_tokens", "16", "--data.max_len", "256",
        "--train.num_episodes", "1", "--ckpt.output_dir", str(tmp_path / "out"),
    ]  # fmt: skip
    common += ["--scheduler.force"]  # each preset's own plan, priced faster than OpenRLHF's or not (a tiny shape)
    common += ["--scheduler.profile", "qwen2.5-7b-l40s"]  # a tiny model is near no shipped profile
    launched = "rlhfless-stream" if (scheduler, mode) == ("rlhfless", "async") else scheduler  # its async form
    fills = launched == "rlhfless-stream" and "--train.colocate_actor_ref" in extra
    if fills:  # a model whose learner state leaves a fill engine room on the learner's one GPU
        common += ["--scheduler.profile", str(H.small_learner_profile(tmp_path))]
    run = H.run_launch(
        [sys.executable, str(LAUNCH), *common, *extra], tmp_path, {**os.environ, "RLHFLESS_CPU_LAUNCH_GPUS": str(gpus)}
    )
    out = run.stdout + run.stderr
    assert run.returncode != 0  # it cannot finish without CUDA ...
    assert not [line for line in run.stderr.splitlines() if line.startswith("error:")], out[-3000:]
    assert "ModelActor.init_model_from_pretrained" in out and "_cuda_setDevice" in out, out[-3000:]
    assert BUILT[mode] in out.splitlines(), out[-3000:]
    failed = [line for line in out.splitlines() if "Exception raised in creation task" in line]
    if "tensor-parallel" in shape and failed:
        # vLLM's CPU build runs no Ray executor, which OpenRLHF's tensor-parallel engines use: where the engine gets
        # to start before the learner reaches CUDA (async), it fails there, and only it
        assert "current platform cpu does not support ray" in out, out[-3000:]
        assert all("(RlhflessRolloutActorImpl pid=" in line for line in failed), failed
    else:
        assert not failed, out[-3000:]
    assert f"rlhfless: launch plan: scheduler {launched!r}" in out
    if fills:  # built through Ray in the learner's placement group, beside its models, before they load
        assert "1 fill engines on the learner's GPUs" in out and "1 fill engine(s) built in the learner's" in out
    elif launched == "rlhfless-stream":
        assert "no fill engines (" in out
    if launched != scheduler:
        assert f"rlhfless: scheduler {scheduler!r} in an async launch (--train.async_enable) runs {launched!r}" in out
    if "tensor-parallel" in shape:
        assert "sharded over 2 GPUs" in out  # the planner models the engines at their size


@pytest.mark.slow
def test_partial_rollouts_with_correction_off_are_refused_in_one_line(tmp_path):
    returncode, stdout, stderr = _cpu_launch(tmp_path, IS_FLAG, "off", scheduler="rlhfless-fast")
    assert returncode != 0
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {IS_FLAG} off cannot run with scheduler"), stderr
    assert "Traceback" not in stdout + stderr
    assert "RlhflessRolloutActorImpl" not in stdout + stderr  # refused before OpenRLHF's train() built anything


def test_the_learning_side_internals_of_the_installed_openrlhf(openrlhf_learning, monkeypatch):
    pytest.importorskip("datasets")
    checked = check_internals(learning=True)
    assert "openrlhf.trainer.ppo_trainer_async.PPOTrainerAsync.__init__" in checked
    assert "openrlhf.trainer.ppo_trainer.PPOTrainer.broadcast_to_vllm" in checked
    # the async swap relies on PPOTrainerAsync looking its two actor classes up when it runs: a release that
    # builds them another way is named before anything starts
    from openrlhf.trainer import ppo_trainer_async

    def __init__(self, *args, **kwargs):  # builds its actors some other way
        self.generator_actor = None

    monkeypatch.setattr(ppo_trainer_async.PPOTrainerAsync.__ray_actor_class__, "__init__", __init__)
    with pytest.raises(OpenRLHFMismatch, match=r"PPOTrainerAsync\.__init__: no longer looks up"):
        check_internals(learning=True)


def test_every_class_the_launcher_swaps_in_can_be_shipped_by_ray(openrlhf_learning, monkeypatch):
    """Ray ships an actor class by value with every method on it, and a method that calls ``super()`` from an
    OpenRLHF class whose name ``@ray.remote`` took then fails in the worker (OpenRLHF 0.11.2's
    ``TrainingActor.__init__`` under Ray 2.55: ``super(type, obj): obj must be an instance or subtype of type``).
    None of the launcher's classes inherits one; a class that did is named by the internals check, before Ray
    starts. (Each class is also built through Ray in the CPU launches below.)"""
    pytest.importorskip("datasets")
    from openrlhf.trainer import ppo_trainer_async
    from rlhfless_openrlhf.internals import swapped_classes, unshippable_methods
    from rlhfless_openrlhf.trainer import RlhflessTrainingActorImpl

    classes = swapped_classes()
    assert len(classes) == 5 and all(unshippable_methods(cls) == [] for cls in classes)
    assert unshippable_methods(ppo_trainer_async.TrainingActor.__ray_actor_class__) == [
        "openrlhf.trainer.ppo_trainer_async.TrainingActor.__init__",
        "openrlhf.trainer.ppo_trainer_async.TrainingActor.broadcast_to_vllm",
    ]
    monkeypatch.delattr(RlhflessTrainingActorImpl, "__init__")  # the class as it was when it crashed every launch
    with pytest.raises(OpenRLHFMismatch, match=r"RlhflessTrainingActorImpl inherits .*TrainingActor\.__init__"):
        check_internals(learning=True)


def test_the_drafter_flag_sets_the_engines_speculative_decoding_in_either_launch():
    """``--scheduler.drafter`` replaces the preset's drafter (an unknown one lists the drafters; with ``--scheduler
    openrlhf`` it is refused, OpenRLHF runs unchanged); the async form keeps it, and the engine builder turns it
    into vLLM's speculative config."""
    from types import SimpleNamespace

    from rlhfless_openrlhf.decide import launched_form
    from rlhfless_openrlhf.engine_factory import drafter_overrides
    from rlhfless_openrlhf.plan import LaunchPlan

    from rlhfless_sdk import get_plugin_manager

    request = resolve({"--scheduler": "rlhfless", "--scheduler.drafter": "history"})
    assert request.scheduler.drafter.name == "history"
    assert resolve({"--scheduler": "rlhfless"}).scheduler.drafter.name == "none"
    assert resolve({"--scheduler": "rlhfless-onpolicy"}).scheduler.drafter.name == "none"
    with pytest.raises(SystemExit, match=r"--scheduler\.drafter 'histroy'.*history"):
        resolve({"--scheduler": "rlhfless", "--scheduler.drafter": "histroy"})
    with pytest.raises(SystemExit, match=r"--scheduler\.drafter has no effect with --scheduler openrlhf"):
        resolve({"--scheduler": "openrlhf", "--scheduler.drafter": "history"})
    args = SimpleNamespace(train=SimpleNamespace(async_enable=True))
    launched = launched_form(args, LaunchPlan.of(request), get_plugin_manager().registry).scheduler
    assert launched.name == "rlhfless-stream" and launched.drafter.name == "history"
    over = drafter_overrides(launched.drafter)
    assert over["speculative_config"]["method"] == "custom_class" and '"history"' in over["rlhfless_drafter"]
    assert drafter_overrides({"name": "none"}) == {} and drafter_overrides(None) == {}
    assert drafter_overrides("ngram") == {
        "speculative_config": {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 4,
        },
        "rlhfless_drafter": '{"name": "ngram", "params": {}}',
    }
    # a roofline budget: vLLM's batch-size schedule on GPU engines; a GPU-only drafter leaves CPU engines without one
    roofline = {"name": "ngram", "params": {"step_tokens": 768, "gpu_only": True}}
    gpu = drafter_overrides(roofline, "gpu")["speculative_config"]
    assert gpu["method"] == "ngram" and gpu["num_speculative_tokens_per_batch_size"][0] == (1, 153, 4)
    assert drafter_overrides(roofline, "cpu") == {}
    assert drafter_overrides("ngram", "cpu")["speculative_config"]["method"] == "ngram"  # not GPU-only: drafts


def test_the_engine_builder_sets_the_launched_schedulers_kv_watermark_on_vllm():
    """``rlhfless`` in a synchronous launch builds its engines with vLLM's scheduler watermark (``kv_watermark``,
    5% of the KV kept free when admitting beside running sequences); its async form, the stream, holds samples
    back itself and keeps vLLM's default, as OpenRLHF's engines do."""
    from types import SimpleNamespace

    from rlhfless_openrlhf.decide import launched_form
    from rlhfless_openrlhf.engine_factory import engine_overrides
    from rlhfless_openrlhf.plan import LaunchPlan

    from rlhfless_sdk import get_plugin_manager

    def launched(asynchronous: bool):
        args = SimpleNamespace(train=SimpleNamespace(async_enable=asynchronous))
        config = launched_form(args, LaunchPlan.of(request), get_plugin_manager().registry).scheduler
        return config, engine_overrides(config.drafter, config.kv_watermark, "cpu")

    request = resolve({"--scheduler": "rlhfless"})
    sync, stream = launched(False), launched(True)
    assert sync[0].name == "rlhfless" and sync[1] == {"watermark": 0.05}
    assert stream[0].name == "rlhfless-stream" and stream[1] == {}
    both = engine_overrides("ngram", 0.05, "cpu")
    assert both["watermark"] == 0.05 and both["speculative_config"]["method"] == "ngram"
    assert engine_overrides(None) == {}


def test_a_drafter_on_tensor_parallel_engines_is_refused_before_any_engine_starts(monkeypatch):

    import rlhfless_openrlhf.engine_factory as factory
    from rlhfless_openrlhf.plan import LaunchPlan

    from rlhfless_sdk.api.errors import RlhflessError

    plan = LaunchPlan.of(resolve({"--scheduler": "rlhfless", "--scheduler.drafter": "history"}))
    with pytest.raises(RlhflessError, match=r"drafter 'history' with --vllm\.tensor_parallel_size 2"):
        factory.build_launch_engines(plan, [], False, 1, 2, "model")


def test_an_async_stream_builds_fill_engines_only_where_the_learners_group_and_memory_allow(monkeypatch, caplog):
    """``rlhfless-stream`` (``fill_engines``) in an async launch: one fill engine per learner GPU, with vLLM's memory
    share what the profile's learner state leaves (``beside_fraction``), only where OpenRLHF builds the learner's
    models in a placement group of their own (``--train.colocate_actor_ref``) and the state OpenRLHF's estimator
    builds (a critic under ``gae``) leaves an engine worth running; otherwise none, one line naming why."""
    import logging

    from rlhfless_sdk.api.profiles import load_profile

    learner = load_profile("qwen2.5-7b-l40s").learner
    from rlhfless_openrlhf.plan import FillPlan

    launch = _hooked(monkeypatch, "rlhfless-stream", ["--actor.model_name_or_path", "m"])
    base = {"train.async_enable": True, "vllm.num_engines": 8, "vllm.tensor_parallel_size": 1}
    cases = [
        ({}, None, "pass --train.colocate_actor_ref"),
        (
            {"train.colocate_actor_ref": True},
            FillPlan(engines=8, memory=round(learner.beside_fraction("grpo", 8), 3)),
            "",
        ),
        ({"train.colocate_actor_ref": True, "actor.num_gpus_per_node": 2}, None, "under a tenth of its KV cache"),
        # PPO (OpenRLHF's default estimator, gae, with no --critic.model_name_or_path: OpenRLHF takes the critic from
        # the reward model after parsing): the critic's state too, so what is left is too little for an engine
        ({"train.colocate_actor_ref": True, "algo.advantage.estimator": "gae"}, None, "the ppo learner's state"),
        # the simulator's test: 5 GPUs leave 29% of a GPU's memory, less than the weights, so no KV cache at all
        ({"train.colocate_actor_ref": True, "actor.num_gpus_per_node": 5}, None, "under a tenth of its KV cache"),
        # last: the hook keeps the profile it sharded for the planner
        ({"train.colocate_actor_ref": True, "vllm.tensor_parallel_size": 2}, None, "one-GPU engines"),
    ]
    for flags, fill, why in cases:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="rlhfless.openrlhf"):
            _hierarchized(**{**base, **flags})
        said = [r.getMessage() for r in caplog.records if "fill engines" in r.getMessage()]
        assert launch.plan.fill == fill and len(said) == 1, said
        assert why in said[0] if fill is None else "8 fill engines on the learner's GPUs" in said[0]
    assert 0.45 < learner.beside_fraction("grpo", 8) < 0.55


def _model_dir(tmp_path, name: str, **shape) -> str:
    import json

    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(shape))
    return str(folder)


#: Qwen2.5-3B's and Qwen2.5-7B's shapes, as their config.json files give them.
QWEN_3B = dict(hidden_size=2048, num_hidden_layers=36, intermediate_size=11008, vocab_size=151936,
               num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
QWEN_7B = dict(hidden_size=3584, num_hidden_layers=28, intermediate_size=18944, vocab_size=152064,
               num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)  # fmt: skip


def test_the_launch_is_priced_with_the_shipped_profile_nearest_its_model_and_gpu(tmp_path):
    """Without ``--scheduler.profile``: the model's parameters from its config.json (3.09B and 7.62B for Qwen2.5's
    3B and 7B shapes), the GPU from its device name; the nearest shipped profile on that GPU, named in one line; on a
    node with no GPU to read, the default's GPU; a model near none (or a GPU no profile has) is refused in one line
    naming --scheduler.profile; an unreadable config (a hub name not cached here) is priced with the default."""
    from rlhfless_openrlhf import profile_fit
    from rlhfless_openrlhf.train_ppo_ray import model_flag, resolve

    from rlhfless_sdk.api.profiles import load_profile, profile_names

    shipped = {n: load_profile(n) for n in profile_names()}
    small, seven = _model_dir(tmp_path, "3b", **QWEN_3B), _model_dir(tmp_path, "7b", **QWEN_7B)
    assert profile_fit.model_params_b(small) == pytest.approx(3.09, abs=0.01)
    assert profile_fit.model_params_b(seven) == pytest.approx(7.61, abs=0.02)
    assert profile_fit.fit(small, "NVIDIA H100 80GB HBM3", shipped).profile == "qwen2.5-3b-h100"
    assert profile_fit.fit(seven, "NVIDIA L40S", shipped).profile == "qwen2.5-7b-l40s"
    assert profile_fit.fit(seven, "NVIDIA H100 PCIe", shipped).profile == "qwen2.5-7b-h100"
    headless = profile_fit.fit(small, None, shipped)
    assert headless.profile == "qwen2.5-3b-l40s" and "no GPU to read on this node" in headless.line
    for model, gpu in ((seven, "NVIDIA A100-SXM4-80GB"), (_model_dir(tmp_path, "tiny", hidden_size=64,
                       num_hidden_layers=2, vocab_size=100), "NVIDIA L40S")):  # fmt: skip
        with pytest.raises(SystemExit, match=r"no shipped profile is near .* pass --scheduler\.profile"):
            profile_fit.fit(model, gpu, shipped)
    unread = profile_fit.fit("no-such-org/no-such-model", None, shipped)
    assert unread.profile == "qwen2.5-7b-l40s" and "not readable here" in unread.line
    rest = ["--actor.model_name_or_path", small, "--vllm.num_engines", "2"]
    request = resolve({"--scheduler": "rlhfless"}, model_flag(rest))
    assert request.profile.name in ("qwen2.5-3b-l40s", "qwen2.5-3b-h100") and request.profile_line
    given = resolve({"--scheduler": "rlhfless", "--scheduler.profile": "qwen2.5-7b-h100"}, model_flag(rest))
    assert given.profile.name == "qwen2.5-7b-h100" and given.profile_line is None
    assert model_flag([f"--actor.model_name_or_path={seven}"]) == seven and model_flag([]) is None


# -- the launch reads its inputs once, and reaches OpenRLHF only through the swaps it lists ------------------------
def _launch_until_ray(monkeypatch, argv: list[str]):
    """The launcher's ``main`` on ``argv``, through OpenRLHF's own parser and the launch's hooks, stopped where
    OpenRLHF's ``train()`` starts Ray; the hooks are taken out after the test."""
    import importlib
    import sys

    import ray
    from rlhfless_openrlhf.launch import SWAPS

    class BeforeRay(Exception):
        pass

    def no_ray(*_args, **_kwargs):
        raise BeforeRay

    for module, name, where in SWAPS:
        if where == "launcher":
            owner = importlib.import_module(module)
            monkeypatch.setattr(owner, name, getattr(owner, name))
    monkeypatch.setattr(ray, "init", no_ray)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    with pytest.raises(BeforeRay):
        main(argv)


def _module_attributes() -> dict[tuple[str, str], int]:
    import sys

    return {
        (name, attr): id(value)
        for name, module in list(sys.modules.items())
        if (name.startswith("openrlhf") or name == "ray.util.placement_group") and module is not None
        for attr, value in list(vars(module).items())
    }


def test_a_launch_validates_its_scheduler_and_loads_its_profile_once_and_patches_only_the_listed_swaps(
    monkeypatch, tmp_path, openrlhf_learning
):
    """``--scheduler.config FILE --scheduler.profile NAME`` through ``main`` to the plan OpenRLHF's trainer would be
    built with: the scheduler config is validated once (reading the file), the profile loaded once, the mode worked
    out once for the scheduler and once for its async form; the launch
    changes no module attribute of OpenRLHF (or Ray's ``placement_group``) but the swaps ``SWAPS`` lists, each
    named in docs/openrlhf.md, and puts nothing on OpenRLHF's args."""
    import importlib

    from rlhfless_openrlhf.launch import SWAPS, Launch

    import rlhfless_sdk.api.profiles as profiles
    from rlhfless_sdk import get_plugin_manager
    from rlhfless_sdk.api.config import SchedulerConfig

    assert get_plugin_manager().registry.schedulers  # the presets are validated as the registry is built
    for module in (
        "openrlhf.utils.config",
        "openrlhf.trainer.ray",
        "openrlhf.trainer.ppo_trainer",
        "openrlhf.trainer.ppo_trainer_async",
        "openrlhf.trainer.ray.vllm_engine",
        "ray.util.placement_group",
    ):
        importlib.import_module(module)  # fmt: skip
    import rlhfless_sdk.rollout.modes as modes

    counts = {"config": 0, "profile": 0, "mode": 0}
    validate, load, mode_of = SchedulerConfig.model_validate.__func__, profiles.load_profile, modes.mode_of

    def counted_validate(cls, *args, **kwargs):
        counts["config"] += cls is SchedulerConfig
        return validate(cls, *args, **kwargs)

    def counted_load(*args, **kwargs):
        counts["profile"] += 1
        return load(*args, **kwargs)

    monkeypatch.setattr(SchedulerConfig, "model_validate", classmethod(counted_validate))

    def counted_mode(*args, **kwargs):
        counts["mode"] += 1
        return mode_of(*args, **kwargs)

    monkeypatch.setattr(profiles, "load_profile", counted_load)
    monkeypatch.setattr(modes, "mode_of", counted_mode)
    seen = []
    hierarchize = Launch.hierarchize
    monkeypatch.setattr(Launch, "hierarchize", lambda self, a: seen.append((hierarchize(self, a), self)) or seen[-1][0])
    config = tmp_path / "mine.yaml"
    config.write_text("base: rlhfless\nname: mine\n")
    before = _module_attributes()
    _launch_until_ray(monkeypatch, [
        "--scheduler.config", str(config), "--scheduler.profile", "qwen2.5-3b-h100", "--scheduler.force",
        "--actor.model_name_or_path", "m", "--vllm.num_engines", "1", "--reward.remote_url", "reward.py",
    ])  # fmt: skip
    changed = {key for key, ident in _module_attributes().items() if key in before and before[key] != ident}
    # the mode is worked out for the scheduler and for its async form (``async_launch``), each once, when the flags
    # are checked; the plan and the actors take it from there
    assert counts == {"config": 1, "profile": 1, "mode": 2}
    args, launch = seen[-1]
    assert launch.plan.name == "mine" and launch.plan.profile.name == "qwen2.5-3b-h100"
    assert not any("rlhfless" in name for name in vars(args))
    listed = {(module, name) for module, name, where in SWAPS if where == "launcher"}
    assert changed <= listed, changed - listed
    assert {("openrlhf.utils.config", "hierarchize"), ("openrlhf.trainer.ray", "create_vllm_engines")} <= changed
    doc = (Path(__file__).resolve().parent.parent / "docs" / "openrlhf.md").read_text()
    assert [f"`{module}.{name}`" for module, name, _ in SWAPS if f"`{module}.{name}`" not in doc] == []


def test_a_drafter_drafts_where_the_launch_prices_a_gain_and_nowhere_at_a_losing_acceptance(monkeypatch, caplog):
    """``--scheduler.drafter``: at the acceptance shipped for ``history`` (measured on a CPU: about one token a
    step) the launch prices a loss at every running count and the engines run without it; at an acceptance that
    pays (``das-assumption`` shipped as the drafter's own) it drafts, fewer tokens the more sequences run, the
    budget handed to the engines' proposer (and to vLLM as its largest draft), one line saying where;
    ``--scheduler.force`` keeps the drafter's own budget."""
    import logging

    import rlhfless_openrlhf.decide as decide_module
    from rlhfless_openrlhf.drafting import ENV, drafter_env, speculative_config

    from rlhfless_sdk.api.profiles import load_acceptance

    def launched(flags: dict, acceptance: str | None = None):
        if acceptance is not None:
            monkeypatch.setattr("rlhfless_sdk.api.profiles.load_acceptance", lambda _name: load_acceptance(acceptance))
        with caplog.at_level(logging.INFO, logger="rlhfless.openrlhf"):
            caplog.clear()
            plan = decide_module.decide(_hierarchized(), resolve({"--scheduler": "rlhfless", **flags}))
        return plan, [r.getMessage() for r in caplog.records if "drafter 'history'" in r.getMessage()]

    plan, said = launched({"--scheduler.drafter": "history"})
    assert plan.scheduler.drafter.name == "none" and plan.draft_budget is None
    assert len(said) == 1 and "priced to lose at every running count" in said[0], said
    plan, said = launched({"--scheduler.drafter": "history"}, "das-assumption")
    budget = plan.draft_budget
    assert plan.scheduler.drafter.name == "history" and budget[0] > 0
    assert list(budget) == sorted(budget, reverse=True), budget  # falls as more sequences run
    assert len(said) == 1 and "drafts at 1-" in said[0] and "priced to gain" in said[0], said
    config = speculative_config("history", "gpu", budget)
    assert config["num_speculative_tokens"] == max(budget)
    import os

    assert os.environ[ENV] == drafter_env("history", budget)
    monkeypatch.delenv(ENV, raising=False)
    plan, said = launched({"--scheduler.drafter": "history", "--scheduler.force": "true"})
    assert plan.scheduler.drafter.name == "history" and plan.draft_budget is None and "unpriced" in said[0]


def test_the_launch_drops_a_drafter_that_gains_per_running_count_but_loses_over_the_first_steps(caplog):
    """The launch decides as the simulator does (``Simulator.price_drafter`` on the planning workload): at the
    measured ``suffix`` acceptance, ``rlhfless-onpolicy`` on OpenRLHF's default flags is priced to gain at low
    running counts but to lose over the workload's first two steps (the lost async scheduling is paid at every
    count), so the engines run without it and one line says so with both times; ``rlhfless`` on a long-response
    launch keeps it."""
    import logging

    import rlhfless_openrlhf.decide as decide_module

    def launched(scheduler: str, **flat):
        with caplog.at_level(logging.INFO, logger="rlhfless.openrlhf"):
            caplog.clear()
            plan = decide_module.decide(
                _hierarchized(**flat), resolve({"--scheduler": scheduler, "--scheduler.drafter": "suffix"})
            )
        return plan, [r.getMessage() for r in caplog.records if "drafter 'suffix'" in r.getMessage()]

    plan, said = launched("rlhfless-onpolicy")
    assert plan.scheduler.drafter.name == "none" and plan.draft_budget is None
    assert len(said) == 1 and "priced to gain less than 1% over the workload's first two steps" in said[0], said
    assert " s with it and " in said[0] and "this launch's flags" in said[0]
    long = {"vllm.num_engines": 8, "rollout.max_new_tokens": 8192, "rollout.n_samples_per_prompt": 8}
    plan, said = launched("rlhfless", **long, **{"rollout.batch_size": 128, "data.max_len": 9216})
    assert plan.scheduler.drafter.name == "suffix" and max(plan.draft_budget) > 0
    assert len(said) == 1 and "where it is priced to gain" in said[0], said


def test_no_drafter_is_built_on_cpu_engines_unless_forced(caplog):
    """vLLM 0.29's CPU build does not sample the target's tokens once it verifies drafts at temperature 1
    (``examples/drafter_sampling_check.py``): a CPU launch drops the drafter with a warning naming why;
    ``--scheduler.force`` builds it, saying the same."""
    import logging

    import rlhfless_openrlhf.decide as decide_module

    def launched(**ours):
        with caplog.at_level(logging.INFO, logger="rlhfless.openrlhf"):
            caplog.clear()
            request = resolve({"--scheduler": "rlhfless", "--scheduler.drafter": "suffix", **ours})
            plan = decide_module.decide(_hierarchized(), request, cpu=True)
        return plan, [r for r in caplog.records if "drafter 'suffix'" in r.getMessage()]

    plan, said = launched()
    assert plan.scheduler.drafter.name == "none" and plan.draft_budget is None
    assert len(said) == 1 and said[0].levelno == logging.WARNING, said
    assert "not built on these CPU engines" in said[0].getMessage() and "temperature > 0" in said[0].getMessage()
    plan, said = launched(**{"--scheduler.force": "true"})
    assert plan.scheduler.drafter.name == "suffix"
    assert any("is built on these CPU engines (--scheduler.force)" in r.getMessage() for r in said), said
