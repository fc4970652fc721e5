"""The launch plan: what a launch with an RLHFless scheduler runs, decided once.

Two frozen records, built in this order:

- ``LaunchRequest``: the launcher's own flags, checked before OpenRLHF loads: the scheduler config (validated once:
  a preset of the registry, or the YAML read once), the profile (loaded once), the report and trace paths, the
  carry timeout, the split, the node size, ``--scheduler.force``.
- ``LaunchPlan``: the request decided against OpenRLHF's parsed flags, right after its parser ran
  (``rlhfless_openrlhf.decide``): the scheduler that runs (its async form, or OpenRLHF's own where the plan prices
  slower), its mode, the profile at the engines' size, the fill engines, the learner's GPUs, and the OpenRLHF flags
  the plan changes (``flags``), set on OpenRLHF's ``args`` by one function (``apply``).

The plan reaches OpenRLHF's actors as one value: the trainer classes the launcher swaps in take it as a
constructor argument (``BoundActor``, installed by ``rlhfless_openrlhf.launch``), and the engine builder reads it
from the same launch object; nothing of it travels in module globals, environment variables or attributes on
``args``. It imports nothing heavy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlhfless_openrlhf.capabilities import adapter_refusal

from rlhfless_sdk.api.config import SchedulerConfig
from rlhfless_sdk.api.plugins import Registry, get_plugin_manager
from rlhfless_sdk.api.records import TimePerTokenProfile
from rlhfless_sdk.rollout.modes import PLAIN, STREAM, Mode, mode_for

#: Seconds the end of a carrying step waits for the carried samples to come back (``--scheduler.carry_timeout``).
CARRY_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class FlagChange:
    """One OpenRLHF flag the plan sets: its dotted path in OpenRLHF's hierarchized args (``vllm.num_engines``,
    ``algo.advantage.is_correction_level``) and the value."""

    path: str
    value: Any

    @property
    def flag(self) -> str:
        return f"--{self.path}"

    def set_on(self, args: Any) -> None:
        *groups, name = self.path.split(".")
        target = args
        for group in groups:
            target = getattr(target, group)
        setattr(target, name, self.value)


@dataclass(frozen=True)
class FillPlan:
    """The stream's fill engines (``rlhfless_openrlhf.fill``): one a learner GPU, at vLLM memory ``memory``."""

    engines: int
    memory: float


@dataclass(frozen=True)
class FellBack:
    """Never slower: the scheduler the user chose was priced slower than OpenRLHF's own, which runs instead."""

    scheduler: str
    runs: str
    priced: str


@dataclass(frozen=True)
class LaunchRequest:
    """The launcher's own flags, checked (``rlhfless_openrlhf.train_ppo_ray.resolve``)."""

    scheduler: SchedulerConfig
    mode: Mode
    profile: TimePerTokenProfile
    report: str
    trace: str | None = None
    carry_timeout_s: float = CARRY_TIMEOUT_S
    split: str = "auto"
    node_gpus: int = 8
    force: bool = False
    profile_line: str | None = None
    async_mode: Mode | None = None  # the mode of the scheduler's async form (``async_launch``), where it has one


@dataclass(frozen=True)
class LaunchPlan:
    """What runs: see the module docstring. Changed only by making a new one (``running``, ``setting``,
    ``dataclasses.replace``) while the launcher decides; then frozen for the run."""

    request: LaunchRequest
    scheduler: SchedulerConfig
    mode: Mode
    profile: TimePerTokenProfile
    launched_as: str | None = None
    fell_back: FellBack | None = None
    fill: FillPlan | None = None
    learner_gpus: int = 0
    flags: tuple[FlagChange, ...] = ()
    draft_budget: tuple[int, ...] | None = None  # draft tokens at 1, 2, ... running, priced (None: the drafter's)

    @classmethod
    def of(cls, request: LaunchRequest) -> LaunchPlan:
        """The plan of a request before OpenRLHF's flags are read: its scheduler as it is."""
        return cls(request, request.scheduler, request.mode, request.profile)

    def running(self, config: SchedulerConfig, registry: Registry | None = None, **changes: Any) -> LaunchPlan:
        """This plan running ``config`` instead (its mode worked out for it, refused where the adapter cannot)."""
        return dataclasses.replace(self, scheduler=config, mode=runnable_mode(config, registry), **changes)

    def setting(self, args: Any, path: str, value: Any) -> LaunchPlan:
        """This plan with OpenRLHF's flag ``path`` set to ``value``, and set on ``args`` (the decision's scratch copy
        of OpenRLHF's args, so that later decisions read it)."""
        change = FlagChange(path, value)
        change.set_on(args)
        return dataclasses.replace(self, flags=(*[f for f in self.flags if f.path != path], change))

    @property
    def name(self) -> str:
        return self.scheduler.name

    def line(self) -> str:
        """The plan in one line, as the launch logs it."""
        flags = ", ".join(f"{f.flag} {f.value}" for f in self.flags) or "none"
        fill = f", {self.fill.engines} fill engine(s)" if self.fill else ""
        return (
            f"launch plan: scheduler {self.name!r} (mode {self.mode.name}), profile {self.profile.name!r}{fill}; "
            f"OpenRLHF flags the plan sets: {flags}"
        )

    @property
    def streams(self) -> bool:
        return self.mode.pipeline == STREAM

    @property
    def carries(self) -> bool:
        return self.mode.driver != PLAIN

    @property
    def keeps_tokens(self) -> bool:
        return self.mode.keeps_tokens


class BoundActor:
    """A Ray actor class whose ``remote`` adds keyword arguments (``kwargs()``, read when it is called): how a class
    swapped into OpenRLHF gets the launch plan without a global. ``options`` keeps the binding."""

    def __init__(self, actor_class: Any, kwargs: Callable[[], dict[str, Any]]) -> None:
        self.actor_class, self.kwargs = actor_class, kwargs

    def options(self, **opts: Any) -> BoundActor:
        return BoundActor(self.actor_class.options(**opts), self.kwargs)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.actor_class.remote(*args, **kwargs, **self.kwargs())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.actor_class, name)


def runnable_mode(config: SchedulerConfig, registry: Registry | None = None) -> Mode:
    """The mode of ``config`` (``rlhfless_sdk.rollout.modes``); a scheduler the adapter cannot run is refused in one
    line naming what needs more (``capabilities.adapter_refusal``)."""
    registry = registry or get_plugin_manager().registry
    mode = mode_for(config, registry)
    refused = adapter_refusal(config, registry, mode=mode)
    if refused is not None:
        raise SystemExit(f"error: {refused}")
    return mode


def apply(plan: LaunchPlan, args: Any) -> None:
    """Set every OpenRLHF flag the plan changes on OpenRLHF's ``args``: the one place the launch writes to them."""
    for change in plan.flags:
        change.set_on(args)
