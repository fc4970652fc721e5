"""Fixes to OpenRLHF 0.11.2's learner that the launcher applies in its model actors' processes, before they load.

- **ZeRO-3 with transformers 5.** ``openrlhf/models/actor.py`` 16-50 wraps transformers'
  ``_apply_weight_conversions_to_state_dict`` to keep the checkpoint keys that match the model exactly (OpenRLHF
  issue 1232), calling it as a function that returns one dict and updating that dict. In transformers 5 it is a
  generator of dicts (``integrations/deepspeed.py`` 339-346), so under ``--ds.zero_stage 3`` every policy and
  reference model load fails with ``'generator' object has no attribute 'update'``. The same rule, kept here for
  the generator: the exactly matching keys are set aside, the rest go through transformers' conversions, and the
  set-aside keys follow as one more dict.

``install()`` runs in the launching process: OpenRLHF's ``RayActorGroup.async_init_model_from_pretrained`` (how
``train()`` loads every model: policy, reference, critic, reward) first runs ``apply()`` in each of the group's
actors (``__ray_call__``; an actor runs its calls in order, so before the load).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from typing import Any


def _keeping_exact_keys(convert: Any) -> Any:
    """transformers' conversion generator, with the checkpoint keys that match the model as they are set aside."""

    @functools.wraps(convert)
    def apply_conversions(model: Any, state_dict: Any, weight_mapping: Any) -> Iterator[Any]:
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        model_keys = model.state_dict()
        renamings = [m for m in weight_mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in weight_mapping if isinstance(m, WeightConverter)]
        metadata = getattr(state_dict, "_metadata", None)
        rest, exact = state_dict.copy(), {}
        for key in list(state_dict):
            renamed, _ = rename_source_key(key, renamings, converters, model.base_model_prefix, model_keys)
            if renamed not in model_keys and key in model_keys:
                exact[key] = rest.pop(key)
        if metadata is not None:
            rest._metadata = metadata
        yield from convert(model, rest, weight_mapping)
        if exact:
            kept = type(state_dict)(exact) if isinstance(state_dict, dict) else dict(exact)
            if metadata is not None:
                kept._metadata = metadata
            yield kept

    apply_conversions._rlhfless_fixed = True  # type: ignore[attr-defined]
    return apply_conversions


def patch_zero3_weight_mapping() -> None:
    """What ``openrlhf.models.actor._patch_zero3_weight_mapping`` does, for transformers whose conversions yield."""
    try:
        import transformers.integrations.deepspeed as hf_deepspeed
    except ImportError:
        return
    convert = getattr(hf_deepspeed, "_apply_weight_conversions_to_state_dict", None)
    if convert is None or getattr(convert, "_rlhfless_fixed", False):
        return
    if not inspect.isgeneratorfunction(convert):
        return  # a transformers that returns one dict: OpenRLHF's own patch is right there
    hf_deepspeed._apply_weight_conversions_to_state_dict = _keeping_exact_keys(convert)


def apply(actor: Any = None) -> None:
    """In a model actor's process (``actor``: the actor itself, as ``__ray_call__`` passes it)."""
    import openrlhf.models.actor as actor_module

    actor_module._patch_zero3_weight_mapping = patch_zero3_weight_mapping


def install() -> None:
    """In the launching process: each model group runs ``apply`` in its actors before it loads their models."""
    from openrlhf.trainer.ray.launcher import RayActorGroup

    load = RayActorGroup.async_init_model_from_pretrained
    if getattr(load, "_rlhfless_fixed", False):
        return

    @functools.wraps(load)
    def async_init_model_from_pretrained(self: Any, *args: Any, **kwargs: Any) -> Any:
        import ray

        ray.get([handle.__ray_call__.remote(apply) for handle in self._actor_handlers])
        return load(self, *args, **kwargs)

    async_init_model_from_pretrained._rlhfless_fixed = True  # type: ignore[attr-defined]
    RayActorGroup.async_init_model_from_pretrained = async_init_model_from_pretrained
