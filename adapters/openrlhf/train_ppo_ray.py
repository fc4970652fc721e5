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
to ``token`` (saying so in one line); passed as ``off``, the launch is refused. Then OpenRLHF's own launcher runs,
with three hooks: ``hierarchize`` adds the scheduler to ``args`` (which reaches every Ray actor inside
``strategy.args``), ``create_vllm_engines`` builds RLHFless's engine class (placed by the scheduler's placer where
OpenRLHF builds the engines' own placement group), and the trainer is RLHFless's subclass of ``PPOTrainer``
(``PPOTrainerAsync`` with ``--train.async_enable``), which swaps in the samples generator inside the actor that
generates. Before OpenRLHF loads its models, each model actor gets the fixes of ``learner_fixes`` (ZeRO-3 under
transformers 5).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlhfless_openrlhf.launch_split import flag as _flag

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

#: Seconds the end of a carrying step waits for the carried samples to come back (``--scheduler.carry_timeout``).
CARRY_TIMEOUT_S = 120.0

#: OpenRLHF's importance-sampling correction of the rollout logprobs (its default: ``off``).
IS_CORRECTION = "--algo.advantage.is_correction_level"
#: The shortest abbreviation of it that argparse expands (``--algo.advantage.is_correction_`` is ambiguous).
IS_CORRECTION_ABBREV = "--algo.advantage.is_correction_l"

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


def resolve(ours: dict[str, str], model: str | None = None) -> dict[str, Any] | None:
    """Validate the scheduler, config, profile, output files and timeout (every one given, whatever the scheduler);
    None means: run OpenRLHF unchanged (then a flag of ours that only RLHFless's schedulers read is refused).
    ``model``: OpenRLHF's ``--actor.model_name_or_path``, whose nearest shipped profile prices the launch unless
    ``--scheduler.profile`` names one (``profile_fit``)."""

    from rlhfless_sdk.api.config import read_scheduler_config
    from rlhfless_sdk.api.options import unwritable
    from rlhfless_sdk.api.plugins import get_plugin_manager
    from rlhfless_sdk.api.profiles import load_profile

    registry = get_plugin_manager().registry
    name = ours.get("--scheduler", "openrlhf")
    if "--scheduler.config" in ours:
        config = read_scheduler_config(ours["--scheduler.config"], registry)
    else:
        config = registry.resolve(name)  # a name (an unknown one lists the valid ones) or a YAML file
    from rlhfless_openrlhf import profile_fit

    fitted = None
    if "--scheduler.profile" not in ours and model is not None and name != "openrlhf":
        from rlhfless_sdk.api.profiles import profile_names

        fitted = profile_fit.fit(model, profile_fit.gpu_name(), {n: load_profile(n) for n in profile_names()})
    profile = load_profile(ours.get("--scheduler.profile", fitted.profile if fitted else profile_fit.DEFAULT))
    for flag in ("--scheduler.report", "--scheduler.trace"):
        if flag in ours and (why := unwritable(Path(ours[flag]), folder=False)) is not None:
            raise SystemExit(f"error: {flag} {ours[flag]}: {why}")
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
    if config.async_launch is not None:  # its async form is refused here, not after OpenRLHF has loaded
        scheduler_settings(config.launched(registry, True))
    split = ours.get("--scheduler.split", "auto")
    if split not in SPLIT_CHOICES and not (split.isdigit() and int(split) > 0):
        raise SystemExit(
            f"error: --scheduler.split {split!r}: choose one of {', '.join(SPLIT_CHOICES)}, or a number of rollout GPUs"
        )
    node_gpus = ours.get("--scheduler.node_gpus", "8")
    if not node_gpus.isdigit() or int(node_gpus) < 1:
        raise SystemExit(f"error: --scheduler.node_gpus {node_gpus!r}: a whole number of GPUs, at least 1")
    report = str(Path(ours.get("--scheduler.report", "rlhfless_steps.jsonl")).resolve())
    trace = str(Path(ours["--scheduler.trace"]).resolve()) if "--scheduler.trace" in ours else None
    return {
        **scheduler_settings(config),
        "profile": profile.model_dump(mode="json"),
        "report": report,
        "trace": trace,
        "carry_timeout_s": carry_timeout,
        "split": split,
        "node_gpus": int(node_gpus),
        "force": _switch(ours, "--scheduler.force"),
        "profile_line": fitted.line if fitted else None,
    }


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


def scheduler_settings(config: Any) -> dict[str, Any]:
    """The settings' scheduler part: the config, and how its steps run (``rlhfless_sdk.rollout.modes``), for the
    checks of OpenRLHF's flags."""
    from rlhfless_openrlhf.capabilities import adapter_refusal

    from rlhfless_sdk.api.plugins import get_plugin_manager
    from rlhfless_sdk.rollout.modes import mode_for

    registry = get_plugin_manager().registry
    refused = adapter_refusal(config, registry)
    if refused is not None:
        raise SystemExit(f"error: {refused}")
    mode = mode_for(config, registry)
    return {
        "scheduler": config.model_dump(mode="json"),
        "mode": {**dataclasses.asdict(mode), "carries": mode.carries},
        "keeps_tokens": mode.keeps_tokens,
    }


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


def passed(flag: str, argv: Sequence[str], shortest: str | None = None) -> bool:
    """Whether the command line ``argv`` sets ``flag`` the way argparse reads it: ``--flag VALUE``,
    ``--flag=VALUE``, or an abbreviation of it from ``shortest`` (its shortest unambiguous prefix) on."""
    shortest = shortest or flag
    for arg in argv:
        if arg == "--":  # argparse: positionals only from here
            return False
        name = arg.partition("=")[0]
        if name.startswith(shortest) and flag.startswith(name):
            return True
    return False


# -- OpenRLHF modes the adapter refuses: (flag, test on OpenRLHF's hierarchized args, why) ---------------------
REFUSED: tuple[tuple[str, Any, str], ...] = (
    (
        "--train.agent_func_path",
        lambda a: bool(_flag(a, "train", "agent_func_path")),
        "multi-turn agents interleave environment turns with generation, and a migrated sample's text is rebuilt "
        "from tokens only",
    ),
    (
        "--data.max_images_per_prompt",
        lambda a: int(_flag(a, "data", "max_images_per_prompt") or 0) > 0,
        "vision-language prompts: a migrated sample's continuation would be re-prefilled without its images",
    ),
)


#: OpenRLHF modes in which a straggler policy cannot carry samples (partial rollouts) or defer prompts (tail
#: batching) from one step to the next.
CANNOT_CARRY: tuple[tuple[str, Any, str], ...] = (
    (
        "--algo.dynamic_filtering_enable",
        lambda a: bool(_flag(a, "algo", "dynamic_filtering_enable")),
        "a group dropped after completion breaks the B groups a step that partial rollouts and tail batching train",
    ),
)


def check_modes(args: Any, settings: dict[str, Any] | None = None, argv: Sequence[str] = ()) -> None:
    """Refuse, with one line naming the flag, an OpenRLHF mode the RLHFless generator cannot run faithfully;
    turn on the importance-sampling correction a scheduler that trains stale tokens needs (``argv``: OpenRLHF's
    command line, to tell a level the user chose from OpenRLHF's default)."""
    for flag, used, why in REFUSED:
        if used(args):
            raise SystemExit(
                f"error: {flag} is not supported with --scheduler rlhfless ({why}); run it with --scheduler openrlhf"
            )
    mode = (settings or {}).get("mode") or {}
    straggler_ref = ((settings or {}).get("scheduler") or {}).get("straggler", {})
    straggler = straggler_ref.get("name", "none")
    if mode.get("carries"):
        for flag, used, why in CANNOT_CARRY:
            if not used(args):
                continue
            if settings and (straggler_ref.get("params") or {}).get("margin") is not None:
                plain_steps(settings, flag, why)  # tail batching where it pays: here it cannot, so never
                mode = settings["mode"]
                break
            raise SystemExit(
                f"error: {flag} cannot carry samples or defer prompts across steps, which the straggler policy "
                f"{straggler!r} does ({why}); use --scheduler rlhfless-slo instead"
            )
    if settings and settings.get("profile"):
        match_profile(args, settings)
    streams = mode.get("pipeline") == "stream"
    if settings and (mode.get("carries") or streams):
        check_oversampling(args, settings["scheduler"]["name"], straggler, streams)
    if streams:
        check_stream(args, settings)
    elif settings and settings.get("profile") and mode.get("pipeline") in (None, "sync"):
        check_sync_price(args, settings)
    if (settings or {}).get("keeps_tokens"):
        correct_stale_tokens(args, settings, argv)
    if (settings or {}).get("keeps_tokens") and _flag(args, "train", "async_enable") and not streams:
        queue = int(_flag(args, "train", "async_queue_size") or 1)
        log.info(
            "rlhfless: --train.async_enable with scheduler %r: the generator runs up to %d batch(es) ahead of "
            "training and carries cut samples into its next batch, so a trained token is at most %d weight "
            "updates old (importance correction %s)",
            settings["scheduler"]["name"],
            queue,
            queue + 1,
            args.algo.advantage.is_correction_level,
        )


def plain_steps(settings: dict[str, Any], flag: str, why: str) -> None:
    """Turn off a straggler policy that tail-batches only where it pays (``margin``), in ``settings``, for a launch
    whose ``flag`` forbids deferring prompts: every step is then OpenRLHF's own (one line says so)."""
    from rlhfless_sdk.api.config import SchedulerConfig

    config = SchedulerConfig.model_validate(settings["scheduler"])
    settings.update(scheduler_settings(config.derive(straggler="none")))
    log.info(
        "rlhfless: %s: scheduler %r runs OpenRLHF's own step every round, without tail batching (%s)",
        flag,
        config.name,
        why,
    )


def check_oversampling(args: Any, name: str, straggler: str, streams: bool) -> None:
    """Refuse ``--rollout.vllm_generate_batch_size`` above ``--rollout.batch_size`` (OpenRLHF's oversampling, async
    only) for a scheduler that carries work between steps or streams: OpenRLHF keeps the groups one generation makes
    beyond a batch in a buffer and trains them a weight update later (so a carried token would be one update older
    than the launcher says) and its checkpoints do not keep that buffer (a resumed run would lose those groups). A
    stream forms batches of B groups itself: the flag would do nothing."""
    batch = int(_flag(args, "rollout", "batch_size") or 0)
    generate = int(_flag(args, "rollout", "vllm_generate_batch_size") or 0)
    if generate <= batch:
        return
    why = (
        "a stream forms batches of B = --rollout.batch_size groups itself, so the flag would do nothing"
        if streams
        else "OpenRLHF trains the groups beyond a batch from a buffer a weight update later than the scheduler's "
        f"age bound says, and its checkpoints do not keep that buffer, so a resumed run would lose them (the "
        f"straggler policy {straggler!r} carries work between steps)"
    )
    raise SystemExit(
        f"error: --rollout.vllm_generate_batch_size {generate} > --rollout.batch_size {batch} cannot run with "
        f"scheduler {name!r} ({why}); drop --rollout.vllm_generate_batch_size (each step generates B groups)"
    )


def match_profile(args: Any, settings: dict[str, Any]) -> None:
    """Model OpenRLHF's engines at their own size: under ``--vllm.tensor_parallel_size`` k each engine holds k GPUs,
    so a one-GPU profile with a ``tensor_parallel`` block is sharded k ways for the planner (one line says so); a
    profile of another size that cannot be is refused, naming both sizes (the plan would model other engines)."""
    from rlhfless_sdk.api.records import TimePerTokenProfile

    k = max(int(_flag(args, "vllm", "tensor_parallel_size") or 1), 1)
    prof = TimePerTokenProfile.model_validate(settings["profile"])
    if prof.gpus_per_actor == k:
        return
    sharded, why = None, f"it models engines of {prof.gpus_per_actor} GPUs"
    if prof.gpus_per_actor == 1:
        try:
            sharded = prof.sharded(k)
        except ValueError as exc:
            why = str(exc)
    if sharded is None:
        raise SystemExit(
            f"error: --vllm.tensor_parallel_size {k} runs engines of {k} GPUs, but profile {prof.name!r} cannot model "
            f"them ({why}); pass --scheduler.profile with a profile of {k}-GPU engines (`rlhfless profile` measures "
            "one) or a one-GPU profile with a tensor_parallel block"
        )
    settings["profile"] = sharded.model_dump(mode="json")
    log.info(
        "rlhfless: --vllm.tensor_parallel_size %d: the planner models each engine as profile %r sharded over %d GPUs "
        "(%s)",
        k,
        prof.name,
        k,
        sharded.name,
    )


def check_stream(args: Any, settings: dict[str, Any]) -> None:
    """The streaming pipeline runs in OpenRLHF's async loop (``--train.async_enable``), its engines generating on
    while the learner trains; each weight broadcast must pause them between decode iterations and resume them,
    which is OpenRLHF's partial-rollout broadcast (``--train.partial_rollout_enable``, turned on here with a line
    saying so). Refused in one line: no async loop, sleeping engines (their running samples' KV would be freed) and
    dynamic filtering (a dropped group breaks the B groups a batch trains)."""
    name = settings["scheduler"]["name"]
    pipeline = settings["scheduler"]["pipeline"]
    if not _flag(args, "train", "async_enable"):
        raise SystemExit(
            f"error: scheduler {name!r} streams (pipeline: stream): its engines generate on while the learner "
            "trains, which needs OpenRLHF's async loop: pass --train.async_enable (or use --scheduler rlhfless-fast)"
        )
    for flag, group, key, why in (
        ("--vllm.enable_sleep", "vllm", "enable_sleep", "a sleeping engine would free its running samples' KV cache"),
        (
            "--algo.dynamic_filtering_enable",
            "algo",
            "dynamic_filtering_enable",
            "a group dropped after completion breaks the B groups a batch trains",
        ),
    ):
        if _flag(args, group, key):
            raise SystemExit(f"error: {flag} cannot run with scheduler {name!r}, which streams ({why})")
    from rlhfless_openrlhf.launch_split import plan_split

    choice = plan_split(args, settings, keep=settings.get("split") == "keep", force=bool(settings.get("force")))
    if choice is not None and choice.fallback:
        run_openrlhf_instead(
            settings,
            "async loop",
            f"{choice.time_s:,.0f} s against {choice.replaced_s:,.0f} s for {choice.steps} steps",
        )
        return
    if not _flag(args, "train", "partial_rollout_enable"):
        args.train.partial_rollout_enable = True
        log.info(
            "rlhfless: scheduler %r streams: --train.partial_rollout_enable on (each weight broadcast pauses the "
            "engines between decode iterations and running samples go on under the new weights)",
            name,
        )
    from rlhfless_openrlhf import fill

    settings["fill"] = fill.plan(args, settings)
    queue = int(_flag(args, "train", "async_queue_size") or 1)
    max_age = int(pipeline.get("max_age", 1))
    log.info(
        "rlhfless: scheduler %r streams in OpenRLHF's async loop (queue %d): batches of B complete groups, no "
        "token more than %d weight updates old; the generator forms up to %d batch(es) ahead of training%s",
        name,
        queue,
        max_age,
        min(queue, max_age),
        f" (the age bound holds it there: a queue above {max_age} adds nothing)" if queue > max_age else "",
    )


def run_openrlhf_instead(settings: dict[str, Any], what: str, priced: str) -> None:
    """Never slower: ``settings`` (a launch's) become OpenRLHF's own (the ``openrlhf`` scheduler: its step, or its
    async loop), one line saying why and how to run the plan anyway."""
    from rlhfless_sdk.api.plugins import get_plugin_manager

    name = settings["scheduler"]["name"]
    settings.update(scheduler_settings(get_plugin_manager().registry.scheduler("openrlhf")))
    settings["fell_back"] = {"scheduler": name, "runs": f"OpenRLHF's {what}", "priced": priced}
    log.info(
        "rlhfless: scheduler %r is priced slower than OpenRLHF's %s with these flags (%s); OpenRLHF's %s runs "
        "instead (--scheduler.force runs %r anyway)",
        name,
        what,
        priced,
        what,
        name,
    )


def check_sync_price(args: Any, settings: dict[str, Any]) -> None:
    """Never slower, for a synchronous launch: the scheduler's plan against OpenRLHF's own step on the same flags
    (``launch_split.price_sync``); where it is not faster by ``MIN_GAIN``, OpenRLHF's step runs
    (``--scheduler.force``: the plan)."""
    from rlhfless_openrlhf.launch_split import price_sync

    if settings.get("force") or _flag(args, "train", "async_enable") or settings["scheduler"]["name"] == "openrlhf":
        return
    price = price_sync(args, settings)
    if price is None:
        return
    log.info(
        "rlhfless: scheduler %r priced on %s: %.0f s against OpenRLHF's step's %.0f s (%.2fx)",
        settings["scheduler"]["name"],
        price.source,
        price.ours,
        price.theirs,
        price.theirs / price.ours if price.ours > 0 else float("inf"),
    )
    if not price.runs_plan:
        run_openrlhf_instead(settings, "step", f"{price.ours:,.0f} s against {price.theirs:,.0f} s")


def correct_stale_tokens(args: Any, settings: dict[str, Any], argv: Sequence[str]) -> None:
    """Partial rollouts train a carried sample's tokens one weight update after they were generated: each needs
    its importance weight (the rollout logprob against the trained policy's). OpenRLHF asks vLLM for rollout
    logprobs and applies the weight only with ``--algo.advantage.is_correction_level`` other than ``off``, its
    default. So it is turned on (``token``) unless the user chose a level; an explicit ``off`` is refused."""
    advantage = args.algo.advantage
    level = getattr(advantage, "is_correction_level", "off")
    name = settings["scheduler"]["name"]
    pipeline = settings["scheduler"].get("pipeline", {})
    if settings["mode"]["pipeline"] == "stream":
        stale = f"its streaming pipeline trains tokens up to {int(pipeline.get('max_age', 1))} weight updates stale"
    else:
        straggler = settings["scheduler"]["straggler"]["name"]
        stale = f"its straggler policy {straggler!r} trains carried tokens one weight update stale"
    if passed(IS_CORRECTION, argv, IS_CORRECTION_ABBREV):
        if level == "off":
            raise SystemExit(
                f"error: {IS_CORRECTION} off cannot run with scheduler {name!r}: {stale}, which needs the "
                f"importance-sampling correction; pass {IS_CORRECTION} token (or seq), or use --scheduler "
                "rlhfless-onpolicy (no stale token)"
            )
        return
    if level == "off":
        advantage.is_correction_level = "token"
        log.info(
            "rlhfless: scheduler %r: %s: importance-sampling correction on, %s token (pass the flag to choose "
            "another level)",
            name,
            stale,
            IS_CORRECTION,
        )


def install(settings: dict[str, Any], argv: Sequence[str] | None = None) -> None:
    """Hook RLHFless into OpenRLHF's launcher for this process (and, through args, its Ray actors); ``argv``: the
    command line OpenRLHF's parser reads (default: ``sys.argv[1:]`` when it runs)."""
    import openrlhf.trainer.ppo_trainer as ppo_trainer_module  # needs OpenRLHF's GPU dependencies
    import openrlhf.trainer.ppo_trainer_async as ppo_trainer_async_module
    from rlhfless_openrlhf import learner_fixes
    from rlhfless_openrlhf.trainer import RlhflessPPOTrainer, RlhflessPPOTrainerAsync

    install_rollout_hooks(settings, argv)
    learner_fixes.install()
    ppo_trainer_module.PPOTrainer = RlhflessPPOTrainer
    ppo_trainer_async_module.PPOTrainerAsync = RlhflessPPOTrainerAsync


def install_rollout_hooks(settings: dict[str, Any], argv: Sequence[str] | None = None) -> None:
    """The hooks that need only OpenRLHF's rollout side: the args and the engine builder. ``argv``: the command
    line OpenRLHF's parser reads (default: ``sys.argv[1:]`` when the hook runs, which is what the parser read)."""
    import openrlhf.trainer.ray as ray_pkg
    import openrlhf.utils.config as config_module
    import rlhfless_openrlhf.engine_factory as engines_module
    from rlhfless_openrlhf.engine_factory import create_vllm_engines_with_rlhfless
    from rlhfless_openrlhf.launch_split import launched_settings

    original = getattr(config_module.hierarchize, "__wrapped__", config_module.hierarchize)

    def hierarchize(args: Any) -> Any:
        out = original(args)
        launched = launched_settings(out, settings, scheduler_settings)
        if launched is settings:  # never changed in place: the launch's own settings stay what the user asked
            launched = dict(settings)
        check_modes(out, launched, sys.argv[1:] if argv is None else argv)  # may run OpenRLHF's own instead
        os.environ["RLHFLESS_PLACER"] = launched["scheduler"]["placer"]["name"]
        out.rlhfless = launched
        engines_module.launch_args = out  # the engine builder reads the learner's size from it
        return out

    hierarchize.__wrapped__ = original  # type: ignore[attr-defined]
    record_placement_groups()
    os.environ["RLHFLESS_PLACER"] = settings["scheduler"]["placer"]["name"]  # read by the engine builder
    config_module.hierarchize = hierarchize
    ray_pkg.create_vllm_engines = create_vllm_engines_with_rlhfless


def record_placement_groups() -> None:
    """Record each placement group OpenRLHF's launcher builds (``engine_factory.launch_groups``): the one of the
    learner's actor and reference models is where the stream's fill engines go. Its launcher imports Ray's
    ``placement_group`` when it runs, after this."""
    import importlib

    import rlhfless_openrlhf.engine_factory as engines_module

    pg_module = importlib.import_module("ray.util.placement_group")  # the module (``ray.util`` names the function)

    original = getattr(pg_module.placement_group, "__wrapped__", pg_module.placement_group)

    def placement_group(*args: Any, **kwargs: Any) -> Any:
        group = original(*args, **kwargs)
        engines_module.launch_groups.append(group)
        return group

    placement_group.__wrapped__ = original  # type: ignore[attr-defined]
    pg_module.placement_group = placement_group


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


def main(argv: list[str] | None = None) -> None:
    from rlhfless_sdk.api.errors import RlhflessError

    argv = list(sys.argv[1:] if argv is None else argv)
    ours, rest = split_args(argv)
    if "-h" in rest or "--help" in rest:
        print_help()
        return
    try:
        settings = resolve(ours, model_flag(rest))  # ours first: a bad one is refused before OpenRLHF loads
        if settings is not None:
            from rlhfless_openrlhf.internals import check_internals

            check_internals(learning=True)
    except RlhflessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if settings is not None:
        from rlhfless_openrlhf.generator import log_lines

        log_lines()
        if settings.get("profile_line"):
            log.info("rlhfless: %s", settings["profile_line"])
        install(settings, rest)
    sys.argv = ["openrlhf.cli.train_ppo_ray", *rest]
    runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
