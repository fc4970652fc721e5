"""PromptBatch: the columnar view of a step's prompts that policies work on.

Backends build it once from their prompts (a trace, a trainer's tokenized batch); policies then see numpy
columns, so a plan for 100,000 prompts never loops over pydantic objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


def _locked(array: np.ndarray) -> bool:
    """Whether ``array``'s memory belongs to an immutable ``bytes`` object (nothing can make it writeable)."""
    base: Any = array
    while isinstance(base, np.ndarray):
        if base.flags.writeable:
            return False
        base = base.base
    return isinstance(base, bytes)


def readonly(array: Any) -> np.ndarray:
    """``array`` truly read-only: its data copied once into an immutable ``bytes`` buffer (an array already so
    is shared, not copied). Writing raises, and so does ``setflags(write=True)``, on the array and on its base:
    a policy cannot unlock its inputs and change what later policies and schedulers see."""
    arr = np.asarray(array)
    if _locked(arr):
        view = arr.view()
        view.flags.writeable = False
        return view
    if arr.dtype.hasobject:  # no buffer to freeze: a read-only copy of its own (only this module's callers)
        out = arr.copy()
        out.flags.writeable = False
        return out
    frozen = np.frombuffer(np.ascontiguousarray(arr).tobytes(), dtype=arr.dtype)
    return frozen.reshape(arr.shape)


@dataclass(frozen=True)
class PromptBatch:
    """A step's prompts, in the order their samples must come back.

    Prompt token ids, when known, are stored flat: prompt i is ``token_flat[token_offsets[i]:token_offsets[i+1]]``
    (``token_offsets`` is the cumulative sum of ``prompt_lengths``). ``true_lengths`` (per prompt, the mean true
    response length) is set only by simulators; the ``oracle`` predictor reads it and refuses to run without it.

    A batch is read-only: ``uids`` is a tuple and every array's memory is an immutable buffer (``readonly``: not
    even ``setflags(write=True)`` unlocks it), so a policy that writes to it fails its call (and falls back to
    its kind's baseline, with a warning naming its plugin) instead of changing what later policies and
    schedulers see. Copy an array (``np.array(batch.prompt_lengths)``) to work on it.
    """

    uids: tuple[str, ...]
    prompt_lengths: np.ndarray
    n_samples: np.ndarray
    token_flat: np.ndarray | None = None
    true_lengths: np.ndarray | None = None
    _sample_offsets: np.ndarray = field(init=False, repr=False)
    _token_offsets: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "uids", tuple(self.uids))
        for name in ("prompt_lengths", "n_samples", "token_flat", "true_lengths"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, readonly(value))
        p = len(self.uids)
        if self.prompt_lengths.shape != (p,) or self.n_samples.shape != (p,):
            raise ValueError(
                f"PromptBatch columns disagree: {p} uids, prompt_lengths {self.prompt_lengths.shape}, "
                f"n_samples {self.n_samples.shape}"
            )
        if p and int(self.n_samples.min()) < 1:
            raise ValueError("PromptBatch.n_samples: every prompt needs at least one sample")
        tok_off = np.zeros(p + 1, dtype=np.int64)
        np.cumsum(self.prompt_lengths, out=tok_off[1:])
        object.__setattr__(self, "_token_offsets", readonly(tok_off))
        if self.token_flat is not None and self.token_flat.shape != (int(tok_off[-1]),):
            raise ValueError(
                f"PromptBatch.token_flat has {self.token_flat.shape[0]} tokens; "
                f"prompt_lengths sum to {int(tok_off[-1])}"
            )
        if self.true_lengths is not None and self.true_lengths.shape != (p,):
            raise ValueError(f"PromptBatch.true_lengths has shape {self.true_lengths.shape} for {p} prompts")
        offsets = np.zeros(p + 1, dtype=np.int64)
        np.cumsum(self.n_samples, out=offsets[1:])
        object.__setattr__(self, "_sample_offsets", readonly(offsets))

    @classmethod
    def empty(cls) -> PromptBatch:
        return cls(uids=[], prompt_lengths=np.zeros(0, np.int64), n_samples=np.zeros(0, np.int64))

    @property
    def has_tokens(self) -> bool:
        return self.token_flat is not None

    @property
    def token_offsets(self) -> np.ndarray:
        """``token_offsets[i]:token_offsets[i+1]`` is prompt i in ``token_flat`` (length P+1)."""
        return self._token_offsets

    def tokens(self, i: int) -> np.ndarray:
        """Prompt i's token ids (requires ``has_tokens``)."""
        assert self.token_flat is not None, "this batch carries no token ids"
        return self.token_flat[self._token_offsets[i] : self._token_offsets[i + 1]]

    def __len__(self) -> int:
        return len(self.uids)

    @property
    def total_samples(self) -> int:
        return int(self._sample_offsets[-1])

    @property
    def sample_offsets(self) -> np.ndarray:
        """``offsets[i]:offsets[i+1]`` are prompt i's samples in sample order (length P+1)."""
        return self._sample_offsets

    def sample_prompt_index(self) -> np.ndarray:
        """The prompt index of every sample, samples in prompt order."""
        return np.repeat(np.arange(len(self), dtype=np.int64), self.n_samples)
