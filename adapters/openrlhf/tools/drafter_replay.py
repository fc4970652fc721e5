"""``rlhfless drafter-replay FILE``: recorded rollouts replayed through drafters offline (``workloads.draft_replay``).

It reports, for each drafter and each budget k, the tokens a verification step yields and the first drafted
token's acceptance: overall, by where in a response the step starts, on each group's longest response, and by
training step; the proposer's host time a proposal; ``--out`` writes the acceptance ``rlhfless simulate
--acceptance`` reads (at the largest k, with its figures by position).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from rlhfless_sdk.workloads.draft_replay import POSITIONS, acceptance_record, read_rollouts, replay


def _tokenizer(folder: Path | None, say) -> Any:
    """A Hugging Face tokenizer from ``folder`` (default: the demo's converted SmolLM2-135M-Instruct)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise click.ClickException(
            "drafter-replay tokenizes with transformers: pip install -e '.[demo]' (or pip install transformers)"
        ) from None
    if folder is None:
        from rlhfless_openrlhf.tools.workbench import default_cache, smollm2_model

        try:
            folder = smollm2_model(default_cache(), say)
        except RuntimeError as exc:
            raise click.ClickException(f"{exc}; or pass --tokenizer DIR") from None
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as exc:
        message = f"{folder}: not a Hugging Face tokenizer folder ({exc})"
        raise click.BadParameter(message, param_hint="'--tokenizer'") from None


def _ks(value: str) -> list[int]:
    try:
        ks = sorted({int(x) for x in value.split(",") if x.strip()})
    except ValueError:
        raise click.BadParameter(f"{value!r}: a comma-separated list of whole numbers", param_hint="'--k'") from None
    if not ks or ks[0] < 1:
        raise click.BadParameter(f"{value!r}: each k at least 1", param_hint="'--k'")
    return ks


@click.command("drafter-replay")
@click.argument("file", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.option("--drafter", "drafters", multiple=True, default=("suffix",), show_default=True, help="Repeat.")
@click.option("--k", "k_list", default="2,4,8", show_default=True, help="Draft budgets a verification step.")
@click.option(
    "--tokenizer",
    type=click.Path(path_type=Path, file_okay=False, exists=True),
    default=None,
    help="A Hugging Face tokenizer folder. Default: the demo's converted SmolLM2-135M-Instruct.",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Write the acceptance at the largest k (YAML, for `rlhfless simulate --acceptance FILE`); one --drafter.",
)
@click.option("--about", default=None, help="What the rollouts are, for the acceptance file's source line.")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON instead of tables.")
def drafter_replay_cmd(
    file: Path,
    drafters: tuple[str, ...],
    k_list: str,
    tokenizer: Path | None,
    out: Path | None,
    about: str | None,
    as_json: bool,
) -> None:
    """Replay recorded rollouts (JSON lines, one group a line: {"uid", "step", "prompt", "responses"}) through
    each drafter: the siblings run side by side, finished ones whole, and each step's groups join the drafter's
    history after the step."""
    import yaml
    from rlhfless_openrlhf.tools.options import check_drafter

    from rlhfless_sdk import get_plugin_manager

    ks = _ks(k_list)
    for name in drafters:
        check_drafter(name)
    if out is not None and len(drafters) != 1:
        raise click.BadParameter("--out writes one drafter's acceptance: give one --drafter", param_hint="'--out'")
    say = lambda m: click.echo(m, err=True)  # noqa: E731
    tok = _tokenizer(tokenizer, say)
    groups = read_rollouts(file, lambda texts: tok(texts, add_special_tokens=False)["input_ids"])
    registry = get_plugin_manager().registry
    total = sum(len(r) for g in groups for r in g.responses) * len(ks) * len(drafters)
    results: dict[str, dict[int, Any]] = {}
    with click.progressbar(length=total, label="replaying", file=sys.stderr) as bar:
        for name in drafters:
            results[name] = {k: replay(registry.create("drafter", name), groups, k, bar.update) for k in ks}
    report = {
        "file": str(file),
        "groups": len(groups),
        "responses": sum(len(g.responses) for g in groups),
        "steps": len({g.step for g in groups}),
        "drafters": {name: [r.report() for r in by_k.values()] for name, by_k in results.items()},
    }
    if out is not None:
        (name,) = drafters
        source = (
            f"measured: rlhfless drafter-replay {file.name} --drafter {name} (k {ks[-1]}): {report['groups']} groups, "
            f"{report['responses']} responses, {report['steps']} steps" + (f"; {about}" if about else "")
        )
        record = acceptance_record(name, results[name][ks[-1]], source)
        out.write_text(yaml.safe_dump(record, sort_keys=False), encoding="utf-8")
        say(f"wrote {out}")
    click.echo(json.dumps(report, indent=1) if as_json else "\n".join(report_lines(report)))


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def report_lines(report: dict[str, Any]) -> list[str]:
    """The replay as tables: each drafter's tokens a verification step (and first-token acceptance) by k."""
    lines = [f"{report['file']}: {report['groups']} groups, {report['responses']} responses, {report['steps']} steps"]
    columns = ["overall", *(name for name, _ in POSITIONS), "longest"]
    lines.append(f"{'drafter':<10}{'k':>3}  " + "".join(f"{c:>15}" for c in columns) + f"{'ms/prop':>9}")
    for name, rows in report["drafters"].items():
        for r in rows:
            cells = [r, *(r["positions"][p] for p, _ in POSITIONS), r["longest"]]
            text = "".join(f"{_f(c['tokens_per_step']):>8} ({_f(c['first_acceptance'])})" for c in cells)
            lines.append(f"{name:<10}{r['k']:>3}  {text}{_f(r['propose_ms'], 3):>9}")
    lines.append("tokens a verification step (the first drafted token's acceptance, given a draft)")
    for name, rows in report["drafters"].items():
        by_step = rows[-1]["by_step"]
        steps = " ".join(f"{s}:{_f(f['tokens_per_step'])}" for s, f in by_step.items())
        lines.append(f"{name}, k {rows[-1]['k']}, by training step: {steps}")
    return lines
