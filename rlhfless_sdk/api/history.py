"""Per-prompt response-length history in an embedded SQLite store.

One row per (prompt uid, observation): the mean response length of that prompt's samples in one observed step
and how many there were. Each ``record`` call takes the next step number inside its own write transaction, so
several processes writing the same prompts at once never overwrite each other: every observation is kept, in
the order it was written. ``path=None`` keeps the store in memory (a simulation must never see another run's
future); a file path makes it survive restarts and lets several processes share it (WAL journal, immediate
transactions, a busy timeout). A file that is not a SQLite database, or one written by something else or by
an incompatible version, is an error that names the file: never a silently empty history. So is a write that
fails (a read-only file, a lock held past the timeout).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from rlhfless_sdk.api.errors import RlhflessError

APP_ID = "rlhfless-length-history"
SCHEMA_VERSION = 1
_CHUNK = 900  # SQLite's default limit on bound parameters is 999
_POLL_S = 0.05  # a locked database is retried this often, so Ctrl-C is never stuck in SQLite's own wait


class _LockTimeout(sqlite3.OperationalError):
    """Another process held the lock for longer than the store's timeout."""


class HistoryError(RlhflessError):
    """The history store cannot be opened or written; the message names the file."""


class LengthHistory:
    """Mean response length per prompt per step, persisted in SQLite (in memory when ``path`` is None)."""

    def __init__(self, path: str | Path | None = None, *, timeout_s: float = 60.0) -> None:
        self.path = None if path is None else Path(path).expanduser()
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        where = ":memory:" if self.path is None else str(self.path)
        if self.path is not None:
            if self.path.is_dir():
                raise HistoryError(f"{self.path}: is a folder, expected a length-history file")
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(where, timeout=_POLL_S, isolation_level=None, check_same_thread=False)
            self._db.execute(f"PRAGMA busy_timeout = {int(_POLL_S * 1000)}")
            # Several processes opening a new file at once contend for the lock that switching the journal to WAL
            # and creating the tables take: a locked database is retried until timeout_s, like a write.
            self._retry_locked(self._open_file)
        except sqlite3.DatabaseError as exc:
            raise HistoryError(f"{where}: not a usable rlhfless length history ({exc})") from None

    def _open_file(self) -> None:
        if self.path is not None:
            self._db.execute("PRAGMA journal_mode = WAL")
        self._check_or_create()

    def _retry_locked(self, fn) -> None:
        """Run ``fn``, retrying a locked database in short waits until ``timeout_s`` has passed (SQLite's own
        wait is kept short, so Ctrl-C is never stuck in it)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return fn()
            except _LockTimeout:
                raise  # an inner wait already took the whole timeout
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) and "busy" not in str(exc):
                    raise
                if time.monotonic() >= deadline:
                    raise _LockTimeout(
                        f"database is locked by another process for more than {self.timeout_s:g} s"
                    ) from None
                time.sleep(_POLL_S)

    def _check_or_create(self) -> None:
        db = self._db
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:
            self._begin()
            try:
                tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
                if not tables:  # nobody created it between our look and our lock
                    db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
                    db.execute(
                        "CREATE TABLE lengths (uid TEXT NOT NULL, step INTEGER NOT NULL, mean REAL NOT NULL, "
                        "count INTEGER NOT NULL, PRIMARY KEY (uid, step))"
                    )
                    db.executemany(
                        "INSERT INTO meta VALUES (?, ?)", [("app", APP_ID), ("schema_version", str(SCHEMA_VERSION))]
                    )
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "meta" not in tables or "lengths" not in tables:
            raise HistoryError(
                f"{self.path}: a SQLite database, but not an rlhfless length history (tables {sorted(tables)})"
            )
        meta = dict(db.execute("SELECT key, value FROM meta"))
        if meta.get("app") != APP_ID:
            raise HistoryError(f"{self.path}: a SQLite database written by {meta.get('app')!r}, not by rlhfless")
        if meta.get("schema_version") != str(SCHEMA_VERSION):
            raise HistoryError(
                f"{self.path}: length history schema version {meta.get('schema_version')}, this rlhfless reads "
                f"version {SCHEMA_VERSION}; move the file aside or use a new history path"
            )

    def close(self) -> None:
        self._db.close()

    # -- writing ---------------------------------------------------------------------------------------
    def next_step(self) -> int:
        (last,) = self._db.execute("SELECT MAX(step) FROM lengths").fetchone()
        return 0 if last is None else int(last) + 1

    def _begin(self) -> None:
        """Take the write lock, retrying a locked database in short waits until ``timeout_s`` has passed."""
        self._retry_locked(lambda: self._db.execute("BEGIN IMMEDIATE"))

    def record(self, observations: Mapping[str, Sequence[float]]) -> int:
        """Store one observed step: each prompt's response lengths (their mean and count), in one transaction
        under the next step number, which it returns. Raises HistoryError when the write fails."""
        with self._lock:
            try:
                self._begin()
                (last,) = self._db.execute("SELECT MAX(step) FROM lengths").fetchone()
                step = 0 if last is None else int(last) + 1
                rows = [(uid, step, sum(v) / len(v), len(v)) for uid, v in observations.items() if len(v)]
                self._db.executemany("INSERT INTO lengths VALUES (?, ?, ?, ?)", rows)
                self._db.execute("COMMIT")
                return step
            except sqlite3.DatabaseError as exc:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise HistoryError(f"{self.path or ':memory:'}: cannot write the length history ({exc})") from None

    # -- reading ---------------------------------------------------------------------------------------
    def recent(self, uids: Iterable[str], window: int) -> dict[str, list[float]]:
        """The last ``window`` step means of each uid that has any, oldest first."""
        out: dict[str, list[float]] = {}
        uids = list(dict.fromkeys(uids))
        with self._lock:
            for i in range(0, len(uids), _CHUNK):
                chunk = uids[i : i + _CHUNK]
                marks = ",".join("?" * len(chunk))
                rows = self._db.execute(
                    f"SELECT uid, mean FROM (SELECT uid, mean, step, ROW_NUMBER() OVER "
                    f"(PARTITION BY uid ORDER BY step DESC) AS k FROM lengths WHERE uid IN ({marks})) "
                    f"WHERE k <= ? ORDER BY uid, step",
                    (*chunk, window),
                )
                for uid, mean in rows:
                    out.setdefault(uid, []).append(mean)
        return out

    def last_step_mean(self) -> float | None:
        """Mean length over the most recent step's samples (the cold-start guess)."""
        row = self._db.execute(
            "SELECT SUM(mean * count) / SUM(count) FROM lengths WHERE step = (SELECT MAX(step) FROM lengths)"
        ).fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def __len__(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM lengths").fetchone()[0])
