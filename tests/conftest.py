"""Shared fixtures. Import-mode importlib: this folder is never imported as a package named ``tests``."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from rlhfless_sdk import PluginManager, reset_plugin_manager

# CI is derandomized so that a red run is reproducible; `HYPOTHESIS_PROFILE=thorough` explores afresh.
settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("thorough", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

_ENV = ("RLHFLESS_PLUGINS", "RLHFLESS_DISABLE_PLUGIN_AUTOLOAD", "RLHFLESS_TRACE_HOOKS")


@pytest.fixture(autouse=True)
def _clean_plugin_env(monkeypatch):
    """Every test starts with the default plugin environment and a fresh process-wide manager."""
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    reset_plugin_manager()
    yield
    reset_plugin_manager()


@pytest.fixture
def bare_pm() -> PluginManager:
    """A manager with no plugin at all, not even the default one: tests register throwaway plugins on it."""
    return PluginManager(autoload=False, defaults=False)


@pytest.fixture
def registry():
    """The registry of the default and installed plugins."""
    return PluginManager().registry


@pytest.fixture(scope="session")
def registry_with():
    """``registry_with(name=plugin, ...)``: the registry of the default and installed plugins plus throwaway ones."""

    def make(**plugins):
        pm = PluginManager()
        for name, plugin in plugins.items():
            pm.register(plugin, name=name)
        return pm.registry

    return make


@pytest.fixture(scope="session")
def openrlhf_learning():
    """OpenRLHF's learning-side modules (experience maker, PPO launcher) made importable on a CPU machine.

    They need peft, deepspeed==0.19.6 and torchdata (skipped without them) and flash-attn, which cannot be
    installed without CUDA: ``flash_attn_placeholder`` stands in for it (every function in it raises if called).
    """
    for name in ("peft", "deepspeed", "torchdata"):
        pytest.importorskip(name)
    spec = importlib.util.spec_from_file_location(
        "flash_attn_placeholder", Path(__file__).with_name("flash_attn_placeholder.py")
    )
    placeholder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(placeholder)
    placeholder.install()
    pytest.importorskip("openrlhf.trainer.ppo_utils.experience_maker")
