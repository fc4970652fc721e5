"""``--drafter`` and ``--acceptance``: speculative decoding in `rlhfless simulate` (``api.speculation``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click

from rlhfless_sdk.api.config import PolicyRef, SchedulerConfig
from rlhfless_sdk.api.errors import RlhflessError
from rlhfless_sdk.api.profiles import load_acceptance
from rlhfless_sdk.api.speculation import Acceptance
from rlhfless_sdk.simulation.simulator import LOST_PER_COUNT, LOST_STEPS

drafter_options = (
    click.option(
        "--drafter",
        default=None,
        metavar="NAME",
        help="Add, after each scheduler that is not a baseline, the same one with this drafter (speculative "
        "decoding on its engines), named NAME.DRAFTER; baselines run OpenRLHF's and verl's engines (no drafter).",
    ),
    click.option(
        "--acceptance",
        default=None,
        metavar="NAME|FILE",
        help="The drafters' acceptance: a shipped one (history, ngram: measured by `rlhfless drafter-bench`; "
        "das-assumption: an assumption), geometric:A (an assumed per-token acceptance A, for sweeps) or a YAML "
        "file. Default: the one shipped for each drafter.",
    ),
)


def with_drafter(configs: Sequence[SchedulerConfig], drafter: str | None) -> list[SchedulerConfig]:
    """``configs`` and, after each one that is not a baseline, its copy with ``drafter``."""
    return SchedulerConfig.with_drafter(configs, drafter)


def drafter_arg(registry: Any, name: str | None) -> str | None:
    """``--drafter``: a registered drafter's name (an unknown one lists them)."""
    if name is not None:
        problems = registry.check_refs({"drafter": PolicyRef(name=name)})
        if problems:
            raise click.BadParameter(problems[0].message, param_hint="'--drafter'")
    return name


def acceptance_arg(value: str | None) -> Acceptance | None:
    if value is None:
        return None
    try:
        return load_acceptance(value)
    except RlhflessError as exc:
        raise click.BadParameter(str(exc), param_hint="'--acceptance'") from None


def drafter_lines(rows: Sequence[dict[str, Any]], gpus: int) -> list[str]:
    """One line per row that ran a drafter: its acceptance, tokens a step, and the work bound at that acceptance."""
    out = []
    for row in rows:
        d = row.get("drafter")
        if not d:
            continue
        label = "ASSUMED" if d["assumption"] else "measured"
        if d["drafts_at"] is None:
            lost = d.get("lost") or LOST_PER_COUNT
            if d.get("lost") == LOST_STEPS and d.get("lost_s"):
                lost += " ({:,.1f} s with it, {:,.1f} s without)".format(*d["lost_s"])
            out.append(
                f"{row['name']}: drafter {d['name']} {lost} on these engines at its {label} acceptance "
                f"({d['acceptance']}): they run without it"
            )
            continue
        lo, hi = d["drafts_at"]
        tps = d["tokens_per_step"]
        drafted = d["bound_gpu_s"] / gpus if gpus else None
        out.append(
            f"{row['name']}: drafter {d['name']} drafting at {lo}-{hi} running sequences (where it is priced to "
            f"gain), {label} acceptance ({d['acceptance']}); "
            f"{tps:.3f} tokens a verification step in this run (at most {d['best_tokens_per_step']:.3f}); work bound "
            f"at this acceptance {drafted:,.1f} s (plain decoding {row['bound_s']:,.1f} s)"
        )
    return out
