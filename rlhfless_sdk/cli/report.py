"""``rlhfless report FILE``: a run's JSON-lines step report (``--scheduler.report`` of a launch, one ``StepReport``
a line, every mode) as a table, its totals, and a plot of the step times and token ages."""

from __future__ import annotations

import json
from pathlib import Path

import click
from pydantic import ValidationError

from rlhfless_sdk.api.records import StepReport
from rlhfless_sdk.cli.args import plot_option

COLUMNS = (
    ("step", 5, lambda r: f"{r.step}"),
    ("time s", 8, lambda r: f"{r.time_s:.1f}"),
    ("gen s", 8, lambda r: f"{r.generation_s:.1f}"),
    ("learn s", 8, lambda r: f"{r.prepare_s + r.learn_s:.1f}"),
    ("engines", 7, lambda r: f"{r.num_actors}"),
    ("busy", 5, lambda r: f"{1 - r.idle_fraction:.2f}"),
    ("GPU-s", 8, lambda r: f"{r.gpu_seconds:.0f}"),
    ("samples", 7, lambda r: f"{r.samples}"),
    ("groups", 6, lambda r: "-" if r.groups_trained is None else f"{r.groups_trained}"),
    ("carried", 7, lambda r: f"{r.carried_samples}"),
    ("migr", 5, lambda r: f"{r.migrations}"),
    ("stale", 6, lambda r: f"{r.stale_token_fraction:.0%}"),
    ("age", 4, lambda r: f"{r.max_token_age_steps}"),
    ("fallbacks", 0, lambda r: ",".join(r.fallbacks) or "-"),
)


def read_report(path: Path) -> list[StepReport]:
    """Every step of a JSON-lines step report; a line that is not one names the file and the line."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise click.ClickException(f"{path}: cannot read it ({exc})") from None
    steps = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            steps.append(StepReport.model_validate(json.loads(line)))
        except (ValueError, ValidationError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise click.ClickException(f"{path}, line {n}: not a step report ({first})") from None
    if not steps:
        raise click.ClickException(f"{path}: no step in it")
    return steps


def table(steps: list[StepReport]) -> str:
    head = " ".join(f"{name:>{width}}" if width else name for name, width, _ in COLUMNS)
    rows = [" ".join(f"{cell(r):>{w}}" if w else cell(r) for _, w, cell in COLUMNS) for r in steps]
    schedulers = sorted({r.scheduler for r in steps})
    total = sum(r.time_s for r in steps)
    tokens = sum(r.response_tokens for r in steps)
    summary = (
        f"{len(steps)} steps of {', '.join(schedulers)}: {total:,.1f} s in all, {total / len(steps):,.1f} s a step; "
        f"{tokens:,} response tokens ({tokens / total if total else 0:,.0f} a second); "
        f"{sum(r.gpu_seconds for r in steps):,.0f} GPU-s; oldest token {max(r.max_token_age_steps for r in steps)} "
        f"update(s); {sum(r.migrations for r in steps)} migrations; "
        f"{sum(bool(r.fallbacks) for r in steps)} step(s) with a fallback"
    )
    return "\n".join([head, *rows, summary])


def plot(steps: list[StepReport], out: Path, title: str) -> None:
    """Each step's time split into generation and learning, and its oldest token's age."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r.step for r in steps]
    gen = [r.generation_s for r in steps]
    learn = [r.prepare_s + r.learn_s for r in steps]
    other = [max(r.time_s - g - lr, 0.0) for r, g, lr in zip(steps, gen, learn, strict=True)]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True, height_ratios=(3, 1))
    top.bar(x, gen, label="generation")
    top.bar(x, learn, bottom=gen, label="prepare + learn")
    top.bar(x, other, bottom=[g + lr for g, lr in zip(gen, learn, strict=True)], label="other (sync, waits)")
    top.set_ylabel("seconds")
    top.set_title(title)
    top.legend(loc="upper right")
    bottom.plot(x, [r.max_token_age_steps for r in steps], marker="o", label="oldest token (updates)")
    bottom.plot(x, [r.stale_token_fraction for r in steps], marker=".", label="stale share")
    bottom.set_xlabel("step")
    bottom.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    bottom.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


@click.command("report")
@click.argument("file", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="The steps and the totals as one JSON object.")
@plot_option("each step's time (generation, learning) and token age")
def report_cmd(file: Path, as_json: bool, plot_path: Path | None) -> None:
    """Print a run's JSON-lines step report (a launch's --scheduler.report) as a table, with its totals."""
    steps = read_report(file)
    if as_json:
        total = sum(r.time_s for r in steps)
        body = {"file": str(file), "steps": [r.model_dump(mode="json") for r in steps], "total_time_s": total}
        click.echo(json.dumps(body))
    else:
        click.echo(table(steps))
    if plot_path is not None:
        plot(steps, plot_path, f"{file.name}: {', '.join(sorted({r.scheduler for r in steps}))}")
        if not as_json:
            click.echo(f"plot: {plot_path}")
