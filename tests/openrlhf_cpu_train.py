"""Train with the drop-in launcher, and through it OpenRLHF's own ``train()``, on a machine without a GPU.

Used by ``test_openrlhf_training.py`` in a subprocess: ``python tests/openrlhf_cpu_train.py OUT <launcher flags>``.
It starts a local Ray with logical GPUs (``RLHFLESS_CPU_LAUNCH_GPUS``, default 2: one per learner rank or engine),
puts the CPU shims (``openrlhf_cpu_shims``: each names the OpenRLHF line it stands in for) in this process, in every
Ray worker and, as a vLLM plugin, in the engines' own processes, and runs the launcher. Everything else is real:
OpenRLHF's parser, its ``train()``, DeepSpeed's learner on its CPU accelerator, the weight broadcast to the vLLM CPU
engines, the launcher's hooks and classes. What the run did is written under OUT by ``openrlhf_cpu_probe`` (the
learner's and engines' own state after each step), for the test to check.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

OUT = Path(sys.argv[1]).resolve()
OUT.mkdir(parents=True, exist_ok=True)

import openrlhf_cpu_probe  # noqa: E402
import openrlhf_cpu_shims  # noqa: E402

plugins = openrlhf_cpu_shims.plugin_path(OUT / "plugins")
env = {
    "PYTHONPATH": os.pathsep.join([str(HERE), str(plugins), os.environ.get("PYTHONPATH", "")]),
    "DS_ACCELERATOR": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RLHFLESS_CPU_PROBE": str(OUT / "probe"),
}
os.environ.update(env)  # the probe in this process reads it
sys.path.insert(0, str(plugins))
openrlhf_cpu_probe.install()

import openrlhf_built  # noqa: E402

openrlhf_built.launch(sys.argv[2:], env, "openrlhf_cpu_probe.install")
print("rlhfless-cpu-train: train() returned", flush=True)
deadline = time.monotonic() + 120  # the engines' answers to the last weight sync, written by a thread
while openrlhf_cpu_probe.unanswered(OUT / "probe") > 0 and time.monotonic() < deadline:
    time.sleep(0.5)
