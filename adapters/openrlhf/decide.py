"""The launch plan decided against OpenRLHF's parsed flags (``decide``), once, before Ray builds anything.

Each rule reads OpenRLHF's hierarchized flags and returns the plan it makes (``rlhfless_openrlhf.plan``), or
refuses the launch in one line naming the flag:

- an async launch of a scheduler with an ``async_launch`` form runs that form (``launched_form``);
- a mode the RLHFless generator cannot run faithfully is refused (``REFUSED``); a carrying straggler policy where
  OpenRLHF drops groups (``CANNOT_CARRY``) is refused, or runs plain steps where it tail-batches only where it pays;
- the profile is modelled at the engines' tensor-parallel size (``match_profile``);
- OpenRLHF's oversampling is refused for a scheduler that carries or streams (``check_oversampling``);
- a stream gets its split, its partial-rollout broadcast and its fill engines (``check_stream``); a synchronous
  launch is priced against OpenRLHF's own step (``check_sync_price``); either runs OpenRLHF's own where the plan is
  priced slower (never slower; ``--scheduler.force`` runs the plan);
- stale tokens get OpenRLHF's importance-sampling correction (``correct_stale_tokens``).

The rules work on a copy of OpenRLHF's args (a later rule reads what an earlier one set); the plan's ``flags`` are
set on the real ones by ``plan.apply``.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from rlhfless_openrlhf.launch_split import flag as _flag
from rlhfless_openrlhf.launch_split import learner_gpus
from rlhfless_openrlhf.plan import FellBack, LaunchPlan, LaunchRequest, runnable_mode

from rlhfless_sdk.api.plugins import Registry, get_plugin_manager

#: OpenRLHF's importance-sampling correction of the rollout logprobs (its default: ``off``).
IS_CORRECTION = "--algo.advantage.is_correction_level"
#: The shortest abbreviation of it that argparse expands (``--algo.advantage.is_correction_`` is ambiguous).
IS_CORRECTION_ABBREV = "--algo.advantage.is_correction_l"

log = logging.getLogger("rlhfless.openrlhf")


def decide(
    args: Any, request: LaunchRequest, argv: Sequence[str] = (), registry: Registry | None = None, *, cpu: bool = False
) -> LaunchPlan:
    """The plan of ``request`` on OpenRLHF's parsed ``args`` (``argv``: OpenRLHF's command line, to tell a flag the
    user passed from OpenRLHF's default; ``cpu``: vLLM's CPU build serves the engines). ``args`` itself is not
    changed: ``plan.apply`` sets the plan's flags."""
    registry = registry or get_plugin_manager().registry
    scratch = copy.deepcopy(args)
    plan = launched_form(scratch, LaunchPlan.of(request), registry)
    refuse_modes(scratch)
    plan = carry_rules(scratch, plan, registry)
    plan = match_profile(scratch, plan)
    plan = price_drafter(scratch, plan, registry, cpu)
    if plan.carries or plan.streams:
        check_oversampling(scratch, plan)
    if plan.streams:
        plan = check_stream(scratch, plan, registry)
    elif plan.mode.pipeline == "sync":
        plan = check_sync_price(scratch, plan, registry)
    if plan.keeps_tokens:
        plan = correct_stale_tokens(scratch, plan, argv)
        log_async_lag(scratch, plan)
    return dataclasses.replace(plan, learner_gpus=learner_gpus(scratch) if hasattr(scratch, "actor") else 0)


def launched_form(args: Any, plan: LaunchPlan, registry: Registry) -> LaunchPlan:
    """Under ``--train.async_enable`` a scheduler with an ``async_launch`` form runs that form (one line says so)."""
    config = plan.scheduler
    form = config.launched(registry, bool(_flag(args, "train", "async_enable", False)))
    if form is config:
        return plan
    log.info(
        "rlhfless: scheduler %r in an async launch (--train.async_enable) runs %r: %s",
        config.name,
        form.name,
        form.description,
    )
    mode = plan.request.async_mode or runnable_mode(form, registry)  # worked out with the request's
    return dataclasses.replace(plan, scheduler=form, mode=mode, launched_as=config.name)


#: Why a drafter is not built on vLLM's CPU engines (measured by ``examples/drafter_sampling_check.py``).
CPU_SAMPLING = (
    "vLLM 0.29's CPU build does not sample what the target model would once it verifies drafts at temperature > 0 "
    "(its own ngram method too: docs/drafters.md)"
)


def price_drafter(args: Any, plan: LaunchPlan, registry: Registry, cpu: bool = False) -> LaunchPlan:
    """The scheduler's drafter drafts where the simulator prices a gain at its shipped acceptance
    (``launch_split.price_drafter``, the simulator's own decision on the planning workload): at each running count
    of an engine, the draft count whose token costs least, none where a plain engine's token is cheaper; and only
    if engines with it beat plain ones over the workload's first two steps (a stream: its steady token). Priced to
    lose: the engines run without it. One line says which and why; ``--scheduler.force`` keeps the drafter's own
    budget. On vLLM's CPU engines (``cpu``) no drafter is built unless forced (``CPU_SAMPLING``)."""
    from rlhfless_openrlhf.launch_split import price_drafter as simulated_price

    from rlhfless_sdk.api.errors import UnknownPolicyError
    from rlhfless_sdk.api.profiles import load_acceptance

    ref = plan.scheduler.drafter
    if ref.name == "none":
        return plan
    if cpu and not plan.request.force:
        log.warning("rlhfless: drafter %r is not built on these CPU engines: %s; they run without it "
                    "(--scheduler.force builds it, for the mechanics only)", ref.name, CPU_SAMPLING)  # fmt: skip
        return plan.running(plan.scheduler.derive(drafter="none"), registry)
    if cpu:
        log.warning("rlhfless: drafter %r is built on these CPU engines (--scheduler.force): %s", ref.name,
                    CPU_SAMPLING)  # fmt: skip
    if plan.request.force:
        log.info("rlhfless: drafter %r drafts its own budget, unpriced (--scheduler.force)", ref.name)
        return plan
    try:
        acceptance = load_acceptance(ref.name)
    except UnknownPolicyError:
        log.info("rlhfless: drafter %r drafts its own budget, unpriced: no acceptance ships for it", ref.name)
        return plan
    price, source = simulated_price(args, plan, acceptance)
    if price.spec is None:  # it drafts nothing on the profile's device
        return plan
    why = f"profile {plan.profile.name!r}, {acceptance.source.split(';')[0]}"
    if price.lost is not None:
        lost = price.said()
        if price.over_steps:
            why += f"; the workload: {source}"
        log.info("rlhfless: drafter %r %s (%s): the engines run without it", ref.name, lost, why)
        return plan.running(plan.scheduler.derive(drafter="none"), registry)
    priced = price.spec.budget
    drafting = [r for r, k in enumerate(priced, start=1) if k > 0]
    log.info("rlhfless: drafter %r drafts at %d-%d running sequences an engine, where it is priced to gain (%s)",
             ref.name, drafting[0], drafting[-1], why)  # fmt: skip
    return dataclasses.replace(plan, draft_budget=tuple(priced))


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


def refuse_modes(args: Any) -> None:
    """Refuse, with one line naming the flag, an OpenRLHF mode the RLHFless generator cannot run faithfully."""
    for flag, used, why in REFUSED:
        if used(args):
            raise SystemExit(
                f"error: {flag} is not supported with --scheduler rlhfless ({why}); run it with --scheduler openrlhf"
            )


def carry_rules(args: Any, plan: LaunchPlan, registry: Registry) -> LaunchPlan:
    """A straggler policy that carries work between steps, where an OpenRLHF flag forbids it (``CANNOT_CARRY``): one
    that tail-batches only where it pays (``margin``) runs OpenRLHF's step every round (one line says so); any other
    is refused, naming the flag."""
    if not plan.carries:
        return plan
    straggler = plan.scheduler.policy("straggler")
    for flag, used, why in CANNOT_CARRY:
        if not used(args):
            continue
        if straggler.params.get("margin") is None:
            raise SystemExit(
                f"error: {flag} cannot carry samples or defer prompts across steps, which the straggler policy "
                f"{straggler.name!r} does ({why}); use --scheduler rlhfless-slo instead"
            )
        log.info(
            "rlhfless: %s: scheduler %r runs OpenRLHF's own step every round, without tail batching (%s)",
            flag,
            plan.name,
            why,
        )
        return plan.running(plan.scheduler.derive(straggler="none"), registry)
    return plan


def check_oversampling(args: Any, plan: LaunchPlan) -> None:
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
        if plan.streams
        else "OpenRLHF trains the groups beyond a batch from a buffer a weight update later than the scheduler's "
        f"age bound says, and its checkpoints do not keep that buffer, so a resumed run would lose them (the "
        f"straggler policy {plan.scheduler.policy('straggler').name!r} carries work between steps)"
    )
    raise SystemExit(
        f"error: --rollout.vllm_generate_batch_size {generate} > --rollout.batch_size {batch} cannot run with "
        f"scheduler {plan.name!r} ({why}); drop --rollout.vllm_generate_batch_size (each step generates B groups)"
    )


def match_profile(args: Any, plan: LaunchPlan) -> LaunchPlan:
    """Model OpenRLHF's engines at their own size: under ``--vllm.tensor_parallel_size`` k each engine holds k GPUs,
    so a one-GPU profile with a ``tensor_parallel`` block is sharded k ways for the planner (one line says so); a
    profile of another size that cannot be is refused, naming both sizes (the plan would model other engines)."""
    k = max(int(_flag(args, "vllm", "tensor_parallel_size") or 1), 1)
    prof = plan.profile
    if prof.gpus_per_actor == k:
        return plan
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
    log.info(
        "rlhfless: --vllm.tensor_parallel_size %d: the planner models each engine as profile %r sharded over %d "
        "GPUs (%s)",
        k,
        prof.name,
        k,
        sharded.name,
    )
    return dataclasses.replace(plan, profile=sharded)


def check_stream(args: Any, plan: LaunchPlan, registry: Registry) -> LaunchPlan:
    """The streaming pipeline runs in OpenRLHF's async loop (``--train.async_enable``), its engines generating on
    while the learner trains; each weight broadcast must pause them between decode iterations and resume them,
    which is OpenRLHF's partial-rollout broadcast (``--train.partial_rollout_enable``, turned on here with a line
    saying so). Refused in one line: no async loop, sleeping engines (their running samples' KV would be freed) and
    dynamic filtering (a dropped group breaks the B groups a batch trains)."""
    from rlhfless_openrlhf import fill
    from rlhfless_openrlhf.launch_split import plan_split

    name = plan.name
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
    choice, plan = plan_split(args, plan)
    if choice is not None and choice.fallback:
        priced = f"{choice.time_s:,.0f} s against {choice.replaced_s:,.0f} s for {choice.steps} steps"
        return run_openrlhf_instead(plan, registry, "async loop", priced)
    if not _flag(args, "train", "partial_rollout_enable"):
        plan = plan.setting(args, "train.partial_rollout_enable", True)
        log.info(
            "rlhfless: scheduler %r streams: --train.partial_rollout_enable on (each weight broadcast pauses the "
            "engines between decode iterations and running samples go on under the new weights)",
            name,
        )
    plan = dataclasses.replace(plan, fill=fill.plan(args, plan))
    queue, max_age = int(_flag(args, "train", "async_queue_size") or 1), int(plan.scheduler.pipeline.max_age)
    log.info(
        "rlhfless: scheduler %r streams in OpenRLHF's async loop (queue %d): batches of B complete groups, no "
        "token more than %d weight updates old; the generator forms up to %d batch(es) ahead of training%s",
        name,
        queue,
        max_age,
        min(queue, max_age),
        f" (the age bound holds it there: a queue above {max_age} adds nothing)" if queue > max_age else "",
    )
    return plan


def run_openrlhf_instead(plan: LaunchPlan, registry: Registry, what: str, priced: str) -> LaunchPlan:
    """Never slower: the plan runs OpenRLHF's own (the ``openrlhf`` scheduler: its step, or its async loop), one
    line saying why and how to run the plan anyway."""
    name = plan.name
    log.info(
        "rlhfless: scheduler %r is priced slower than OpenRLHF's %s with these flags (%s); OpenRLHF's %s runs "
        "instead (--scheduler.force runs %r anyway)",
        name,
        what,
        priced,
        what,
        name,
    )
    fell_back = FellBack(scheduler=name, runs=f"OpenRLHF's {what}", priced=priced)
    return plan.running(registry.scheduler("openrlhf"), registry, fell_back=fell_back)


def check_sync_price(args: Any, plan: LaunchPlan, registry: Registry) -> LaunchPlan:
    """Never slower, for a synchronous launch: the scheduler's plan against OpenRLHF's own step on the same flags
    (``launch_split.price_sync``); where it is not faster by ``MIN_GAIN``, OpenRLHF's step runs
    (``--scheduler.force``: the plan)."""
    from rlhfless_openrlhf.launch_split import price_sync

    if plan.request.force or _flag(args, "train", "async_enable") or plan.name == "openrlhf":
        return plan
    price = price_sync(args, plan)
    if price is None:
        return plan
    log.info(
        "rlhfless: scheduler %r priced on %s: %.0f s against OpenRLHF's step's %.0f s (%.2fx)",
        plan.name,
        price.source,
        price.ours,
        price.theirs,
        price.theirs / price.ours if price.ours > 0 else float("inf"),
    )
    if price.runs_plan:
        return plan
    return run_openrlhf_instead(plan, registry, "step", f"{price.ours:,.0f} s against {price.theirs:,.0f} s")


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


def correct_stale_tokens(args: Any, plan: LaunchPlan, argv: Sequence[str]) -> LaunchPlan:
    """Partial rollouts train a carried sample's tokens one weight update after they were generated: each needs
    its importance weight (the rollout logprob against the trained policy's). OpenRLHF asks vLLM for rollout
    logprobs and applies the weight only with ``--algo.advantage.is_correction_level`` other than ``off``, its
    default. So it is turned on (``token``) unless the user chose a level; an explicit ``off`` is refused."""
    level = getattr(args.algo.advantage, "is_correction_level", "off")
    name = plan.name
    if plan.streams:
        age = int(plan.scheduler.pipeline.max_age)
        stale = f"its streaming pipeline trains tokens up to {age} weight updates stale"
    else:
        straggler = plan.scheduler.policy("straggler").name
        stale = f"its straggler policy {straggler!r} trains carried tokens one weight update stale"
    if passed(IS_CORRECTION, argv, IS_CORRECTION_ABBREV):
        if level == "off":
            raise SystemExit(
                f"error: {IS_CORRECTION} off cannot run with scheduler {name!r}: {stale}, which needs the "
                f"importance-sampling correction; pass {IS_CORRECTION} token (or seq), or use --scheduler "
                "rlhfless-onpolicy (no stale token)"
            )
        return plan
    if level != "off":
        return plan
    log.info(
        "rlhfless: scheduler %r: %s: importance-sampling correction on, %s token (pass the flag to choose "
        "another level)",
        name,
        stale,
        IS_CORRECTION,
    )
    return plan.setting(args, "algo.advantage.is_correction_level", "token")


def log_async_lag(args: Any, plan: LaunchPlan) -> None:
    """The line an async launch of a carrying scheduler (not a stream) prints: how old a trained token may be."""
    if plan.streams or not _flag(args, "train", "async_enable"):
        return
    queue = int(_flag(args, "train", "async_queue_size") or 1)
    log.info(
        "rlhfless: --train.async_enable with scheduler %r: the generator runs up to %d batch(es) ahead of "
        "training and carries cut samples into its next batch, so a trained token is at most %d weight "
        "updates old (importance correction %s)",
        plan.name,
        queue,
        queue + 1,
        args.algo.advantage.is_correction_level,
    )
