"""Every typed record survives a round trip through JSON, and validation errors name the field."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from rlhfless_sdk.api import records as rec
from rlhfless_sdk.api.config import PolicyRef, SchedulerConfig

names = st.text(st.characters(min_codepoint=33, max_codepoint=0x2FFF), min_size=1, max_size=12)
nat = st.integers(0, 10**6)
pos = st.integers(1, 10**4)
fin = st.floats(0, 1e6, allow_nan=False, allow_infinity=False)


actors = st.builds(
    rec.Actor, actor_id=nat, role=st.sampled_from(["decode", "prefill", "learner"]), num_gpus=st.integers(1, 8)
)


@st.composite
def placements(draw):
    actor = draw(actors)
    gpus = draw(st.lists(st.integers(0, 63), min_size=actor.num_gpus, max_size=actor.num_gpus, unique=True))
    return rec.ActorPlacement(actor=actor, node=draw(names), gpu_indices=gpus)


@st.composite
def prefill_plans(draw):
    groups = draw(st.lists(nat, min_size=0, max_size=6))
    members = draw(st.lists(st.integers(0, max(len(groups) - 1, 0)), max_size=10)) if groups else []
    before = draw(nat)
    return rec.PrefillPlan(
        planner=draw(names),
        shared_prefix_length=draw(nat),
        prompt_group=members,
        group_prefix_tokens=groups,
        tokens_before=before,
        tokens_after=draw(st.integers(0, before)),
    )


@st.composite
def step_plans(draw):
    n = draw(st.integers(1, 16))
    return rec.StepPlan(
        step=draw(nat),
        scheduler=draw(names),
        num_actors=n,
        assignment=draw(st.lists(st.integers(0, n - 1), max_size=30)),
        predicted_lengths=draw(st.lists(fin, max_size=10)),
        prefill=draw(prefill_plans()),
        placement=draw(st.lists(placements(), max_size=3)),
        candidates=draw(
            st.lists(st.builds(rec.CandidateEstimate, num_actors=pos, time_s=fin, gpu_seconds=fin), max_size=4)
        ),
        fallbacks=draw(st.lists(names, max_size=2)),
        planner_ms=draw(fin),
    )


@st.composite
def migrations(draw):
    a = draw(nat)
    b = draw(nat.filter(lambda x: x != a))
    return rec.MigrationDecision(
        uid=draw(names),
        sample_index=draw(nat),
        from_actor=a,
        to_actor=b,
        tokens_generated=draw(nat),
        mode=draw(st.sampled_from(["tokens", "kv"])),
    )


sample_progress = st.builds(
    rec.SampleProgress,
    uid=names,
    sample_index=nat,
    actor_id=nat,
    tokens_generated=nat,
    predicted_length=fin,
    max_tokens=pos,
    migrations=nat,
)
actor_progress = st.builds(
    rec.ActorProgress, actor_id=nat, planned_tokens=fin, generated_tokens=nat, running=nat, waiting=nat, free_slots=nat
)


def each(strategy, *fields: str) -> dict:
    """``field=strategy`` for each of ``fields``: the many fields of a record that draw alike, spelled once."""
    return dict.fromkeys(fields, strategy)


tensor_parallel = st.builds(
    rec.TensorParallel,
    **each(pos, "layers", "hidden_size", "kv_heads", "max_gpus"),
    weights_gb=st.floats(0.01, 1e4),
    memory_efficiency=st.floats(0.01, 1.0),
    **each(st.floats(0, 1e-3), "allreduce_s", "allreduce_hop_s"),
    allreduce_gbps=st.floats(0.1, 1e4),
)

profiles = st.builds(
    rec.TimePerTokenProfile,
    **each(names, "name", "model", "hardware"),
    gpus_per_actor=pos,
    decode_base_s=st.floats(1e-6, 1e6),  # decode must take some time
    **each(fin, "decode_per_seq_s", "decode_per_ctx_token_s"),
    **each(fin, "prefill_base_s", "prefill_per_new_token_s", "prefill_per_cached_token_s"),
    **each(pos, "kv_capacity_tokens", "max_num_seqs", "kv_bytes_per_token"),
    cold_start_s=fin,
    **each(st.floats(0.01, 1e4), "intra_node_gbps", "inter_node_gbps"),
    **each(fin, "price_per_gpu_second", "prepare_gpu_s_per_token", "learn_gpu_s_per_token", "weight_sync_s"),
    derivation=st.text(max_size=40),
    tensor_parallel=st.none() | tensor_parallel,
)

STRATEGIES = {
    rec.FinishedSample: st.builds(
        rec.FinishedSample,
        uid=names,
        sample_index=nat,
        prompt_length=nat,
        response_length=nat,
        actor_id=st.none() | nat,
        migrations=nat,
        finish_reason=st.sampled_from(["stop", "length", "abort"]),
        predicted_length=st.none() | fin,
    ),
    rec.GPU: st.builds(rec.GPU, node=names, index=nat),
    rec.Node: st.builds(rec.Node, name=names, num_gpus=pos, gpu_type=names),
    rec.Cluster: st.lists(
        st.builds(rec.Node, name=names, num_gpus=pos), min_size=1, max_size=4, unique_by=lambda n: n.name
    ).map(lambda nodes: rec.Cluster(nodes=nodes)),
    rec.Actor: actors,
    rec.ActorPlacement: placements(),
    rec.TimePerTokenProfile: profiles,
    rec.TensorParallel: tensor_parallel,
    rec.PrefillGroup: st.builds(
        rec.PrefillGroup, prefix_tokens=nat, prompt_indices=st.lists(nat, min_size=1, max_size=5)
    ),
    rec.PrefillPlan: prefill_plans(),
    rec.CandidateEstimate: st.builds(rec.CandidateEstimate, num_actors=pos, time_s=fin, gpu_seconds=fin),
    rec.StepPlan: step_plans(),
    rec.MigrationDecision: migrations(),
    rec.SampleProgress: sample_progress,
    rec.ActorProgress: actor_progress,
    rec.StepProgress: st.builds(
        rec.StepProgress,
        step=nat,
        elapsed_s=fin,
        total_samples=nat,
        actors=st.lists(actor_progress, max_size=3),
        unfinished=st.lists(sample_progress, max_size=3),
    ),
    rec.StepReport: st.builds(
        rec.StepReport,
        step=nat,
        scheduler=names,
        **each(fin, "time_s", "generation_s", "prepare_s", "learn_s", "gpu_seconds", "gpu_seconds_serverful"),
        idle_fraction=st.floats(0, 1),
        imbalance=st.floats(1, 100),
        **each(nat, "prefill_tokens_saved", "migrations"),
        num_actors=pos,
        samples=nat,
        actor_busy_s=st.lists(fin, max_size=4),
        prediction_mae=st.none() | fin,
        planner_ms=fin,
        fallbacks=st.lists(names, max_size=2),
    ),
}


def test_every_record_has_a_strategy():
    assert set(rec.ALL_RECORDS) == set(STRATEGIES)


@pytest.mark.parametrize("cls", rec.ALL_RECORDS, ids=lambda c: c.__name__)
def test_json_round_trip(cls):
    @given(STRATEGIES[cls])
    def check(record):
        again = cls.model_validate_json(record.model_dump_json())
        assert again == record

    check()


@given(st.builds(PolicyRef, name=names, params=st.dictionaries(names, st.integers() | st.text(max_size=5), max_size=3)))
def test_scheduler_config_round_trip(ref):
    cfg = SchedulerConfig(
        name="x", predictor=ref, prefill_planner=ref, assigner=ref, migrator=ref, scaler=ref, placer=ref
    )
    assert SchedulerConfig.model_validate_json(cfg.model_dump_json()) == cfg


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: rec.FinishedSample(uid="a", sample_index=0, prompt_length=1, response_length=-1), "response_length"),
        (
            lambda: rec.StepReport(
                step=0, scheduler="s", time_s=1, gpu_seconds=1, idle_fraction=2, imbalance=1, num_actors=1
            ),
            "idle_fraction",
        ),
        (lambda: rec.StepPlan(num_actors=2, assignment=[0, 2], predicted_lengths=[]), "num_actors=2"),
        (
            lambda: rec.MigrationDecision(uid="a", sample_index=0, from_actor=1, to_actor=1, tokens_generated=0),
            "from_actor and to_actor",
        ),
        (
            lambda: rec.Cluster(nodes=[rec.Node(name="a", num_gpus=1), rec.Node(name="a", num_gpus=2)]),
            "duplicate node names",
        ),
        (
            lambda: rec.ActorPlacement(actor=rec.Actor(actor_id=0, num_gpus=2), node="a", gpu_indices=[0]),
            "needs 2 GPU",
        ),
        (lambda: rec.PrefillPlan(tokens_before=1, tokens_after=2), "tokens_after=2"),
        (
            lambda: rec.FinishedSample(uid="a", sample_index=0, prompt_length=1, response_length=1, colour="red"),
            "colour",
        ),
    ],
)
def test_validation_errors_name_the_field(build, field):
    with pytest.raises(ValidationError) as err:
        build()
    assert field in str(err.value)
