"""What the reference policies share."""

from __future__ import annotations

from rlhfless_sdk import NoParams


class Parameterless:
    """A policy that takes no parameters (its spec's ``params`` is ``NoParams``)."""

    def __init__(self, params: NoParams | None = None) -> None:
        pass
