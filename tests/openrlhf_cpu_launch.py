"""Run the drop-in launcher, and through it OpenRLHF's own CLI, on a machine without a GPU, as far as it goes.

Used by ``test_openrlhf_launcher.py`` in a subprocess: ``python tests/openrlhf_cpu_launch.py <launcher flags>``.
It starts a local Ray with two logical GPUs (``RLHFLESS_CPU_LAUNCH_GPUS``: another count), makes OpenRLHF's
learning-side modules importable in this process and in every Ray worker (``flash_attn_placeholder``: flash-attn
cannot be installed without CUDA; its functions raise if called), and has the launcher build its engines on vLLM's
CPU build (``main(cpu=True)``). Everything else is real: OpenRLHF's argument parser, its ``train()``, the
launcher's hooks and class swaps, the engines, the trainer actor and its samples generator. The run ends where
OpenRLHF first needs CUDA (DeepSpeed's model init with NCCL); the caller checks how far it got from the output.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import flash_attn_placeholder  # noqa: E402

flash_attn_placeholder.install()

import openrlhf_built  # noqa: E402

openrlhf_built.launch(
    sys.argv[1:],
    {
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    },
    "flash_attn_placeholder.install",
)
