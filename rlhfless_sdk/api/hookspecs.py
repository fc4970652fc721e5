"""Hook specifications: the whole extension API of rlhfless.

Every hook is a registration hook in the ``register(record)`` style: rlhfless calls it once per plugin while
it builds its registry, with a ``register`` callable; the plugin calls ``register`` once for each thing it
provides. Names must be unique across all plugins of one kind. Hooks are called with keyword arguments
only; a plugin may implement any subset of them.

One hook per policy kind, ``rlhfless_register_<kind>s(register)``, one per row of the kind table
(``rlhfless_sdk.api.kinds``, whose ``PolicyKind.hook`` names them; ``tests/test_hookspecs.py`` checks that the two
agree): ``register(PolicySpec(name=..., factory=..., params=...))``; and one each for scheduler presets and
subcommands.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

from rlhfless_sdk.api.base import PolicySpec
from rlhfless_sdk.api.config import SchedulerConfig

PROJECT = "rlhfless"
hookspec = pluggy.HookspecMarker(PROJECT)

RegisterPolicy = Callable[[PolicySpec], None]


@hookspec
def rlhfless_register_schedulers(register: Callable[[SchedulerConfig], None]) -> None:
    """Register scheduler presets: ``register(SchedulerConfig(...))``, one policy of each kind plus parameters."""


@hookspec
def rlhfless_register_modes(register: Callable[[Any], None]) -> None:
    """Register ways of running steps: ``register(DriverSpec(...))`` for a step driver (which schedulers it runs,
    its session), ``register(PipelineSpec(...))`` for a pipeline (``pipeline: mode`` accepts its name; the
    simulator's run of it). The built-in ones come from the default plugin ``rlhfless-modes``, through this hook.
    """


@hookspec
def rlhfless_register_commands(register: Callable[[Any], None]) -> None:
    """Register ``rlhfless`` subcommands: ``register(click_command)`` (a framework's adapter adds its own).

    A command's module should import lightly: ``rlhfless --help`` loads every plugin that registers commands.
    """


# -- one registration hook per policy kind, in the order of the kind table ------------------------------------
@hookspec
def rlhfless_register_predictors(register: RegisterPolicy) -> None:
    """Register length predictors (``LengthPredictor``): ``register(PolicySpec(name=..., factory=...))``.

    A predictor estimates each prompt's response length before a step (``predict(batch)``) and learns from the
    finished samples (``observe(samples)``). The baseline is ``prompt-length``.
    """


@hookspec
def rlhfless_register_prefill_planners(register: RegisterPolicy) -> None:
    """Register prefill planners (``PrefillPlanner``) that deduplicate shared prompt prefixes.

    ``plan(batch, capacity_tokens)`` groups the prompts that share a prefix; baseline ``none``.
    """


@hookspec
def rlhfless_register_assigners(register: RegisterPolicy) -> None:
    """Register prompt assigners (``PromptAssigner``) that map prompts to decode actors.

    ``assign(batch, predicted, num_actors)`` returns an actor per prompt (or per sample); an assigner may also
    have ``order`` and ``pull_buffer`` (see the kind table). The baseline is ``round-robin``.
    """


@hookspec
def rlhfless_register_migrators(register: RegisterPolicy) -> None:
    """Register cut-and-migrate policies (``Migrator``) consulted while a step runs.

    ``decide(progress)`` returns the unfinished samples to move and where; baseline ``none`` (never moves one).
    """


@hookspec
def rlhfless_register_scalers(register: RegisterPolicy) -> None:
    """Register actor scalers (``ActorScaler``) that choose the step's decode-actor count.

    The planner estimates each of ``candidates(min_actors, max_actors)`` and ``choose(estimates)`` picks one.
    The baseline is ``fixed``.
    """


@hookspec
def rlhfless_register_stragglers(register: RegisterPolicy) -> None:
    """Register straggler policies (``StragglerPolicy``): how a step treats its long tail.

    ``segment_tokens(step)`` is the token budget a sample started in that step may use (None: it runs to its
    end); tail batching adds ``over_provision``, partial rollouts cut at B groups add ``keeps_tokens`` too. The
    baseline is ``none``, and a scheduler config may leave the kind out.
    """


@hookspec
def rlhfless_register_placers(register: RegisterPolicy) -> None:
    """Register actor placers (``ActorPlacer``) that put actors onto nodes and GPUs.

    ``place(decode_loads, cluster, gpus_per_actor, extra)``: one placement per actor; baseline ``pack``.
    """


@hookspec
def rlhfless_register_drafters(register: RegisterPolicy) -> None:
    """Register drafters (``Drafter``) that propose tokens for the engines' speculative decoding.

    ``draft_tokens(running, remaining)`` is the step's budget, ``propose(prompt, response, k, siblings)`` the draft
    and ``observe(prompt, responses)`` feeds finished groups; baseline ``none``, and a config may leave it out.
    """


SCHEDULER_HOOK = "rlhfless_register_schedulers"
MODE_HOOK = "rlhfless_register_modes"
COMMAND_HOOK = "rlhfless_register_commands"
