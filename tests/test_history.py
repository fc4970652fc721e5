"""The SQLite length history: restarts, concurrent writers that lose nothing, clear errors, and write failures
that stop a run unless the history is best-effort."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading

import numpy as np
import pytest
import rlhfless_test_helpers as H  # registered by conftest.py
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
    assert store.record({"after": [1]}) == 80  # each record() took its own step number
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


def test_a_locked_history_is_an_error_after_the_timeout(tmp_path, monkeypatch):
    import rlhfless_sdk.api.history as history

    path = tmp_path / "h.sqlite"
    store = LengthHistory(path, timeout_s=0.3)
    holder = locked(path)
    clock = [0.0]  # the store's clock: each retry's sleep advances it, so no wall-clock figure is asserted
    monkeypatch.setattr(history.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(history.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    with pytest.raises(HistoryError, match=r"h\.sqlite: cannot write.*locked by another process for more than 0.3 s"):
        store.record({"a": [1]})
    assert 0.3 <= clock[0] < 0.3 + 2 * history._POLL_S  # it gave up when the timeout had passed, not before
    monkeypatch.undo()
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


def test_ctrl_c_while_waiting_for_a_locked_history_exits_130_promptly(tmp_path, start_until):
    """Interrupted once it says it waits for the lock (its warning on stderr, not after a sleep that a loaded
    machine outruns): exit status 130, not the error an hour's lock timeout would end in."""
    import os
    import signal

    path = tmp_path / "h.sqlite"
    LengthHistory(path).close()
    holder = locked(path)  # held for the whole test: the run would wait an hour for it
    cfg = _config(tmp_path, path, history_timeout_s=3600)
    cmd = [sys.executable, "-m", "rlhfless_sdk", "simulate", "--prompts", "8", "--steps", "2", "--scheduler", cfg]
    proc, lines = start_until(cmd, "is locked by another process; waiting up to 3600 s", env={**os.environ})
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=600)  # a guard against a hang only
    proc.reader.join()
    holder.execute("ROLLBACK")
    assert proc.returncode == 130, "".join(lines)[-400:]
    assert "interrupted" in "".join(lines)


def test_a_simulation_never_reads_what_an_earlier_run_left_in_the_file(tmp_path, registry):
    """history.py's rule: a simulation must never see another run's future. Inside ``isolated_history`` (every
    simulator run) a history file is written, but only what this store recorded is read; outside, the file's
    whole history is (a restart)."""
    from rlhfless_sdk.api.history import isolated_history
    from rlhfless_sdk.api.profiles import load_profile
    from rlhfless_sdk.cli.simulate import make_cluster
    from rlhfless_sdk.simulation.simulator import Simulator
    from rlhfless_sdk.workloads.synthetic import SyntheticWorkload
    from rlhfless_sdk.workloads.traces import synthetic_workload

    path = tmp_path / "h.sqlite"
    with isolated_history():
        store = LengthHistory(path)
        assert store.isolated and store.recent(["a"], 3) == {} and store.last_step_mean() is None
        store.record({"a": [10.0]})
        assert store.recent(["a"], 3) == {"a": [10.0]}
        again = LengthHistory(path)  # another run: the file holds the first's step, it reads nothing of it
        assert again.recent(["a"], 3) == {} and again.last_step_mean() is None
    assert LengthHistory(path).recent(["a"], 3) == {"a": [10.0]}  # written: a restart outside a simulation sees it

    ewma = {"name": "ewma", "params": {"history_path": str(path)}}
    config = registry.scheduler("openrlhf").derive(name="h", predictor=ewma)
    work = synthetic_workload(SyntheticWorkload(16, 2, seed=4), 3)
    sim = Simulator(
        load_profile("qwen2.5-7b-l40s"), make_cluster(4, 4), registry=registry, plan_s=0.0
    )  # a fixed plan time: the runs compare to the last digit
    skip = {"planner_ms"}
    first = [r.model_dump(exclude=skip) for r in sim.run(config, work).reports]
    second = [r.model_dump(exclude=skip) for r in sim.run(config, work).reports]
    assert second == first  # step 0 of the second run saw nothing of the first's lengths
    assert len(LengthHistory(path)) == 1 + 2 * 3 * 16  # yet both runs wrote theirs


def test_a_schema_that_is_not_ours_and_a_failed_read_name_the_file(tmp_path):
    path = H.foreign_schema_history(tmp_path / "cols.sqlite")
    with pytest.raises(HistoryError, match=r"cols\.sqlite: its lengths table has columns \['uid', 'length'\]"):
        LengthHistory(path)
    good = LengthHistory(tmp_path / "good.sqlite")
    good.record({"a": [1.0]})
    with sqlite3.connect(tmp_path / "good.sqlite") as db:
        db.execute("DROP TABLE lengths")
    with pytest.raises(HistoryError, match=r"good\.sqlite: cannot read the length history \(no such table"):
        good.recent(["a"], 1)


def _read_only(path):
    path.chmod(0o444)
    path.parent.chmod(0o555)
    try:
        (path.parent / "probe").touch()
    except OSError:
        return
    path.parent.chmod(0o755)
    pytest.skip("this user writes to read-only files and folders anyway (root)")


def test_a_history_this_process_cannot_write_is_read_and_its_writes_fail_cleanly(tmp_path):
    """A valid history in a read-only folder (no WAL files can be made there) is opened for reading; a write
    fails naming the file, and the observation is kept in memory for the rest of the run."""
    path = tmp_path / "ro" / "h.sqlite"
    store = LengthHistory(path)
    store.record({"a": [100.0], "b": [50.0]})
    store.close()
    _read_only(path)
    try:
        store = LengthHistory(path)
        assert store.read_only and store.recent(["a", "b"], 2) == {"a": [100.0], "b": [50.0]}
        assert store.last_step_mean() == 75.0 and len(store) == 2
        with pytest.raises(HistoryError, match=r"h\.sqlite: cannot write the length history \(read-only"):
            store.record({"a": [10.0]})
        assert store.recent(["a"], 2) == {"a": [100.0, 10.0]} and store.last_step_mean() == 10.0
    finally:
        path.parent.chmod(0o755)
        path.chmod(0o644)
