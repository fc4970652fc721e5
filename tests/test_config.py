"""Scheduler configs: the shipped presets validate; every kind of bad file is reported with its YAML path."""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

import pytest
from click.testing import CliRunner

from rlhfless_sdk import ConfigError, read_scheduler_config
from rlhfless_sdk.cli.main import main

CONFIGS = Path(__file__).resolve().parent.parent / "configs"

GOOD = """\
name: mine
predictor: {name: ewma, params: {window: 1}}
prefill_planner: dedup
assigner: sorted
migrator: {name: tau, params: {tau: 0.7}}
scaler:
  name: cost-aware
  params: {lambda: 0.7}
placer: locality-aware
"""


def validate(tmp_path: Path, text: str):
    path = tmp_path / "sched.yaml"
    path.write_text(text)
    return CliRunner().invoke(main, ["config", "validate", str(path)])


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_presets_validate(path, registry):
    cfg = read_scheduler_config(path, registry)
    assert cfg.name == path.stem
    assert cfg.name in registry.names("scheduler")


def test_paper_defaults_in_rlhfless_paper_preset(registry):
    cfg = registry.scheduler("rlhfless-paper")
    assert cfg.predictor.name == "ewma" and cfg.predictor.params["window"] == 1
    assert cfg.migrator.name == "tau" and cfg.migrator.params["tau"] == 0.7
    assert cfg.scaler.name == "cost-aware" and registry.validate_params("scaler", cfg.scaler).lam == 0.7
    assert cfg.prefill_planner.name == "dedup" and cfg.assigner.name == "sorted"


def test_rlhfless_preset_is_never_slower_than_openrlhf(registry):
    """``rlhfless``: groups balanced by predicted work on the deadline scaler's count, the long tail spread by KV
    (``balance``), vLLM's KV watermark at 5% (no preemption storms when the KV fills), no dedup prefill, tail
    batching where the predicted tail pays and the stream in an async launch; ``rlhfless-slo`` is the same dispatch
    and scaler without tail batching, the tail's spreading and the watermark (its earlier form)."""
    cfg = registry.scheduler("rlhfless")
    assert (cfg.assigner.name, cfg.migrator.name, cfg.prefill_planner.name) == ("balanced", "balance", "none")
    assert cfg.scaler.name == "deadline" and cfg.scaler.params == {"slack": 0.01, "max_uncertainty": 0.05}
    assert cfg.async_launch == "rlhfless-stream"  # an async launch runs the stream
    assert cfg.straggler.name == "tail-batch" and cfg.straggler.params == {"over_provision": 0.5, "margin": 0.0}
    assert cfg.kv_watermark == 0.05 and registry.scheduler("openrlhf").kv_watermark == 0.0
    same = {
        "kv_watermark": 0.0,
        "name": "x",
        "description": "",
        "async_launch": None,
        "straggler": registry.scheduler("rlhfless-slo").straggler,
        "migrator": registry.scheduler("rlhfless-slo").migrator,
    }
    assert cfg.model_copy(update=same) == registry.scheduler("rlhfless-slo").model_copy(update=same)


def test_openrlhf_preset_is_openrlhfs_behaviour(registry):
    cfg = registry.scheduler("openrlhf")
    assert (cfg.assigner.name, cfg.scaler.name, cfg.migrator.name, cfg.prefill_planner.name) == (
        "least-pending",
        "fixed",
        "none",
        "none",
    )


def test_presets_are_package_data():
    names = {e.name for e in files("rlhfless_configs").iterdir()}
    assert {"rlhfless.yaml", "rlhfless-paper.yaml", "openrlhf.yaml"} <= names


def test_good_file(tmp_path):
    res = validate(tmp_path, GOOD)
    assert res.exit_code == 0, res.output
    assert "ok (scheduler 'mine')" in res.output


#: Bad files, each a change to ``GOOD``, and every part of what their one error report (exit status 1) must say.
BAD_FILES = {
    "syntax-error": (
        GOOD.replace("params: {lambda: 0.7}", "params: {lambda: 0.7"),
        ["YAML syntax error", "line"],
    ),
    "wrong-type": (GOOD + "min_actors: many\n", ["min_actors (line 10)", "valid integer"]),
    "wrong-type-of-a-policy-param": (GOOD.replace("tau: 0.7", "tau: soon"), ["migrator.params.tau (line 5)"]),
    "unknown-policy-name": (
        GOOD.replace("assigner: sorted", "assigner: sortd"),
        ["assigner.name (line 4)", "valid: balanced, chunks, least-pending, round-robin, sorted"],
    ),
    "lambda-above-1": (GOOD.replace("lambda: 0.7", "lambda: 1.5"), ["scaler.params.lambda (line 8)"]),
    "lambda-below-0": (GOOD.replace("lambda: 0.7", "lambda: -0.1"), ["scaler.params.lambda (line 8)"]),
    "missing-and-unknown-fields": (
        GOOD.replace("placer: locality-aware\n", "placr: pack\n"),
        ["placer: required field is missing", "placr (line 9): unknown field"],
    ),
    "every-problem-at-once": (
        GOOD.replace("lambda: 0.7", "lambda: 2").replace("tau: 0.7", "tau: soon") + "min_actors: many\n",
        ["3 problem(s)", "migrator.params.tau (line 5)", "scaler.params.lambda (line 8)", "min_actors (line 10)"],
    ),
    "a-boolean-param-is-not-a-number": (
        GOOD.replace("lambda: 0.7", "lambda: true"),
        ["scaler.params.lambda (line 8)", "got true"],
    ),
    "a-boolean-field-is-not-a-number": (GOOD + "min_actors: false\n", ["min_actors (line 10)"]),
    "a-key-given-twice": (GOOD + "placer: pack\n", ["placer (line 10): given twice (first on line 9)"]),
}


@pytest.mark.parametrize(("text", "says"), BAD_FILES.values(), ids=BAD_FILES)
def test_a_bad_file_is_reported_with_its_yaml_path(tmp_path, text, says):
    res = validate(tmp_path, text)
    assert res.exit_code == 1
    for part in says:
        assert part in res.output


def test_not_a_mapping_and_missing_file(tmp_path):
    res = validate(tmp_path, "- just\n- a list\n")
    assert res.exit_code == 1 and "expected a mapping" in res.output
    res = CliRunner().invoke(main, ["config", "validate", str(tmp_path / "nope.yaml")])
    assert res.exit_code == 1 and "cannot read file" in res.output


def test_error_names_the_file(tmp_path, registry):
    path = tmp_path / "x.yaml"
    path.write_text(GOOD.replace("lambda: 0.7", "lambda: 3"))
    with pytest.raises(ConfigError) as err:
        read_scheduler_config(path, registry)
    assert str(path) in str(err.value)
    assert err.value.problems[0].path == "scaler.params.lambda"


def test_schema_is_json_schema():
    res = CliRunner().invoke(main, ["config", "schema"])
    assert res.exit_code == 0
    schema = json.loads(res.output)
    assert schema["title"] == "SchedulerConfig"
    assert {"predictor", "prefill_planner", "assigner", "migrator", "scaler", "placer"} <= set(schema["required"])


@pytest.mark.parametrize("name", ["rlhfless", "rlhfless-paper"])
def test_show_round_trips(tmp_path, registry, name):
    res = CliRunner().invoke(main, ["config", "show", name])
    assert res.exit_code == 0
    path = tmp_path / "again.yaml"
    path.write_text(res.output)
    assert read_scheduler_config(path, registry) == registry.scheduler(name)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (bytes(range(256)), "not UTF-8 text"),
        (GOOD.replace("mine", "caf\u00e9").encode("latin-1"), "(line 1): not UTF-8 text"),
        (__import__("gzip").compress(GOOD.encode()), "is gzip-compressed"),
    ],
)
def test_undecodable_config_or_profile_is_one_clear_error(tmp_path, data, message):
    path = tmp_path / "bad.yaml"
    path.write_bytes(data)
    for args in (["config", "validate", str(path)], ["plan", "--profile", str(path)]):
        res = CliRunner().invoke(main, args)
        assert res.exit_code in (1, 2) and str(path) in res.output and message in res.output, res.output
        assert ("Traceback" not in res.output and res.exception is None) or isinstance(res.exception, SystemExit)


def test_a_byte_order_mark_is_fine(tmp_path):
    path = tmp_path / "bom.yaml"
    path.write_bytes("\ufeff".encode() + GOOD.encode())
    assert read_scheduler_config(path).name == "mine"


def test_a_scheduler_yaml_extends_a_preset_with_base_and_only_what_changes(tmp_path):
    """``base: rlhfless`` and only what changes: the preset's config, a differently named policy replacing the
    preset's whole (params too), mappings merged field by field; the same file in ``rlhfless simulate`` and in the
    launcher's ``--scheduler FILE``."""
    from click.testing import CliRunner

    from rlhfless_sdk.api.errors import ConfigError
    from rlhfless_sdk.api.plugins import get_plugin_manager
    from rlhfless_sdk.cli.main import main

    registry = get_plugin_manager().registry
    mine = tmp_path / "mine.yaml"
    mine.write_text("base: rlhfless\nname: mine\nscaler: fixed\nmigrator: {params: {}}\n")
    config, preset = registry.resolve(str(mine)), registry.scheduler("rlhfless")
    assert config.name == "mine" and config.scaler.name == "fixed" and config.scaler.params == {}
    same = {k for k in ("predictor", "assigner", "migrator", "straggler", "placer", "prefill_planner")}
    assert all(getattr(config, k) == getattr(preset, k) for k in same)
    assert config.kv_watermark == preset.kv_watermark and config.async_launch == preset.async_launch
    unnamed = tmp_path / "unnamed.yml"
    unnamed.write_text("base: rlhfless-fast\nkv_watermark: 0.1\n")
    assert registry.resolve(str(unnamed)).name == "rlhfless-fast" and registry.resolve(str(unnamed)).kv_watermark == 0.1
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nbase: rlhfles\n")
    with pytest.raises(ConfigError, match=r"(?s)bad\.yaml.*base \(line 2\): no scheduler named 'rlhfles'"):
        registry.resolve(str(bad))
    out = CliRunner().invoke(main, ["simulate", "--prompts", "16", "--samples", "2", "--steps", "2", "--gpus", "4",
                                    "--scheduler", "openrlhf", "--scheduler", str(mine)])  # fmt: skip
    assert out.exit_code == 0 and "\nmine " in out.output, out.output


def test_the_launcher_takes_a_scheduler_yaml_file(tmp_path):
    pytest.importorskip("openrlhf")
    from rlhfless_openrlhf.train_ppo_ray import resolve

    mine = tmp_path / "mine.yaml"
    mine.write_text("base: rlhfless\nname: mine\nkv_watermark: 0.02\n")
    request = resolve({"--scheduler": str(mine)})
    assert request.scheduler.name == "mine" and request.scheduler.kv_watermark == 0.02
