"""Small builders shared by several test files: throwaway plugins, in-flight samples, a foreign history file.

Tests run with import mode importlib, so this folder is no package: a test file loads this module by path,
under a name of its own::

    _spec = importlib.util.spec_from_file_location("rlhfless_test_helpers", Path(__file__).with_name("_helpers.py"))
    H = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(H)

and ``H.sibling("strategies")`` loads another shared module of this folder the same way.
"""

from __future__ import annotations

import importlib.util
import os
import sqlite3
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from rlhfless_sdk import PolicySpec, hookimpl
from rlhfless_sdk.api.kinds import KIND
from rlhfless_sdk.api.records import SampleProgress


def _load(module: str, file: str) -> ModuleType:
    """The file ``file`` of this folder, executed as the module ``module`` (registered in ``sys.modules``: a
    dataclass in it looks its module up there)."""
    spec = importlib.util.spec_from_file_location(module, Path(__file__).with_name(file))
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = loaded
    spec.loader.exec_module(loaded)
    return loaded


def sibling(name: str) -> ModuleType:
    """The module ``<name>.py`` of this folder, loaded by path as ``rlhfless_test_<name>``."""
    return _load(f"rlhfless_test_{name}", f"{name}.py")


def toy_mode() -> ModuleType:
    """The toy mode plugin (``rlhfless_toy_mode.py``: a straggler policy, its driver and a preset, in one file),
    loaded by path under its own name, as an installed plugin's module is imported, once."""
    return sys.modules.get("rlhfless_toy_mode") or _load("rlhfless_toy_mode", "rlhfless_toy_mode.py")


def install_toy_mode(folder: Path) -> dict[str, str]:
    """Install the toy mode plugin as pip would (an ``rlhfless`` entry point in a ``.dist-info`` under ``folder``)
    for the processes started with the environment returned: ``folder`` and this folder on ``PYTHONPATH``."""
    info = Path(folder) / "rlhfless_toy_mode-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rlhfless-toy-mode\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[rlhfless]\ntoy-mode = rlhfless_toy_mode\n")
    paths = [str(folder), str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(paths)}


def _hookimpl(body: Callable[[Callable[[Any], None]], None]) -> Callable[..., None]:
    def hook(self, register):
        body(register)

    return hookimpl(hook)


def plugin(**hooks: Callable[[Callable[[Any], None]], None]) -> object:
    """A throwaway plugin object: ``plugin(rlhfless_register_assigners=body)`` implements that hook (any name,
    even one that matches no hookspec) by calling ``body(register)``."""
    return type("ThrowawayHooks", (), {name: _hookimpl(body) for name, body in hooks.items()})()


def _registers(specs: Sequence[PolicySpec]) -> Callable[[Callable[[Any], None]], None]:
    def body(register):
        for spec in specs:
            register(spec)

    return body


def policy_plugin(**by_kind: PolicySpec | Sequence[PolicySpec]) -> object:
    """A throwaway plugin that registers policies, by kind: ``policy_plugin(assigner=PolicySpec(...))``, or a
    list of specs for a kind; each kind's registration hook (``KIND[kind].hook``) registers them in order."""
    hooks = {}
    for kind, specs in by_kind.items():
        hooks[KIND[kind].hook] = _registers([specs] if isinstance(specs, PolicySpec) else list(specs))
    return plugin(**hooks)


def in_flight(
    uid: str, actor: int, tokens: int, *, predicted: float, max_tokens: int, index: int = 0
) -> SampleProgress:
    """An unfinished sample as a progress snapshot lists it: on ``actor``, ``tokens`` generated so far."""
    return SampleProgress(
        uid=uid,
        sample_index=index,
        actor_id=actor,
        tokens_generated=tokens,
        predicted_length=predicted,
        max_tokens=max_tokens,
    )


def foreign_schema_history(path: Path) -> Path:
    """Write, at ``path``, a length history whose meta table says it is ours but whose ``lengths`` table has
    other columns (uid, length): a file the history must refuse, naming it."""
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        db.execute("INSERT INTO meta VALUES ('app', 'rlhfless-length-history'), ('schema_version', '1')")
        db.execute("CREATE TABLE lengths (uid TEXT, length REAL)")
    return path


def local_ray(ray: Any, cpus: int, gpus: int) -> None:
    """A local Ray for the engine tests: logical CPUs and GPUs (one GPU per vLLM engine on the CPU build), 1 GiB
    of KV per engine."""
    ray.init(
        num_cpus=cpus,
        num_gpus=gpus,
        include_dashboard=False,
        runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}},
    )


def run_ended(cmd: Sequence[str], timeout: float, **kw: Any):
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=...)`` in a process group of its own: on a
    timeout the whole group gets SIGKILL (the engines a command started too, not only the command), then
    ``TimeoutExpired`` is raised as ``subprocess.run`` raises it."""
    import os
    import signal
    import subprocess

    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kw
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _marked(marker: str) -> list[int]:
    """Processes whose environment holds ``marker`` (what a launch and everything it started inherited)."""
    needle = marker.encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes():
                    pids.append(int(entry.name))
            except OSError:  # gone, or not ours to read
                continue
    return pids


def run_launch(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 600):
    """``cmd`` (a CPU launch) run to its end; then every process it left behind is killed. A launch stopped by the
    missing CUDA can leave processes behind (vLLM's EngineCore, Ray's workers; seen: an EngineCore orphaned to pid
    1 and deaf to SIGTERM), which a later test counting engine processes would see. Each launch's processes carry
    a marker of their own in their environment; those left get SIGKILL."""
    return end_launch(start_launch(cmd, cwd, env), timeout)


def start_launch(cmd: list[str], cwd: Path, env: dict[str, str] | None = None):
    """``cmd`` started, with the marker ``run_launch`` describes (``proc.marker``); its output goes to two files in
    ``cwd`` (a pipe nobody reads while the test waits on the launch would fill and stall it)."""
    import os
    import subprocess
    import uuid

    name, value = "RLHFLESS_TEST_LAUNCH", uuid.uuid4().hex
    outs = [Path(cwd) / f"launch-{value}.{stream}" for stream in ("out", "err")]
    with open(outs[0], "w") as out, open(outs[1], "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=cwd, env={**(env or os.environ), name: value})
    proc.marker, proc.outs = f"{name}={value}", outs
    return proc


def launch_processes(proc, title: str) -> list[int]:
    """The processes of the launch ``proc`` whose title (``/proc/PID/cmdline``) starts with ``title``."""
    found = []
    for pid in _marked(proc.marker):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(title.encode()):
                found.append(pid)
        except OSError:
            continue
    return found


def end_launch(proc, timeout: float = 600):
    """Wait for the launch ``proc`` (SIGKILL past ``timeout``), then kill what it left; its CompletedProcess."""
    import contextlib
    import os
    import signal
    import subprocess

    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    finally:
        for pid in _marked(proc.marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    out, err = (path.read_text(errors="replace") for path in proc.outs)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def note_figures(test: str, name: str, figures: dict[str, Any]) -> None:
    """A test's measured figures, as one JSON line appended to the file ``RLHFLESS_TEST_FIGURES`` names (for a
    report), else printed (``pytest -s`` shows it)."""
    import json
    import os

    line = json.dumps({"test": test, "name": name, **figures})
    if path := os.environ.get("RLHFLESS_TEST_FIGURES"):
        with open(path, "a") as out:
            out.write(line + "\n")
    else:
        print(line)


def small_learner_profile(folder: Path) -> Path:
    """``qwen2.5-3b-h100`` with the learner state of a 0.5B model, as a profile file in ``folder``: a one-GPU
    learner of it leaves a stream's fill engine room on that GPU (a 3B learner's state leaves under a tenth of the
    KV cache, so the launcher builds no fill engine), for the CPU launches that test fill engines."""
    import json

    from rlhfless_sdk.api.profiles import load_profile

    path = folder / "small-learner.yaml"
    if not path.exists():
        profile = load_profile("qwen2.5-3b-h100")
        small = profile.model_copy(update={"learner": profile.learner.model_copy(update={"params_b": 0.5})})
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(small.model_dump(mode="json")))  # JSON is YAML
    return path
