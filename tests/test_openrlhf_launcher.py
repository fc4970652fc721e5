"""The drop-in launcher: flags, validation before Ray starts, the internals check and the hooks."""

from __future__ import annotations

import argparse
import importlib.metadata

import pytest

pytest.importorskip("openrlhf", reason="the adapter's tests need openrlhf 0.11.2 (installed by the test command)")

from rlhfless_openrlhf import OpenRLHFMismatch, check_openrlhf_version
from rlhfless_openrlhf.internals import check_internals
from rlhfless_openrlhf.train_ppo_ray import install_rollout_hooks, main, resolve, split_args


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
    settings = resolve({"--scheduler": "rlhfless", "--scheduler.profile": "qwen2.5-3b-h100"})
    assert settings["scheduler"]["name"] == "rlhfless" and settings["profile"]["name"] == "qwen2.5-3b-h100"


def test_an_async_preset_is_refused_with_the_openrlhf_flags_to_use():
    with pytest.raises(SystemExit, match=r"--train\.async_enable"):
        resolve({"--scheduler": "openrlhf-async"})


@pytest.mark.parametrize("name", ["rlhfless-fast", "rlhfless-onpolicy"])
def test_a_straggler_preset_is_refused_until_real_engines_carry_samples(name):
    # running it would silently drop its straggler policy: refused at launch instead, naming the policy
    with pytest.raises(SystemExit, match=r"straggler policy '(partial-batch|tail-batch)'.*rlhfless simulate"):
        resolve({"--scheduler": name})


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
        assert "GPU install" in capsys.readouterr().err
    else:  # a machine with OpenRLHF's full install: the trainer side checks out too
        assert any("PPOTrainer" in c for c in check_internals(learning=True))


def test_hooks_put_the_scheduler_into_args(monkeypatch):
    import openrlhf.trainer.ray as ray_pkg
    import openrlhf.utils.config as config_module

    monkeypatch.setattr(config_module, "hierarchize", config_module.hierarchize)
    monkeypatch.setattr(ray_pkg, "create_vllm_engines", ray_pkg.create_vllm_engines)
    settings = resolve({"--scheduler": "rlhfless"})
    install_rollout_hooks(settings)
    flat = argparse.Namespace(**{"vllm.enable_prefix_caching": False, "rollout.n_samples_per_prompt": 8})
    args = config_module.hierarchize(flat)
    assert args.rlhfless == settings and args.vllm.enable_prefix_caching is True
    assert args.rollout.n_samples_per_prompt == 8
    assert ray_pkg.create_vllm_engines.__name__ == "create_vllm_engines_with_rlhfless"


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
