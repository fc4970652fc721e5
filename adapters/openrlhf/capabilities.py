"""What the OpenRLHF adapter runs: the modes of its samples generator (``runs``), and the one-line refusal of a
scheduler that needs another (light: no Ray, vLLM or OpenRLHF import, so the launcher and the CLI check first)."""

from __future__ import annotations

from rlhfless_sdk.api.config import SchedulerConfig
from rlhfless_sdk.api.plugins import Registry, get_plugin_manager
from rlhfless_sdk.rollout.drivers import refusal
from rlhfless_sdk.rollout.modes import ASYNC, BATCH_CUT, STREAM, Mode, mode_for

#: The name a driver or pipeline spec gives its own run on OpenRLHF under (``backends``).
BACKEND_KEY = "openrlhf"


def runs(registry: Registry | None = None) -> frozenset[str]:
    """The modes the samples generator runs on OpenRLHF's engines (``rlhfless_openrlhf.run_modes``): every step
    driver of the registry that carries no tokens between steps (plain steps, or its session's rounds: a plugin's
    too), the batch cut (its ``CarriedWork``), the stream (inside OpenRLHF's async loop), and every driver or
    pipeline that brings its own run for OpenRLHF (``backends["openrlhf"]``: a plugin's)."""
    registry = registry or get_plugin_manager().registry
    alone = {name for name, spec in registry.drivers.items() if not spec.keeps_tokens}
    own = {
        name for name, spec in [*registry.drivers.items(), *registry.pipelines.items()] if BACKEND_KEY in spec.backends
    }
    return frozenset(alone | own | {BATCH_CUT, STREAM})


BACKEND = "the OpenRLHF adapter"
_ASYNC_HINT = (
    "on OpenRLHF pass --train.async_enable (and --train.partial_rollout_enable) with --scheduler openrlhf; "
    "`rlhfless simulate` models the async pipeline"
)


#: Why a stream cannot run outside OpenRLHF's async loop: its engines generate on while the learner trains, and
#: only that loop's partial-rollout broadcast pauses them for a weight update.
STREAM_NEEDS = (
    "streams (pipeline: stream): its engines generate on while the learner trains, so it runs only in OpenRLHF's "
    "async loop, whose partial-rollout broadcast pauses them for each weight update: launch it with "
    "`python -m rlhfless_openrlhf.train_ppo_ray` and --train.async_enable --train.partial_rollout_enable"
)


def adapter_refusal(
    config: SchedulerConfig, registry: Registry | None = None, *, async_loop: bool = True, mode: Mode | None = None
) -> str | None:
    """Why the adapter cannot run ``config`` (None: it can), naming the policy or pipeline that needs more.
    ``async_loop=False``: steps run one after the other (the demo, the fidelity check), where a stream cannot;
    ``mode``: the config's, where the caller has it (else worked out here)."""
    mode = mode or mode_for(config, registry)
    research = f"scheduler {config.name!r} is in the research set (simulated only; `rlhfless simulate` runs it): "
    lead = research if config.group == "research" else f"scheduler {config.name!r}: "
    if mode.elastic:
        return (
            f"{lead}its elastic split (pipeline: elastic) resizes the learner between batches, which OpenRLHF's "
            "DeepSpeed learner cannot do without a restart from checkpoint (on OpenRLHF: rlhfless-stream)"
        )
    if config.policy("predictor").name == "oracle":
        return f"{lead}its oracle predictor reads true lengths, which no real run knows (on OpenRLHF: rlhfless)"
    if mode.tail:
        learns = mode.tail == "learn"
        work = "scores and learns on" if learns else "scores"
        groups = "actor, reference and reward groups" if learns else "reference and reward groups"
        lead = research + "it" if config.group == "research" else f"scheduler {config.name!r}"
        return (
            f"{lead} {work} complete groups in the generation tail on the GPUs whose engines are done (pipeline: "
            f"tail_prepare{', tail_learn' if learns else ''}), but OpenRLHF scores and learns on its whole {groups} "
            "at once, sharded over every GPU; `rlhfless simulate` runs it (on OpenRLHF: rlhfless-onpolicy)"
        )
    if config.group == "research":
        return f"{research}no OpenRLHF learner runs its mechanism (`rlhfless plugins` lists the presets that run)"
    if mode.name == STREAM and not async_loop:
        return f"scheduler {config.name!r} {STREAM_NEEDS}; `rlhfless simulate` runs it too"
    why = refusal(config, mode, runs(registry), BACKEND, registry)
    if why is not None:
        why += f"; {_ASYNC_HINT}" if mode.name == ASYNC else "; `rlhfless simulate` runs every step driver"
    return why
