"""Argument types and output helpers shared by the ``rlhfless`` commands (and the adapter's): every number is
range-checked and every output path checked before any work starts, and JSON output is strict JSON."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import click

#: At least one (prompts, samples, GPUs, repeats, ...) / zero or more (steps where 0 means "the default", seeds).
POSITIVE = click.IntRange(min=1)
NON_NEGATIVE = click.IntRange(min=0)

#: What matplotlib writes without extra packages.
PLOT_FORMATS = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


class FiniteFloat(click.ParamType):
    """A finite float (no nan or inf), above ``minimum`` (or at it when ``inclusive``)."""

    name = "float"

    def __init__(self, minimum: float, *, inclusive: bool = True) -> None:
        self.minimum, self.inclusive = minimum, inclusive

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            out = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(out):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        if out < self.minimum or (out == self.minimum and not self.inclusive):
            self.fail(f"{value!r} must be {'>=' if self.inclusive else '>'} {self.minimum:g}", param, ctx)
        return out


def plot_path(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """``--plot FILE``: a format matplotlib writes, in a folder that exists and is writable, checked up front."""
    if value is None:
        return None
    if value.suffix.lower() not in PLOT_FORMATS:
        raise click.BadParameter(f"{value}: unknown plot format; use one of {', '.join(PLOT_FORMATS)}", ctx, param)
    folder = value.parent if str(value.parent) else Path(".")
    if not folder.is_dir():
        raise click.BadParameter(f"{value}: folder {folder} does not exist", ctx, param)
    if not os.access(folder, os.W_OK) or value.is_dir():
        raise click.BadParameter(f"{value}: cannot write there", ctx, param)
    return value


def plot_option(what: str) -> Any:
    """The ``--plot FILE`` option, checked up front by ``plot_path``."""
    return click.option(
        "--plot",
        "plot_path",
        type=click.Path(path_type=Path),
        callback=plot_path,
        help=f"Write {what} (PNG, PDF, SVG or JPEG).",
    )


def finite(obj: Any) -> Any:
    """``obj`` with every nan or infinity replaced by None (JSON has no such numbers)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def dumps(obj: Any, **kw: Any) -> str:
    """Strict JSON (``allow_nan=False``): a non-finite number becomes null."""
    return json.dumps(finite(obj), allow_nan=False, **kw)
