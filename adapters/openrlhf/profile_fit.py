"""The shipped profile a launch is priced with, when ``--scheduler.profile`` is not given: the one nearest the
model (its parameter count, from the model's own ``config.json``) on the launch's GPU (the device's name).

A profile prices decode, prefill, training and the weight broadcast of one model on one GPU; priced with another
model's or another GPU's, a plan (and the never-slower check) is off by the ratio of the two. So the launcher picks
the shipped profile of the nearest model (within ``NEAR`` in parameters) on the same GPU, and says which; where no
shipped profile is near, it refuses in one line naming ``--scheduler.profile`` (a profile YAML of one's own:
``docs/simulator.md``). Where the model's config cannot be read here (a hub name not in the local cache), the
default profile prices it, one line saying so; where this node has no GPU to read (a CPU head node), the nearest
model's profile on the default's GPU.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: A shipped profile is near a model whose parameter count is within this factor of the profile's model.
NEAR = 1.5
#: The profile a launch is priced with when nothing about the model can be read.
DEFAULT = "qwen2.5-7b-l40s"
#: GPU families as the shipped profiles' ``hardware`` and a device's name spell them.
FAMILIES = ("H100", "H200", "H20", "A100", "A10G", "L40S", "L4", "B200", "MI300X")


@dataclass(frozen=True)
class Fit:
    """The profile a launch is priced with, and the line that says why."""

    profile: str
    line: str


def model_params_b(model: str) -> float | None:
    """Parameters (billions) of the model at ``model`` from its ``config.json`` (a local folder, or one in the
    Hugging Face cache; nothing is downloaded), or None where none can be read. Counted from the shape: attention
    (grouped-query aware), a gated MLP, the embeddings (twice unless tied)."""
    config = _config(model)
    if config is None:
        return None
    try:
        h, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
        inter = int(config.get("intermediate_size") or 4 * h)
        vocab = int(config.get("vocab_size") or 0)
        heads = int(config.get("num_attention_heads") or 1)
        kv = int(config.get("num_key_value_heads") or heads)
    except (KeyError, TypeError, ValueError):
        return None
    head = h // max(heads, 1)
    attention = 2 * h * h + 2 * h * kv * head
    embeddings = vocab * h * (1 if config.get("tie_word_embeddings") else 2)
    return (layers * (attention + 3 * h * inter) + embeddings) / 1e9


def _config(model: str) -> dict[str, Any] | None:
    path = Path(model) / "config.json"
    if not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(model, "config.json")
        except Exception:
            return None
        if not isinstance(cached, str):
            return None
        path = Path(cached)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def gpu_name() -> str | None:
    """This node's first GPU's name, or None without one (a CPU head node)."""
    try:
        import torch

        return str(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None
    except Exception:
        return None


def family(text: str) -> str | None:
    """The GPU family ``text`` (a device name, a profile's ``hardware``) names, or None."""
    words = text.upper().replace("-", " ").split()
    return next((f for f in FAMILIES if f in words), None)


def fit(model: str, gpu: str | None, profiles: dict[str, Any]) -> Fit:
    """The shipped profile (``profiles``: name -> ``TimePerTokenProfile``) for ``model`` on ``gpu``; raises
    ``SystemExit`` naming ``--scheduler.profile`` where none is near."""
    params = model_params_b(model)
    if params is None:
        return Fit(DEFAULT, f"the model's config.json is not readable here ({model}): priced with {DEFAULT!r}; pass "
                            "--scheduler.profile for your model and GPU")  # fmt: skip
    sized = {n: p for n, p in profiles.items() if p.learner is not None}
    near = {n: p for n, p in sized.items() if abs(math.log(params / p.learner.params_b)) <= math.log(NEAR)}
    want = family(gpu) if gpu else family(profiles[DEFAULT].hardware)
    on_gpu = {n: p for n, p in near.items() if family(p.hardware) == want}
    if not on_gpu:
        shipped = ", ".join(f"{n} ({p.learner.params_b:g}B, {family(p.hardware)})" for n, p in sorted(sized.items()))
        raise SystemExit(
            f"error: no shipped profile is near a {params:.2f}B model on {gpu or 'this GPU'}; pass --scheduler.profile "
            f"NAME|FILE (shipped: {shipped}; a profile of your own: docs/simulator.md)"
        )
    name = min(on_gpu, key=lambda n: abs(math.log(params / on_gpu[n].learner.params_b)))
    where = f"the GPU is {gpu}" if gpu else f"no GPU to read on this node, so {want} as the default's"
    return Fit(name, f"priced with profile {name!r} ({on_gpu[name].model} on {on_gpu[name].hardware}): the model has "
                     f"{params:.2f}B parameters, {where}; --scheduler.profile picks another")  # fmt: skip
