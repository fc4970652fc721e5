"""Per-prompt response-length history in an embedded SQLite store.

One row per (prompt uid, observation): the mean response length of that prompt's samples in one observed step
and how many there were. Each ``record`` call takes the next step number inside its own write transaction, so
several processes writing the same prompts at once never overwrite each other: every observation is kept, in
the order it was written. ``path=None`` keeps the store in memory (a simulation must never see another run's
future); a file path makes it survive restarts and lets several processes share it (WAL journal, immediate
transactions, a busy timeout). A file that is not a SQLite database, or one written by something else or by
an incompatible version (a ``lengths`` table of other columns included), is an error that names the file:
never a silently empty history. So is a write that fails (a read-only file, a lock held past the timeout), and
so is a read that fails.

A simulation replays a workload whose later steps are another run's future, so a history opened inside
``isolated_history()`` (the simulator's runs, ``plan``, ``compare-predictors``, ``bench``) reads only what it
recorded itself: its file is still written (a write that fails still stops the run), but a previous run's
lengths in it are never seen. A history in a folder or file this process cannot write (where SQLite cannot create
its WAL files) is opened for reading: its lengths are used, and its first write fails as any failed write does.
An observation whose write failed is kept in memory for the rest of the run, read as the newest (a best-effort
predictor goes on learning from it).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

from rlhfless_sdk.api.errors import RlhflessError

APP_ID = "rlhfless-length-history"
SCHEMA_VERSION = 1
_CHUNK = 900  # SQLite's default limit on bound parameters is 999
_POLL_S = 0.05  # a locked database is retried this often, so Ctrl-C is never stuck in SQLite's own wait
_WARN_WAIT_S = 1.0  # a lock waited on this long is worth a warning: the run is not stuck, it waits
_COLUMNS = ("uid", "step", "mean", "count")
_ISOLATED: contextvars.ContextVar[bool] = contextvars.ContextVar("rlhfless_isolated_history", default=False)

log = logging.getLogger("rlhfless.history")


@contextlib.contextmanager
def isolated_history() -> Iterator[None]:
    """Histories opened inside read only what they record themselves (a simulation's run: see the module)."""
    token = _ISOLATED.set(True)
    try:
        yield
    finally:
        _ISOLATED.reset(token)


class _LockTimeout(sqlite3.OperationalError):
    """Another process held the lock for longer than the store's timeout."""


class HistoryError(RlhflessError):
    """The history store cannot be opened or written; the message names the file."""


class HistoryLocked(HistoryError):
    """Another process held the history file's lock for longer than the store's timeout."""


class LengthHistory:
    """Mean response length per prompt per step, persisted in SQLite (in memory when ``path`` is None)."""

    def __init__(
        self, path: str | Path | None = None, *, timeout_s: float = 60.0, isolated: bool | None = None
    ) -> None:
        """``isolated``: read only what this store records (default: whether ``isolated_history()`` is on)."""
        self.path = None if path is None else Path(path).expanduser()
        self.timeout_s = timeout_s
        self.isolated = _ISOLATED.get() if isolated is None else isolated
        self.read_only = False  # a file this process cannot write: opened for reading
        self._lock = threading.Lock()
        # what this store recorded (isolated), or what it could not write: read as the newest observations
        self._memory: LengthHistory | None = None
        self._last_in_memory = False
        where = ":memory:" if self.path is None else str(self.path)
        if self.path is not None:
            if self.path.is_dir():
                raise HistoryError(f"{self.path}: is a folder, expected a length-history file")
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise HistoryError(f"{self.path}: cannot create its folder ({exc.strerror or exc})") from None
        try:
            if self.path is not None and self.path.is_file() and not self._writable():
                self._open_read_only()
            else:
                self._db = sqlite3.connect(where, timeout=_POLL_S, isolation_level=None, check_same_thread=False)
                self._db.execute(f"PRAGMA busy_timeout = {int(_POLL_S * 1000)}")
                # Several processes opening a new file at once contend for the lock that switching the journal to
                # WAL and creating the tables take: a locked database is retried until timeout_s, like a write.
                self._retry_locked(self._open_file)
        except _LockTimeout as exc:
            raise HistoryLocked(f"{where}: cannot open the length history ({exc})") from None
        except sqlite3.DatabaseError as exc:
            raise HistoryError(f"{where}: not a usable rlhfless length history ({exc})") from None

    def _writable(self) -> bool:
        """Whether this process may write the file and create SQLite's WAL files beside it."""
        assert self.path is not None
        return os.access(self.path, os.W_OK) and os.access(self.path.parent, os.W_OK | os.X_OK)

    def _open_read_only(self) -> None:
        """Open a file this process cannot write, for reading: as is when SQLite's WAL files exist already (or
        need no creating), else as an immutable file (nobody can write it here either)."""
        assert self.path is not None
        self.read_only = True
        uri = "file:" + urllib.parse.quote(str(self.path.resolve()))
        last: sqlite3.DatabaseError | None = None
        for query in ("?mode=ro", "?mode=ro&immutable=1"):
            try:
                self._db = sqlite3.connect(uri + query, uri=True, isolation_level=None, check_same_thread=False)
                self._check_or_create()
                return
            except HistoryError:
                raise
            except sqlite3.DatabaseError as exc:
                last = exc
                with contextlib.suppress(Exception):
                    self._db.close()
        assert last is not None
        raise last

    def _open_file(self) -> None:
        if self.path is not None:
            self._db.execute("PRAGMA journal_mode = WAL")
        self._check_or_create()

    def _retry_locked(self, fn) -> None:
        """Run ``fn``, retrying a locked database in short waits until ``timeout_s`` has passed (SQLite's own
        wait is kept short, so Ctrl-C is never stuck in it)."""
        start = time.monotonic()
        deadline, warned = start + self.timeout_s, False
        while True:
            try:
                return fn()
            except _LockTimeout:
                raise  # an inner wait already took the whole timeout
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) and "busy" not in str(exc):
                    raise
                now = time.monotonic()
                if now >= deadline:
                    raise _LockTimeout(
                        f"database is locked by another process for more than {self.timeout_s:g} s"
                    ) from None
                if not warned and now - start >= _WARN_WAIT_S:
                    warned = True
                    log.warning(
                        "%s: the length history is locked by another process; waiting up to %g s for it",
                        self.path,
                        self.timeout_s,
                    )
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
        columns = [r[1] for r in db.execute("PRAGMA table_info(lengths)")]
        if meta.get("app") == APP_ID and not set(_COLUMNS) <= set(columns):
            raise HistoryError(
                f"{self.path}: its lengths table has columns {columns}, not {list(_COLUMNS)}: not an rlhfless "
                "length history of this version; move the file aside or use a new history path"
            )
        if meta.get("app") != APP_ID:
            raise HistoryError(f"{self.path}: a SQLite database written by {meta.get('app')!r}, not by rlhfless")
        if meta.get("schema_version") != str(SCHEMA_VERSION):
            raise HistoryError(
                f"{self.path}: length history schema version {meta.get('schema_version')}, this rlhfless reads "
                f"version {SCHEMA_VERSION}; move the file aside or use a new history path"
            )

    def close(self) -> None:
        self._db.close()
        if self._memory is not None:
            self._memory.close()

    def _where(self) -> str:
        return str(self.path or ":memory:")

    def _read(self, fn):
        """``fn()``, a read of the file: a failure is an error naming the file, never a bare SQLite error."""
        try:
            return fn()
        except sqlite3.DatabaseError as exc:
            raise HistoryError(f"{self._where()}: cannot read the length history ({exc})") from None

    # -- writing ---------------------------------------------------------------------------------------
    def _begin(self) -> None:
        """Take the write lock, retrying a locked database in short waits until ``timeout_s`` has passed."""
        self._retry_locked(lambda: self._db.execute("BEGIN IMMEDIATE"))

    def record(self, observations: Mapping[str, Sequence[float]]) -> int:
        """Store one observed step: each prompt's response lengths (their mean and count), in one transaction
        under the next step number, which it returns. Raises HistoryError when the write fails; the step is then
        kept in memory for the rest of the run (read as the newest)."""
        if self.path is not None and (self.isolated or self.read_only):
            self._remember(observations)  # what this run reads (isolated), or would have lost (read-only)
        if self.read_only:
            raise HistoryError(
                f"{self.path}: cannot write the length history (read-only: this process cannot write the file or "
                "its folder, where SQLite keeps its WAL files; opened for reading)"
            )
        with self._lock:
            try:
                self._begin()
                (last,) = self._db.execute("SELECT MAX(step) FROM lengths").fetchone()
                step = 0 if last is None else int(last) + 1
                rows = [(uid, step, sum(v) / len(v), len(v)) for uid, v in observations.items() if len(v)]
                self._db.executemany("INSERT INTO lengths VALUES (?, ?, ?, ?)", rows)
                self._db.execute("COMMIT")
                if not self.isolated:
                    self._last_in_memory = False
                return step
            except sqlite3.DatabaseError as exc:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                if not self.isolated:
                    self._remember(observations)
                reason = str(exc)
                if "readonly" in reason:
                    reason = f"read-only: {reason}"
                raise HistoryError(f"{self._where()}: cannot write the length history ({reason})") from None

    def _remember(self, observations: Mapping[str, Sequence[float]]) -> None:
        if self._memory is None:
            self._memory = LengthHistory(None, isolated=False)
        self._memory.record(observations)
        self._last_in_memory = True

    # -- reading ---------------------------------------------------------------------------------------
    def recent(self, uids: Iterable[str], window: int) -> dict[str, list[float]]:
        """The last ``window`` step means of each uid that has any, oldest first."""
        uids = list(dict.fromkeys(uids))
        if self.isolated and self.path is not None:
            return self._memory.recent(uids, window) if self._memory is not None else {}
        out = self._read(lambda: self._recent(uids, window))
        if self._memory is not None:  # observations whose write failed: the newest
            for uid, values in self._memory.recent(uids, window).items():
                out[uid] = (out.get(uid, []) + values)[-window:]
        return out

    def _recent(self, uids: list[str], window: int) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
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
        if (self.isolated and self.path is not None) or self._last_in_memory:
            return self._memory.last_step_mean() if self._memory is not None else None
        row = self._read(
            lambda: self._db.execute(
                "SELECT SUM(mean * count) / SUM(count) FROM lengths WHERE step = (SELECT MAX(step) FROM lengths)"
            ).fetchone()
        )
        return None if row is None or row[0] is None else float(row[0])

    def __len__(self) -> int:
        return int(self._read(lambda: self._db.execute("SELECT COUNT(*) FROM lengths").fetchone()[0]))
