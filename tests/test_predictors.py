"""Predictor variants (model, hybrid, group), the SQLite length history, and their comparison."""

from __future__ import annotations

import json

import numpy as np
import pytest
import rlhfless_test_helpers as H  # registered by conftest.py
from click.testing import CliRunner

from rlhfless_sdk.api.batch import PromptBatch
from rlhfless_sdk.api.config import PolicyRef
from rlhfless_sdk.api.profiles import load_profile
from rlhfless_sdk.api.records import ActorProgress, FinishedSample, StepProgress
from rlhfless_sdk.cli.compare import kendall_tau, with_predictor
from rlhfless_sdk.cli.main import main
from rlhfless_sdk.cli.simulate import make_cluster
from rlhfless_sdk.simulation.simulator import Simulator
from rlhfless_sdk.workloads.synthetic import SyntheticWorkload, finished_samples
from rlhfless_sdk.workloads.traces import synthetic_workload


def sample(uid: str, length: int, k: int = 0) -> FinishedSample:
    return FinishedSample(uid=uid, sample_index=k, prompt_length=10, response_length=length)


# -- model, hybrid, group -----------------------------------------------------------------------------------
def test_model_learns_from_token_ngrams_and_predicts_unseen_prompts(registry):
    model = registry.create("predictor", "model")
    batch, lengths = SyntheticWorkload(200, 4, seed=5, step=0).batch()
    cold = model.predict(batch)
    model.observe(finished_samples(batch, lengths))
    warm = model.predict(batch)
    truth = batch.true_lengths
    assert np.abs(warm - truth).mean() < 0.7 * np.abs(cold - truth).mean()
    assert kendall_tau(warm, truth) > 0.5
    unseen, _ = SyntheticWorkload(50, 4, seed=99).batch()
    out = model.predict(unseen)
    assert out.shape == (50,) and np.isfinite(out).all() and (out >= 0).all()


def test_model_without_token_ids_uses_prompt_length(registry):
    model = registry.create("predictor", "model")
    batch = PromptBatch(uids=[f"u{i}" for i in range(40)], prompt_lengths=np.arange(10, 50), n_samples=np.ones(40, int))
    model.predict(batch)
    model.observe([sample(f"u{i}", 10 * (i + 10)) for i in range(40)])  # length grows with the prompt
    out = model.predict(batch)
    assert out[-1] > out[0]


def test_hybrid_uses_history_then_the_model(registry):
    hybrid = registry.create("predictor", "hybrid")
    batch, lengths = SyntheticWorkload(30, 2, seed=2).batch()
    hybrid.predict(batch)
    hybrid.observe(finished_samples(batch, lengths))
    seen = hybrid.predict(batch)
    assert seen == pytest.approx(batch.true_lengths)  # window-1 EWMA = last mean
    fresh, _ = SyntheticWorkload(5, 2, seed=77).batch()
    fresh = PromptBatch(
        uids=[f"new{i}" for i in range(5)],
        prompt_lengths=fresh.prompt_lengths,
        n_samples=fresh.n_samples,
        token_flat=fresh.token_flat,
    )
    assert hybrid.predict(fresh) == pytest.approx(hybrid.model.predict(fresh))


def test_group_refines_unfinished_siblings(registry):
    group = registry.create("predictor", "group")
    progress = StepProgress(
        total_samples=4,
        actors=[ActorProgress(actor_id=0, planned_tokens=400, generated_tokens=300, running=2, free_slots=2)],
        unfinished=[
            H.in_flight("g", actor=0, tokens=120, predicted=100, max_tokens=1024, index=2),
            H.in_flight("g", actor=0, tokens=20, predicted=100, max_tokens=1024, index=3),
            H.in_flight("alone", actor=0, tokens=20, predicted=100, max_tokens=1024),
        ],
        finished={"g": [300, 500]},
    )
    out = group.refine(progress).unfinished
    # siblings that ran past 120 tokens averaged 400; one sample's weight of history (its plan, 120+1 at least)
    assert out[0].predicted_length == pytest.approx((300 + 500 + 121) / 3)
    assert out[0].planned_length == 100
    assert out[2].predicted_length == 100  # no finished sibling: unchanged
    decisions_seen = []

    class Spy:
        def decide(self, p):
            decisions_seen.append(p)
            return []

    planner = Simulator(load_profile("qwen2.5-3b-h100"), make_cluster(4, 4), registry=registry).planner(
        registry.scheduler("rlhfless-paper")
    )
    planner.policies["predictor"] = group
    planner.policies["migrator"] = Spy()
    planner.migration.decide(progress)
    assert decisions_seen[0].unfinished[0].predicted_length > 100  # the migrator sees refined predictions


@pytest.mark.parametrize("name", ["model", "hybrid", "group"])
def test_each_new_predictor_runs_in_a_grpo_simulation(registry, name):
    w = synthetic_workload(SyntheticWorkload(48, 8, seed=4), 3)
    sim = Simulator(load_profile("qwen2.5-7b-l40s"), make_cluster(8, 8), registry=registry)
    res = sim.run(with_predictor(registry.scheduler("rlhfless-paper"), PolicyRef(name=name)), w)
    assert [r.samples for r in res.reports] == [384, 384, 384]
    assert res.reports[-1].prediction_mae < res.reports[0].prediction_mae


# -- comparison ----------------------------------------------------------------------------------------------
def test_kendall_tau():
    assert kendall_tau(np.array([1, 2, 3]), np.array([10, 20, 30])) == pytest.approx(1.0)
    assert kendall_tau(np.array([1, 2, 3]), np.array([30, 20, 10])) == pytest.approx(-1.0)
    assert kendall_tau(np.array([1, 1, 1]), np.array([1, 2, 3])) == 0.0


def test_compare_predictors_json_and_plot(tmp_path):
    png = tmp_path / "cmp.png"
    args = "compare-predictors --prompts 40 --samples 4 --steps 3 --predictors ewma,model,prompt-length,oracle --json"
    res = CliRunner().invoke(main, [*args.split(), "--plot", str(png), "--gpus", "8"])
    assert res.exit_code == 0, res.output
    rows = {r["name"]: r for r in json.loads(res.output)["predictors"]}
    assert set(rows) == {"ewma", "model", "prompt-length", "oracle"}
    for r in rows.values():
        assert {"mae", "acc50", "acc100", "kendall_tau", "sim_time_s", "sim_gpu_seconds"} <= set(r)
    # the oracle knows each prompt's mean length: perfect ranking, and the least error a per-prompt guess can have
    assert rows["oracle"]["kendall_tau"] == pytest.approx(1.0)
    assert rows["oracle"]["mae"] == min(r["mae"] for r in rows.values())
    assert rows["ewma"]["mae"] < rows["prompt-length"]["mae"]
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_compare_predictors_unknown_name():
    res = CliRunner().invoke(main, ["compare-predictors", "--predictors", "ewma,modle", "--no-simulate"])
    assert res.exit_code == 2 and "did you mean 'model'" in res.output


def test_example_third_party_plugin_is_selected_by_name_in_a_simulation(registry):
    spec = registry.policy("predictor", "max-recent")  # examples/rlhfless-example-predictor, installed by CI
    assert spec.plugin == "example-predictor"
    w = synthetic_workload(SyntheticWorkload(32, 4, seed=6), 3)
    sim = Simulator(load_profile("qwen2.5-7b-l40s"), make_cluster(8, 8), registry=registry)
    ref = type(registry.scheduler("rlhfless").predictor)(name="max-recent", params={"window": 2})
    res = sim.run(with_predictor(registry.scheduler("rlhfless"), ref), w)
    assert res.scheduler == "rlhfless.max-recent" and len(res.reports) == 3
    assert res.reports[0].fallbacks == []
