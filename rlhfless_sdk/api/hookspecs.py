"""Hook specifications: the whole extension API of rlhfless.

Every hook is a registration hook in the ``register(record)`` style: rlhfless calls it once per plugin while
it builds its registry, with a ``register`` callable; the plugin calls ``register`` once for each thing it
provides. Names must be unique across all plugins of one kind. Hooks are called with keyword arguments
only; a plugin may implement any subset of them.

One hook per policy kind, ``rlhfless_register_<kind>s(register)``, made from the kind table
(``rlhfless_sdk.api.kinds``): ``register(PolicySpec(name=..., factory=..., params=...))``; and the two below.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

from rlhfless_sdk.api.config import SchedulerConfig
from rlhfless_sdk.api.kinds import KINDS, PolicyKind
from rlhfless_sdk.api.records import PolicySpec

PROJECT = "rlhfless"
hookspec = pluggy.HookspecMarker(PROJECT)

RegisterPolicy = Callable[[PolicySpec], None]


@hookspec
def rlhfless_register_schedulers(register: Callable[[SchedulerConfig], None]) -> None:
    """Register scheduler presets: ``register(SchedulerConfig(...))``, one policy of each kind plus parameters."""


@hookspec
def rlhfless_register_commands(register: Callable[[Any], None]) -> None:
    """Register ``rlhfless`` subcommands: ``register(click_command)`` (the OpenRLHF adapter adds ``demo``, ``profile``).

    A command's module should import lightly: ``rlhfless --help`` loads every plugin that registers commands.
    """


def _policy_hook(kind: PolicyKind) -> Callable[..., None]:
    def spec(register: RegisterPolicy) -> None:
        pass

    spec.__name__ = spec.__qualname__ = kind.hook
    spec.__doc__ = kind.summary
    return hookspec(spec)


for _kind in KINDS:
    globals()[_kind.hook] = _policy_hook(_kind)

SCHEDULER_HOOK = "rlhfless_register_schedulers"
COMMAND_HOOK = "rlhfless_register_commands"
