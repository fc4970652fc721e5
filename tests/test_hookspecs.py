"""The hookspecs, written out one per policy kind, agree with the kind table, and rlhfless calls them."""

from __future__ import annotations

import inspect

import pytest
import rlhfless_test_helpers as H  # registered by conftest.py

from rlhfless_sdk import PolicySpec
from rlhfless_sdk.api import hookspecs
from rlhfless_sdk.api.kinds import KINDS


def declared_hookspecs() -> dict[str, object]:
    """Every function of the module that pluggy takes for a hookspec (what ``add_hookspecs`` registers)."""
    marker = f"{hookspecs.PROJECT}_spec"
    return {name: f for name, f in vars(hookspecs).items() if inspect.isfunction(f) and hasattr(f, marker)}


def test_one_hookspec_per_kind_plus_modes_schedulers_and_commands_and_no_other():
    policy_hooks = [kind.hook for kind in KINDS]
    assert len(set(policy_hooks)) == len(KINDS)
    others = [hookspecs.MODE_HOOK, hookspecs.SCHEDULER_HOOK, hookspecs.COMMAND_HOOK]
    assert sorted(declared_hookspecs()) == sorted([*policy_hooks, *others])


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_a_policy_hook_takes_only_register_and_says_what_it_registers(kind):
    spec = declared_hookspecs()[kind.hook]
    assert list(inspect.signature(spec).parameters) == ["register"]
    doc = inspect.getdoc(spec)
    assert doc.splitlines()[0] == kind.summary  # the kind table's words on what the hook registers
    assert kind.protocol.__name__ in doc and f"``{kind.baseline}``" in doc


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_a_plugin_implementing_a_written_out_hook_is_called(bare_pm, kind):
    calls = []

    def register_one(register):
        calls.append(kind.hook)
        register(PolicySpec(name="written-out", factory=lambda params: None))

    bare_pm.register(H.plugin(**{kind.hook: register_one}), name="one-hook")
    registry = bare_pm.registry
    assert calls == [kind.hook]  # called once, by rlhfless's plugin manager
    spec = registry.policy(kind.name, "written-out")
    assert (spec.kind, spec.plugin) == (kind.name, "one-hook")
    assert all(registry.names(k.name) == [] for k in KINDS if k is not kind)


def test_the_package_exports_every_kinds_protocol_and_its_docstring_lists_them():
    import rlhfless_sdk

    for kind in KINDS:
        name = kind.protocol.__name__
        assert getattr(rlhfless_sdk, name) is kind.protocol and name in rlhfless_sdk.__all__
        assert f"- {kind.title}: ``{name}``" in rlhfless_sdk.__doc__
