"""The per-sample check model (``EngineCostModel``) and what the planner learns for it (``LengthSpread``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlhfless_sdk.api.profiles import load_profile
from rlhfless_sdk.api.protocols import Candidate
from rlhfless_sdk.api.records import Cluster, PrefillPlan
from rlhfless_sdk.planning.engine_model import EngineCostModel, EngineModel, EngineSamples, LengthSpread
from rlhfless_sdk.simulation.simulator import Simulator
from rlhfless_sdk.workloads.synthetic import SyntheticWorkload
from rlhfless_sdk.workloads.traces import synthetic_workload

PROFILE = load_profile("qwen2.5-7b-l40s")


def test_with_true_lengths_the_check_model_is_the_simulator(registry):
    """Given every sample's true length (no spread), the check model runs the simulator's own engine: the same
    generation time as simulating the plan, warm engines, no migration."""
    work = synthetic_workload(SyntheticWorkload(64, 4, seed=2, median_length=500, max_length=4096), 2)
    prof = PROFILE.model_copy(update={"kv_capacity_tokens": 40_000})
    sim = Simulator(prof, Cluster.uniform(1, 4), registry=registry, plan_s=0.0)  # the engines alone
    res = sim.run(registry.scheduler("openrlhf"), work)
    ws, step = work.steps[1], res.steps[1]
    candidate = Candidate(ws.batch, ws.lengths, np.asarray(step.plan.assignment), step.plan.num_actors, PrefillPlan())
    est = EngineCostModel(sim.profile).estimate(candidate, warm_actors=4)
    assert step.report.cold_starts == 0
    assert est.time_s == pytest.approx(step.report.generation_s, rel=1e-9)


@given(
    true=st.lists(st.integers(1, 5000), min_size=2, max_size=200),
    bias=st.floats(0.1, 10.0),
)
def test_length_spread_is_learned_within_bounds(true, bias):
    true = np.asarray(true, dtype=float)
    pred = np.maximum(true * bias, 1.0)
    spread = LengthSpread.observe(true, pred)
    assert spread.cap == int(true.max())
    assert 0.0 <= spread.capped <= 1.0 and spread.sigma >= 0.0
    assert 0.05 <= spread.scale <= 20.0
    f = spread.factors(np.arange(1000) // 4)
    assert f.shape == (1000,) and (f > 0).all()


def test_an_unbiased_exact_predictor_learns_no_spread():
    true = np.array([100.0, 200, 300, 400])
    spread = LengthSpread.observe(true, true)
    assert spread.scale == pytest.approx(1.0) and spread.sigma == pytest.approx(0.0, abs=1e-9)


def test_runaways_are_learned_as_a_share_at_the_cap():
    rng = np.random.default_rng(0)
    pred = rng.uniform(100, 1000, 10_000)
    true = pred * rng.lognormal(-0.125, 0.5, pred.size)
    true[rng.random(pred.size) < 0.05] = 8192
    true = np.minimum(true, 8192)
    spread = LengthSpread.observe(true, pred)
    assert spread.cap == 8192 and 0.05 <= spread.capped < 0.06
    assert spread.sigma == pytest.approx(0.5, abs=0.05) and spread.scale == pytest.approx(1.0, abs=0.05)
    drawn = EngineCostModel(PROFILE).lengths(
        *synthetic_batch(pred),
        spread,  # the estimate's lengths: about the same share at the cap
    )
    assert 0.04 <= (drawn == 8192).mean() <= 0.07


def synthetic_batch(pred: np.ndarray):
    from rlhfless_sdk.api.batch import PromptBatch

    batch = PromptBatch(
        uids=[f"p{i}" for i in range(pred.size)],
        prompt_lengths=np.full(pred.size, 10),
        n_samples=np.ones(pred.size, dtype=np.int64),
    )
    return batch, pred


def test_the_report_carries_the_check_models_estimate_and_its_error(registry):
    work = synthetic_workload(SyntheticWorkload(32, 4, seed=1), 3)
    sim = Simulator(PROFILE, Cluster.uniform(1, 4), registry=registry)
    for r in sim.run(registry.scheduler("rlhfless-slo"), work).reports:
        assert r.estimated_generation_s is not None and r.estimated_generation_s > 0
        assert r.estimate_error == pytest.approx(r.estimated_generation_s / r.generation_s - 1)


@given(
    batch=st.integers(1, 256),
    ctx=st.integers(0, 400_000),
    k=st.integers(0, 300),
    overhead=st.floats(0.0, 0.002),
    per_seq=st.floats(0.0, 2e-4),
    comm=st.sampled_from([0.0, 4e-5]),
)
def test_overlapped_decode_steps_sum_the_roofline_of_each_step(batch, ctx, k, overhead, per_seq, comm):
    """k steps in one jump cost what the steps one by one cost: overhead + all-reduces + max(weights + KV read,
    compute)."""
    from rlhfless_sdk.planning.engine_model import EngineModel

    prof = PROFILE.model_copy(
        update={
            "decode_overlap": True,
            "decode_overhead_s": overhead,
            "decode_per_seq_s": per_seq,
            "decode_per_seq_comm_s": comm,
        }
    )
    e = EngineModel(0, prof, "", 0.0)
    e.B, e.ctx = batch, ctx
    w = prof.decode_base_s - overhead
    one_by_one = sum(
        overhead + comm * batch + max(w + prof.decode_per_ctx_token_s * (ctx + batch * j), per_seq * batch)
        for j in range(k)
    )
    assert e._overlapped(k) == pytest.approx(one_by_one, rel=1e-9, abs=1e-12)
    room = one_by_one * 0.6
    fit = e._steps_within(room, k)
    assert e._overlapped(fit) <= room + 1e-12 and (fit == k or e._overlapped(fit + 1) > room)


def test_overlap_makes_a_busy_step_faster_and_keeps_every_sample(registry):
    work = synthetic_workload(SyntheticWorkload(64, 8, seed=4), 2)
    add = PROFILE.model_copy(update={"decode_overlap": False})
    over = PROFILE.model_copy(update={"decode_overlap": True, "decode_overhead_s": 0.002})
    runs = [
        Simulator(p, Cluster.uniform(1, 2), registry=registry).run(registry.scheduler("openrlhf"), work)
        for p in (add, over)
    ]
    for res in runs:
        assert [r.samples for r in res.reports] == [ws.batch.total_samples for ws in work.steps]
    assert runs[1].reports[1].generation_s < runs[0].reports[1].generation_s


@pytest.mark.filterwarnings("error")  # numpy's "invalid value encountered" (0 x inf) fails the test
@pytest.mark.parametrize("true_scale", [0, 1])
def test_zero_predictions_and_zero_lengths_give_finite_estimates(true_scale):
    """Predictions of 0 (the protocol allows them) with runaway samples, and a step whose lengths were all 0:
    the check model's lengths stay finite (a runaway runs to the cap whatever its prediction), no 0 x inf."""
    batch, lengths = SyntheticWorkload(32, 4, seed=3, runaway=0.3, max_length=2048).batch()
    true = lengths * true_scale
    zeros = np.zeros(len(batch))
    spread = LengthSpread.observe(true, zeros[batch.sample_prompt_index()], groups=batch.sample_prompt_index())
    if true_scale == 0:
        assert spread.capped == 0.0  # nothing hit a cap of 0 tokens
    else:
        assert spread.capped > 0.2 and spread.cap == 2048
    model = EngineCostModel(PROFILE)
    drawn = model.lengths(batch, zeros, spread)
    assert drawn.min() >= 0 and drawn.max() <= 2048
    est = model.estimate(Candidate(batch, zeros, np.zeros(len(batch), dtype=np.int64), 1, PrefillPlan()), spread=spread)
    assert np.isfinite(est.time_s) and est.time_s < 1e4
    left = spread.remaining(np.zeros(5), np.arange(5.0))
    assert np.isfinite(left).all() and (left >= 1).all()


def _step_s(prof, batch: int, ctx: int) -> float:
    """One decode step of ``batch`` sequences holding ``ctx`` KV tokens on an engine of ``prof`` (overlapped)."""
    o = prof.decode_overhead_s + prof.decode_per_seq_comm_s * batch
    return o + max(
        prof.decode_base_s - prof.decode_overhead_s + prof.decode_per_ctx_token_s * ctx, prof.decode_per_seq_s * batch
    )


@given(k=st.integers(2, 8), batch=st.integers(1, 512), ctx=st.integers(0, 2_000_000), new=st.integers(1, 100_000))
def test_a_sharded_engine_is_faster_per_step_but_never_cheaper_in_gpu_seconds(k, batch, ctx, new):
    """Tensor parallel over k GPUs: a decode step of few sequences takes less time (the lever on a generation
    tail), but no step and no prefill takes fewer GPU-seconds than on one GPU, so the work bound (one-GPU engines)
    stays a bound for every engine shape; the KV cache holds at least min(k, KV heads) times as many tokens."""
    tp = PROFILE.sharded(k)
    assert tp.gpus_per_actor == k and tp.name == f"{PROFILE.name}-tp{k}" and tp.tensor_parallel is None
    assert k * _step_s(tp, batch, ctx) >= _step_s(PROFILE, batch, ctx) * (1 - 1e-12)
    assert k * (tp.prefill_per_new_token_s * new) >= PROFILE.prefill_per_new_token_s * new * (1 - 1e-12)
    assert tp.kv_capacity_tokens >= PROFILE.kv_capacity_tokens * min(k, PROFILE.tensor_parallel.kv_heads)
    assert tp.colocated_kv_capacity_tokens >= PROFILE.colocated_kv_capacity_tokens * min(k, 4)
    if batch <= 64 and ctx <= 64 * 8192:
        assert _step_s(tp, batch, ctx) < _step_s(PROFILE, batch, ctx)


def test_sharding_is_refused_with_what_is_missing():
    assert PROFILE.sharded(1) is PROFILE
    with pytest.raises(ValueError, match="no tensor_parallel block"):
        load_profile("qwen2.5-7b-h100").sharded(2)
    with pytest.raises(ValueError, match=r"expected 2\.\.8 GPUs"):
        PROFILE.sharded(16)
    with pytest.raises(ValueError, match="already 2 GPUs"):
        PROFILE.sharded(2).model_copy(update={"tensor_parallel": PROFILE.tensor_parallel}).sharded(2)


def test_the_tensor_parallel_tail_example_prints_every_engine_shape():
    """``examples/tensor_parallel_tail.py`` (sharding the tail, measured) runs: a row
    per engine shape, the one-GPU fleet first at 1.000x, every sample finished with all its tokens (the script
    checks that before it prints a time)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "tensor_parallel_tail.py"
    out = subprocess.run([sys.executable, str(script), "--steps", "1"], capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    rows = [line.rsplit(None, 3) for line in lines[2:]]
    assert len(rows) == 11 and rows[0][0].startswith("16 one-GPU engines") and rows[0][2:] == ["1.000", "1.000"]
    assert sum(r[0].startswith("one-GPU, then TP") for r in rows) == 6
    assert all(float(r[1]) > 0 for r in rows)


@given(
    lengths=st.lists(st.integers(1, 400), min_size=1, max_size=24),
    prompt=st.integers(1, 300),
    frac=st.floats(0.05, 0.95),
)
def test_a_pause_that_frees_the_kv_preempts_every_running_sample_and_loses_no_token(lengths, prompt, frac):
    """OpenRLHF's partial-rollout pause (vLLM's ``clear_cache=True``) in the engine model: every sample running at
    the pause is preempted with the tokens it has (none lost), re-prefills its prompt and tokens when admitted
    again, and every sample still ends at exactly its length; the same run without the pause ends no later."""
    import math

    from rlhfless_sdk.planning.engine_model import DONE, EngineModel, EngineSamples

    def samples() -> EngineSamples:
        n = len(lengths)
        return EngineSamples(range(n), [0] * n, [prompt] * n, [0] * n, lengths, [float(x) for x in lengths], [0] * n)

    plain_s, plain = samples(), EngineModel(0, PROFILE, "", 0.0)
    plain.waiting.extend(range(len(lengths)))
    plain.run_until(plain_s, math.inf)
    end = plain.t
    s, eng = samples(), EngineModel(0, PROFILE, "", 0.0)
    eng.waiting.extend(range(len(lengths)))
    eng.run_until(s, frac * end)
    running = {sid: eng.gen_now(s, sid) for sid in eng.stack}
    assert eng.free_kv(s) == len(running) and eng.B == 0 and eng.ctx == 0
    assert {sid: s.generated[sid] for sid in running} == running  # every token kept
    assert list(eng.waiting)[: len(running)] == sorted(running)  # at the head of the queue, oldest first
    eng.run_until(s, math.inf)
    assert s.state == [DONE] * len(lengths) and s.generated == list(lengths)
    assert eng.preemptions == len(running)
    assert eng.t >= end - 1e-9 * max(end, 1.0)


@given(
    lengths=st.lists(st.integers(1, 400), min_size=1, max_size=40),
    prompts=st.lists(st.integers(1, 200), min_size=1, max_size=40),
    capacity=st.integers(400, 4000),
    watermark=st.sampled_from([0.0, 0.05, 0.2, 0.5]),
)
def test_the_kv_watermark_holds_admissions_beside_running_sequences_and_every_sample_ends(
    lengths, prompts, capacity, watermark
):
    """vLLM's scheduler watermark in the engine model: a sequence admitted beside running ones leaves the
    watermark's share of the KV free; one admitted onto an idle engine is not held back, so no sample waits forever,
    every sample ends at exactly its length, and preemption (recompute) still makes room as the running ones grow."""
    import math

    from rlhfless_sdk.planning.engine_model import DONE, EngineModel, EngineSamples

    n = len(lengths)
    plen = [prompts[i % len(prompts)] for i in range(n)]
    prof = PROFILE.model_copy(update={"kv_capacity_tokens": capacity, "watermark": watermark})
    s = EngineSamples(range(n), [0] * n, plen, [0] * n, lengths, [float(x) for x in lengths], [0] * n)
    free = capacity - int(watermark * capacity)
    seen: list[tuple[int, int, int]] = []  # (running before, running after, KV after) of each admission round

    class Checked(EngineModel):
        def admit(self, samples: EngineSamples) -> None:
            before = self.B
            super().admit(samples)
            seen.append((before, self.B, self.ctx))

    eng = Checked(0, prof, "", 0.0)
    eng.waiting.extend(range(n))
    eng.run_until(s, math.inf)
    assert s.state == [DONE] * n and s.generated == list(lengths)
    for before, after, ctx in seen:
        if after > max(before, 1):  # admitted beside running sequences
            assert ctx <= free, (before, after, ctx, free)


@given(
    prompt=st.lists(st.integers(1, 400), min_size=1, max_size=120),
    data=st.data(),
    engines=st.integers(1, 4),
    overlap=st.booleans(),
    kv=st.sampled_from([2_000, 20_000, 453_000]),
    seqs=st.sampled_from([4, 64, 256]),
)
def test_an_engine_drained_at_once_keeps_the_event_loops_clock_to_the_last_bit(
    prompt, data, engines, overlap, kv, seqs
):
    """Once nothing waits to be admitted, an engine runs its batch to the end in numpy (``_drain``); the event loop
    (what a finite clock limit runs) gives every sample the same finish time, bit for bit, and the engines the same
    busy time, steps and preemptions, with KV pressure (preemption, recompute) or without, after a pause that freed
    the KV or without."""
    n = len(prompt)
    target = data.draw(st.lists(st.integers(0, 3000), min_size=n, max_size=n))
    actor = data.draw(st.lists(st.integers(0, engines - 1), min_size=n, max_size=n))
    profile = PROFILE.model_copy(
        update={
            "decode_overlap": overlap,
            "kv_capacity_tokens": kv,
            "max_num_seqs": seqs,
            "decode_per_seq_comm_s": 1e-6,
        }
    )

    pause = data.draw(st.none() | st.floats(0.0, 60.0))  # a pause that frees the KV (a weight broadcast) then

    def run(limit: float) -> tuple:
        s = EngineSamples(range(n), [0] * n, prompt, [0] * n, target, [], actor)
        models = [EngineModel(a, profile, "", 0.0) for a in range(engines)]
        for sid in range(n):
            models[actor[sid]].waiting.append(sid)
        for m in models:
            if pause is not None:
                m.run_until(s, pause)
                m.free_kv(s)  # what was running is admitted again, its tokens recomputed
            m.run_until(s, limit)
        engines_ = [(m.t, m.busy, m.S, m.seq_steps, m.preemptions, m.last_token, m.generated) for m in models]
        return s.finish_time, s.events, engines_

    assert run(math.inf) == run(1e300)  # 1e300: never reached, but a limit: the event loop all the way
