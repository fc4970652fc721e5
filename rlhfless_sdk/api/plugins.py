"""The plugin manager: loads plugins from the ``rlhfless`` entry-point group and builds the policy registry.

The reference policies are a default plugin (``DEFAULT_PLUGINS``, as simonw/llm ships its own): registered
in-process by the same hooks as any other, before the installed ones, so every kind's baseline exists even
with autoload off. Third-party plugins come through the entry-point group. Environment variables:

- ``RLHFLESS_PLUGINS=a,b``: load only these installed plugins (entry-point or distribution names; an empty
  value loads none). The default plugins always load.
- ``RLHFLESS_DISABLE_PLUGIN_AUTOLOAD=1``: load no installed plugin (the default plugins still load); register
  plugins by hand.
- ``RLHFLESS_TRACE_HOOKS=1``: print every hook call, its plugin and its result to stderr.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pluggy
from pydantic import BaseModel, ValidationError

from rlhfless_sdk.api import hookspecs
from rlhfless_sdk.api.base import SYNC, DriverSpec, PipelineSpec, PolicySpec
from rlhfless_sdk.api.config import PolicyRef, SchedulerConfig, problems_from_validation, read_scheduler_config
from rlhfless_sdk.api.errors import ConfigProblem, PluginError, RlhflessError, UnknownPolicyError
from rlhfless_sdk.api.kinds import KIND, KINDS, POLICY_KINDS

ENTRY_POINT_GROUP = "rlhfless"
#: Plugins registered in-process by every manager, by name, in this order: the built-in ways of running steps,
#: then the reference policies and shipped presets.
DEFAULT_PLUGINS: dict[str, str] = {
    "rlhfless-modes": "rlhfless_sdk.simulation.builtin_modes",
    "rlhfless-policies": "rlhfless_policies.plugin",
}
ENV_PLUGINS = "RLHFLESS_PLUGINS"
ENV_DISABLE_AUTOLOAD = "RLHFLESS_DISABLE_PLUGIN_AUTOLOAD"
ENV_TRACE = "RLHFLESS_TRACE_HOOKS"

log = logging.getLogger("rlhfless.plugins")


def _skip_hint(plugin: str | None) -> str:
    """How to run without a broken installed plugin (none for the built-in one)."""
    if plugin in DEFAULT_PLUGINS:
        return ""
    return (
        f"; to run without it, set {ENV_PLUGINS} to the installed plugins you want (empty: none) "
        f"or {ENV_DISABLE_AUTOLOAD}=1, or uninstall it"
    )


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


@dataclass(frozen=True)
class SchedulerPreset:
    """A registered scheduler: its config and the plugin that provides it."""

    config: SchedulerConfig
    plugin: str

    @property
    def name(self) -> str:
        return self.config.name


@dataclass
class Registry:
    """Every policy and scheduler the loaded plugins registered, by kind and name."""

    policies: dict[str, dict[str, PolicySpec]] = field(default_factory=lambda: {k: {} for k in POLICY_KINDS})
    schedulers: dict[str, SchedulerPreset] = field(default_factory=dict)
    commands: dict[str, tuple[Any, str]] = field(default_factory=dict)  # name -> (click command, plugin)
    drivers: dict[str, DriverSpec] = field(default_factory=dict)  # step drivers, in the order registered
    pipelines: dict[str, PipelineSpec] = field(default_factory=dict)  # pipelines (``pipeline: mode``), likewise
    autoload_note: str = ""

    def names(self, kind: str) -> list[str]:
        if kind == "scheduler":
            return sorted(self.schedulers)
        return sorted(self.policies[kind])

    def policy(self, kind: str, name: str) -> PolicySpec:
        if kind not in self.policies:
            raise UnknownPolicyError("policy kind", kind, list(POLICY_KINDS))
        try:
            return self.policies[kind][name]
        except KeyError:
            raise UnknownPolicyError(kind, name, self.names(kind), self.autoload_note) from None

    def scheduler(self, name: str) -> SchedulerConfig:
        try:
            return self.schedulers[name].config
        except KeyError:
            raise UnknownPolicyError("scheduler", name, self.names("scheduler"), self.autoload_note) from None

    def resolve(self, name_or_path: str) -> SchedulerConfig:
        """A registered scheduler by name, or a scheduler YAML file by path (every command and the adapter
        resolve a ``--scheduler`` this way)."""
        if name_or_path.endswith((".yaml", ".yml")) or Path(name_or_path).is_file():
            return read_scheduler_config(name_or_path, self)
        return self.scheduler(name_or_path)

    def validate_params(self, kind: str, ref: PolicyRef) -> BaseModel:
        """The policy's params model instance, validated from ``ref.params``."""
        return self.policy(kind, ref.name).params.model_validate(ref.params)

    def check_config(self, config: SchedulerConfig) -> list[ConfigProblem]:
        """Problems with ``config``'s policy names and parameters and its pipeline's mode; empty when it can run."""
        problems = self.check_refs(config.policy_refs())
        mode = config.pipeline.mode
        if mode != SYNC and mode not in self.pipelines:
            known = ", ".join([SYNC, *self.pipelines])
            problems.append(ConfigProblem("pipeline.mode", f"unknown pipeline mode {mode!r} (known: {known})"))
        return problems

    def pipeline(self, name: str) -> PipelineSpec:
        """The registered pipeline ``name`` (``pipeline: mode``); an unknown one lists the known."""
        try:
            return self.pipelines[name]
        except KeyError:
            raise UnknownPolicyError("pipeline mode", name, [SYNC, *self.pipelines], self.autoload_note) from None

    def check_refs(self, refs: dict[str, PolicyRef]) -> list[ConfigProblem]:
        """Problems with these policies' names and parameters (by kind), every one of them."""
        problems: list[ConfigProblem] = []
        for kind, ref in refs.items():
            try:
                self.validate_params(kind, ref)
            except UnknownPolicyError as exc:
                problems.append(ConfigProblem(f"{kind}.name", str(exc)))
            except ValidationError as exc:
                problems.extend(problems_from_validation(exc, prefix=(kind, "params")))
        return problems

    def create(self, kind: str, ref: PolicyRef | str) -> Any:
        """Build the policy ``ref`` names, check it implements its kind's protocol, and return it."""
        ref = PolicyRef.model_validate(ref)
        spec = self.policy(kind, ref.name)
        params = spec.params.model_validate(ref.params)
        try:
            policy = spec.factory(params)
        except RlhflessError:
            raise  # already says what is wrong (a history file that cannot be used, ...)
        except (Exception, SystemExit) as exc:  # SystemExit: a factory calling sys.exit must not end the run silently
            raise PluginError(f"plugin {spec.plugin!r}: {kind} {ref.name!r} factory raised {exc!r}") from exc
        protocol = KIND[kind].protocol
        if not isinstance(policy, protocol):
            missing = [m for m in _protocol_methods(protocol) if not callable(getattr(policy, m, None))]
            raise PluginError(
                f"plugin {spec.plugin!r}: {kind} {ref.name!r} built a {type(policy).__name__} that does not "
                f"implement {protocol.__name__} (missing: {', '.join(missing)})"
            )
        return policy


def _own_version() -> str:
    try:
        return importlib.metadata.version("rlhfless")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree
        return "source"


def _protocol_methods(protocol: type) -> list[str]:
    return sorted(n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_"))


class PluginManager:
    """A typed façade over pluggy: core code asks for policies by kind and name, never touches ``pm.hook``."""

    def __init__(self, autoload: bool | None = None, defaults: bool = True) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT)
        self._pm.add_hookspecs(hookspecs)
        self._dists: dict[str, str] = {}
        self._registry: Registry | None = None
        if _env_flag(ENV_TRACE):
            self._pm.trace.root.setwriter(sys.stderr.write)
            self._pm.enable_tracing()
        self.autoload = (not _env_flag(ENV_DISABLE_AUTOLOAD)) if autoload is None else autoload
        if defaults:
            self.load_defaults()
        if self.autoload:
            self.load_entrypoints()

    # -- loading -------------------------------------------------------------------------------------
    def load_defaults(self) -> list[str]:
        """Register the default plugins (``DEFAULT_PLUGINS``) that are not registered yet."""
        loaded = []
        for name, module in DEFAULT_PLUGINS.items():
            if self._pm.get_plugin(name) is not None or self._pm.is_blocked(name):
                continue
            try:
                plugin = importlib.import_module(module)
            except Exception as exc:
                raise PluginError(f"default plugin {name!r} (module {module!r}) failed to import: {exc!r}") from exc
            self.register(plugin, name=name)
            self._dists[name] = f"rlhfless {_own_version()} (built in)"
            loaded.append(name)
        return loaded

    def load_entrypoints(self) -> list[str]:
        """Load the installed plugins of the ``rlhfless`` entry-point group (honouring ``RLHFLESS_PLUGINS``)."""
        allow_env = os.environ.get(ENV_PLUGINS)
        allow = None if allow_env is None else {x.strip() for x in allow_env.split(",") if x.strip()}
        loaded, seen = [], set()
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist.name if ep.dist is not None else "?"
            seen |= {ep.name, dist}
            if allow is not None and ep.name not in allow and dist not in allow:
                continue
            if self._pm.get_plugin(ep.name) is not None or self._pm.is_blocked(ep.name):
                continue
            try:
                plugin = ep.load()
            except (Exception, SystemExit) as exc:
                raise PluginError(
                    f"plugin {ep.name!r} (entry point {ep.value!r} of distribution {dist!r}) failed to import: "
                    f"{exc!r}{_skip_hint(ep.name)}"
                ) from exc
            self.register(plugin, name=ep.name)
            self._dists[ep.name] = f"{dist} {ep.dist.version}" if ep.dist is not None else dist
            loaded.append(ep.name)
        for missing in sorted((allow or set()) - seen - set(DEFAULT_PLUGINS)):
            warnings.warn(f"{ENV_PLUGINS} names {missing!r}, which is not an installed rlhfless plugin", stacklevel=2)
        return loaded

    def register(self, plugin: object, name: str | None = None) -> str:
        """Register a plugin object or module; a hookimpl that matches no hookspec is an error."""
        try:
            plugin_name = self._pm.register(plugin, name=name)
            self._pm.check_pending()
        except pluggy.PluginValidationError as exc:
            if self._pm.is_registered(plugin):
                self._pm.unregister(plugin)
            raise PluginError(f"plugin {name or plugin!r} is invalid: {exc}{_skip_hint(name)}") from exc
        except ValueError as exc:  # pluggy: name already registered
            raise PluginError(str(exc)) from exc
        self._registry = None
        assert plugin_name is not None
        return plugin_name

    def unregister(self, name: str) -> None:
        self._pm.unregister(name=name)
        self._dists.pop(name, None)
        self._registry = None

    def plugin_names(self) -> list[str]:
        return [name for name, _ in self._pm.list_name_plugin()]

    def distribution(self, plugin_name: str) -> str:
        return self._dists.get(plugin_name, "")

    # -- the registry --------------------------------------------------------------------------------
    @property
    def registry(self) -> Registry:
        if self._registry is None:
            self._registry = self._build_registry()
        return self._registry

    def _call_per_plugin(self, hook_name: str, register: Callable[[str], Callable[[Any], None]]) -> None:
        """Call ``hook_name`` on each plugin alone, so that each record is attributed to its plugin."""
        hook = getattr(self._pm.hook, hook_name)
        plugins = self._pm.get_plugins()
        for impl in hook.get_hookimpls():
            others = [p for p in plugins if p is not impl.plugin]
            caller = self._pm.subset_hook_caller(hook_name, remove_plugins=others)
            try:
                caller(register=register(impl.plugin_name))
            except (PluginError, UnknownPolicyError):
                raise
            except (Exception, SystemExit) as exc:
                raise PluginError(
                    f"plugin {impl.plugin_name!r} raised in {hook_name}: {exc!r}{_skip_hint(impl.plugin_name)}"
                ) from exc

    def _build_registry(self) -> Registry:
        reg = Registry()
        if not self.autoload:
            reg.autoload_note = f"plugin autoload is off ({ENV_DISABLE_AUTOLOAD} or autoload=False)"
        elif os.environ.get(ENV_PLUGINS) is not None:
            reg.autoload_note = f"{ENV_PLUGINS}={os.environ[ENV_PLUGINS]!r} limits which plugins load"
        self._register_modes(reg)
        for kind in KINDS:
            self._register_policies(reg, kind.name)
        self._register_schedulers(reg)
        self._register_commands(reg)
        for preset in reg.schedulers.values():  # a preset naming a policy nobody registered is a plugin bug
            problems = reg.check_config(preset.config)
            if problems:
                log.warning(
                    "scheduler %r from plugin %r is not usable: %s",
                    preset.name,
                    preset.plugin,
                    "; ".join(map(str, problems)),
                )
        return reg

    def _register(
        self, hook: str, expected: type | tuple[type, ...], what: str, store: Callable[[Any, str], str | None]
    ) -> None:
        """Call ``hook`` on each plugin with a ``register`` that checks each record is an ``expected`` (``what``
        names it) and hands it to ``store(record, plugin)``, which keeps it, or names who registered its name first
        (a duplicate, refused naming both plugins)."""

        def for_plugin(plugin: str) -> Callable[[Any], None]:
            def register(record: Any) -> None:
                if not isinstance(record, expected):
                    raise PluginError(
                        f"plugin {plugin!r} passed a {type(record).__name__} to register() in {hook}; expected {what}"
                    )
                taken = store(record, plugin)
                if taken is not None:
                    raise PluginError(f"duplicate {taken} and by plugin {plugin!r}")

            return register

        self._call_per_plugin(hook, for_plugin)

    def _register_policies(self, reg: Registry, kind: str) -> None:
        """Every plugin's policies of ``kind``, through the kind's hook: a ``PolicySpec`` each, names unique."""
        table = reg.policies[kind]

        def store(spec: PolicySpec, plugin: str) -> str | None:
            if spec.name in table:
                return f"{kind} name {spec.name!r}: registered by plugin {table[spec.name].plugin!r}"
            table[spec.name] = spec.model_copy(update={"kind": kind, "plugin": plugin})
            return None

        self._register(KIND[kind].hook, PolicySpec, "rlhfless_sdk.PolicySpec", store)

    def _register_modes(self, reg: Registry) -> None:
        """Every plugin's ways of running steps: a ``DriverSpec`` or a ``PipelineSpec`` each, names unique across
        both (and never ``sync``)."""

        def store(spec: DriverSpec | PipelineSpec, plugin: str) -> str | None:
            owner = reg.drivers.get(spec.name) or reg.pipelines.get(spec.name)
            if owner is not None or spec.name == SYNC:
                by = f"plugin {owner.plugin!r}" if owner is not None else "rlhfless (the synchronous loop)"
                return f"mode name {spec.name!r}: registered by {by}"
            table: dict[str, Any] = reg.drivers if isinstance(spec, DriverSpec) else reg.pipelines
            table[spec.name] = replace(spec, plugin=plugin)
            return None

        what = "rlhfless_sdk.DriverSpec or rlhfless_sdk.PipelineSpec"
        self._register(hookspecs.MODE_HOOK, (DriverSpec, PipelineSpec), what, store)

    def _register_schedulers(self, reg: Registry) -> None:
        """Every plugin's scheduler presets: a ``SchedulerConfig`` each, names unique."""

        def store(config: SchedulerConfig, plugin: str) -> str | None:
            if config.name in reg.schedulers:
                return f"scheduler name {config.name!r}: registered by plugin {reg.schedulers[config.name].plugin!r}"
            reg.schedulers[config.name] = SchedulerPreset(config=config, plugin=plugin)
            return None

        self._register(hookspecs.SCHEDULER_HOOK, SchedulerConfig, "rlhfless_sdk.SchedulerConfig", store)

    def _register_commands(self, reg: Registry) -> None:
        """Every plugin's ``rlhfless`` subcommands: a click command each (a ``name`` and a ``main``), names unique."""

        def store(command: Any, plugin: str) -> str | None:
            name = getattr(command, "name", None)
            if not name or not callable(getattr(command, "main", None)):
                raise PluginError(
                    f"plugin {plugin!r} passed a {type(command).__name__} to register() in "
                    f"{hookspecs.COMMAND_HOOK}; expected a click command"
                )
            if name in reg.commands:
                return f"command {name!r}: registered by plugin {reg.commands[name][1]!r}"
            reg.commands[name] = (command, plugin)
            return None

        self._register(hookspecs.COMMAND_HOOK, object, "a click command", store)


_manager: PluginManager | None = None


def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager, created (and plugins loaded) on first use."""
    global _manager
    if _manager is None:
        _manager = PluginManager()
    return _manager


def reset_plugin_manager() -> None:
    """Forget the process-wide manager (tests; after installing a plugin at run time)."""
    global _manager
    _manager = None
