"""Scheduler configs: a named composition of one policy of each kind plus parameters, read from YAML.

Validation runs in two passes so every error names its YAML path: the file's structure (``SchedulerConfig``),
then each policy name and its parameters against the plugin registry (the policy's own ``params`` model).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import yaml
from pydantic import (
    Field,
    NonNegativeInt,
    PositiveInt,
    ValidationError,
    create_model,
    model_validator,
)

from rlhfless_sdk.api.base import Record
from rlhfless_sdk.api.errors import ConfigError, ConfigProblem
from rlhfless_sdk.api.kinds import KIND, KINDS, POLICY_KINDS, PolicyKind


class ConfigChecker(Protocol):
    """What validates a config's policy names and params (the plugin registry)."""

    def check_refs(self, refs: dict[str, PolicyRef]) -> list[ConfigProblem]: ...


class PolicyRef(Record):
    """A policy chosen by name, with its parameters (``assigner: sorted`` is short for ``{name: sorted}``)."""

    name: str = Field(min_length=1)
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value


class _Named(Record):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_.-]*$")
    description: str = ""


def _policy_field(kind: PolicyKind) -> tuple[Any, Any]:
    doc = f"The {kind.title} ({kind.protocol.__name__}), by name with its params."
    if kind.optional:
        return PolicyRef, Field(default_factory=lambda: PolicyRef(name=kind.baseline), description=doc)
    return PolicyRef, Field(description=doc)


class PipelineConfig(Record):
    """How generation and learning share the cluster and the clock.

    ``sync`` (a framework's default loop): every GPU generates, then every GPU learns. ``async``: ``rollout_gpus``
    GPUs only generate, the rest only learn, and the next batch is generated while the current one trains, at most
    ``queue_size`` batches ahead (so tokens are up to ``queue_size`` weight updates old). Without
    ``partial_rollout`` a weight broadcast waits for the batch being generated to finish (the engines' lock); with
    it the engines pause for the broadcast and go on with the new weights, so one sample can hold tokens of two
    policies. ``stream`` (``rlhfless_sdk.rollout.stream``): ``rollout_gpus`` GPUs generate without batch
    boundaries, the learner trains each B complete groups as soon as they exist, weight updates pause the engines
    and running samples go on under the new weights; no token is more than ``max_age`` updates old; ``elastic``
    re-plans the split between batches. ``tail_prepare`` (sync): a GPU whose engine has decoded its last token of the
    step scores complete groups while the others finish (``rlhfless_sdk.simulation.tail_prepare``; simulator only);
    ``tail_learn`` has those GPUs learn on them too (forward and backward; the optimizer step still waits).
    A framework adapter's docs name the framework flags each setting models.
    """

    mode: str = Field(
        default="sync",
        pattern=r"^[a-z][a-z0-9_-]*$",
        description="sync, async, stream, or a pipeline a plugin registered (the registry checks the name).",
    )
    queue_size: PositiveInt = Field(default=1, description="async: batches generated ahead of training.")
    partial_rollout: bool = Field(default=False, description="async: keep generating through a weight update.")
    pause_keeps_kv: bool = Field(
        default=True,
        description="async with partial_rollout: the pause for a weight update keeps the running samples' KV cache "
        "(RLHFless's engines); false: frees it, and every running sample re-prefills its prompt and tokens after "
        "the update (vLLM's default pause, which a framework's own engines may use).",
    )
    rollout_gpus: PositiveInt | None = Field(
        default=None,
        description="async, stream: GPUs that generate (the rest learn); default: the fastest split, every one "
        "tried on the first steps.",
    )
    max_age: NonNegativeInt = Field(default=1, description="stream: the most weight updates any trained token is old.")
    elastic: bool = Field(
        default=False, description="stream: re-plan the rollout/learner split between batches from what it measures."
    )
    tail_prepare: bool = Field(
        default=False,
        description="sync: GPUs whose engines are done score complete groups during the generation tail (simulator).",
    )
    tail_learn: bool = Field(
        default=False,
        description="sync, with tail_prepare: the freed GPUs also run the learner's forward and backward on complete "
        "groups, in gradient groups of their own, and their gradients join the optimizer step (simulator).",
    )
    updates_per_batch: PositiveInt = Field(
        default=1,
        description="sync, tail_learn: optimizer steps the learner takes on one batch (the rollout batch's "
        "samples over the training batch size, times the epochs per batch); only the first's share of the learning "
        "can move into the tail, since the later ones need the weights it makes.",
    )
    kv_slots: float | None = Field(
        default=None,
        gt=0.0,
        le=1.0,
        description="stream: each engine runs at most this share of the samples its KV cache holds in steady state "
        "(read from the lengths finished so far), and at most max_num_seqs; none: max_num_seqs (vLLM admits by the "
        "KV a sample holds now and preempts when the running samples outgrow the cache).",
    )
    fill_engines: bool = Field(
        default=False,
        description="stream, fixed split: until the first batch is complete (the learner has nothing to train), the "
        "learner's GPUs run engines too, beside its state (colocated KV); they stop when it starts training, and "
        "their samples go on on the rollout engines with every token they had.",
    )
    split_schedule: list[NonNegativeInt] | None = Field(
        default=None,
        description="stream, elastic: rollout GPUs pinned for each batch in turn (0: the planner's choice; the "
        "batches after the list: the planner's); for measuring a split pattern against the planner (simulator).",
    )

    @property
    def pipelined(self) -> bool:
        """Generation and learning on GPUs of their own, at once (``async`` or ``stream``)."""
        return self.mode != "sync"

    @model_validator(mode="after")
    def _async_only(self) -> PipelineConfig:
        if self.mode == "sync" and (self.partial_rollout or self.rollout_gpus is not None or self.queue_size != 1):
            raise ValueError("queue_size, partial_rollout and rollout_gpus apply to mode: async or stream only")
        if not self.pause_keeps_kv and not (self.mode == "async" and self.partial_rollout):
            raise ValueError(
                "pause_keeps_kv: false applies to mode: async with partial_rollout: true only (the stream's engines "
                "are RLHFless's, which keep the KV cache through a weight update)"
            )
        if self.mode != "stream" and (self.max_age != 1 or self.elastic):
            raise ValueError("max_age and elastic apply to mode: stream only")
        if self.kv_slots is not None and self.mode != "stream":
            raise ValueError("kv_slots holds back an engine's samples in the stream: it applies to mode: stream only")
        if self.fill_engines and (self.mode != "stream" or self.elastic):
            raise ValueError("fill_engines lends the learner's GPUs to a fixed-split stream's fill: mode: stream only")
        if self.elastic and self.rollout_gpus is not None:
            raise ValueError(
                "rollout_gpus fixes the split, which elastic: true re-plans between batches: drop one of them "
                "(split_schedule pins an elastic stream's split batch by batch)"
            )
        if self.split_schedule is not None and not (self.mode == "stream" and self.elastic):
            raise ValueError("split_schedule pins an elastic split: it applies to mode: stream with elastic: true")
        if self.tail_learn and not self.tail_prepare:
            raise ValueError("tail_learn extends tail_prepare: set tail_prepare: true with it")
        if self.updates_per_batch != 1 and not self.tail_learn:
            raise ValueError("updates_per_batch bounds what tail_learn moves: it applies with tail_learn: true only")
        if self.mode != "sync" and self.tail_prepare:
            raise ValueError("tail_prepare applies to mode: sync only (a pipeline scores on its learner's GPUs)")
        if self.mode == "stream" and (self.partial_rollout or self.queue_size != 1):
            raise ValueError(
                "mode: stream always generates through weight updates and bounds age by max_age; "
                "queue_size and partial_rollout are async's"
            )
        return self


# One field per policy kind, in the kind table's order, after ``name`` and ``description``.
_WithPolicies = create_model("_WithPolicies", __base__=_Named, **{k.name: _policy_field(k) for k in KINDS})


class SchedulerConfig(_WithPolicies):  # type: ignore[misc,valid-type]
    """A scheduler: one policy of each kind (a field per row of the kind table), plus the planner's parameters."""

    group: Literal["preset", "baseline", "research"] = Field(
        default="preset",
        description="preset: a scheduler a framework adapter launches; baseline: a framework's own behaviour, "
        "measured against; research: a mechanism no framework's learner runs, simulated only.",
    )
    min_actors: PositiveInt = Field(default=1, description="Fewest decode actors the scaler may choose.")
    max_actors: PositiveInt | None = Field(
        default=None, description="Most decode actors the scaler may choose; default: every GPU of the cluster."
    )
    burst: float = Field(
        default=1.0,
        ge=1.0,
        le=64.0,
        description="With no max_actors: the most decode actors, as a multiple of what the fleet holds; beyond "
        "it, serverless burst actors billed on top of the fleet (1: the fleet only).",
    )
    prefill_capacity_tokens: PositiveInt = Field(
        default=65536, description="Tokens the prefill actor can hold in one deduplicated batch."
    )
    kv_watermark: float = Field(
        default=0.0,
        ge=0.0,
        le=0.5,
        description="vLLM's scheduler watermark on the engines: the share of the KV cache kept free when a waiting "
        "or preempted sequence is admitted beside running ones, so that the running ones grow into it instead of "
        "being preempted and recomputed (0: vLLM's default, none).",
    )
    pipeline: PipelineConfig = Field(
        default_factory=PipelineConfig, description="Synchronous steps, or generation overlapping learning."
    )
    async_launch: str | None = Field(
        default=None,
        description="The registered scheduler this one runs in a launch whose generation overlaps learning (a "
        "framework's async mode; `rlhfless simulate --launch async`); none: this one in either launch.",
    )

    @model_validator(mode="after")
    def _actor_range(self) -> SchedulerConfig:
        if self.max_actors is not None and self.max_actors < self.min_actors:
            raise ValueError(f"max_actors={self.max_actors} is below min_actors={self.min_actors}")
        if self.async_launch is not None and self.pipeline.pipelined:
            raise ValueError(
                f"async_launch names what a synchronous scheduler runs in an async launch; this one is already "
                f"pipeline: {self.pipeline.mode}"
            )
        return self

    def launched(self, registry: Any, asynchronous: bool) -> SchedulerConfig:
        """What this scheduler runs in a synchronous or an async launch: itself, or (async) its ``async_launch``
        scheduler from ``registry``, which must be pipelined. The drafter goes with either launch: an async form
        that drafts nothing takes this scheduler's."""
        if not asynchronous or self.async_launch is None:
            return self
        form = registry.scheduler(self.async_launch)
        if not form.pipeline.pipelined:
            raise ValueError(
                f"scheduler {self.name!r}: async_launch {self.async_launch!r} is synchronous (pipeline: "
                f"{form.pipeline.mode}); an async launch needs a pipelined scheduler"
            )
        if form.policy("drafter").name == "none" and self.policy("drafter").name != "none":
            form = form.derive(drafter=self.policy("drafter").model_dump())
        return form

    def drafted(self, drafter: str) -> SchedulerConfig:
        """This scheduler with the drafter ``drafter`` (speculative decoding on its engines), named ``NAME.DRAFTER``."""
        return self.derive(
            name=f"{self.name}.{drafter}", drafter=drafter, description=f"{self.name} with drafter {drafter}"
        )

    @staticmethod
    def with_drafter(configs: Sequence[SchedulerConfig], drafter: str | None) -> list[SchedulerConfig]:
        """``configs`` and, after each one that is not a baseline (a framework's own engines draft nothing) and does
        not already draft with it, its copy with ``drafter`` (``drafted``)."""
        out: list[SchedulerConfig] = []
        for c in configs:
            out.append(c)
            if drafter and c.group != "baseline" and c.policy("drafter").name != drafter:
                out.append(c.drafted(drafter))
        return out

    def derive(self, **changes: Any) -> SchedulerConfig:
        """A validated copy with some fields replaced (``assigner="sorted"`` works as in YAML)."""
        return SchedulerConfig.model_validate({**self.model_dump(), **changes})

    def policy_refs(self) -> dict[str, PolicyRef]:
        return {kind: getattr(self, kind) for kind in POLICY_KINDS}

    def policy(self, kind: str) -> PolicyRef:
        return getattr(self, KIND[kind].name)

    def migrates(self) -> bool:
        """Whether the step controller consults a migrator while the step runs."""
        return self.policy("migrator").name != "none"


def _dotted(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _line_of(root: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """1-based line of the YAML node at ``loc``; None when a mapping lacks the key (a missing field)."""
    node, line = root, (root.start_mark.line + 1 if root is not None else None)
    for part in loc:
        nxt = None
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.value == str(part):
                    nxt = value
                    break
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            nxt = node.value[part]
        if nxt is None:  # a scalar stands for the whole subtree (``assigner: sorted``); a mapping lacks the key
            return line if isinstance(node, yaml.ScalarNode) else None
        node, line = nxt, nxt.start_mark.line + 1
    return line


def problems_from_validation(
    err: ValidationError, prefix: tuple[Any, ...] = (), root: yaml.Node | None = None
) -> list[ConfigProblem]:
    problems = []
    for e in err.errors():
        loc = prefix + tuple(e["loc"])
        msg = e["msg"]
        if e["type"] == "missing":
            msg = "required field is missing"
        elif e["type"] == "extra_forbidden":
            msg = "unknown field"
        elif "input" in e and e["type"] not in ("missing",) and not isinstance(e["input"], dict | list):
            msg = f"{msg} (got {e['input']!r})"
        problems.append(ConfigProblem(path=_dotted(loc), message=msg, line=_line_of(root, loc)))
    return problems


def parse_yaml(text: str, source: str) -> tuple[Any, yaml.Node | None]:
    """Parse YAML text; a syntax error becomes a ConfigError naming line and column."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        col = f", column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(source, [ConfigProblem("", f"YAML syntax error{col}: {problem}", line)]) from None
    dup = _duplicate_keys(root)
    if dup:
        raise ConfigError(source, dup)
    return data, root


def _duplicate_keys(node: yaml.Node | None) -> list[ConfigProblem]:
    """A key given twice in one mapping (YAML keeps the last silently): one problem per repeat, with its line."""
    out: list[ConfigProblem] = []
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode):
                line = key.start_mark.line + 1
                if key.value in seen:
                    out.append(ConfigProblem(key.value, f"given twice (first on line {seen[key.value]})", line))
                seen.setdefault(key.value, line)
            out += _duplicate_keys(value)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            out += _duplicate_keys(item)
    return out


def read_scheduler_config(path: str | Path, registry: ConfigChecker | None = None) -> SchedulerConfig:
    """Read and fully validate a scheduler config file (structure, and against ``registry`` when given)."""
    return parse_scheduler_config(read_yaml_text(path), str(path), registry)


def read_yaml_text(path: str | Path) -> str:
    """A YAML file's text; unreadable, binary or non-UTF-8 files are a ConfigError naming the file."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(str(path), [ConfigProblem("", f"cannot read file: {exc.strerror or exc}")]) from None
    if data[:2] == b"\x1f\x8b":
        raise ConfigError(str(path), [ConfigProblem("", "is gzip-compressed, not YAML text")])
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError(str(path), [ConfigProblem("", f"not UTF-8 text ({exc.reason})", line)]) from None


def parse_scheduler_config(text: str, source: str, registry: ConfigChecker | None = None) -> SchedulerConfig:
    """A scheduler config from YAML ``text`` (``source`` names it in errors). ``base: NAME`` extends a registered
    scheduler (``registry`` needed): its config, with only what the file sets changed (``extend``)."""
    data, root = parse_yaml(text, source)
    if not isinstance(data, dict):
        got = "an empty file" if data is None else type(data).__name__
        raise ConfigError(source, [ConfigProblem("", f"expected a mapping of fields, got {got}", 1)])
    if "base" in data:
        data = _based(data, source, root, registry)
    problems: list[ConfigProblem] = []
    config = None
    try:
        config = SchedulerConfig.model_validate(data)
    except ValidationError as exc:
        problems += problems_from_validation(exc, root=root)
    if registry is not None:  # every policy that parsed is checked too, so one run lists every problem
        refs = {}
        for kind in POLICY_KINDS:
            try:
                refs[kind] = config.policy(kind) if config is not None else PolicyRef.model_validate(data[kind])
            except (KeyError, ValidationError):
                continue
        for p in registry.check_refs(refs):
            loc = tuple(int(x) if x.isdigit() else x for x in p.path.split("."))
            problems.append(ConfigProblem(p.path, p.message, _line_of(root, loc)))
    if problems:
        raise ConfigError(source, sorted(problems, key=lambda p: (p.line or 0, p.path)))
    assert config is not None
    return config


def config_json_schema() -> dict[str, Any]:
    """JSON Schema of a scheduler config file."""
    return SchedulerConfig.model_json_schema()


def _based(data: dict[str, Any], source: str, root: Any, registry: ConfigChecker | None) -> dict[str, Any]:
    """``data`` (a config file's mapping with ``base: NAME``) as the whole config it stands for: the registered
    scheduler NAME's, extended by the file (``extend``). Without a ``name`` of its own it is named NAME."""
    base = data["base"]
    where = _line_of(root, ("base",))
    if not isinstance(base, str) or not base:
        raise ConfigError(source, [ConfigProblem("base", "names a registered scheduler to extend", where)])
    scheduler = getattr(registry, "scheduler", None)
    if scheduler is None:
        raise ConfigError(source, [ConfigProblem("base", "needs the plugin registry to read the scheduler", where)])
    try:
        parent = scheduler(base).model_dump(mode="json", exclude_defaults=True)
    except Exception as exc:
        raise ConfigError(source, [ConfigProblem("base", str(exc), where)]) from None
    rest = {k: v for k, v in data.items() if k != "base"}
    return extend(parent, rest)


def extend(parent: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    """``parent`` (a config's fields) with ``child``'s changes: mappings merge field by field, anything else is
    replaced; a policy the child names differently (``scaler: fixed`` over ``{name: deadline, params: ...}``)
    replaces the parent's whole, params included."""
    out = dict(parent)
    for key, value in child.items():
        old = out.get(key)
        if isinstance(value, dict) and isinstance(old, dict):
            renamed = "name" in value and "name" in old and value["name"] != old["name"]
            out[key] = dict(value) if renamed else extend(old, value)
        else:
            out[key] = value
    return out
