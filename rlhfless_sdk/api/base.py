"""The base of every record (``Record``: frozen, unknown fields and non-finite numbers refused, a YAML boolean never
taken for a number) and what a plugin registers (``PolicySpec``)."""

from __future__ import annotations

import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
)


def _numeric(annotation: Any) -> bool:
    """int or float (possibly constrained or optional), and not a bool."""
    if annotation in (int, float):
        return True
    args = typing.get_args(annotation)
    return bool(args) and bool not in args and any(_numeric(a) for a in args if a is not type(None))


class Record(BaseModel):
    """Base of all records: unknown fields and non-finite numbers are rejected, and a record is frozen once built
    (``model_copy(update=...)`` makes a changed copy), so a policy cannot change what others see."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """``lambda: true`` is a mistake, not 1.0: a YAML boolean is refused where a number is expected."""
        if info.field_name is None:
            return value
        if isinstance(value, bool):
            where, found = "", value
        elif (
            isinstance(value, list)
            and (i := next((k for k, v in enumerate(value) if isinstance(v, bool)), None)) is not None
        ):
            where, found = f"item {i}: ", value[i]  # list items: split_schedule: [true, 2]
        else:
            return value
        field = cls.model_fields.get(info.field_name)
        if field is not None and _numeric(field.annotation):
            raise ValueError(f"{where}expected a number, got {str(found).lower()}")
        return value


class NoParams(Record):
    """Parameters of a policy that takes none."""


class PolicySpec(BaseModel):
    """What a plugin registers: a named factory for one policy kind.

    ``factory(params)`` receives an instance of ``params`` (validated from the scheduler config) and returns
    an object implementing the kind's protocol. ``kind`` and ``plugin`` are filled in by the registry.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_.-]*$", description="Lower-case name used in configs.")
    factory: Callable[[Any], Any]
    params: type[BaseModel] = NoParams
    description: str = Field(default="", description="One line shown by `rlhfless plugins`.")
    reads_predictions: bool = Field(
        default=True,
        description="Whether the policy reads predicted lengths (its plan inputs or the samples' predicted_length); "
        "a scheduler whose policies all say False consults no predictor.",
    )
    kind: str = ""
    plugin: str = ""


# -- ways of running steps: what a plugin registers through ``rlhfless_register_modes`` --------------------------
#: The pipeline every scheduler runs unless it names another: generation, then learning, on every GPU.
SYNC = "sync"


@dataclass(frozen=True)
class DriverSpec:
    """A step driver: its ``name``; which schedulers it runs (``claims(config, straggler, ask)``, ``ask()`` a
    checked ``keeps_tokens(0)`` of the straggler policy; drivers are asked newest first, the built-in ones last);
    whether it trains tokens of older weights (``keeps_tokens``); and its ``session``
    (``(planner, b, prompts) -> DriverSession``, the steps of a run; None: one step at a time, ``PlainStep``). A
    backend runs it through its session, written once in the SDK; ``backends``: its own run on a backend that needs
    one, by the backend's name (see ``PipelineSpec``). ``plugin`` is filled in by the registry."""

    name: str
    claims: Callable[..., bool]
    keeps_tokens: bool = False
    session: Callable[..., Any] | None = None
    description: str = ""
    backends: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    plugin: str = ""


@dataclass(frozen=True)
class PipelineSpec:
    """A pipeline (``pipeline: mode`` in a scheduler config): its ``name``; whether it trains tokens of older weights
    (``keeps_tokens``); the simulator's run of it (``simulate(simulator, config, workload, on_step, mode)``, a
    ``SimulationResult``); and, for a search over rollout/learner splits, its run at one split
    (``run_at(simulator, config, workload, on_step, rollout_gpus, mode)``; None: it is not searched).
    ``backends``: its run on a framework's backend, by the name and in the form that backend's adapter documents
    (imported only there); a backend that has none of its own for it refuses the pipeline.
    ``plugin`` is filled in by the registry."""

    name: str
    keeps_tokens: bool = False
    simulate: Callable[..., Any] | None = None
    run_at: Callable[..., Any] | None = None
    description: str = ""
    backends: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    plugin: str = ""
