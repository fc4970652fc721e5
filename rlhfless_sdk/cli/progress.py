"""A progress bar for long simulations: on stderr when it is a terminal, silent otherwise (a pipe, a log, ``--json``).

The bar names what runs now and how long the run has taken, redrawn every second, so that a scheduler whose split
search simulates many runs before its first step still shows the run is alive.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

import click


class Progress:
    """``step()`` after each simulated step, ``now(name)`` when the next scheduler starts."""

    def __init__(self, total: int, file: IO[str], label: str) -> None:
        self._bar = click.progressbar(length=total, label=label, file=file, show_pos=True)
        self._what, self._label = "", label
        self._start = time.monotonic()
        self._lock = threading.Lock()

    def __enter__(self) -> Progress:
        self._bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._bar.__exit__(None, None, None)

    def now(self, what: str) -> None:
        with self._lock:
            self._what = what
            self._render()

    def step(self, n: int = 1) -> None:
        with self._lock:
            self._bar.update(n)
            self._render()

    def redraw(self) -> None:
        """The elapsed time moves on between steps too (``progress`` calls this every second)."""
        with self._lock:
            self._render()

    def _render(self) -> None:
        elapsed = time.monotonic() - self._start
        self._bar.label = f"{self._label} {self._what} ({elapsed:.0f} s)".replace("  ", " ")
        self._bar.render_progress()


class _Silent:
    def now(self, what: str) -> None:
        pass

    def step(self, n: int = 1) -> None:
        pass


@contextmanager
def progress(total: int, show: bool = True, file: IO[str] | None = None, label: str = "simulating") -> Iterator:
    """A ``Progress`` on ``file`` (stderr) if ``show`` and it is a terminal, else one that prints nothing."""
    file = sys.stderr if file is None else file
    if not (show and file.isatty()):
        yield _Silent()
        return
    shown = Progress(total, file, label)
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(1.0):
            shown.redraw()

    ticker = threading.Thread(target=tick, name="rlhfless-progress", daemon=True)
    with shown:
        ticker.start()
        try:
            yield shown
        finally:
            stop.set()
            ticker.join()
