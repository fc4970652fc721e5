"""Engines die with the process that started them, however it ends (SIGKILL included).

vLLM's ``EngineCore`` process has no watch on its parent: a command killed hard (a test's timeout, ``kill -9``, the
OOM killer) leaves it, and its worker, computing with parent PID 1. Ray's head processes die with the driver (Ray
sets a parent-death signal on them), but not the engine processes under its workers.

``reap_on_exit()`` starts a small watcher in a session of its own (so that a signal to the caller's process group
does not end it first). The watcher notes every descendant of the watched process twice a second, and once that
process is gone, kills each noted descendant still alive (the same process: its start time is checked, so a reused
PID is left alone) and whatever those have started since. It is the standard library only and runs as a script:
``python reaper.py PID``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

POLL_S = 0.5

Proc = tuple[int, int]  # (pid, start time in clock ticks since boot): one process, never a reused PID


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent PID, start time) from /proc, or None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    fields = raw[raw.rindex(b")") + 2 :].split()  # after the command name, which may hold spaces and parentheses
    return fields[0].decode(), int(fields[1]), int(fields[19])


def children_by_parent() -> dict[int, list[Proc]]:
    table: dict[int, list[Proc]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _stat(int(name))
            if stat is not None:
                table.setdefault(stat[1], []).append((int(name), stat[2]))
    return table


def descendants(roots: list[int], table: dict[int, list[Proc]] | None = None) -> list[Proc]:
    """Every living process under ``roots`` (the roots themselves not included), parents before children."""
    table = children_by_parent() if table is None else table
    out: list[Proc] = []
    todo = list(roots)
    while todo:
        for child in table.get(todo.pop(), []):
            if child not in out:
                out.append(child)
                todo.append(child[0])
    return out


def alive(proc: Proc) -> bool:
    stat = _stat(proc[0])
    return stat is not None and stat[2] == proc[1] and stat[0] not in ("Z", "X")


def kill_all(noted: list[Proc]) -> int:
    """SIGKILL every noted process still alive and everything under it, until none is left; returns how many."""
    killed = 0
    for _ in range(10):  # a process may start another while its siblings die
        living = [p for p in noted if alive(p)]
        living += [p for p in descendants([pid for pid, _ in living]) if p not in living]
        if not living:
            break
        for pid, _ in living:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
        time.sleep(0.1)
        noted = living
    return killed


def watch(pid: int) -> int:
    """Note ``pid``'s descendants until it ends, then kill those still alive (see the module's docstring)."""
    me = os.getpid()
    stat = _stat(pid)
    if stat is None:
        return 0
    target = (pid, stat[2])
    noted: dict[Proc, None] = {}
    while alive(target):
        noted.update((p, None) for p in descendants([pid]) if p[0] != me)
        time.sleep(POLL_S)
    return kill_all(list(noted))


_watchers: dict[int, subprocess.Popen] = {}  # by watched PID: one watcher a process, however often it is asked


def reap_on_exit() -> subprocess.Popen | None:
    """Start the watcher of this process, once (Linux; elsewhere nothing is started). Returns it, for tests."""
    if not os.path.isdir("/proc/self"):
        return None
    me = os.getpid()
    if me in _watchers and _watchers[me].poll() is None:
        return _watchers[me]
    _watchers[me] = subprocess.Popen(
        [sys.executable, "-S", os.path.abspath(__file__), str(os.getpid())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # out of the caller's process group: a group kill reaches the engines, not this
        close_fds=True,
    )
    return _watchers[me]


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the command's to handle; this one ends after it
    watch(int(sys.argv[1]))
