"""Typed records that cross Ray between RLHFless's engines and its samples generator (no Ray or vLLM here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlhfless_sdk import StepReport


@dataclass
class EngineStats:
    """An engine's account of the current step (``rl_stats``), reset by ``rl_reset_stats``."""

    progress: dict[str, int]  # sample key -> tokens generated so far, keyed samples in flight, in admission order
    running: int  # requests in flight (keyed or not)
    busy_s: float  # seconds with at least one request in flight
    first: float | None  # wall clock of the first request this step; None: no work yet
    last: float | None  # wall clock of the latest finished request
    prompt_tokens: int
    cached_tokens: int  # vLLM's num_cached_tokens of the step's samples: prompt tokens from the prefix cache
    generated_tokens: int  # response tokens of the step's finished (or cut) pieces on this engine
    dedup_saved_tokens: int = 0  # of the cached tokens, those within a prefix the dedup plan warmed here
    weights_version: int = 0  # weight updates resumed from so far (never reset: a run's count)
    updates: list[tuple[float, float]] = field(default_factory=list)  # wall clock (paused, resumed) of each update
    engine_alive: bool = True  # vLLM's EngineCore is up (False: it died under this live actor, e.g. CUDA OOM)
    kv_capacity_tokens: int = 0  # tokens this engine's KV cache holds (vLLM's blocks x block size; 0: not known)
    max_num_seqs: int = 0  # sequences it runs at once (vLLM's scheduler setting; 0: not known)
    watermark: float = 0.0  # share of the KV its scheduler keeps free when admitting beside running sequences


@dataclass
class CutSample:
    """What ``cut`` hands back: enough to continue the sample elsewhere."""

    prompt_token_ids: list[int]
    partial: list[int]  # response tokens generated before the cut
    partial_logprobs: list[Any] | None
    remaining: int  # response tokens still allowed
    sampling_params: Any  # vLLM SamplingParams


@dataclass
class Continuation:
    """What ``continue_sample`` produced, delivered to the engine that holds the cut sample. ``finish_reason``
    ``CARRIED``: none, the step ended (the sample is carried into a later step, or aborted)."""

    token_ids: list[int]
    logprobs: list[Any] | None
    finish_reason: str


@dataclass(frozen=True)
class SharedTokenizer:
    """The generator's tokenizer, put in Ray's object store once (``ref``, an ObjectRef) and passed by reference.

    OpenRLHF's engine calls take the Hugging Face tokenizer as an argument, so every call pickles it on the caller
    and unpickles it on the engine: for SmolLM2's tokenizer 38 ms and 151 ms on this project's CPU machine, per
    prompt, every step, on the cores the engines decode with. An engine resolves this once and keeps it."""

    ref: Any


#: The finish reason of a sample handed back at a step's end, to be continued later or dropped (never trained as is).
CARRIED = "carried"

#: What a piece sent to a closed engine (``rl_close``: a stopped fill engine) fails with, before generating anything.
CLOSED = "rlhfless: work was sent to a stopped fill engine"


@dataclass
class RolloutStepResult:
    """What ``GeneratorActor.step`` returns: the step's samples in training order, its report and merged logs."""

    prompts: list[str]  # one per sample: each prompt's n samples adjacent, prompts in batch order
    response_lengths: list[int]
    report: StepReport | None
    logs: dict[str, Any]  # OpenRLHF's logs dict with the rlhfless/* metrics merged in
