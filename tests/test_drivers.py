"""The step drivers: which one a scheduler gets (declared capabilities, no probing), what a backend that cannot run
it says, the fallbacks of a step reaching its report in every mode, and `plan` planning where `simulate` runs."""

from __future__ import annotations

import json

import pytest
import rlhfless_test_helpers as H  # registered by conftest.py
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfless_sdk import NoParams, PolicySpec
from rlhfless_sdk.api.errors import UnknownPolicyError
from rlhfless_sdk.api.records import Cluster
from rlhfless_sdk.cli.main import main
from rlhfless_sdk.planning.planner import planner_for
from rlhfless_sdk.rollout.drivers import refusal
from rlhfless_sdk.rollout.modes import (
    ASYNC,
    BATCH_CUT,
    PLAIN,
    TAIL_ROUNDS,
    TOKEN_BUDGET,
    mode_for,
    mode_names,
    planned_mode,
)
from rlhfless_sdk.simulation.simulator import Simulator
from rlhfless_sdk.workloads.synthetic import SyntheticWorkload
from rlhfless_sdk.workloads.traces import synthetic_workload

PROFILE = "qwen2.5-7b-l40s"


class RaisingPredictor:
    """A length predictor whose every call raises (a plugin bug)."""

    def __init__(self, params=None) -> None:
        pass

    def predict(self, batch):
        raise RuntimeError("predictor bug")

    def observe(self, samples) -> None:
        pass


RAISING = PolicySpec(name="raises", factory=RaisingPredictor, params=NoParams)


@pytest.fixture
def registry(registry_with):
    return registry_with(raising=H.policy_plugin(predictor=RAISING))


def _profile():
    from rlhfless_sdk.api.profiles import load_profile

    return load_profile(PROFILE)


def _small_learner():
    """The profile without its learner block, for async pipelines on 4 GPUs (a 7B learner's state needs 4 L40S
    alone: ``tests/test_stream.py`` tests that floor)."""
    return _profile().model_copy(update={"learner": None})


EXPECTED = {
    "openrlhf": PLAIN,
    "verl": PLAIN,
    "rlhfless": TAIL_ROUNDS,  # where the predicted tail pays; else a plain round
    "rlhfless-paper": PLAIN,
    "rlhfless-fast": BATCH_CUT,
    "rlhfless-onpolicy": TAIL_ROUNDS,
    "openrlhf-async": ASYNC,
    "openrlhf-async-partial": ASYNC,
}


@pytest.mark.parametrize(("preset", "mode"), sorted(EXPECTED.items()))
def test_each_preset_gets_the_driver_its_straggler_policy_declares(registry, preset, mode):
    planner = planner_for(registry.scheduler(preset), _profile(), Cluster.of_gpus(8, 8), registry)
    assert planned_mode(planner).name == mode
    assert mode_for(registry.scheduler(preset), registry) == planned_mode(planner)  # no planner needed to ask


def test_a_token_budget_policy_gets_its_driver_and_a_backend_without_it_refuses_naming_it(registry):
    config = registry.scheduler("openrlhf").derive(name="budgeted", straggler={"name": "partial"})
    planner = planner_for(config, _profile(), Cluster.of_gpus(8, 8), registry)
    mode = planned_mode(planner)
    assert mode.name == TOKEN_BUDGET
    assert refusal(config, mode, mode_names(), "the simulator") is None
    why = refusal(config, mode, {PLAIN, BATCH_CUT}, "a test backend")
    assert why is not None and "'partial'" in why and "token-budget" in why and "a test backend" in why
    assert "plain, batch-cut" in why  # what the backend does run


def test_a_third_party_straggler_policy_declares_its_capability_by_protocol(registry_with):
    """A plugin's own over-provisioning policy gets tail rounds; with ``keeps_tokens`` True, a batch cut: what it
    implements says it, whatever it is named."""

    class Rounds:
        def __init__(self, params=None) -> None:
            pass

        def segment_tokens(self, step):
            return None

        def over_provision(self, step):
            return 0.5

    class Keeps(Rounds):
        def keeps_tokens(self, step):
            return True

    specs = [PolicySpec(name=n, factory=f, params=NoParams) for n, f in (("my-rounds", Rounds), ("my-cut", Keeps))]
    registry = registry_with(mine=H.policy_plugin(straggler=specs))
    base = registry.scheduler("openrlhf")
    for name, mode in (("my-rounds", TAIL_ROUNDS), ("my-cut", BATCH_CUT)):
        config = base.derive(name=name, straggler={"name": name})
        assert planned_mode(planner_for(config, _profile(), Cluster.of_gpus(8, 8), registry)).name == mode
        assert mode_for(config, registry).name == mode


def test_a_toy_pipeline_registered_in_one_file_runs_on_the_simulator_and_openrlhf_refuses_it_in_one_line(
    registry_with,
):
    """A new way of running steps is one registration through pluggy, where it is written (here, this test: no
    source file of the project changes): ``pipeline: mode: toy`` checks out, mode_of names it, the simulator runs
    it through its ``simulate``, and the OpenRLHF adapter, which does not run it, refuses it in one line naming the
    pipeline. Without the plugin the name is unknown, said by the registry."""
    from rlhfless_openrlhf.capabilities import adapter_refusal

    from rlhfless_sdk import PipelineSpec
    from rlhfless_sdk.api.errors import UnknownPolicyError

    ran = []

    def simulate(sim, config, workload, on_step, mode):  # the toy: plain steps, each on the whole fleet
        ran.append(mode)
        return sim.run_plain(sim.planner(config), workload, on_step)

    toy = H.plugin(rlhfless_register_modes=lambda register: register(PipelineSpec("toy", simulate=simulate)))
    registry = registry_with(toy=toy)
    config = registry.scheduler("openrlhf").derive(name="toyed", pipeline={"mode": "toy"})
    assert registry.check_config(config) == [] and registry.pipelines["toy"].plugin == "toy"
    mode = mode_for(config, registry)
    assert mode.name == "toy" and mode.pipelined and not mode.keeps_tokens
    sim = Simulator(_profile(), Cluster.of_gpus(8, 8), registry=registry)
    assert "toy" in sim.modes
    result = sim.run(config, synthetic_workload(SyntheticWorkload(16, 4, seed=0), 2))
    assert ran == [mode] and len(result.reports) == 2
    why = adapter_refusal(config, registry)
    assert why is not None and "\n" not in why and "pipeline: toy" in why and "the OpenRLHF adapter" in why
    bare = registry_with()
    assert [p.message for p in bare.check_config(config)] == [
        "unknown pipeline mode 'toy' (known: sync, async, stream)"
    ]
    with pytest.raises(UnknownPolicyError, match="toy"):
        mode_for(config, bare)


def test_a_new_straggler_behaviour_is_its_policy_and_its_driver(registry_with):
    """A straggler behaviour with a driver of its own (``tests/rlhfless_toy_mode.py``, one file): the policy, the
    driver and a preset, registered by one plugin through pluggy, nothing else. The simulator runs its steps through
    the session; the OpenRLHF adapter offers it (a session that carries no tokens runs there as rounds). Without the
    plugin, its preset is unknown and its policy's claim falls to the built-in drivers."""
    from rlhfless_openrlhf.capabilities import adapter_refusal, runs

    toy = H.toy_mode()

    registry = registry_with(toy=toy)
    config = registry.scheduler(toy.NAME)
    assert mode_for(config, registry).name == toy.NAME and registry.drivers[toy.NAME].plugin == "toy"
    sim = Simulator(_profile(), Cluster.of_gpus(8, 8), registry=registry)
    result = sim.run(config, synthetic_workload(SyntheticWorkload(16, 4, seed=0), 3))
    assert len(result.reports) == 3 and [r.samples for r in result.reports] == [64, 64, 64]
    assert toy.NAME in runs(registry) and adapter_refusal(config, registry) is None
    assert toy.NAME not in runs(registry_with())
    # the toy pipeline (its simulator run, its own run on OpenRLHF) with the toy driver's steps inside it
    piped = registry.scheduler(toy.PIPE)
    mode = mode_for(piped, registry)
    assert (mode.name, mode.driver, mode.pipelined) == (toy.PIPE, toy.NAME, True)
    result = sim.run(piped, synthetic_workload(SyntheticWorkload(16, 4, seed=0), 3))
    assert [r.samples for r in result.reports] == [64, 64, 64]
    assert toy.PIPE in runs(registry) and adapter_refusal(piped, registry) is None
    with pytest.raises(UnknownPolicyError, match=toy.NAME):
        registry_with().scheduler(toy.NAME)


def test_a_driver_that_carries_tokens_is_refused_by_the_adapter_in_one_line(registry_with):
    """A plugin's driver whose session keeps tokens between steps needs a carry of its own on OpenRLHF: the
    adapter refuses it in one line naming the policy and the driver."""
    from rlhfless_openrlhf.capabilities import adapter_refusal

    from rlhfless_sdk import DriverSpec
    from rlhfless_sdk.rollout.drivers import budget_session

    class Keeps:
        def __init__(self, params=None) -> None:
            pass

        def segment_tokens(self, step):
            return 64

    claims = lambda config, straggler, ask: isinstance(straggler, Keeps)  # noqa: E731
    policies = H.policy_plugin(straggler=[PolicySpec(name="keeps", factory=Keeps, params=NoParams)])
    driver = H.plugin(
        rlhfless_register_modes=lambda register: register(
            DriverSpec("keeps", claims, keeps_tokens=True, session=budget_session)
        )
    )
    registry = registry_with(mine=policies, mine_driver=driver)
    config = registry.scheduler("openrlhf").derive(name="kept", straggler={"name": "keeps"})
    assert mode_for(config, registry).name == "keeps"
    why = adapter_refusal(config, registry)
    assert why is not None and "\n" not in why and "'keeps'" in why and "keeps step driver" in why
    without = registry_with(mine=policies)  # the driver's plugin not loaded: the built-in claim for a non-baseline
    assert mode_for(config, without).name == TOKEN_BUDGET


def _every_preset() -> list[str]:
    from rlhfless_sdk import get_plugin_manager

    return get_plugin_manager().registry.names("scheduler")


@pytest.mark.parametrize("preset", _every_preset())
def test_a_raising_predictor_is_reported_on_every_step_in_every_mode(registry, preset):
    """The fallback to the baseline predictor reaches every step's report, whichever driver runs the preset (a batch
    cut's step that starts no new prompt asks no predictor: the carried pieces keep their first prediction)."""
    config = registry.scheduler(preset).derive(predictor="raises", burst=1.0)
    sim = Simulator(_profile(), Cluster.of_gpus(8, 8), registry=registry, split_probe_steps=1)
    workload = synthetic_workload(SyntheticWorkload(16, 4, seed=0), 3)
    result = sim.run(config, workload)
    fallbacks = [r.fallbacks for r in result.reports]
    if config.pipeline.mode == "stream":  # the stream calls no predictor (prompt order, whichever engine has room)
        assert fallbacks == [[]] * len(result.reports)
        return
    assert all("predictor:raises" in f for f in fallbacks[: len(workload.steps)]), fallbacks


@pytest.mark.parametrize("preset", ["openrlhf", "rlhfless-paper", "rlhfless-fast", "openrlhf-async"])
@pytest.mark.parametrize("burst", [False, True])
def test_plan_plans_on_the_cluster_simulate_runs_on(preset, burst):
    """`plan` and `simulate` build their planners the same way (``planner_for``): the same engine counts to choose
    from, the fleet's (16 here) unless burst engines are allowed."""
    flags = ["--scheduler", preset, "--gpus", "16", "--prompts", "64", "--samples", "4", "--json"]
    flags += ["--allow-burst"] if burst else []
    flags += ["--rollout-gpus", "8"] if preset == "openrlhf-async" else []
    runner = CliRunner()
    planned = runner.invoke(main, ["plan", *flags])
    assert planned.exit_code == 0, planned.output
    plan = json.loads(planned.output)["schedulers"][0]
    simulated = runner.invoke(main, ["simulate", *flags, "--steps", "1"])
    assert simulated.exit_code == 0, simulated.output
    run = json.loads(simulated.output)["schedulers"][0]
    candidates = sorted(c["num_actors"] for c in plan["candidates"])
    if plan["rollout_gpus"]:  # async: its step planned on its rollout GPUs only
        assert candidates[-1] == plan["rollout_gpus"]
        return
    step = run["steps"][0]
    if step.get("frontier"):  # what the simulated step chose from
        assert sorted(f["num_actors"] for f in step["frontier"]) == candidates
    assert step["num_actors"] in candidates and run["peak_gpus"] <= max(candidates[-1], 16)
    # the fleet's 16 engines (a prefill actor takes one of them), 24 with burst for the preset that bursts
    assert candidates[-1] == {"rlhfless-paper": 15, "rlhfless-fast": 24 if burst else 16}.get(preset, 16)


# -- partial rollouts inside the async pipeline (the simulator) -------------------------------------------------
@settings(max_examples=12, deadline=None)
@given(
    steps=st.integers(1, 4),
    per_step=st.integers(1, 8),
    samples=st.integers(1, 4),
    over=st.sampled_from([0.0, 0.5, 1.0]),
    queue=st.integers(1, 2),
    partial=st.booleans(),
    seed=st.integers(0, 3),
)
def test_an_async_pipeline_cut_at_b_groups_trains_every_token_once_and_bounds_its_age(
    steps, per_step, samples, over, queue, partial, seed
):
    """An async pipeline whose batches are cut once B groups are complete (the straggler policy ``partial-batch``):
    every batch but the last trains B groups, every prompt's group trains exactly once with every token it
    generated, and no token is older than the pipeline's lag plus one batch it was carried across."""
    from rlhfless_sdk import get_plugin_manager

    registry = get_plugin_manager().registry
    pipeline = {"mode": "async", "queue_size": queue, "partial_rollout": partial, "rollout_gpus": 2}
    straggler = {"name": "partial-batch", "params": {"over_provision": over}}
    config = registry.scheduler("openrlhf-async").derive(name="async-cut", pipeline=pipeline, straggler=straggler)
    work = synthetic_workload(
        SyntheticWorkload(per_step, samples, seed=seed, median_length=60.0, max_length=400), steps
    )
    total_prompts = sum(len(ws.batch) for ws in work.steps)
    sim = Simulator(_small_learner(), Cluster.of_gpus(4, 4), registry=registry)
    reports = sim.run(config, work).reports
    b = max(len(ws.batch) for ws in work.steps)
    assert [r.groups_trained for r in reports[:-1]] == [b] * (len(reports) - 1)
    assert sum(r.groups_trained for r in reports) == total_prompts
    assert sum(r.response_tokens for r in reports) == sum(int(ws.lengths.sum()) for ws in work.steps)
    assert max(r.max_token_age_steps for r in reports) <= queue + 1


def test_an_async_pipeline_refuses_a_driver_it_does_not_model(registry):
    from rlhfless_sdk.api.errors import RlhflessError

    config = registry.scheduler("openrlhf-async").derive(name="async-tail", straggler={"name": "tail-batch"})
    sim = Simulator(_small_learner(), Cluster.of_gpus(4, 4), registry=registry)
    work = synthetic_workload(SyntheticWorkload(4, 2, seed=0, median_length=60.0, max_length=400), 2)
    with pytest.raises(RlhflessError, match=r"'async-tail'.*tail-rounds.*partial-batch"):
        sim.run(config.derive(pipeline={"mode": "async", "rollout_gpus": 2}), work)
