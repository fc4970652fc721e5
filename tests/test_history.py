"""The SQLite length history: restarts, concurrent writers that lose nothing, clear errors, and write failures
that stop a run unless the history is best-effort."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from click.testing import CliRunner

from rlhfless_sdk import FinishedSample, HistoryError, LengthHistory, PromptBatch
from rlhfless_sdk.cli.main import main


def sample(uid: str, length: int, k: int = 0) -> FinishedSample:
    return FinishedSample(uid=uid, sample_index=k, prompt_length=10, response_length=length)


def test_history_survives_a_restart(tmp_path, registry):
    path = tmp_path / "h.sqlite"
    first = registry.create("predictor", {"name": "ewma", "params": {"history_path": str(path)}})
    first.observe([sample("a", 100), sample("a", 300, 1), sample("b", 50)])
    first.store.close()
    again = registry.create("predictor", {"name": "ewma", "params": {"history_path": str(path)}})
    batch = PromptBatch(uids=["a", "b", "new"], prompt_lengths=np.array([1, 1, 1]), n_samples=np.array([2, 1, 1]))
    assert again.predict(batch).tolist() == [200.0, 50.0, 150.0]  # history, history, cold start: last step mean
    assert again.store.next_step() == 1
    assert again.store.record({"a": [10]}) == 1  # the next observation takes the next step number


WRITER = """
import sys
from rlhfless_sdk.api.history import LengthHistory
path, worker, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
store = LengthHistory(path)
for step in range(steps):
    store.record({f"w{worker}-p{i}": [worker * 100 + step + i] for i in range(50)})
"""


def test_history_is_safe_with_several_writer_processes(tmp_path):
    path = str(tmp_path / "shared.sqlite")
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, path, str(w), "20"]) for w in range(4)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0, 0]
    store = LengthHistory(path)
    assert len(store) == 4 * 20 * 50  # every row of every writer, none lost
    assert store.recent(["w3-p7"], window=2) == {"w3-p7": [300 + 18 + 7, 300 + 19 + 7]}


def test_opening_waits_for_a_writer_that_holds_the_lock(tmp_path):
    """Another process in a write transaction while this one opens the file (CI once saw two of four writers
    fail in the open with 'database is locked'): the open waits for the lock like a write does."""
    path = tmp_path / "busy.sqlite"
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)  # a new file, not yet in WAL
    holder.execute("BEGIN EXCLUSIVE")  # as another process creating it holds it: nobody may even read
    threading.Timer(0.5, lambda: holder.execute("ROLLBACK")).start()
    store = LengthHistory(path, timeout_s=30)  # the lock is held for 0.5 s, ten times SQLite's own busy wait
    assert store.record({"a": [1.0]}) == 0
    holder.close()


def test_opening_gives_up_on_a_lock_held_past_the_timeout(tmp_path):
    path = tmp_path / "stuck.sqlite"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    with pytest.raises(HistoryError, match=r"stuck\.sqlite.*locked"):
        LengthHistory(path, timeout_s=0.3)
    holder.execute("ROLLBACK")
    holder.close()


def test_corrupt_file_is_a_clear_error(tmp_path):
    path = tmp_path / "garbage.sqlite"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(HistoryError, match=r"garbage\.sqlite.*not a usable rlhfless length history"):
        LengthHistory(path)


def test_foreign_or_incompatible_database_is_a_clear_error(tmp_path):
    foreign = tmp_path / "other.sqlite"
    with sqlite3.connect(foreign) as db:
        db.execute("CREATE TABLE things (x)")
    with pytest.raises(HistoryError, match="not an rlhfless length history"):
        LengthHistory(foreign)
    old = tmp_path / "old.sqlite"
    LengthHistory(old).close()
    with sqlite3.connect(old) as db:
        db.execute("UPDATE meta SET value = '0' WHERE key = 'schema_version'")
    with pytest.raises(HistoryError, match="schema version 0"):
        LengthHistory(old)
    with pytest.raises(HistoryError, match="is a folder"):
        LengthHistory(tmp_path)


SHARED_WRITER = """
import sys
from rlhfless_sdk import LengthHistory
path, worker, steps, uids = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
store = LengthHistory(path)
for step in range(steps):
    store.record({f"p{i}": [worker * 1000 + step] for i in range(uids)})
"""


def test_writers_observing_the_same_prompts_lose_nothing(tmp_path):
    """4 processes, each observing the same 500 prompts for 20 steps: 40,000 observations, 40,000 rows."""
    path = str(tmp_path / "shared.sqlite")
    procs = [subprocess.Popen([sys.executable, "-c", SHARED_WRITER, path, str(w), "20", "500"]) for w in range(4)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0, 0, 0]
    store = LengthHistory(path)
    assert len(store) == 4 * 20 * 500
    assert store.next_step() == 80  # each record() took its own step number
    seen = store.recent(["p7"], window=80)["p7"]
    assert sorted(seen) == sorted(w * 1000 + s for w in range(4) for s in range(20))
    for w in range(4):  # each writer's observations in the order it wrote them
        own = [x for x in seen if w * 1000 <= x < (w + 1) * 1000]
        assert own == sorted(own)


def locked(path):
    """Another connection holding the write lock (as another process's long transaction would)."""
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    return holder


def test_a_locked_history_is_an_error_after_the_timeout(tmp_path):
    path = tmp_path / "h.sqlite"
    store = LengthHistory(path, timeout_s=0.3)
    holder = locked(path)
    t0 = time.monotonic()
    with pytest.raises(HistoryError, match=r"h\.sqlite: cannot write.*locked by another process for more than 0.3 s"):
        store.record({"a": [1]})
    assert time.monotonic() - t0 < 5
    holder.execute("ROLLBACK")
    assert store.record({"a": [1]}) == 0  # free again: the write goes through
    assert len(store) == 1


def _config(tmp_path, path, **params):
    lines = "".join(f"      {k}: {v}\n" for k, v in params.items())
    cfg = tmp_path / "with-history.yaml"
    cfg.write_text(
        "name: with-history\npredictor:\n  name: ewma\n  params:\n"
        f"      history_path: {path}\n{lines}"
        "prefill_planner: none\nassigner: least-pending\nmigrator: none\nscaler: fixed\nplacer: pack\n"
    )
    return str(cfg)


def test_a_failed_history_write_stops_the_run_unless_best_effort(tmp_path):
    path = tmp_path / "h.sqlite"
    LengthHistory(path).close()
    holder = locked(path)
    args = ["simulate", "--prompts", "8", "--samples", "2", "--steps", "2", "--gpus", "2", "--no-frontier"]
    res = CliRunner().invoke(main, [*args, "--scheduler", _config(tmp_path, path, history_timeout_s=0.2)])
    assert res.exit_code == 2 and "h.sqlite: cannot write the length history" in res.output
    res = CliRunner().invoke(
        main,
        [*args, "--scheduler", _config(tmp_path, path, history_timeout_s=0.2, history_best_effort="true")],
    )
    assert res.exit_code == 0, res.output
    holder.execute("ROLLBACK")
    assert len(LengthHistory(path)) == 0  # nothing was written, and the best-effort run said so in its log


def test_ctrl_c_while_waiting_for_a_locked_history_exits_130_promptly(tmp_path):
    import os
    import signal

    path = tmp_path / "h.sqlite"
    LengthHistory(path).close()
    holder = locked(path)  # held for the whole test: the run would wait 60 s for it
    cfg = _config(tmp_path, path, history_timeout_s=60)
    cmd = [sys.executable, "-m", "rlhfless_sdk", "simulate", "--prompts", "8", "--steps", "2", "--scheduler", cfg]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ})
    time.sleep(5)  # start-up, then the first step's history write waits on the lock
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=20)  # not the 60 s lock timeout
    holder.execute("ROLLBACK")
    assert proc.returncode == 130, err.decode()[-400:]
