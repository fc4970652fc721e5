"""Length replay's mapping of a run's groups onto a trace's (``rlhfless_sdk.workloads.replay``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlhfless_sdk.api.batch import PromptBatch
from rlhfless_sdk.api.errors import RlhflessError
from rlhfless_sdk.workloads.replay import LengthReplay, long_reasoning_workload, replay_from
from rlhfless_sdk.workloads.synthetic import SyntheticWorkload
from rlhfless_sdk.workloads.traces import Workload, WorkloadStep, load_trace

GPQA = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "traces" / "gpqa-qwen2.5-7b-ppo"
needs_gpqa = pytest.mark.skipif(not GPQA.is_dir(), reason=f"real trace not found at {GPQA} (outside this workplace)")


def _workload(groups: list[list[int]], per_step: int) -> Workload:
    steps = []
    for s in range(0, len(groups), per_step):
        chunk = groups[s : s + per_step]
        batch, _ = SyntheticWorkload(len(chunk), 1, seed=s).batch()
        n = np.array([len(g) for g in chunk], dtype=np.int64)
        batch = PromptBatch(uids=batch.uids, prompt_lengths=batch.prompt_lengths, n_samples=n)
        steps.append(WorkloadStep(step=s // per_step, batch=batch, lengths=np.array([x for g in chunk for x in g])))
    return Workload("t", steps)


groups_st = st.lists(st.lists(st.integers(1, 5000), min_size=1, max_size=6), min_size=1, max_size=20)


@given(groups=groups_st, per_step=st.integers(1, 5), cap=st.integers(1, 6000), events=st.lists(st.integers(0, 7)))
def test_each_group_takes_the_next_trace_group_and_keeps_it_until_it_trains(groups, per_step, cap, events):
    replay = LengthReplay(_workload(groups, per_step), cap)
    longest = max(max(g) for g in groups)
    assert replay.scale == pytest.approx(min(1.0, cap / longest))
    open_: dict[str, list[int]] = {}
    order = 0
    for e in events:  # 0-3: a group asks (new or open); 4-7: an open group trains
        key = f"p{e % 4}"
        if e < 4:
            got = replay.lengths(key, 4)
            if key in open_:
                assert got == open_[key]  # carried or deferred: the same lengths again
            else:
                src = groups[order % len(groups)]
                order += 1
                want = [min(max(round(src[j % len(src)] * replay.scale), 1), cap) for j in range(4)]
                assert got == want  # the trace's groups in order, round again at the end
                open_[key] = got
            assert all(1 <= x <= cap for x in got)
            assert replay.given(key, 4) == got
        elif key in open_:
            replay.release(key)
            del open_[key]
            assert replay.given(key, 4) is None
    assert replay.used == order
    state = replay.state_dict()
    again = LengthReplay(_workload(groups, per_step), cap)
    again.load_state_dict(state)
    assert again.next == replay.next and again.assigned.keys() == replay.assigned.keys()


@needs_gpqa
def test_the_gpqa_trace_is_scaled_so_its_longest_response_is_the_cap():
    replay = replay_from(GPQA, 256)
    longest = max(int(s.lengths.max()) for s in load_trace(GPQA).steps)
    assert longest == 1333 and replay.scale == pytest.approx(256 / 1333)
    got = [replay.lengths(f"u{k}", 1)[0] for k in range(len(replay))]
    assert max(got) == 256 and min(got) >= 1
    assert replay.describe()["lengths_from"] == "gpqa-qwen2.5-7b-ppo"


def test_the_long_reasoning_input_is_long_tailed_with_runaways_at_the_cap():
    workload = long_reasoning_workload(256)
    lengths = np.concatenate([s.lengths for s in workload.steps])
    assert lengths.max() == 256 and 0.03 < np.mean(lengths == 256) < 0.15
    assert np.median(lengths) < 0.3 * 256  # most samples short, a long tail
    assert replay_from("long-reasoning", 256).scale == 1.0


def test_bad_replay_inputs_say_what_is_wrong(tmp_path):
    with pytest.raises(RlhflessError, match="no trace at"):
        replay_from(tmp_path / "missing.jsonl", 64)
    with pytest.raises(RlhflessError, match="cap of at least 1"):
        LengthReplay(long_reasoning_workload(64), 0)


def test_fidelity_compares_per_group_ratios_and_simulates_a_replayed_trace(tmp_path):
    """The fidelity command's arithmetic and its simulator side, on a trace written as the demo writes it."""
    import json

    from rlhfless_openrlhf.tools.fidelity import compare, simulate_replayed

    measured = {"a": {"generation_s": 60.0, "groups": 30}, "b": {"generation_s": 40.0, "groups": 30}}
    simulated = {"a": {"generation_s": 50.0, "groups": 30}, "b": {"generation_s": 25.0, "groups": 30}}
    rows = compare(measured, simulated, ["a", "b"])
    assert [r["measured_ratio"] for r in rows] == pytest.approx([1.0, 1.5])
    assert [r["simulated_ratio"] for r in rows] == pytest.approx([1.0, 2.0])
    assert rows[1]["ratio_error"] == pytest.approx(2.0 / 1.5 - 1)
    trace = tmp_path / "trace.jsonl"
    replay = LengthReplay(long_reasoning_workload(64, prompts=6, samples=2, steps=2), 64)
    with trace.open("w") as fh:
        for step in range(2):
            for p in range(6):
                for j, length in enumerate(replay.lengths(f"p{p}-{step}", 2)):
                    row = {
                        "uid": f"p{p}",
                        "step": step,
                        "sample_idx": j,
                        "prompt_length": 20,
                        "response_length": length,
                    }
                    fh.write(json.dumps(row) + "\n")
    profile = tmp_path / "p.yaml"
    import yaml

    from rlhfless_sdk.api.profiles import load_profile

    profile.write_text(yaml.safe_dump(load_profile("qwen2.5-3b-l40s").model_dump(mode="json")))
    out = simulate_replayed(trace, profile, ("openrlhf", "rlhfless-fast"), 2)
    assert set(out) == {"openrlhf", "rlhfless-fast"}
    assert out["openrlhf"]["groups"] == 12 and len(out["openrlhf"]["steps_s"]) == 2
    assert all(v["generation_s"] > 0 for v in out.values())


def test_fidelity_pools_the_runs_seconds_and_groups():
    from rlhfless_openrlhf.tools.fidelity import compare, pooled

    def run(a, b, sa, sb):
        measured = {"a": {"generation_s": a, "groups": 10}, "b": {"generation_s": b, "groups": 10}}
        simulated = {"a": {"generation_s": sa, "groups": 10}, "b": {"generation_s": sb, "groups": 10}}
        return {"rows": compare(measured, simulated, ["a", "b"])}

    rows = pooled([run(60.0, 50.0, 55.0, 50.0), run(60.0, 70.0, 55.0, 50.0)])
    assert rows[1]["measured_ratio"] == pytest.approx(120.0 / 120.0)
    assert rows[1]["simulated_ratio"] == pytest.approx(110.0 / 100.0)
    assert rows[1]["ratio_error"] == pytest.approx(0.1)
    assert rows[1]["measured_ratio_range"] == pytest.approx([60.0 / 70.0, 60.0 / 50.0])
