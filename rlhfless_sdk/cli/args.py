"""Argument types and output helpers shared by the ``rlhfless`` commands (and the adapter's): every number is
range-checked and every output path checked before any work starts, and JSON output is strict JSON."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

from rlhfless_sdk.api.options import FiniteFloat, unwritable, writable_file, writable_folder

__all__ = ["FiniteFloat", "unwritable", "writable_file", "writable_folder"]  # shared with commands of plugins

#: At least one (prompts, samples, GPUs, repeats, ...) / zero or more (steps where 0 means "the default", seeds).
POSITIVE = click.IntRange(min=1)
NON_NEGATIVE = click.IntRange(min=0)

#: Most GPUs a cluster may have, burst engines included: `plan` takes seconds at this size, a simulated step
#: about ten; a cluster of a billion GPUs would not fit in memory.
MAX_GPUS = 100_000
GPUS = click.IntRange(min=1, max=MAX_GPUS)
#: Most earlier steps `plan --history` replays: each is a whole step's prompts observed by every scheduler's
#: predictor (a tenth of a second or more), and no predictor's window needs more.
MAX_HISTORY = 100
#: Memory a simulated sample takes at its peak: its columns, its engine's state and its step's records (two
#: simulated steps of 262,144 samples each peak at about 2.8 GB); a planned one, far less (`bench plan` of 800,000
#: samples a step peaks at 1.2 GB).
BYTES_PER_SAMPLE = 8 * 1024
BYTES_PER_PLANNED_SAMPLE = 2 * 1024


def memory_bytes() -> int:
    """This machine's physical memory (16 GiB where the system does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return 16 * 2**30


def max_samples(bytes_per_sample: int = BYTES_PER_SAMPLE) -> int:
    """The most samples a workload may hold on this machine (``bytes_per_sample`` each)."""
    return max(memory_bytes() // bytes_per_sample, 1)


def check_samples(
    prompts: int,
    samples: int,
    steps: int = 1,
    *,
    steps_flag: str = "--steps",
    bytes_per_sample: int = BYTES_PER_SAMPLE,
) -> None:
    """``prompts x samples x steps`` samples fit this machine's memory (``bytes_per_sample`` each: simulated,
    or ``BYTES_PER_PLANNED_SAMPLE`` for a plan); else a usage error naming the flag that makes them too many
    (``--prompts`` or ``--samples`` when one step is too much, else ``steps_flag``)."""
    most, total = max_samples(bytes_per_sample), prompts * samples * steps
    if total <= most:
        return
    if prompts * samples > most:
        flag, value = ("--prompts", prompts) if prompts >= samples else ("--samples", samples)
    else:
        flag, value = steps_flag, steps
    raise click.BadParameter(
        f"{value}: {prompts:,} prompts x {samples:,} samples x {steps:,} steps = {total:,} samples, more than this "
        f"machine's memory holds ({memory_bytes() / 2**30:.0f} GiB: about {most:,} samples at "
        f"{bytes_per_sample // 1024} KiB each)",
        param_hint=f"'{flag}'",
    )


#: What matplotlib writes without extra packages.
PLOT_FORMATS = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def plot_path(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """``--plot FILE``: a format matplotlib writes, in a folder that exists and is writable, and matplotlib
    installed, all checked up front."""
    if value is None:
        return None
    if value.suffix.lower() not in PLOT_FORMATS:
        raise click.BadParameter(f"{value}: unknown plot format; use one of {', '.join(PLOT_FORMATS)}", ctx, param)
    folder = value.parent if str(value.parent) else Path(".")
    if not folder.is_dir():
        raise click.BadParameter(f"{value}: folder {folder} does not exist", ctx, param)
    if not os.access(folder, os.W_OK) or value.is_dir():
        raise click.BadParameter(f"{value}: cannot write there", ctx, param)
    try:  # before the run, not after it
        import matplotlib  # noqa: F401
    except ImportError:
        raise click.BadParameter(
            f"{value}: plotting needs matplotlib: pip install 'rlhfless[plot]'", ctx, param
        ) from None
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


MEMORY_HELP = (
    "KV memory of a synchronous engine, which time-shares its GPUs with the learner: colocated (beside the "
    "learner's states, vLLM's gpu_memory_utilization about 0.55: the profile's colocated_kv_capacity_tokens) or "
    "dedicated (the learner offloaded while generating: the profile's kv_capacity_tokens). Engines on GPUs of "
    "their own (async pipelines, burst engines) always get the dedicated capacity."
)


def _no_kv_tokens(ctx: click.Context, param: click.Parameter, value: int | None) -> None:
    if value is not None:
        raise click.BadParameter(
            "--kv-tokens gave every engine one capacity, async and burst engines included; say which memory: "
            "--dedicated-kv-tokens N (engines on GPUs of their own) and/or --colocated-kv-tokens N (beside the "
            "learner), and --memory for what synchronous engines get",
            ctx,
            param,
        )


def model_options(*, algo: bool = True) -> Any:
    """``--memory`` (the KV capacity a synchronous engine gets), ``--dedicated-kv-tokens N`` and
    ``--colocated-kv-tokens N`` (the two capacities, overriding the profile's) and, where learning is simulated,
    ``--algo``."""

    def wrap(fn: Any) -> Any:
        options = [
            click.option(
                "--memory",
                type=click.Choice(["colocated", "dedicated"]),
                default="colocated",
                show_default=True,
                help=MEMORY_HELP,
            ),
            click.option(
                "--dedicated-kv-tokens",
                type=POSITIVE,
                default=None,
                help="KV capacity of an engine on GPUs of its own, in tokens (default: the profile's).",
            ),
            click.option(
                "--colocated-kv-tokens",
                type=POSITIVE,
                default=None,
                help="KV capacity of an engine beside the learner, in tokens (default: the profile's).",
            ),
            click.option(
                "--kv-tokens", type=POSITIVE, default=None, hidden=True, expose_value=False, callback=_no_kv_tokens
            ),
        ]
        if algo:
            options.append(
                click.option(
                    "--algo",
                    type=click.Choice(["auto", "ppo", "grpo"]),
                    default="auto",
                    show_default=True,
                    help="Learner costs: ppo (critic, reward model) or grpo (critic-free); auto: grpo when prompts "
                    "have several samples.",
                )
            )
        for option in reversed(options):
            fn = option(fn)
        return fn

    return wrap


def engine_profiles(
    profile: str,
    dedicated_kv_tokens: int | None,
    colocated_kv_tokens: int | None,
    memory: str,
    tensor_parallel: int = 1,
) -> tuple[Any, Any]:
    """From the same flags: the profile on engines of their own (dedicated memory: async and burst engines), and a
    synchronous engine's (``memory``), each through ``run_profile``."""
    kv = (dedicated_kv_tokens, colocated_kv_tokens)
    dedicated = run_profile(profile, *kv, tensor_parallel=tensor_parallel)
    return dedicated, run_profile(profile, *kv, memory, tensor_parallel)


def run_profile(
    profile: str,
    dedicated_kv_tokens: int | None = None,
    colocated_kv_tokens: int | None = None,
    memory: str | None = None,
    tensor_parallel: int = 1,
) -> Any:
    """The named (or YAML) profile with the two KV capacities overridden (checked: colocated <= dedicated);
    with ``memory``, the profile of a synchronous engine with that memory. ``tensor_parallel`` > 1: each engine
    sharded over that many GPUs (``TimePerTokenProfile.sharded``), before the overrides (which are per engine)."""
    from pydantic import ValidationError

    from rlhfless_sdk.api.profiles import load_profile

    prof = load_profile(profile)
    try:
        prof = prof.sharded(tensor_parallel)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--tensor-parallel") from None
    update: dict[str, Any] = {}
    if dedicated_kv_tokens is not None:
        update["kv_capacity_tokens"] = dedicated_kv_tokens
    if colocated_kv_tokens is not None:
        update["colocated_kv_capacity_tokens"] = colocated_kv_tokens
    if update:
        tag = "".join(f"@{k.split('_')[0]}kv{v}" for k, v in update.items())
        try:
            prof = type(prof).model_validate({**prof.model_dump(), **update, "name": f"{prof.name}{tag}"})
        except ValidationError as exc:
            raise click.BadParameter(
                "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors()),
                param_hint="--dedicated-kv-tokens / --colocated-kv-tokens",
            ) from None
    if memory is None:
        return prof
    try:
        return prof.with_memory(memory)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--memory") from None


def synthetic_shape_options(fn: Any) -> Any:
    """The synthetic workload's length distribution (used when no ``--trace`` is given)."""
    synthetic = [  # (flag, default, type, help)
        ("--median-length", 300.0, FiniteFloat(0.0, inclusive=False), "median response length."),
        ("--length-sigma", 0.6, FiniteFloat(0.0), "log-normal spread across prompts."),
        ("--sample-sigma", 0.35, FiniteFloat(0.0), "spread within a prompt's group."),
        ("--max-length", 1024, POSITIVE, "response length cap."),
        (
            "--runaway",
            0.0,
            FiniteFloat(0.0, maximum=1.0),
            "share of samples that never stop and hit --max-length (repetition loops).",
        ),
        (
            "--length-growth",
            1.0,
            FiniteFloat(0.0, inclusive=False),
            "the last step's lengths are X times the first's, growing geometrically (reasoning RL).",
        ),
    ]
    options = [
        click.option(flag, default=default, type=kind, show_default=True, help=f"Synthetic: {text}")
        for flag, default, kind, text in synthetic
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


#: ``--launch``: which of OpenRLHF's loops the schedulers are run as.
LAUNCHES = ("sync", "async", "both")
launch_option = click.option(
    "--launch",
    type=click.Choice(LAUNCHES),
    default=LAUNCHES[0],
    help="Run the schedulers as a synchronous launch does (the default), as an async one (--train.async_enable: a "
    "scheduler with an async form, such as rlhfless, runs it, named NAME.async), or both.",
)
