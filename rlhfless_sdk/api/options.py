"""Argument types every ``rlhfless`` command shares with the commands a plugin registers
(``rlhfless_register_commands``): numbers that must be finite, output paths checked before any work starts."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click


class FiniteFloat(click.ParamType):
    """A finite float (no nan or inf), above ``minimum`` (or at it when ``inclusive``), at most ``maximum``."""

    name = "float"

    def __init__(self, minimum: float, *, inclusive: bool = True, maximum: float | None = None) -> None:
        self.minimum, self.inclusive, self.maximum = minimum, inclusive, maximum

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            out = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(out):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        if out < self.minimum or (out == self.minimum and not self.inclusive):
            self.fail(f"{value!r} must be {'>=' if self.inclusive else '>'} {self.minimum:g}", param, ctx)
        if self.maximum is not None and out > self.maximum:
            self.fail(f"{value!r} must be <= {self.maximum:g}", param, ctx)
        return out


def unwritable(path: Path, *, folder: bool) -> str | None:
    """Why ``path`` cannot be written as a ``folder`` (made with its parents) or a file (its folders made), or
    None when it can: a file or folder of the other kind in its place, a file where a folder above it must be, or
    a folder above it this user cannot write in."""
    path = Path(path).expanduser()
    if path.exists():
        if folder and not path.is_dir():
            return f"{path} is a file, not a folder"
        if not folder and path.is_dir():
            return f"{path} is a folder, not a file"
        target = path if folder else path.parent
        if not os.access(target if str(target) else Path("."), os.W_OK | os.X_OK):
            return f"cannot write in {target}"
        return None
    above = path.absolute().parent
    while not above.exists():
        above = above.parent
    if not above.is_dir():
        return f"{above} is a file, not a folder"
    if not os.access(above, os.W_OK | os.X_OK):
        return f"cannot write in {above}"
    return None


def writable_folder(ctx: click.Context | None, param: click.Parameter | None, value: Path | None) -> Path | None:
    """An output folder (``--out``): made with its parents when the command writes; checked up front."""
    if value is not None and (why := unwritable(value, folder=True)) is not None:
        raise click.BadParameter(f"{value}: {why}", ctx, param)
    return value


def writable_file(ctx: click.Context | None, param: click.Parameter | None, value: Path | None) -> Path | None:
    """An output file (``--trace``, a profile's ``--out``): its folders made when the command writes; checked up
    front."""
    if value is not None and (why := unwritable(value, folder=False)) is not None:
        raise click.BadParameter(f"{value}: {why}", ctx, param)
    return value


def distinct(configs: Sequence[Any], given: Sequence[str]) -> list[Any]:
    """Scheduler configs resolved from the ``--scheduler`` values ``given`` (in order), refused when two share a
    name: each row, report and plot label is known by its scheduler's name."""
    seen: dict[str, str] = {}
    for config, source in zip(configs, given, strict=True):
        if config.name in seen:
            fix = (
                "give it once"
                if seen[config.name] == source
                else f"both {seen[config.name]} and {source}: give each scheduler file its own name:"
            )
            raise click.BadParameter(
                f"two schedulers are named {config.name!r}, and each row is known by its name ({fix})",
                param_hint="'--scheduler'",
            )
        seen[config.name] = source
    return list(configs)
