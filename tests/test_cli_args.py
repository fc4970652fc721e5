"""Command-line arguments: every bad value is refused before any work starts, JSON output is strict JSON, and
Ctrl-C exits with 130."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from rlhfless_sdk.api.records import dumps
from rlhfless_sdk.cli.main import main


def run(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "--gpus", "-1"], "'--gpus': -1 is not in the range 1<=x<=100000"),
        (["plan", "--gpus", "0"], "'--gpus': 0 is not in the range 1<=x<=100000"),
        (["plan", "--history", "-2"], "'--history': -2 is not in the range 0<=x<=100"),
        (["plan", "--samples", "0"], "'--samples': 0 is not in the range x>=1"),
        (["simulate", "--steps", "-1"], "'--steps': -1 is not in the range x>=1"),
        (["simulate", "--steps", "0"], "'--steps': 0 is not in the range x>=1"),  # it once ran 5 steps silently
        (["compare-predictors", "--steps", "0"], "'--steps': 0 is not in the range x>=1"),
        (["simulate", "--max-length", "0"], "'--max-length': 0 is not in the range x>=1"),
        (["simulate", "--median-length", "-300"], "'--median-length': '-300' must be > 0"),
        (["simulate", "--median-length", "nan"], "'--median-length': 'nan' is not a finite number"),
        (["simulate", "--length-sigma", "inf"], "'--length-sigma': 'inf' is not a finite number"),
        (["simulate", "--gpus-per-node", "0"], "'--gpus-per-node': 0 is not in the range 1<=x<=100000"),
        (["simulate", "--prompts", "0"], "'--prompts': 0 is not in the range x>=1"),
        (["simulate", "--samples", "0"], "'--samples': 0 is not in the range x>=1"),
        (["simulate", "--seed", "-1"], "'--seed': -1 is not in the range x>=0"),
        (["simulate", "--plot", "/no/such/dir/x.png"], "folder /no/such/dir does not exist"),
        (["simulate", "--plot", "x.xyz"], "unknown plot format"),
        (["compare-predictors", "--plot", "chart"], "unknown plot format"),
        (["compare-predictors", "--gpus", "0"], "'--gpus': 0 is not in the range 1<=x<=100000"),
        (["bench", "plan", "--repeat", "0"], "'--repeat': 0 is not in the range 1<=x<=1000"),
        (["bench", "simulate", "--steps", "0"], "'--steps': 0 is not in the range x>=1"),
        (["demo", "--epochs", "0"], "'--epochs': 0 is not in the range x>=1"),
        (["demo", "--max-new-tokens", "-5"], "'--max-new-tokens': -5 is not in the range x>=1"),
        (["simulate", "--tensor-parallel", "16"], "--tensor-parallel: tensor parallel 16: expected 2..8 GPUs"),
        (
            ["simulate", "--profile", "qwen2.5-7b-h100", "--tensor-parallel", "2"],
            "profile 'qwen2.5-7b-h100' has no tensor_parallel block",
        ),
    ],
)
def test_bad_arguments_are_refused_before_any_work(args, message):
    res = run(*args)  # a usage error: click checks every parameter before the command's body runs
    assert res.exit_code == 2 and message in res.output, res.output
    assert "Usage:" in res.output and "Traceback" not in res.output


def test_the_demo_checks_its_prompts_and_schedulers_before_loading_anything(tmp_path):
    bad = tmp_path / "q.jsonl"
    bad.write_text("not json\n")
    res = run("demo", "--prompts", str(bad))
    assert res.exit_code == 2 and "q.jsonl, line 1: expected a JSON object with question and answer" in res.output
    res = run("demo", "--scheduler", "nosuch")
    assert res.exit_code == 2 and "no scheduler named 'nosuch'" in res.output
    res = run("demo", "--scheduler", "openrlhf-async")
    assert res.exit_code == 2 and "--train.async_enable" in res.output
    res = run("demo", "--lengths-from", str(tmp_path / "none.jsonl"))
    assert res.exit_code == 2 and "'--lengths-from'" in res.output and "no trace at" in res.output
    bad.write_text('{"uid": "a", "step": 0, "sample_idx": 0, "prompt_length": 3}\n')
    res = run("fidelity", "--lengths-from", str(bad))
    assert res.exit_code == 2 and "field 'response_length': missing value" in res.output
    res = run("fidelity", "--lengths-from", "long-reasoning", "--scheduler", "openrlhf-async")
    assert res.exit_code == 2 and "--train.async_enable" in res.output
    res = run("fidelity")
    assert res.exit_code == 2 and "Missing option '--lengths-from'" in res.output


def test_tensor_parallel_engines_are_simulated_against_the_one_gpu_work_bound():
    """``--tensor-parallel 2``: every engine is the profile sharded over 2 GPUs (8 of them on 16 GPUs); the work
    bound stays the one-GPU engines' (sharding only adds GPU work), so it is the same figure as a one-GPU run's."""
    args = ["simulate", "--prompts", "32", "--samples", "4", "--steps", "2", "--no-frontier", "--json"]
    one, two = (json.loads(run(*args, "--tensor-parallel", k).output) for k in ("1", "2"))
    assert one["profile"] == "qwen2.5-7b-l40s" and two["profile"] == "qwen2.5-7b-l40s-tp2"
    for a, b in zip(one["schedulers"], two["schedulers"], strict=True):
        assert a["bound_s"] == b["bound_s"] and b["total_time_s"] >= b["bound_s"]
    assert [r["num_actors"] for r in two["schedulers"][0]["steps"]] == [8, 8]


def test_json_output_is_strict_json():
    assert json.loads(dumps({"a": [1.0, math.nan, {"b": math.inf}], "c": -math.inf})) == {
        "a": [1.0, None, {"b": None}],
        "c": None,
    }
    res = run("simulate", "--prompts", "16", "--samples", "2", "--steps", "1", "--json")
    assert res.exit_code == 0

    def refuse(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    json.loads(res.output, parse_constant=refuse)


def test_ctrl_c_exits_130_promptly():
    """A long simulation (minutes), interrupted once it says it is under way (its progress bar on a terminal's
    stderr, not after a sleep that a loaded machine outruns): it stops with exit status 130 and one line, not when
    it ends."""
    import pty
    import select

    cmd = [sys.executable, "-m", "rlhfless_sdk", "simulate", "--prompts", "4096", "--samples", "8", "--steps", "50"]
    main_fd, child_fd = pty.openpty()  # stderr a terminal: the bar shows
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=child_fd,
        env={**os.environ, "COLUMNS": "80"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a backgrounded suite ignores SIGINT
    )
    os.close(child_fd)
    err, deadline = "", time.time() + 600  # a guard against a child that hangs before it is ready
    try:
        while "simulating" not in err and time.time() < deadline and proc.poll() is None:
            if select.select([main_fd], [], [], 1.0)[0]:
                err += os.read(main_fd, 4096).decode(errors="replace")
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=600)  # a guard against a hang only: ignoring the signal would finish the run, exit 0
        while select.select([main_fd], [], [], 0.5)[0]:
            try:
                chunk = os.read(main_fd, 4096)
            except OSError:  # the terminal's other end closed
                break
            if not chunk:
                break
            err += chunk.decode(errors="replace")
    finally:
        os.close(main_fd)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-500:]
    assert "interrupted" in err and "Traceback" not in err


#: The real-engine commands and the launcher, each with a bad argument: (command line after the executable, what
#: the one error line names). Each must fail before Ray or an engine starts.
REAL_ENGINE_BAD_ARGS = [
    (["rlhfless", "demo", "--out", "{file}/sub"], "is a file, not a folder"),
    (["rlhfless", "demo", "--trace", "{file}/t.jsonl"], "is a file, not a folder"),
    (["rlhfless", "demo", "--scheduler", "nosuch"], "no scheduler named 'nosuch'"),
    (["rlhfless", "pipeline-demo", "--learn-ratio", "nan"], "'nan' is not a finite number"),
    (["rlhfless", "pipeline-demo", "--learn-ratio", "inf"], "'inf' is not a finite number"),
    (["rlhfless", "pipeline-demo", "--out", "{file}/sub"], "is a file, not a folder"),
    (["rlhfless", "profile", "--temperature", "nan"], "'nan' is not a finite number"),
    (["rlhfless", "profile", "--out", "{file}/p.yaml"], "is a file, not a folder"),
    (["rlhfless", "fidelity", "--lengths-from", "long-reasoning", "--profile", "{file}"], "not a time-per-token"),
    (["rlhfless", "fidelity", "--lengths-from", "long-reasoning", "--out", "{file}/x"], "is a file, not a folder"),
    (["launcher", "--scheduler", "rlhfless", "--scheduler.report", "{file}/r.jsonl"], "is a file, not a folder"),
    (["launcher", "--scheduler", "rlhfless", "--scheduler.trace", "{file}/t.jsonl"], "is a file, not a folder"),
    (["launcher", "--scheduler", "rlhfless", "--scheduler.carry_timeout", "-1"], "seconds > 0, got '-1'"),
    (["launcher", "--scheduler", "rlhfless", "--scheduler.profile", "bogus"], "no profile named 'bogus'"),
    (["launcher", "--scheduler.profile", "bogus"], "no profile named 'bogus'"),
    (["launcher", "--scheduler", "openrlhf", "--scheduler.carry_timeout", "30"], "no effect with --scheduler openrlhf"),
]


@pytest.mark.parametrize(
    ("argv", "message"), REAL_ENGINE_BAD_ARGS, ids=lambda v: " ".join(v[1:4]) if isinstance(v, list) else None
)
def test_real_engine_commands_refuse_bad_arguments_before_ray_or_an_engine_starts(tmp_path, argv, message):
    """Each real-engine command (and the launcher) given a bad argument fails with one error line naming it, as
    its own process would be run, before Ray or an engine starts: nothing Ray or vLLM prints at start-up appears,
    and the process ends within 10 s (the bound the commands are held to; each takes about 0.4 s here, an engine's
    start minutes)."""
    pytest.importorskip("rlhfless_openrlhf")
    file = tmp_path / "a-file"
    file.write_text("not a folder, not a profile\n")
    args = [a.format(file=file) for a in argv]
    head = (
        [sys.executable, "-m", "rlhfless_openrlhf.train_ppo_ray"]
        if args[0] == "launcher"
        else [sys.executable, "-m", "rlhfless_sdk"]
    )
    res = subprocess.run([*head, *args[1:]], capture_output=True, text=True, timeout=10, cwd=tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode in (1, 2), out[-2000:]
    errors = [line for line in out.splitlines() if line.lower().startswith("error")]
    assert len(errors) == 1 and message in errors[0], out[-2000:]
    for started in ("Started a local Ray instance", "ray.init", "EngineCore", "Initializing a V1 LLM engine"):
        assert started not in out, out[-2000:]
    assert "Traceback" not in out


def test_simulate_shows_progress_only_on_a_terminal(tmp_path):
    """The bar names the scheduler running and the time so far, on a terminal's stderr; piped, or under ``--json``,
    stderr stays empty."""
    import io

    from rlhfless_sdk.cli.progress import progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term, pipe = Terminal(), io.StringIO()
    for stream in (term, pipe):
        with progress(4, file=stream) as bar:
            bar.now("rlhfless")
            bar.step(4)
    with progress(4, show=False, file=Terminal()) as bar:  # --json
        bar.now("rlhfless")
    assert "simulating rlhfless (0 s)" in term.getvalue() and "4/4" in term.getvalue()
    assert pipe.getvalue() == ""
    res = run("simulate", "--steps", "2", "--prompts", "16", "--no-frontier")  # CliRunner: stderr is no terminal
    assert res.exit_code == 0 and "simulating" not in res.stderr
