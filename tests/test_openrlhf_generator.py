"""The samples generator's accounting and settings, without engines (no Ray, no vLLM run here)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("openrlhf", reason="the adapter's tests need openrlhf 0.11.2 (installed by the test command)")


def _stats(busy_s: float, first: float, last: float):
    from rlhfless_openrlhf.messages import EngineStats

    return EngineStats(
        progress={},
        running=0,
        busy_s=busy_s,
        first=first,
        last=last,
        prompt_tokens=0,
        cached_tokens=0,
        generated_tokens=10,
        dedup_saved_tokens=0,
    )


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_a_tensor_parallel_engine_is_billed_on_every_gpu_it_holds(tp):
    """``--vllm.tensor_parallel_size`` TP: each of OpenRLHF's engines holds TP GPUs, so an engine's busy span
    costs TP GPU-seconds and the fleet is engines x TP GPUs (it was one GPU per engine whatever TP was)."""
    from rlhfless_openrlhf.ray_backend import engine_gpus, step_usage
    from rlhfless_openrlhf.rollout_actor import rollout_args

    from rlhfless_sdk.rollout.billing import billing

    args = rollout_args(4)
    args.vllm.tensor_parallel_size = tp
    assert engine_gpus(args) == tp
    assert engine_gpus(rollout_args(4)) == 1  # args without the flag: one GPU an engine
    stats = {0: _stats(3.0, 100.0, 103.0), 1: _stats(1.0, 100.0, 101.0)}  # engine 2 got no work this step
    usage = step_usage(4.0, stats, 3, engine_gpus(args))
    assert usage.gpus_per_engine == tp and usage.gpus == 3 * tp
    bill = billing(usage)
    assert bill["gpu_seconds"] == pytest.approx((3.0 + 1.0) * tp)  # first to last token, on every GPU
    assert bill["gpu_seconds_serverful"] == pytest.approx(3 * tp * 4.0)
    assert bill["peak_gpus"] == 3 * tp
    assert bill["idle_fraction"] == pytest.approx(1.0 - 4.0 / (2 * 4.0))  # shares do not depend on TP


def test_the_carry_timeout_setting_reaches_the_generator_in_openrlhfs_actor(openrlhf_learning):
    """``--scheduler.carry_timeout`` travels in the launch plan to the actor that builds the generator."""
    pytest.importorskip("datasets")
    from rlhfless_openrlhf.plan import LaunchPlan
    from rlhfless_openrlhf.rollout_actor import rollout_args
    from rlhfless_openrlhf.train_ppo_ray import resolve
    from rlhfless_openrlhf.trainer import swap_generator

    old = SimpleNamespace(prompts_dataloader=None, eval_dataloader=None, tokenizer=None, vllm_engines=[object()])
    for flags, seconds in (({}, 120.0), ({"--scheduler.carry_timeout": "900"}, 900.0)):
        plan = LaunchPlan.of(resolve({"--scheduler": "rlhfless-fast", **flags}))
        assert swap_generator(SimpleNamespace(args=rollout_args(2)), old, plan).carry_timeout_s == seconds


@settings(deadline=None, max_examples=200)
@given(
    prompts=st.integers(0, 40),
    batch=st.integers(1, 9),
    draws=st.lists(st.integers(0, 12), min_size=1, max_size=30),
)
def test_prompts_drawn_in_any_amounts_come_out_once_each_in_order(prompts, batch, draws):
    """``take_prompts``: a step that draws other than whole dataloader batches (partial rollouts draw (1 +
    over_provision) x B less what they carry) keeps the rest of a batch for the next draw, where OpenRLHF's own
    ``_collect_prompt_batch`` drops it; exhausted only once the dataloader ran dry and nothing is held."""
    from rlhfless_openrlhf.generator import RlhflessSamplesGenerator

    names = [f"p{i}" for i in range(prompts)]
    loader = iter(
        [
            (list(range(i, i + batch)), names[i : i + batch], ["0"] * len(names[i : i + batch]), None)
            for i in range(0, prompts, batch)
        ]
    )
    gen = SimpleNamespace(_held=[])
    got, ended = [], False
    for k in [*draws, prompts + 1]:  # a last draw asks for more than is left
        out, exhausted = RlhflessSamplesGenerator.take_prompts(gen, loader, k)
        assert len(out) <= k and not ended
        got += [p for p, _label, _image in out]
        ended = exhausted
        if ended:
            break
    assert got == names and ended


def test_a_checkpointed_response_gets_its_reward_back_in_the_shape_openrlhf_built_it_from(openrlhf_learning):
    """A sample that ended in a group still open at a checkpoint is saved as JSON. OpenRLHF builds an experience's
    rewards with ``torch.tensor([reward])``: a one-element reward (what a ``--reward.remote_url`` function gives a
    sample) makes a 1-d tensor, the same value as a list a 2-d one, which OpenRLHF's ``torch.cat`` of a step's
    rewards then refuses (found by the CPU training harness, on the first step after a resume)."""
    import json

    import torch
    from rlhfless_openrlhf.carried import tensor_to_json, tensors_from_json

    response = {"reward": torch.tensor([0.25]), "scores": torch.tensor(0.5), "extra_logs": {"n": torch.tensor([3])}}
    back = tensors_from_json(json.loads(json.dumps(response, default=tensor_to_json)))
    for key in ("reward", "scores"):
        assert back[key].shape == response[key].shape and back[key].dtype == response[key].dtype
    assert back["extra_logs"]["n"].dtype == torch.int64
    assert torch.tensor([back["reward"]]).shape == torch.tensor([response["reward"]]).shape == (1,)
