"""docs/results.md is made by ``examples/results.py``: every table sits under the command the script runs for it,
and each command runs (a short variant of it; the real-engine ones are slow)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("rlhfless_results_script", ROOT / "examples" / "results.py")
results = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = results  # its dataclasses look their module up
_spec.loader.exec_module(results)


def test_every_table_of_the_page_sits_under_the_command_that_makes_it():
    page = results.PAGE.read_text()
    sections = results.sections(page)
    assert list(sections) == [t.id for t in results.TABLES], "the page's tables are the script's, in its order"
    for t in results.TABLES:
        body = sections[t.id]
        assert f"```bash\n{t.command}\n```" in body, f"{t.id}: the page shows another command than the script runs"
        assert re.search(r"Measured \d{4}-\d\d-\d\d at commit `[0-9a-f]{7,}`\.", body), f"{t.id}: not measured"
        assert len([line for line in body.splitlines() if line.startswith("| ")]) >= 2, f"{t.id}: no rows"
    assert page.count("| ") == sum(s.count("| ") for s in sections.values()), "a table outside the script's"


def test_a_rebuilt_table_replaces_its_own_section_and_keeps_the_others(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "PAGE", tmp_path / "results.md")
    plan = results.BY_ID["plan"]
    row = {"scheduler": "a", "regime": "steady", "candidates": 3, "chosen_actors": 2, "median_ms": 1.5, "min_ms": 1}
    report = {"rows": [{**row, "ratio": 1.25}]}
    results.write_page({"plan": results.section(plan, report, "2026-01-01", "abcdef1")})
    results.write_page({"lr-8k": "<!-- table lr-8k -->\nnew\n<!-- end lr-8k -->"})
    sections = results.sections(results.PAGE.read_text())
    assert "| `a` | steady | 3 | 2 | 1.5 | 1.0 | 1.25x |" in sections["plan"] and "new" in sections["lr-8k"]
    assert "Not measured yet" in sections["gpqa"]


@pytest.mark.slow
@pytest.mark.parametrize("table", results.TABLES, ids=lambda t: t.id)
def test_each_command_of_the_page_runs_in_its_short_variant(table, tmp_path):
    if table.kind == "learning" and os.environ.get("RLHFLESS_TRAIN_MATRIX") != "full":
        pytest.skip(
            "a training launch, run with the training matrix (RLHFLESS_TRAIN_MATRIX=full); CI trains the same "
            "launch, OpenRLHF sync through the harness, as tests/test_openrlhf_training.py's openrlhf-sync row"
        )
    trace = tmp_path / "trace.jsonl"
    main_job = os.environ.get("RLHFLESS_MAIN_JOB_DEMO")  # .ci/run: the README's main job ran this command already
    if table.kind == "demo" and main_job:
        report, trace = json.loads((Path(main_job) / "report.json").read_text()), Path(main_job) / "trace.jsonl"
    else:
        report = results.run(table, quick=True, echo=False, extra=("--trace", str(trace)) * (table.kind == "demo"))
    rows = results.RENDER[table.kind](report)
    assert len(rows) >= 2
    if table.kind == "demo":
        check_demo(report, trace)
    if table.kind == "drafters":  # each drafter's proposer host time, measured, in its acceptance record
        for name, acc in report["acceptance"].items():
            search = report["runs"][name]["search"]
            assert len(search) == 1 and next(iter(search.values())) > 0
            assert acc is None or {k: acc[k] for k in search} == pytest.approx(search, rel=0.01)
    if table.kind == "learning":  # OpenRLHF's loop trained each step it was asked for, with a finite reward
        (run,) = report["runs"]
        assert [s["step"] for s in run["steps"]] == [1, 2] and all(0 <= s["reward"] <= 1 for s in run["steps"])
    if table.kind == "simulate":  # every scheduler of the command has its row, and the async form of rlhfless
        asked = re.findall(r"--scheduler (\S+)", table.command)
        drafter = re.findall(r"--drafter (\S+)", table.command)  # a twin with it after each one not a baseline
        twin = (lambda n: [n] if n.startswith(("openrlhf", "verl")) else [n, f"{n}.{drafter[0]}"]) if drafter else (
            lambda n: [n])  # fmt: skip
        assert [r[0].strip("`") for r in rows[1:]] == [
            t for a in asked for n in ([a, f"{a}.async"] if a == "rlhfless" else [a]) for t in twin(n)
        ]


def check_demo(report, trace):
    """The main demo: replayed long-tailed lengths, an A/A row in each part, every group trained once, the order
    rotated per epoch, token ages within each row's bound, and the first row's samples as a replayable trace."""
    names = ["openrlhf", "openrlhf-again", "rlhfless", "rlhfless-fast"]
    epochs, prompts = report["epochs"], report["prompts"]
    assert report["replay"]["lengths_from"].startswith("long-reasoning") and report["replay_off_length"] == 0
    assert [s["scheduler"] for s in report["steps"][: len(names)]] == names
    assert [s["scheduler"] for s in report["steps"][len(names) : 2 * len(names)]] == names[1:] + names[:1]
    totals = {t["scheduler"]: t for t in report["totals"]}
    assert list(totals) == names and all(t["groups"] == epochs * prompts for t in totals.values())
    assert totals["openrlhf"]["max_token_age"] == totals["openrlhf-again"]["max_token_age"] == 0
    assert totals["rlhfless"]["max_token_age"] == 0 and totals["rlhfless-fast"]["max_token_age"] <= 1
    assert all(t["speedup_range"][0] <= t["speedup_range"][1] for t in totals.values())
    rows = {r["row"]: r for r in report["async_loop"]["all_runs"]}
    assert list(rows) == ["openrlhf", "openrlhf-again", "rlhfless.async"]
    loop = report["async_loop"]
    assert all(r["groups"] == loop["batches"] * loop["batch_prompts"] for r in rows.values())
    assert rows["openrlhf"]["max_token_age"] == 1 and 1 <= rows["rlhfless.async"]["max_token_age"] <= 2
    from rlhfless_sdk.workloads.traces import load_trace

    workload = load_trace(trace)
    assert [int(s.batch.n_samples.sum()) for s in workload.steps] == [prompts * report["samples_per_prompt"]] * epochs
