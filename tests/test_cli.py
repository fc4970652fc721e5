"""The ``rlhfless`` command line, run in-process with click's runner and once as a real console script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from rlhfless_sdk import __version__
from rlhfless_sdk.cli.main import main


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def test_help_and_version():
    res = run("--help")
    assert res.exit_code == 0
    for cmd in ("plugins", "config", "bench"):
        assert cmd in res.output
    res = run("--version")
    assert res.exit_code == 0 and __version__ in res.output


def test_plugins_lists_every_kind_with_its_plugin():
    res = run("plugins")
    assert res.exit_code == 0, res.output
    for kind in ("predictor:", "prefill_planner:", "assigner:", "migrator:", "scaler:", "placer:"):
        assert kind in res.output
    # the schedulers in three lists: presets (what OpenRLHF runs), baselines, the research set (simulated only)
    heads = [line for line in res.output.splitlines() if line.startswith("scheduler (")]
    assert [h.split(":")[0] for h in heads] == [
        "scheduler (presets",
        "scheduler (baselines",
        "scheduler (research set",
    ]
    lines = res.output.splitlines()
    listed = {}
    for head in heads:
        at = lines.index(head) + 1
        while at < len(lines) and lines[at].startswith("  "):
            listed.setdefault(head.split(":")[0], []).append(lines[at].split()[0])
            at += 1
    assert {"rlhfless", "rlhfless-stream", "rlhfless-onpolicy"} <= set(listed["scheduler (presets"])
    assert set(listed["scheduler (research set"]) == {
        "oracle",
        "oracle-time",
        "research-elastic-stream",
        "research-onpolicy-overlap",
        "research-onpolicy-tail",
    }
    line = next(line for line in res.output.splitlines() if line.strip().startswith("cost-aware"))
    assert "rlhfless-policies" in line and "lambda" in line


def test_plugins_json():
    res = run("plugins", "--json")
    assert res.exit_code == 0
    rows = json.loads(res.output)
    assert all({"kind", "name", "plugin", "description"} <= set(r) for r in rows)
    got = {(r["kind"], r["name"]) for r in rows}
    assert ("scheduler", "rlhfless") in got and ("scheduler", "openrlhf") in got
    assert ("assigner", "sorted") in got and ("predictor", "ewma") in got


def test_console_script_is_installed():
    beside = Path(sys.executable).parent / "rlhfless"
    exe = str(beside) if beside.exists() else shutil.which("rlhfless")
    assert exe, "the rlhfless console script is not installed"
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True).stdout
    assert __version__ in out


def test_the_adapter_adds_its_commands_through_the_hook(monkeypatch):
    res = run("--help")
    assert "demo" in res.output and "profile" in res.output  # from the rlhfless-openrlhf entry point
    res = run("demo", "--help")
    assert res.exit_code == 0 and "--max-new-tokens" in res.output
    rows = json.loads(run("plugins", "--json").output)
    assert {(r["name"], r["plugin"]) for r in rows if r["kind"] == "command"} == {
        ("demo", "rlhfless-openrlhf"),
        ("drafter-bench", "rlhfless-openrlhf"),
        ("drafter-replay", "rlhfless-openrlhf"),
        ("profile", "rlhfless-openrlhf"),
        ("fidelity", "rlhfless-openrlhf"),
        ("pipeline-demo", "rlhfless-openrlhf"),
    }
    monkeypatch.setenv("RLHFLESS_DISABLE_PLUGIN_AUTOLOAD", "1")
    from rlhfless_sdk import reset_plugin_manager

    reset_plugin_manager()
    res = run("demo")
    assert res.exit_code == 2 and "Plugin commands may be missing: plugin autoload is off" in res.output


def test_report_prints_a_runs_step_report_as_a_table_and_plots_it(tmp_path):
    """``rlhfless report FILE``: a JSON-lines step report (what a launch writes at --scheduler.report; here the
    simulator's reports of the same records) as a table, one row a step, with its totals; ``--json``; ``--plot``;
    a line that is no step report is named by its line number."""
    from rlhfless_sdk.api.plugins import get_plugin_manager
    from rlhfless_sdk.api.profiles import load_profile
    from rlhfless_sdk.api.records import Cluster
    from rlhfless_sdk.simulation.simulator import Simulator
    from rlhfless_sdk.workloads.synthetic import SyntheticWorkload
    from rlhfless_sdk.workloads.traces import synthetic_workload

    registry = get_plugin_manager().registry
    sim = Simulator(load_profile("qwen2.5-3b-h100"), Cluster.of_gpus(8, 8), registry=registry)
    reports = sim.run(registry.resolve("rlhfless"), synthetic_workload(SyntheticWorkload(32, 4, seed=0), 4)).reports
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(r.model_dump(mode="json")) + "\n" for r in reports))
    out = CliRunner().invoke(main, ["report", str(path), "--plot", str(tmp_path / "steps.png")])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert lines[0].split()[:3] == ["step", "time", "s"] and len(lines) == 1 + len(reports) + 2
    total = sum(r.time_s for r in reports)
    assert f"{len(reports)} steps of rlhfless: {total:,.1f} s in all" in out.output
    assert (tmp_path / "steps.png").stat().st_size > 0
    as_json = json.loads(CliRunner().invoke(main, ["report", str(path), "--json"]).output)
    assert len(as_json["steps"]) == len(reports) and as_json["total_time_s"] == pytest.approx(total)
    path.write_text(path.read_text() + '{"step": 9}\n')
    bad = CliRunner().invoke(main, ["report", str(path)])
    assert bad.exit_code != 0 and f"line {len(reports) + 1}: not a step report" in bad.output
