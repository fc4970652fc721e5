"""The plugin manager: registration, selection by name, and the errors a plugin author can hit."""

from __future__ import annotations

import numpy as np
import pytest
import rlhfless_test_helpers as H  # registered by conftest.py
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from rlhfless_sdk import (
    PluginError,
    PluginManager,
    PolicyRef,
    PolicySpec,
    UnknownPolicyError,
    get_plugin_manager,
    hookimpl,
)
from rlhfless_sdk.api.base import NoParams, Record
from rlhfless_sdk.api.batch import PromptBatch
from rlhfless_sdk.api.kinds import KIND, KINDS
from rlhfless_sdk.api.profiles import load_profile

S = H.sibling("strategies")
PROFILE = load_profile("qwen2.5-7b-l40s")
REG_ALL = PluginManager().registry


class ReverseParams(Record):
    offset: int = 0


class ReverseAssigner:
    """Throwaway policy: prompt i to actor (P - 1 - i + offset) mod N."""

    def __init__(self, params: ReverseParams) -> None:
        self.offset = params.offset

    def assign(self, batch: PromptBatch, predicted: np.ndarray, num_actors: int) -> np.ndarray:
        return (np.arange(len(batch))[::-1] + self.offset) % num_actors


class ThrowawayPlugin:
    @hookimpl
    def rlhfless_register_assigners(self, register):
        register(PolicySpec(name="reverse", factory=ReverseAssigner, params=ReverseParams, description="test"))


def test_throwaway_plugin_is_selected_by_name(bare_pm):
    name = bare_pm.register(ThrowawayPlugin(), name="throwaway")
    try:
        spec = bare_pm.registry.policy("assigner", "reverse")
        assert (spec.plugin, spec.kind) == ("throwaway", "assigner")
        policy = bare_pm.registry.create("assigner", PolicyRef(name="reverse", params={"offset": 1}))
        batch = PromptBatch.empty()
        assert policy.assign(batch, np.zeros(0), 3).shape == (0,)
        assert isinstance(policy, ReverseAssigner) and policy.offset == 1
    finally:
        bare_pm.unregister(name)
    with pytest.raises(UnknownPolicyError):
        bare_pm.registry.policy("assigner", "reverse")


def test_throwaway_plugin_beside_the_installed_ones():
    pm = get_plugin_manager()
    pm.register(ThrowawayPlugin(), name="throwaway")
    try:
        assert "reverse" in pm.registry.names("assigner")
        assert "sorted" in pm.registry.names("assigner")
    finally:
        pm.unregister("throwaway")


def test_builtin_policies_are_a_default_plugin_and_the_adapter_an_entry_point():
    pm = PluginManager()
    assert pm.plugin_names()[:2] == ["rlhfless-modes", "rlhfless-policies"]  # in-process, before any installed one
    assert pm.registry.drivers["plain"].plugin == "rlhfless-modes"  # the built-in modes, through the same hook
    assert "rlhfless-openrlhf" in pm.plugin_names()  # the adapter's commands, through the entry-point group
    assert set(pm.registry.commands) >= {"demo", "profile"}
    assert pm.distribution("rlhfless-policies").startswith("rlhfless ")
    assert pm.registry.policy("predictor", "ewma").plugin == "rlhfless-policies"


def test_duplicate_policy_name_names_both_plugins(bare_pm):
    twin = H.policy_plugin(assigner=PolicySpec(name="reverse", factory=ReverseAssigner, params=ReverseParams))
    bare_pm.register(ThrowawayPlugin(), name="first-plugin")
    bare_pm.register(twin, name="second-plugin")
    with pytest.raises(PluginError, match=r"duplicate assigner name 'reverse'.*'first-plugin'.*'second-plugin'"):
        _ = bare_pm.registry


def test_duplicate_with_a_builtin_name():
    shadow = H.policy_plugin(assigner=PolicySpec(name="sorted", factory=ReverseAssigner, params=ReverseParams))
    pm = PluginManager()
    pm.register(shadow, name="shadow")
    with pytest.raises(PluginError, match=r"'sorted'.*'rlhfless-policies'.*'shadow'"):
        _ = pm.registry


def test_misspelled_hookimpl_fails_loudly(bare_pm):
    typo = H.plugin(rlhfless_register_assigner=lambda register: None)  # singular: matches no hookspec
    with pytest.raises(PluginError, match="rlhfless_register_assigner"):
        bare_pm.register(typo, name="typo")
    assert "typo" not in bare_pm.plugin_names()


def test_hookimpl_with_a_wrong_argument_fails(bare_pm):
    class WrongArg:
        @hookimpl
        def rlhfless_register_assigners(self, registrar):
            pass

    with pytest.raises(PluginError, match="registrar"):
        bare_pm.register(WrongArg(), name="wrong-arg")


def test_unknown_name_lists_the_valid_ones(registry):
    with pytest.raises(UnknownPolicyError) as err:
        registry.policy("assigner", "sortd")
    msg = str(err.value)
    assert "no assigner named 'sortd'" in msg
    for name in ("balanced", "least-pending", "round-robin", "sorted"):
        assert name in msg
    assert "did you mean 'sorted'" in msg
    with pytest.raises(UnknownPolicyError, match=r"valid: .*openrlhf.*rlhfless"):
        registry.scheduler("rlhfles")


def test_register_wants_a_policy_spec(bare_pm):
    bare_pm.register(H.plugin(rlhfless_register_predictors=lambda register: register({"name": "loose"})), name="loose")
    with pytest.raises(PluginError, match="plugin 'loose' passed a dict"):
        _ = bare_pm.registry


def _raises(exc: BaseException):
    """A hook body that raises ``exc`` instead of registering anything."""

    def body(register):
        raise exc

    return body


def test_plugin_raising_in_a_hook_is_named(bare_pm):
    bare_pm.register(H.plugin(rlhfless_register_scalers=_raises(RuntimeError("kaput"))), name="boom")
    with pytest.raises(PluginError, match=r"plugin 'boom' raised in rlhfless_register_scalers.*kaput"):
        _ = bare_pm.registry


def test_factory_must_build_the_kind_protocol(bare_pm):
    not_an_assigner = H.policy_plugin(assigner=PolicySpec(name="lazy", factory=lambda p: object(), params=NoParams))
    bare_pm.register(not_an_assigner, name="lazy-plugin")
    with pytest.raises(PluginError, match=r"does not implement PromptAssigner \(missing: assign\)"):
        bare_pm.registry.create("assigner", "lazy")


def test_bad_params_are_a_validation_error(bare_pm):
    bare_pm.register(ThrowawayPlugin(), name="throwaway")
    problems = bare_pm.registry.check_config(
        __import__("rlhfless_sdk").SchedulerConfig(
            name="x",
            predictor="a",
            prefill_planner="b",
            assigner={"name": "reverse", "params": {"offset": "many"}},
            migrator="c",
            scaler="d",
            placer="e",
        )
    )
    paths = [p.path for p in problems]
    assert "assigner.params.offset" in paths
    assert "predictor.name" in paths


def test_allow_list_env(monkeypatch):
    monkeypatch.setenv("RLHFLESS_PLUGINS", "")
    pm = PluginManager()
    assert pm.plugin_names() == ["rlhfless-modes", "rlhfless-policies"]  # the default plugins always load
    with pytest.raises(UnknownPolicyError, match="RLHFLESS_PLUGINS"):
        pm.registry.policy("predictor", "max-recent")
    monkeypatch.setenv("RLHFLESS_PLUGINS", "example-predictor")
    assert PluginManager().plugin_names() == ["rlhfless-modes", "rlhfless-policies", "example-predictor"]
    monkeypatch.setenv("RLHFLESS_PLUGINS", "rlhfless")  # a distribution name works too
    assert PluginManager().plugin_names() == ["rlhfless-modes", "rlhfless-policies", "rlhfless-openrlhf"]


def test_allow_list_warns_about_missing_plugins(monkeypatch):
    monkeypatch.setenv("RLHFLESS_PLUGINS", "rlhfless-policies,not-installed")
    with pytest.warns(UserWarning, match="not-installed"):
        PluginManager()


def test_disable_autoload_env_keeps_the_default_plugin_and_every_baseline(monkeypatch):
    monkeypatch.setenv("RLHFLESS_DISABLE_PLUGIN_AUTOLOAD", "1")
    pm = PluginManager()
    assert pm.plugin_names() == ["rlhfless-modes", "rlhfless-policies"]
    for kind in KINDS:  # every fallback the planner may need exists
        assert pm.registry.policy(kind.name, kind.baseline).plugin == "rlhfless-policies"
    assert pm.registry.scheduler("rlhfless").name == "rlhfless"
    with pytest.raises(UnknownPolicyError, match="autoload is off"):
        pm.registry.policy("predictor", "max-recent")


def test_trace_env_prints_hook_calls(monkeypatch, capsys):
    monkeypatch.setenv("RLHFLESS_TRACE_HOOKS", "1")
    pm = PluginManager()
    _ = pm.registry
    err = capsys.readouterr().err
    assert "rlhfless_register_assigners" in err
    assert "rlhfless_register_schedulers" in err


# -- policies get read-only inputs ----------------------------------------------------------------------------
def _vandalize(*inputs):
    """Write to every input the way a careless policy would; the first write that is refused raises."""
    for x in inputs:
        if isinstance(x, PromptBatch):
            _vandalize(x.prompt_lengths, x.n_samples, x.uids, x.true_lengths, x.token_flat, x.sample_offsets)
        elif isinstance(x, np.ndarray):
            x.sort()  # in place: `predicted.sort()`, `batch.prompt_lengths //= 2`, `batch.n_samples[:] = 1`
            x[...] = 1
        elif isinstance(x, BaseModel):
            name = next(iter(type(x).model_fields))
            setattr(x, name, getattr(x, name))
        elif isinstance(x, list | tuple):
            if x:
                _vandalize(x[0])
            x.append(x[0] if x else 0)  # a tuple has no append: refused too
        elif isinstance(x, dict):
            x.clear()


class Vandal:
    """One policy of every plan-time kind: it writes to its inputs before answering like the baseline would."""

    def __init__(self, params):
        pass

    def predict(self, batch):
        _vandalize(batch)
        return np.zeros(len(batch))

    def observe(self, samples):
        _vandalize(samples)

    def plan(self, batch, capacity_tokens):
        _vandalize(batch)

    def assign(self, batch, predicted, num_actors):
        _vandalize(predicted, batch)

    def candidates(self, min_actors, max_actors):
        return [max_actors]

    def choose(self, estimates):
        _vandalize(estimates)

    def place(self, decode_loads, cluster, gpus_per_actor, extra):
        _vandalize(decode_loads, extra, cluster)

    def decide(self, progress):
        _vandalize(progress, progress.finished, progress.unfinished)
        return []


@pytest.fixture(scope="module")
def vandal_registry(registry_with):
    """The registry with ``vandal`` registered for every policy kind (one hook per row of the kind table)."""
    vandal = PolicySpec(name="vandal", factory=Vandal)
    return registry_with(**{"vandal-plugin": H.policy_plugin(**{kind.name: vandal for kind in KINDS})})


def _columns(batch):
    return [None if a is None else np.array(a) for a in (batch.prompt_lengths, batch.n_samples, batch.token_flat)]


def _same_plan(a, b):
    skip = {"planner_ms", "fallbacks", "scheduler"}
    return a.model_dump(exclude=skip) == b.model_dump(exclude=skip)


@pytest.mark.parametrize("kind", ["predictor", "prefill_planner", "assigner", "scaler", "placer"])
@given(batch=S.prompt_batches(max_prompts=12))
def test_a_policy_that_writes_to_its_inputs_falls_back_and_changes_nothing(vandal_registry, kind, batch):
    from rlhfless_sdk.api.records import Cluster
    from rlhfless_sdk.planning.costmodel import AnalyticCostModel
    from rlhfless_sdk.planning.planner import StepPlanner

    reg = vandal_registry
    base = reg.scheduler("rlhfless-paper").derive(name="base", predictor="prompt-length", migrator="none")
    cluster, cost = Cluster.uniform(2, 4), AnalyticCostModel(PROFILE)
    before = _columns(batch)
    vandal = base.derive(name="vandal", **{kind: "vandal"})
    fallback = base.derive(name="fallback", **{kind: KIND[kind].baseline})
    if kind == "scaler":  # the vandal's candidates are valid; only its choice writes (and falls back)
        fallback = base.derive(name="fallback", scaler={"name": "fixed", "params": {"num_actors": 8}})
    got = StepPlanner(vandal, cluster=cluster, cost_model=cost, registry=reg).plan(batch)
    assert got.fallbacks == [f"{kind}:vandal"]  # the write was refused: the call failed and fell back
    want = StepPlanner(fallback, cluster=cluster, cost_model=cost, registry=reg).plan(batch)
    assert _same_plan(got, want) or kind == "scaler"
    if kind == "scaler":
        assert got.num_actors == want.num_actors
    for a, b in zip(_columns(batch), before, strict=True):  # the next scheduler sees the original data
        assert (a is None and b is None) or np.array_equal(a, b)


@settings(max_examples=15)
@given(prompts=st.integers(2, 24), n=st.integers(1, 4), seed=st.integers(0, 1000))
def test_a_migrator_and_an_observer_that_write_change_nothing_for_later_schedulers(vandal_registry, prompts, n, seed):
    from rlhfless_sdk.api.profiles import load_profile
    from rlhfless_sdk.cli.simulate import make_cluster
    from rlhfless_sdk.simulation.simulator import Simulator
    from rlhfless_sdk.workloads.synthetic import SyntheticWorkload
    from rlhfless_sdk.workloads.traces import synthetic_workload

    reg = vandal_registry
    w = synthetic_workload(SyntheticWorkload(prompts, n, seed=seed), 2)
    sim = Simulator(
        load_profile("qwen2.5-7b-l40s"), make_cluster(8, 8), registry=reg, plan_s=0.0
    )  # a fixed plan time: the runs compare to the last digit
    alone = sim.run(reg.scheduler("openrlhf"), w).reports
    vandal = reg.scheduler("rlhfless-paper").derive(name="vandal", migrator="vandal", predictor="vandal")
    sim.run(vandal, w)
    after = sim.run(reg.scheduler("openrlhf"), w).reports
    skip = {"planner_ms"}
    assert [r.model_dump(exclude=skip) for r in after] == [r.model_dump(exclude=skip) for r in alone]


# -- failures during a step, slow policies, broken plugins ----------------------------------------------------
class BoomMigrator:
    def __init__(self, params):
        pass

    def decide(self, progress):
        raise RuntimeError("migrator exploded")


class SlowAssigner:
    def __init__(self, params):
        pass

    def assign(self, batch, predicted, num_actors):
        import time

        time.sleep(0.05)
        return np.arange(len(batch)) % num_actors


def step_plugin():
    """Registers a ``boom`` migrator and a ``slow`` assigner."""
    return H.policy_plugin(
        migrator=PolicySpec(name="boom", factory=BoomMigrator), assigner=PolicySpec(name="slow", factory=SlowAssigner)
    )


def _simulate(reg, config):
    from rlhfless_sdk.cli.simulate import make_cluster
    from rlhfless_sdk.simulation.simulator import Simulator
    from rlhfless_sdk.workloads.synthetic import SyntheticWorkload
    from rlhfless_sdk.workloads.traces import synthetic_workload

    sim = Simulator(PROFILE, make_cluster(8, 8), registry=reg)
    return sim.run(config, synthetic_workload(SyntheticWorkload(16, 4, seed=1), 2)).reports


def test_a_migrator_that_raises_is_named_in_the_steps_fallbacks(caplog, registry_with):
    reg = registry_with(**{"step-plugin": step_plugin()})
    reports = _simulate(reg, reg.scheduler("rlhfless-paper").derive(name="boom-test", migrator="boom"))
    assert all(r.fallbacks == ["migrator:boom"] for r in reports)
    assert "migrator 'boom' (plugin 'step-plugin') failed" in caplog.text


def test_a_slow_policy_is_named_once_per_step_with_its_time(caplog, monkeypatch, registry_with):
    import rlhfless_sdk.planning.planner as planner_module

    monkeypatch.setattr(planner_module, "SLOW_POLICY_S", 0.1)  # the 10 s assigner of the report, made short
    reg = registry_with(**{"step-plugin": step_plugin()})
    _simulate(reg, reg.scheduler("rlhfless-paper").derive(name="slow-test", assigner="slow", migrator="none"))
    slow = [r.getMessage() for r in caplog.records if "took" in r.getMessage()]
    assert len(slow) == 2  # one per step, although the assigner runs once per candidate actor count
    assert all("assigner 'slow' (plugin 'step-plugin') took" in m and "call(s)" in m for m in slow)
    assert "in step 0" in slow[0] and "in step 1" in slow[1]


def test_a_broken_installed_plugin_says_how_to_run_without_it(bare_pm):
    broken = H.plugin(rlhfless_register_assigners=_raises(ImportError("needs a package that is not installed")))
    bare_pm.register(broken, name="broken")
    with pytest.raises(PluginError, match="to run without it, set RLHFLESS_PLUGINS"):
        _ = bare_pm.registry


def test_planning_at_100000_gpus_places_every_actor():
    """The placers are linear in actors (they were O(actors x nodes): 94 s at this size)."""
    from rlhfless_sdk.api.records import Actor, Cluster
    from rlhfless_sdk.planning.planner import check_placement

    cluster = Cluster.of_gpus(100_000, 8)
    extra = (Actor(actor_id=0, role="learner", num_gpus=8),)
    n = (100_000 - 8) // 2
    for name in ("pack", "locality-aware"):
        placement = REG_ALL.create("placer", name).place(np.arange(n, dtype=float), cluster, 2, extra)
        check_placement(placement, cluster, n, 2, extra)


# -- a policy that unlocks its read-only inputs ---------------------------------------------------------------
def _unlock_and_write(*arrays):
    """What a careless policy does when numpy refuses its write: turn the flag back on, then write."""
    for a in arrays:
        a.setflags(write=True)
        a[...] = 1
        if a.base is not None:  # a view: try its base too
            a.base.setflags(write=True)


class Unlocker:
    """Writes to its inputs after ``setflags(write=True)`` (the base array of a view used to stay writeable)."""

    def __init__(self, params):
        pass

    def predict(self, batch):
        _unlock_and_write(batch.prompt_lengths, batch.n_samples)
        return np.full(len(batch), 100.0)

    def observe(self, samples):
        pass

    def assign(self, batch, predicted, num_actors):
        _unlock_and_write(predicted, batch.sample_offsets)
        return np.zeros(len(batch), dtype=np.int64)

    def place(self, decode_loads, cluster, gpus_per_actor, extra):
        _unlock_and_write(decode_loads)
        return []


def unlock_plugin():
    """Registers ``unlock`` as a predictor, an assigner and a placer."""
    return H.policy_plugin(
        **dict.fromkeys(("predictor", "assigner", "placer"), PolicySpec(name="unlock", factory=Unlocker))
    )


@pytest.mark.parametrize("kind", ["predictor", "assigner", "placer"])
def test_a_policy_cannot_unlock_its_read_only_inputs(caplog, registry_with, kind):
    """``setflags(write=True)`` is refused (the arrays have a read-only base), so the policy falls back, the
    warning names its plugin, and nothing a later scheduler sees has changed."""
    from rlhfless_sdk.api.records import Cluster
    from rlhfless_sdk.planning.costmodel import AnalyticCostModel
    from rlhfless_sdk.planning.planner import StepPlanner
    from rlhfless_sdk.workloads.synthetic import SyntheticWorkload

    reg = registry_with(**{"unlock-plugin": unlock_plugin()})
    batch, _ = SyntheticWorkload(12, 3, seed=2).batch()
    before = [*_columns(batch), np.array(batch.sample_offsets)]
    base = reg.scheduler("openrlhf")
    cluster, cost = Cluster.uniform(1, 4), AnalyticCostModel(PROFILE)
    got = StepPlanner(base.derive(name="unlock", **{kind: "unlock"}), cluster=cluster, cost_model=cost, registry=reg)
    plan = got.plan(batch)
    assert plan.fallbacks == [f"{kind}:unlock"]
    assert f"{kind} 'unlock' (plugin 'unlock-plugin') failed" in caplog.text and "read-only" in caplog.text
    after = [*_columns(batch), np.array(batch.sample_offsets)]
    for a, b in zip(after, before, strict=True):
        assert (a is None and b is None) or np.array_equal(a, b)
    alone = StepPlanner(base, cluster=cluster, cost_model=cost, registry=reg).plan(batch)
    again = StepPlanner(base, cluster=cluster, cost_model=cost, registry=reg).plan(batch)
    assert _same_plan(alone, again)
