"""The discrete-event simulator and ``rlhfless simulate`` (traces: tests/test_traces.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfless_sdk import PluginManager, PolicySpec, Record, hookimpl
from rlhfless_sdk.api.batch import PromptBatch
from rlhfless_sdk.api.profiles import load_profile
from rlhfless_sdk.api.records import Cluster, MigrationDecision, TimePerTokenProfile
from rlhfless_sdk.cli.main import main
from rlhfless_sdk.cli.simulate import make_cluster
from rlhfless_sdk.rollout.billing import held_s
from rlhfless_sdk.rollout.controller import StepController
from rlhfless_sdk.simulation.backend import SimulatedBackend
from rlhfless_sdk.simulation.simulator import Simulator
from rlhfless_sdk.workloads.synthetic import SyntheticWorkload
from rlhfless_sdk.workloads.traces import Workload, WorkloadStep, synthetic_workload

SHARED = Path(__file__).resolve().parent.parent.parent / "shared" / "data"
GPQA = SHARED / "traces" / "gpqa-qwen2.5-7b-ppo"
needs_gpqa = pytest.mark.skipif(not GPQA.is_dir(), reason=f"real trace not found at {GPQA} (outside this workplace)")

CSV_HEAD = "uid,step,sample_idx,prompt,response,prompt_length,response_length\n"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# -- the simulator -----------------------------------------------------------------------------------------
def tiny_profile(**kw) -> TimePerTokenProfile:
    base = dict(
        name="t",
        model="m",
        hardware="h",
        decode_base_s=0.01,
        decode_per_seq_s=0.001,
        decode_per_ctx_token_s=1e-6,
        prefill_base_s=0.0,
        prefill_per_new_token_s=1e-4,
        kv_capacity_tokens=100_000,
        max_num_seqs=64,
        kv_bytes_per_token=1000,
        price_per_gpu_second=1.0,
    )
    return TimePerTokenProfile(**{**base, **kw})


def one_step(prompt_len: int, lengths: list[list[int]]) -> Workload:
    n = np.array([len(x) for x in lengths])
    batch = PromptBatch(
        uids=[f"p{i}" for i in range(len(lengths))],
        prompt_lengths=np.full(len(lengths), prompt_len),
        n_samples=n,
        true_lengths=np.array([np.mean(x) for x in lengths], dtype=float),
    )
    return Workload("t", [WorkloadStep(0, batch, np.array([v for x in lengths for v in x]))])


def fixed(registry, n: int, migrator: str = "none"):
    return registry.scheduler("openrlhf").derive(
        name="fixed-test", scaler={"name": "fixed", "params": {"num_actors": n}}, migrator=migrator
    )


def test_one_actor_matches_the_closed_form(registry):
    prof = tiny_profile()
    sim = Simulator(prof, Cluster.uniform(1, 1), registry=registry)
    res = sim.run(fixed(registry, 1), one_step(10, [[5, 5, 5]]))
    r = res.reports[0]
    # the plan's own wall time (charged: the engine starts after it), then 3 sequences prefilled together (30 new
    # tokens), then 5 decode steps of batch 3, context 30 + 3k
    decode = sum(0.01 + 0.001 * 3 + 1e-6 * (30 + 3 * k) for k in range(5))
    assert r.planner_ms > 0
    assert r.generation_s == pytest.approx(r.planner_ms / 1000 + 30 * 1e-4 + decode)
    assert r.samples == 3 and r.idle_fraction == pytest.approx(0.0, abs=1e-9)


def test_max_num_seqs_makes_waves(registry):
    sim1 = Simulator(tiny_profile(max_num_seqs=4), Cluster.uniform(1, 1), registry=registry)
    sim2 = Simulator(tiny_profile(max_num_seqs=2), Cluster.uniform(1, 1), registry=registry)
    w = one_step(4, [[100, 100, 100, 100]])
    t1 = sim1.run(fixed(registry, 1), w).reports[0].generation_s
    t2 = sim2.run(fixed(registry, 1), w).reports[0].generation_s
    # two waves of two sequences instead of one wave of four: 2 x (base + 2 per-seq) against (base + 4 per-seq)
    assert t2 / t1 == pytest.approx(2 * (0.01 + 0.002) / (0.01 + 0.004), rel=0.02)


def test_kv_capacity_preempts_and_recomputes_yet_finishes_everything(registry):
    sim = Simulator(tiny_profile(kv_capacity_tokens=300), Cluster.uniform(1, 1), registry=registry)
    res = sim.run(fixed(registry, 1), one_step(20, [[100, 120, 140, 160]]))
    assert res.steps[0].preemptions > 0
    assert res.reports[0].samples == 4


def test_billing_serverless_and_serverful(registry):
    prof = tiny_profile(cold_start_s=2.0)
    sim = Simulator(prof, Cluster.uniform(1, 4), registry=registry)
    r = sim.run(fixed(registry, 4), one_step(10, [[50], [50], [400], [50]])).reports[0]
    assert r.gpu_seconds_serverful == pytest.approx(4 * r.time_s)
    busy = sorted(r.actor_busy_s)
    assert r.gpu_seconds == pytest.approx(sum(busy) + 4 * 2.0)  # each actor until its last token, plus cold start
    assert r.cold_starts == 4
    assert r.generation_s == pytest.approx(r.planner_ms / 1000 + 2.0 + max(busy))  # the plan and start-up too
    assert r.idle_fraction == pytest.approx(1 - sum(busy) / (4 * (r.generation_s - r.planner_ms / 1000)))
    assert r.imbalance == pytest.approx(max(busy) / np.mean(busy))


class MoveOnce:
    """Test migrator: moves the longest-running sample of actor 0 to actor 1, once (mode from params)."""

    def __init__(self, params):
        self.mode, self.done = params.mode, False

    def decide(self, progress):
        started = [s for s in progress.unfinished if s.actor_id == 0 and s.tokens_generated > 0]
        if self.done or not started:
            return []
        self.done = True
        s = max(started, key=lambda s: s.tokens_generated)
        return [MigrationDecision.move(s, 1, self.mode)]


class MoveParams(Record):
    mode: str = "tokens"


class MovePlugin:
    @hookimpl
    def rlhfless_register_migrators(self, register):
        register(PolicySpec(name="move-once", factory=MoveOnce, params=MoveParams))


@pytest.mark.parametrize("mode", ["tokens", "kv"])
def test_migration_keeps_every_token_and_charges_its_cost(mode):
    pm = PluginManager()
    pm.register(MovePlugin(), name="move-plugin")
    reg = pm.registry
    prof = tiny_profile(prefill_per_new_token_s=1e-3, kv_bytes_per_token=10**6, intra_node_gbps=1.0)
    sim = Simulator(prof, Cluster.uniform(1, 2), registry=reg)
    config = fixed(reg, 2, migrator={"name": "move-once", "params": {"mode": mode}})
    # prompt 0 -> actor 0 (two samples: 400 and 100 tokens), prompt 1 -> actor 1 (50 tokens)
    res = sim.run(config, one_step(20, [[400, 100], [50]]))
    r = res.reports[0]
    assert r.migrations == 1
    out = res.steps[0].outcome
    assert [s.response_length for s in out.samples] == [400, 100, 50]
    # every token generated once: the long sample's pieces (cut on actor 0, finished on actor 1) add up to it
    assert [sum(t for _, t in p) for p in out.segments] == [400, 100, 50]
    assert [e for e, _ in out.segments[0]] == [0, 1]
    assert [s.migrations for s in out.samples] == [1, 0, 0]
    assert out.samples[0].actor_id == 1  # the long sample finished on actor 1


def test_predictor_learns_across_steps(registry):
    w = synthetic_workload(SyntheticWorkload(64, 4, seed=3), 3)
    sim = Simulator(load_profile("qwen2.5-7b-l40s"), make_cluster(8, 8), registry=registry)
    mae = [r.prediction_mae for r in sim.run(registry.scheduler("rlhfless-paper"), w).reports]
    assert mae[1] < 0.6 * mae[0]  # step 0 is a cold start; then each prompt has a history
    oracle = sim.run(registry.scheduler("oracle"), w).reports
    assert all(r.prediction_mae < mae[1] for r in oracle)


@pytest.mark.parametrize(
    "name", ["openrlhf", "verl", "rlhfless", "rlhfless-paper", "ablation-dedup", "ablation-assign", "oracle"]
)
def test_every_sample_finishes_once(registry, name):
    w = synthetic_workload(SyntheticWorkload(48, 4, seed=1), 2)
    sim = Simulator(load_profile("qwen2.5-3b-h100"), make_cluster(8, 4), registry=registry)
    res = sim.run(registry.scheduler(name), w)
    for step, ws in zip(res.steps, w.steps, strict=True):
        assert step.report.samples == ws.batch.total_samples
        assert step.report.time_s >= step.report.generation_s > 0
        out = step.outcome
        assert [(s.uid, s.sample_index) for s in out.samples] == [
            (u, k) for u, n in zip(ws.batch.uids, ws.batch.n_samples.tolist(), strict=True) for k in range(n)
        ]
        assert [s.response_length for s in out.samples] == ws.lengths.tolist()
        assert [sum(t for _, t in p) for p in out.segments] == ws.lengths.tolist()


def _presets_that_consult(registry, consult: bool) -> list[str]:
    from rlhfless_sdk.rollout.modes import consults_predictor

    return [n for n in registry.names("scheduler") if consults_predictor(registry.scheduler(n), registry) == consult]


def test_a_scheduler_said_to_consult_no_predictor_runs_alike_with_any(registry):
    """``consults_predictor`` (``rlhfless_sdk.rollout.modes``), from each policy's ``reads_predictions``: every
    preset it says consults no predictor (so `compare-predictors` refuses to simulate predictors in it) runs step
    for step alike with predictors as far apart as the prompts' lengths and the true lengths; the ones said to
    consult one include presets that run otherwise (the check tells them apart)."""
    w = synthetic_workload(SyntheticWorkload(24, 4, seed=5, runaway=0.05), 4)
    # a fixed plan time: the runs compare to the last digit (each plan's own wall time differs)
    sim = Simulator(
        load_profile("qwen2.5-7b-l40s"), make_cluster(6, 8), registry=registry, split_probe_steps=2, plan_s=0.0
    )
    blind = _presets_that_consult(registry, False)
    assert {"openrlhf", "verl", "openrlhf-async", "research-elastic-stream", "rlhfless-stream"} <= set(blind)

    def times(config) -> list[tuple[float, float]]:
        return [(r.time_s, r.gpu_seconds) for r in sim.run(config, w).reports]

    for name in blind:
        config = registry.scheduler(name)
        assert times(config.derive(predictor="prompt-length")) == times(config.derive(predictor="oracle")), name
    differs = [
        n
        for n in ("rlhfless-paper", "ablation-assign")
        if times(registry.scheduler(n).derive(predictor="prompt-length"))
        != times(registry.scheduler(n).derive(predictor="oracle"))
    ]
    assert differs and all(n in _presets_that_consult(registry, True) for n in differs)


# -- the command line --------------------------------------------------------------------------------------
def test_simulate_json_and_plot(tmp_path):
    png = tmp_path / "p.png"
    args = "simulate --prompts 32 --samples 4 --steps 2 --gpus 8 --json"
    res = CliRunner().invoke(
        main, [*args.split(), "--plot", str(png), "--scheduler", "openrlhf", "--scheduler", "rlhfless"]
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    names = [s["name"] for s in out["schedulers"]]
    assert names == ["openrlhf", "rlhfless"]
    for s in out["schedulers"]:
        assert {"total_time_s", "total_gpu_seconds", "speedup", "cost_reduction", "steps"} <= set(s)
        assert len(s["steps"]) == 2
    assert out["schedulers"][0]["speedup"] == 1.0 and out["schedulers"][0]["cost_reduction"] == 0.0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_ablation_table():
    res = CliRunner().invoke(main, ["simulate", "--prompts", "32", "--samples", "4", "--steps", "2", "--ablation"])
    assert res.exit_code == 0, res.output
    for name in ("ablation-raw", "ablation-dedup", "ablation-assign", "ablation-scale", "oracle"):
        assert name in res.output
    assert "totals" in res.output


def test_simulate_bad_trace_is_a_clear_error(tmp_path):
    bad = write(tmp_path, "bad.csv", CSV_HEAD + "x,1,0,,,3,oops\n")
    res = CliRunner().invoke(main, ["simulate", "--trace", str(bad)])
    assert res.exit_code == 2
    assert "line 2, field 'response_length'" in res.output


@needs_gpqa
def test_simulate_real_trace_ablation():
    res = CliRunner().invoke(main, ["simulate", "--trace", str(GPQA), "--steps", "3", "--ablation", "--json"])
    assert res.exit_code == 0, res.output
    rows = {s["name"]: s for s in json.loads(res.output)["schedulers"]}
    assert rows["ablation-dedup"]["steps"][0]["prefill_tokens_saved"] > 0  # the shared system prompt
    assert rows["oracle"]["steps"][1]["prediction_mae"] == 0.0


def test_synthetic_length_distribution_is_configurable():
    res = CliRunner().invoke(
        main,
        [
            "simulate",
            "--prompts",
            "16",
            "--samples",
            "2",
            "--steps",
            "1",
            "--median-length",
            "40",
            "--max-length",
            "60",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    lengths = json.loads(res.output)["workload"]["response_length"]
    assert lengths["max"] <= 60 and 20 <= lengths["median"] <= 60


def test_simulate_reports_the_time_cost_frontier():
    res = CliRunner().invoke(
        main,
        [
            "simulate",
            "--prompts",
            "24",
            "--samples",
            "4",
            "--steps",
            "2",
            "--gpus",
            "6",
            "--json",
            "--scheduler",
            "openrlhf",
            "--scheduler",
            "rlhfless-slo",
        ],
    )
    assert res.exit_code == 0, res.output
    rows = {s["name"]: s for s in json.loads(res.output)["schedulers"]}
    for step in rows["rlhfless-slo"]["steps"]:
        front = step["frontier"]
        assert [f["num_actors"] for f in front] == list(range(1, 7))  # every candidate N
        (chosen,) = [f for f in front if f["chosen"]]
        assert chosen["num_actors"] == step["num_actors"]
        assert chosen["simulated_time_s"] == pytest.approx(step["time_s"])
        assert all(f["predicted_time_s"] > 0 and f["simulated_gpu_seconds"] > 0 for f in front)
    assert len(rows["openrlhf"]["steps"][0]["frontier"]) == 1  # a fixed scaler has one candidate
    res = CliRunner().invoke(
        main, ["simulate", "--prompts", "8", "--samples", "2", "--steps", "1", "--json", "--no-frontier"]
    )
    assert "frontier" not in json.loads(res.output)["schedulers"][1]["steps"][0]


@settings(max_examples=12, deadline=None)
@given(
    name=st.sampled_from(["openrlhf", "verl", "rlhfless", "rlhfless-paper", "ablation-dedup"]),
    prompts=st.integers(2, 24),
    n=st.integers(1, 4),
    seed=st.integers(0, 10_000),
    cold=st.floats(0.5, 20.0),
)
def test_start_up_is_charged_to_time_and_cost_and_serverless_never_exceeds_serverful(
    registry_with, name, prompts, n, seed, cold
):
    """One start-up model for every scheduler: a cold engine starts ``cold_start_s`` late (time) and is billed
    for it (cost); an engine that worked in the previous step is warm. Serverless <= serverful on every step."""
    registry = registry_with()
    prof = load_profile("qwen2.5-7b-l40s").model_copy(update={"cold_start_s": cold})
    sim = Simulator(prof, Cluster.uniform(1, 4), registry=registry)
    config = registry.resolve(name)
    work = synthetic_workload(SyntheticWorkload(prompts, n, seed=seed, median_length=60, max_length=200), 3)
    res = sim.run(config, work)
    for i, r in enumerate(res.reports):
        assert r.gpu_seconds <= r.gpu_seconds_serverful * (1 + 1e-9)
        if i == 0:
            assert r.cold_starts >= 1 and r.generation_s >= cold  # every engine starts in the first step
    first, later = res.reports[0], res.reports[1:]
    if name in ("openrlhf", "verl"):  # a fixed fleet: warm after the first step
        assert all(r.cold_starts == 0 for r in later)
        assert first.cold_starts == sum(b > 0 for b in first.actor_busy_s)


def test_runaway_samples_hit_the_cap_and_leave_the_other_lengths_alone():
    base = SyntheticWorkload(200, 4, seed=5, max_length=4096)
    _, plain = base.batch()
    _, loops = SyntheticWorkload(200, 4, seed=5, max_length=4096, runaway=0.1).batch()
    changed = loops != plain
    assert (loops[changed] == 4096).all()  # a runaway runs to the cap; nothing else moves
    assert 0.05 < (loops == 4096).mean() < 0.2


@pytest.mark.parametrize("memory", ["colocated", "dedicated"])
def test_simulate_takes_kv_capacity_algorithm_and_long_reasoning_tails(memory):
    """Synchronous engines get the memory asked for; the async pipeline's engines always the dedicated one."""
    args = ["simulate", "--prompts", "24", "--samples", "4", "--steps", "2", "--max-length", "512"]
    args += ["--runaway", "0.2", "--dedicated-kv-tokens", "20000", "--colocated-kv-tokens", "9000"]
    args += ["--memory", memory, "--algo", "ppo", "--no-frontier", "--json"]
    args += ["--scheduler", "openrlhf", "--scheduler", "openrlhf-async", "--rollout-gpus", "8"]  # PPO's learner: 7
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["kv_capacity_tokens"] == (9000 if memory == "colocated" else 20000) and out["algo"] == "ppo"
    assert out["dedicated_kv_capacity_tokens"] == 20000 and out["colocated_kv_capacity_tokens"] == 9000
    assert out["workload"]["response_length"]["max"] == 512
    sync, asyn = out["schedulers"]
    assert asyn["rollout_gpus"] == 8 and sync["rollout_gpus"] is None
    for row in out["schedulers"]:
        assert {"stale_token_fraction", "max_token_age_steps", "steady_step_s", "peak_gpus", "bound_s"} <= set(row)
        assert row["steady_step_s"] is None and row["speedup_steady"] is None  # 2 steps: no steady step
        assert row["peak_gpus"] == 16 and 0 < row["bound_fraction"] <= 1
        for step in row["steps"]:
            assert step["estimated_generation_s"] is not None and step["estimate_error"] is not None
    assert sync["stale_token_fraction"] == 0 and asyn["max_token_age_steps"] == 1


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--dedicated-kv-tokens", "0", "--dedicated-kv-tokens"),
        ("--kv-tokens", "5000", "--dedicated-kv-tokens N"),  # which memory? say it
        ("--colocated-kv-tokens", "999999999", "exceeds kv_capacity_tokens"),
        ("--runaway", "1.5", "--runaway"),
        ("--algo", "dpo", "--algo"),
        ("--rollout-gpus", "most", "'best'"),
        ("--max-actors", "40", "--allow-burst"),
    ],
)
def test_simulate_refuses_bad_model_flags(flag, value, message):
    res = CliRunner().invoke(main, ["simulate", "--prompts", "4", "--steps", "1", flag, value])
    assert res.exit_code in (1, 2) and message in res.output, res.output


def test_grpo_learns_cheaper_than_ppo_on_the_same_schedule(registry):
    work = synthetic_workload(SyntheticWorkload(32, 4, seed=1), 1)
    prof = load_profile("qwen2.5-7b-l40s")
    runs = {
        algo: Simulator(prof, Cluster.uniform(1, 4), registry=registry, algo=algo, plan_s=0.0).run(
            registry.scheduler("openrlhf"), work
        )
        for algo in ("ppo", "grpo")
    }
    ppo, grpo = runs["ppo"].reports[0], runs["grpo"].reports[0]
    assert grpo.generation_s == ppo.generation_s
    assert grpo.prepare_s == pytest.approx(
        ppo.prepare_s * prof.grpo_prepare_gpu_s_per_token / prof.prepare_gpu_s_per_token
    )
    assert grpo.learn_s < ppo.learn_s and grpo.time_s < ppo.time_s
    assert work.algo == "grpo"  # four samples a prompt: critic-free by default


def test_plan_and_compare_predictors_take_the_kv_capacity():
    res = CliRunner().invoke(main, ["plan", "--prompts", "32", "--colocated-kv-tokens", "5000", "--json"])
    assert res.exit_code == 0, res.output
    args = ["compare-predictors", "--prompts", "16", "--samples", "2", "--steps", "2", "--predictors", "ewma"]
    args += ["--memory", "dedicated", "--dedicated-kv-tokens", "5000", "--colocated-kv-tokens", "4000"]
    args += ["--runaway", "0.1", "--max-length", "300", "--json"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["workload"]["response_length"]["max"] == 300


@pytest.mark.parametrize("cold", [0.5, 600.0])
def test_burst_actors_run_beyond_the_fleet_and_are_billed_on_top_of_it(registry, cold):
    """Burst engines are billed on top of the fleet for as long as they are held: released after a step (start-up
    cheaper than idling through learning), each pays its start-up again; kept (start-up dearer), each is billed
    through the idle tail and learning, and from the next step's start."""
    work = synthetic_workload(SyntheticWorkload(64, 4, seed=6), 3)
    prof = load_profile("qwen2.5-7b-l40s").model_copy(update={"cold_start_s": cold})
    sim = Simulator(prof, Cluster.uniform(1, 4), registry=registry)
    burst = registry.scheduler("openrlhf").derive(
        name="burst-test", scaler={"name": "fixed", "params": {"num_actors": 6}}, burst=2.0
    )
    res = sim.run(burst, work)
    for i, st_ in enumerate(res.steps):
        r = st_.report
        assert r.num_actors == 6  # 2 engines beyond the 4-GPU fleet
        assert r.peak_gpus == 6
        assert sum(p.node.startswith("burst") for p in st_.plan.placement if p.actor.role == "decode") == 2
        bursts = [e for e in st_.usage.engines if e.burst]
        assert len(bursts) == 2
        extra = sum(held_s(e, r.time_s) for e in bursts)
        assert r.gpu_seconds_serverful == pytest.approx(4 * r.time_s + extra)  # the fleet, plus burst as held
        assert r.gpu_seconds <= r.gpu_seconds_serverful * (1 + 1e-9)
        for e in bursts:
            if cold > 100:  # kept: held to the step's end, and from the step's start after the first step
                assert e.kept and e.warm_in == (i > 0)
                start = 0.0 if i else e.first_s - e.cold_start_s
                assert held_s(e, r.time_s) == pytest.approx(r.time_s - start)
            else:  # released: billed its work plus a start-up, every step
                assert not e.kept and not e.warm_in and e.cold_start_s == cold
                assert held_s(e, r.time_s) == pytest.approx(e.last_s - e.first_s + cold)


def test_max_actors_lets_scaling_schedulers_burst_and_keeps_fixed_ones_on_the_fleet():
    args = ["simulate", "--prompts", "32", "--samples", "4", "--steps", "2", "--gpus", "4", "--gpus-per-node", "4"]
    args += ["--max-actors", "8", "--no-frontier", "--json", "--scheduler", "openrlhf", "--scheduler", "rlhfless-fast"]
    res = CliRunner().invoke(main, [*args, "--allow-burst"])
    assert res.exit_code == 0, res.output
    fixed, fast = json.loads(res.output)["schedulers"]
    assert all(s["num_actors"] == 4 and s["peak_gpus"] == 4 for s in fixed["steps"])
    assert all(s["num_actors"] <= 8 and 4 <= s["peak_gpus"] <= 8 for s in fast["steps"])
    assert fast["peak_gpus"] == max(s["peak_gpus"] for s in fast["steps"])


def test_simulate_compares_at_equal_peak_gpus_unless_burst_is_asked(tmp_path):
    """Presets with `burst:` run on the fleet by default; with --allow-burst they may hold more, and the table
    flags every row that does."""
    six = tmp_path / "six.yaml"
    six.write_text(
        "name: six\npredictor: prompt-length\nprefill_planner: none\nassigner: least-pending\nmigrator: none\n"
        "scaler: {name: fixed, params: {num_actors: 6}}\nplacer: pack\nburst: 2.0\n"
    )
    args = ["simulate", "--prompts", "48", "--samples", "4", "--steps", "3", "--gpus", "4", "--gpus-per-node", "4"]
    args += ["--no-frontier", "--scheduler", "openrlhf", "--scheduler", "rlhfless-fast", "--scheduler", str(six)]
    res = CliRunner().invoke(main, [*args, "--json"])
    assert res.exit_code == 0, res.output
    for row in json.loads(res.output)["schedulers"]:
        assert row["peak_gpus"] == 4 and all(s["peak_gpus"] == 4 and s["num_actors"] <= 4 for s in row["steps"])
    res = CliRunner().invoke(main, [*args, "--allow-burst", "--json"])
    rows = json.loads(res.output)["schedulers"]
    assert rows[2]["peak_gpus"] == 6 and all(s["num_actors"] == 6 for s in rows[2]["steps"])
    res = CliRunner().invoke(main, [*args, "--allow-burst"])
    assert "six !" in res.output and "holds more than the 4 GPUs" in res.output
    res = CliRunner().invoke(main, args)
    assert " !" not in res.output and "equal peak" in res.output


def test_a_shared_pull_queue_starts_every_sample_once_on_the_simulated_engines(registry):
    """`work-pull` under KV pressure: engines take samples as they free up; every sample is generated once, to
    its length, and an engine is never handed more than its buffer of waiting samples."""
    starts: list[tuple[int, int, int]] = []  # (sample, engine, samples waiting there before it)

    class Recording(SimulatedBackend):
        def start(self, samples, engines):
            for sid, e in zip(samples, engines, strict=True):
                starts.append((sid, e, len(self.actors[e].waiting)))
            super().start(samples, engines)

    work = synthetic_workload(SyntheticWorkload(24, 4, seed=5, median_length=400, max_length=2048), 2)
    config = registry.scheduler("openrlhf").derive(
        name="pull-test", assigner={"name": "work-pull", "params": {"buffer": 2}}, predictor="model"
    )
    prof = load_profile("qwen2.5-7b-l40s").model_copy(update={"kv_capacity_tokens": 20_000})
    sim = Simulator(prof, Cluster.uniform(1, 4), registry=registry)
    for ws in work.steps:
        starts.clear()
        planner = sim.planner(config)
        plan = planner.plan(ws.batch, step=ws.step)
        assert plan.pull_buffer == 2
        backend = Recording(prof, sim.cluster, ws, plan)
        outcome = StepController(planner, backend, ws.batch, plan, step=ws.step).run()
        assert sorted(s for s, _, _ in starts) == list(range(ws.batch.total_samples))  # each started once
        assert max(w for _, _, w in starts) < 2  # at most the buffer waiting, this one included
        assert [s.response_length for s in outcome.samples] == ws.lengths.tolist()
        assert len({e for _, e, _ in starts}) == 4  # every engine pulled work


def test_frontier_plot_runs_the_baselines_at_each_cluster_size(tmp_path):
    png = tmp_path / "frontier.png"
    args = ["simulate", "--prompts", "16", "--samples", "2", "--steps", "3", "--gpus", "4", "--gpus-per-node", "4"]
    args += ["--no-frontier", "--scheduler", "openrlhf", "--scheduler", "rlhfless-fast", "--json"]
    args += ["--frontier-plot", str(png), "--frontier-gpus", "4,6"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    front = json.loads(res.output)["frontier"]
    assert sorted((r["name"], r["gpus"]) for r in front) == [("openrlhf", 4), ("openrlhf", 6)]
    assert all(r["peak_gpus"] == r["gpus"] for r in front)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = CliRunner().invoke(main, [*args[:-4], "--frontier-plot", str(png), "--frontier-gpus", "4,5x"])
    assert bad.exit_code == 2 and "--frontier-gpus" in bad.output


def test_length_growth_lengthens_the_last_step_by_the_factor():
    flat = synthetic_workload(SyntheticWorkload(64, 4, seed=2, max_length=100_000), 4)
    grown = synthetic_workload(SyntheticWorkload(64, 4, seed=2, max_length=100_000), 4, length_growth=3.0)
    assert grown.name.endswith("-grow3")
    assert np.array_equal(flat.steps[0].lengths, grown.steps[0].lengths)
    ratio = np.median(grown.steps[-1].lengths) / np.median(flat.steps[-1].lengths)
    assert 2.9 < ratio < 3.1


@pytest.mark.parametrize("samples", [1, 4])
def test_prefix_caching_prefills_a_groups_prompt_once_an_engine(samples):
    """With vLLM's prefix cache on, a sample whose group-mate already prefilled the prompt on its engine reads it
    from the cache: a step of n > 1 samples a prompt gets cheaper by about (n - 1) / n of its prompt prefill; with one
    sample a prompt nothing changes."""
    from rlhfless_sdk.api.plugins import get_plugin_manager

    registry = get_plugin_manager().registry
    profile = load_profile("qwen2.5-7b-l40s").model_copy(update={"prefill_per_new_token_s": 1e-3})
    workload = synthetic_workload(SyntheticWorkload(32, samples, seed=3), 2)
    times = {}
    for caching in (False, True):
        sim = Simulator(profile, Cluster.of_gpus(2, 2), registry=registry, prefix_caching=caching, plan_s=0.0)
        result = sim.run(registry.scheduler("openrlhf"), workload)
        times[caching] = sum(s.report.generation_s for s in result.steps)
    if samples == 1:
        assert times[True] == pytest.approx(times[False])
    else:
        assert times[True] < times[False]
