"""Drop-in launcher: ``python -m rlhfless_openrlhf.train_ppo_ray --scheduler rlhfless <openrlhf flags>``.

Every flag of ``openrlhf.cli.train_ppo_ray`` passes through unchanged; these are added:

  --scheduler NAME|FILE      a registered scheduler (``rlhfless plugins`` lists them) or a scheduler YAML file
                             (``base: NAME`` in it extends a registered one); ``openrlhf`` (the default) runs
                             OpenRLHF exactly as it is
  --scheduler.config FILE    a scheduler YAML, overriding the preset
  --scheduler.profile NAME   the time-per-token profile the cost model plans with (default: the shipped one nearest
                             the model, from its config.json, on this node's GPU; one line says which)
  --scheduler.report FILE    the JSON-lines step report (default rlhfless_steps.jsonl)
  --scheduler.trace FILE     also write every sample (uid, step, sample index, prompt and response length,
                             prompt tokens) as a trace that `rlhfless simulate --trace FILE` replays
  --scheduler.carry_timeout S  how long the end of a step that carries or aborts samples (partial rollouts, tail
                             batching) waits for the engines to hand back what those samples have (default 120)
  --scheduler.split auto|keep  a stream with no split of its own: size --vllm.num_engines and the learner to the
                             split the launcher picks (auto, the default; from the trace an earlier run wrote at
                             --scheduler.trace, else from this launch's flags), or keep yours and only log it;
                             a number N: N rollout GPUs, the rest of the engines' and learner's GPUs learn
  --scheduler.node_gpus N    the GPUs a node has (default 8): the split never puts more learner GPUs on a node
  --scheduler.drafter NAME   speculative decoding on the engines with this drafter (none, ngram, history, or a
                             plugin's), instead of the preset's; lossless: vLLM verifies every drafted token
  --scheduler.force          run the scheduler's plan even where its own cost model prices it slower than what
                             OpenRLHF runs with the same flags (by default OpenRLHF's own step or async loop
                             runs then, one line saying so)

Under --train.async_enable, ``--scheduler rlhfless`` runs its async form, the stream (``rlhfless-stream``), at the
split the launcher picks; one line says which, another the split and its expected gain.

Never slower: before OpenRLHF starts, the launcher prices the scheduler's plan against what OpenRLHF runs with the
same flags (its own step; under --train.async_enable its async loop at the split it was given), on the simulator
the split is picked with, and where the plan is not faster it runs OpenRLHF's own (the ``openrlhf`` scheduler) and
says so in one line; ``--scheduler.force`` runs the plan anyway.

The scheduler, the config, the profile, the report and trace paths and the timeout are checked first (a bad one
fails in under a second, before OpenRLHF loads; with ``--scheduler openrlhf``, which runs OpenRLHF unchanged, the
other flags above have no effect and are refused), then the OpenRLHF internals the adapter uses, before Ray starts;
so are OpenRLHF's flags, once OpenRLHF has parsed them: a mode the adapter cannot run is refused with one line
naming the flag. A scheduler whose straggler policy keeps a cut sample's tokens across a weight update (``rlhfless-
fast``: partial rollouts) trains those tokens one update stale, so it needs OpenRLHF's importance-sampling
correction, which is off by default: unless ``--algo.advantage.is_correction_level`` is passed, the launcher sets it
to ``token`` (saying so in one line); passed as ``off``, the launch is refused. OpenRLHF's own launcher runs with
the hooks of one ``Launch`` (``rlhfless_openrlhf.launch``, which lists every name it replaces): right after OpenRLHF
parsed its flags, its ``hierarchize`` hook decides all of the above once, into one frozen ``LaunchPlan``
(``rlhfless_openrlhf.plan``, ``rlhfless_openrlhf.decide``), and the other hooks hand that plan to the engine
builder and the trainer actors.
"""

from __future__ import annotations

import logging
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlhfless_openrlhf.plan import CARRY_TIMEOUT_S, LaunchRequest, runnable_mode

OUR_FLAGS = (
    "--scheduler",
    "--scheduler.config",
    "--scheduler.profile",
    "--scheduler.report",
    "--scheduler.trace",
    "--scheduler.carry_timeout",
    "--scheduler.split",
    "--scheduler.node_gpus",
    "--scheduler.drafter",
    "--scheduler.force",
)
#: Our flags that take no value.
SWITCHES = ("--scheduler.force",)

#: ``--scheduler.split``: size OpenRLHF's engines and learner to the split the launcher picks, or keep the flags (or
#: a number: that many rollout GPUs, the rest learn).
SPLIT_CHOICES = ("auto", "keep")

log = logging.getLogger("rlhfless.openrlhf")


def split_args(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """Our flags (``--flag value`` or ``--flag=value``) and everything else, in order."""
    ours: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in SWITCHES and not eq:
            ours[name] = "true"
        elif name in OUR_FLAGS:
            if not eq:
                if i + 1 >= len(argv):
                    raise SystemExit(f"error: {name} needs a value")
                value = argv[i + 1]
                i += 1
            ours[name] = value
        else:
            rest.append(arg)
        i += 1
    return ours, rest


def resolve(ours: dict[str, str], model: str | None = None) -> LaunchRequest | None:
    """Validate the scheduler, config, profile, output files and timeout (every one given, whatever the scheduler);
    None means: run OpenRLHF unchanged (then a flag of ours that only RLHFless's schedulers read is refused).
    ``model``: OpenRLHF's ``--actor.model_name_or_path``, whose nearest shipped profile prices the launch unless
    ``--scheduler.profile`` names one (``profile_fit``). The scheduler is validated and the profile loaded here, once
    for the launch."""
    from rlhfless_sdk.api.config import read_scheduler_config
    from rlhfless_sdk.api.plugins import get_plugin_manager

    registry = get_plugin_manager().registry
    name = ours.get("--scheduler", "openrlhf")
    if "--scheduler.config" in ours:
        config = read_scheduler_config(ours["--scheduler.config"], registry)
    else:
        config = registry.resolve(name)  # a name (an unknown one lists the valid ones) or a YAML file
    profile, profile_line = launch_profile(ours, model if name != "openrlhf" else None)
    paths = output_paths(ours)
    carry_timeout = _seconds(ours.get("--scheduler.carry_timeout"), "--scheduler.carry_timeout")
    if "--scheduler.config" not in ours and name == "openrlhf":
        unused = [f for f in OUR_FLAGS if f in ours and f != "--scheduler"]
        if unused:
            raise SystemExit(
                f"error: {', '.join(unused)} {'has' if len(unused) == 1 else 'have'} no effect with --scheduler "
                "openrlhf (OpenRLHF runs unchanged: no plan, no step report, no trace, nothing carried); drop "
                f"{'it' if len(unused) == 1 else 'them'} or choose an RLHFless scheduler (--scheduler rlhfless)"
            )
        return None
    if "--scheduler.drafter" in ours:
        config = with_drafter(config, ours["--scheduler.drafter"], registry)
    mode = runnable_mode(config, registry)  # refused here, not after OpenRLHF has loaded
    async_mode = None if config.async_launch is None else runnable_mode(config.launched(registry, True), registry)
    split = ours.get("--scheduler.split", "auto")
    if split not in SPLIT_CHOICES and not (split.isdigit() and int(split) > 0):
        raise SystemExit(
            f"error: --scheduler.split {split!r}: choose one of {', '.join(SPLIT_CHOICES)}, or a number of rollout GPUs"
        )
    node_gpus = ours.get("--scheduler.node_gpus", "8")
    if not node_gpus.isdigit() or int(node_gpus) < 1:
        raise SystemExit(f"error: --scheduler.node_gpus {node_gpus!r}: a whole number of GPUs, at least 1")
    return LaunchRequest(
        scheduler=config,
        mode=mode,
        profile=profile,
        report=paths[0],
        trace=paths[1],
        carry_timeout_s=carry_timeout,
        split=split,
        node_gpus=int(node_gpus),
        force=_switch(ours, "--scheduler.force"),
        profile_line=profile_line,
        async_mode=async_mode,
    )


def launch_profile(ours: dict[str, str], model: str | None) -> tuple[Any, str | None]:
    """The profile a launch plans with, each profile file read once: ``--scheduler.profile``, else the shipped one
    nearest ``model`` (``profile_fit``: one line says why), else the default; and that line."""
    from rlhfless_openrlhf import profile_fit

    from rlhfless_sdk.api.profiles import load_profile, profile_names

    if "--scheduler.profile" in ours:
        return load_profile(ours["--scheduler.profile"]), None
    if model is None:
        return load_profile(profile_fit.DEFAULT), None
    shipped = {n: load_profile(n) for n in profile_names()}
    fitted = profile_fit.fit(model, profile_fit.gpu_name(), shipped)
    return shipped[fitted.profile], fitted.line


def output_paths(ours: dict[str, str]) -> tuple[str, str | None]:
    """The step report's and the trace's paths, absolute, each checked writable."""
    from rlhfless_sdk.api.options import unwritable

    for flag in ("--scheduler.report", "--scheduler.trace"):
        if flag in ours and (why := unwritable(Path(ours[flag]), folder=False)) is not None:
            raise SystemExit(f"error: {flag} {ours[flag]}: {why}")
    report = str(Path(ours.get("--scheduler.report", "rlhfless_steps.jsonl")).resolve())
    trace = str(Path(ours["--scheduler.trace"]).resolve()) if "--scheduler.trace" in ours else None
    return report, trace


def _switch(ours: dict[str, str], name: str) -> bool:
    value = ours.get(name, "false").lower()
    if value not in ("true", "false", "1", "0"):
        raise SystemExit(f"error: {name}={value!r}: pass {name} alone (or ={'true'}/{'false'})")
    return value in ("true", "1")


def model_flag(rest: Sequence[str]) -> str | None:
    """OpenRLHF's ``--actor.model_name_or_path`` in its command line, or None."""
    for i, arg in enumerate(rest):
        name, eq, value = arg.partition("=")
        if name == "--actor.model_name_or_path":
            return value if eq else (rest[i + 1] if i + 1 < len(rest) else None)
    return None


def with_drafter(config: Any, name: str, registry: Any) -> Any:
    """``config`` with the drafter ``--scheduler.drafter`` names (an unknown one lists the registered drafters)."""
    from rlhfless_sdk.api.config import PolicyRef

    problems = registry.check_refs({"drafter": PolicyRef(name=name)})
    if problems:
        raise SystemExit(f"error: --scheduler.drafter {name!r}: {problems[0].message}")
    return config.derive(drafter=name)


def _seconds(value: str | None, flag: str) -> float:
    if value is None:
        return CARRY_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise SystemExit(f"error: {flag} takes a number of seconds > 0, got {value!r}")
    return seconds


def print_help() -> None:
    """The launcher's flags, then OpenRLHF's own (which need its learning side installed)."""
    print(__doc__)
    sys.argv = ["openrlhf.cli.train_ppo_ray", "--help"]
    try:
        runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)
    except ImportError as exc:
        from rlhfless_openrlhf.requirements import openrlhf_install

        print(
            f"OpenRLHF's own flags cannot be listed here: importing its launcher failed ({exc}). Install OpenRLHF "
            f"{openrlhf_install()}"
        )


def main(argv: list[str] | None = None, *, cpu: bool = False) -> None:
    """The launcher: our flags checked, then OpenRLHF's own launcher run with the hooks of one ``Launch``. ``cpu``:
    the engines run on vLLM's CPU build (a machine without a GPU; the test harness passes it)."""
    from rlhfless_sdk.api.errors import RlhflessError

    argv = list(sys.argv[1:] if argv is None else argv)
    ours, rest = split_args(argv)
    if "-h" in rest or "--help" in rest:
        print_help()
        return
    try:
        request = resolve(ours, model_flag(rest))  # ours first: a bad one is refused before OpenRLHF loads
        if request is not None:
            from rlhfless_openrlhf.internals import check_internals

            check_internals(learning=True)
    except RlhflessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if request is not None:
        from rlhfless_openrlhf.generator import log_lines
        from rlhfless_openrlhf.launch import Launch

        log_lines()
        if request.profile_line:
            log.info("rlhfless: %s", request.profile_line)
        Launch(request, rest, cpu=cpu).install()
    sys.argv = ["openrlhf.cli.train_ppo_ray", *rest]
    runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
