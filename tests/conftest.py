"""Shared fixtures. Import-mode importlib: this folder is never imported as a package named ``tests``."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import threading
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


def _register_helpers() -> None:
    """The tests' shared helpers (``_helpers.py``) as the module ``rlhfless_test_helpers``, imported by the test
    modules (``import rlhfless_test_helpers as H``): ``tests`` is no package, so they cannot import it by path."""
    if "rlhfless_test_helpers" in sys.modules:
        return
    spec = importlib.util.spec_from_file_location("rlhfless_test_helpers", Path(__file__).with_name("_helpers.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)


_register_helpers()

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


def sigint_default() -> None:
    """In a child, before it runs: SIGINT's default action. A test suite started in the background (a CI runner, a
    script's ``&``) inherits SIGINT ignored, and Python keeps an ignored SIGINT ignored, so a child the test
    interrupts would never see it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def start_until():
    """``start_until(cmd, signal)``: start ``cmd`` and return ``(proc, lines)`` once a line of its stderr holds
    ``signal``, the child's word that it is ready (no sleep that a loaded machine outruns). ``lines`` keeps
    filling with the rest of its stderr until it ends; ``proc.reader`` is the thread that reads it. A child
    still running at the end of the test is killed."""
    procs = []

    def start(cmd, signal, *, timeout=600.0, **kw):
        kw.setdefault("preexec_fn", sigint_default)
        kw.setdefault("start_new_session", True)  # its own process group, which the end of the test ends whole
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **kw)
        procs.append(proc)
        lines: list[str] = []
        seen = threading.Event()

        def read():
            for line in proc.stderr:
                lines.append(line)
                if signal in line:
                    seen.set()
            seen.set()  # it ended without the signal

        proc.reader = threading.Thread(target=read, daemon=True)
        proc.reader.start()
        seen.wait(timeout)  # a guard against a child that hangs before it is ready, never reached otherwise
        assert any(signal in line for line in lines), f"{cmd} never printed {signal!r}: {''.join(lines)[-1000:]}"
        return proc, lines

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
