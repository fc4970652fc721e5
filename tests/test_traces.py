"""Trace loading: CSV, JSON lines and folders; every malformed input is one clean error naming file, line and
field, never a traceback or a silently wrong workload (a hypothesis test feeds the loader random garbage)."""

from __future__ import annotations

import gzip
import json
import string
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlhfless_sdk.workloads.traces import TraceError, Workload, load_trace

SHARED = Path(__file__).resolve().parent.parent.parent / "shared" / "data"
GPQA = SHARED / "traces" / "gpqa-qwen2.5-7b-ppo"
needs_gpqa = pytest.mark.skipif(not GPQA.is_dir(), reason=f"real trace not found at {GPQA} (outside this workplace)")

CSV_HEAD = "uid,step,sample_idx,prompt,response,prompt_length,response_length\n"


def write(tmp_path: Path, name: str, text: str | bytes) -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


@needs_gpqa
def test_real_gpqa_trace_loads():
    w = load_trace(GPQA)
    assert [s.step for s in w.steps] == list(range(1, 11))
    assert all(len(s.batch) == 120 and s.batch.has_tokens for s in w.steps)
    lengths = np.concatenate([s.lengths for s in w.steps])
    assert (lengths.min(), int(np.median(lengths)), lengths.max()) == (181, 521, 1333)
    # left padding (151643) stripped: token counts equal prompt_length
    assert int(w.steps[0].batch.prompt_lengths[0]) == len(w.steps[0].batch.tokens(0)) == 204


def test_csv_groups_rows_by_uid_and_strips_left_padding(tmp_path):
    path = write(
        tmp_path,
        "t.csv",
        CSV_HEAD
        + '"a",1,0,"[9, 9, 1, 2]",,2,10\n'
        + '"a",1,1,"[9, 9, 1, 2]",,2,30\n'
        + '"b",1,2,"[9, 1, 9]",,2,5\n'
        + '"a",2,0,"[1, 2]",,2,7\n',
    )
    w = load_trace(path, pad_id=9)
    s1 = w.steps[0]
    assert list(s1.batch.uids) == ["a", "b"] and s1.batch.n_samples.tolist() == [2, 1]
    assert s1.lengths.tolist() == [10, 30, 5]
    assert s1.batch.tokens(1).tolist() == [1, 9]  # a pad id inside the prompt stays
    assert s1.batch.true_lengths.tolist() == [20.0, 5.0]
    assert [s.step for s in w.steps] == [1, 2]


def test_jsonl_trace(tmp_path):
    rows = [
        {"uid": "x", "step": 0, "sample_idx": 0, "prompt_length": 3, "response_length": 12},
        {"uid": "x", "step": 0, "sample_idx": 1, "prompt_length": 3, "response_length": 14},
    ]
    w = load_trace(write(tmp_path, "t.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n"))
    assert w.steps[0].batch.n_samples.tolist() == [2] and not w.steps[0].batch.has_tokens


@pytest.mark.parametrize(
    ("name", "text", "where"),
    [
        ("a.csv", "uid,step,sample_idx,prompt_length\nx,1,0,3\n", "line 1, field 'response_length'"),
        ("b.csv", CSV_HEAD + "x,1,0,,,3,many\n", "line 2, field 'response_length'"),
        ("c.csv", CSV_HEAD + "x,1,0,,,3,5\nx,one,1,,,3,5\n", "line 3, field 'step'"),
        ("d.csv", CSV_HEAD + 'x,1,0,"[1, 2",,2,5\n', "line 2, field 'prompt'"),
        ("e.csv", CSV_HEAD + 'x,1,0,"[1, 2, 3]",,2,5\n', "line 2, field 'prompt'"),
        ("f.csv", CSV_HEAD + "x,1,0,,,-3,5\n", "line 2, field 'prompt_length'"),
        ("g.jsonl", '{"uid": "x", "step": 1}\n', "line 1, field 'sample_idx'"),
        ("h.jsonl", '{"uid": "x", "step": 1,\n', "line 1"),
        ("i.csv", CSV_HEAD, "holds no rows"),
        ("j.csv", CSV_HEAD + "x,1,0,,,3,5\nx,1,0,,,3,7\n", "line 3: duplicate sample (uid 'x', step 1, sample_idx 0)"),
        (
            "k.jsonl",
            '{"uid": "x", "step": 1, "sample_idx": 0, "prompt_length": 3, "response_length": Infinity}\n',
            "line 1, field 'response_length': expected an integer",
        ),
        (
            "l.jsonl",
            '{"uid": "x", "step": 1, "sample_idx": 0, "prompt_length": 1e400, "response_length": 3}\n',
            "line 1, field 'prompt_length': expected an integer",
        ),
        ("m.csv", CSV_HEAD + "x,1,0,,,3,10000000000000000000\n", "line 2, field 'response_length'"),
        (
            "n.jsonl",
            '{"uid": "x", "step": true, "sample_idx": 0, "prompt_length": 3, "response_length": 3}\n',
            "line 1, field 'step': expected an integer",
        ),
        ("o.csv", "", "is empty"),
        (
            "p.jsonl",
            '{"uid": ["x"], "step": 1, "sample_idx": 0, "prompt_length": 3, "response_length": 3}\n',
            "line 1, field 'uid'",
        ),
        ("q.csv", CSV_HEAD + "x,1,0,,,3,5000\n", "line 2, field 'response_length': prompt + response = 5,003"),
        (
            "r.csv",
            CSV_HEAD + "x,1,0,,,3,5\ny,1,0,,,3,5\nx,1,1,,,4,5\n",
            "line 4, field 'prompt_length': 4 disagrees with the 3 of the same prompt's first sample (uid 'x', "
            "step 1) at",
        ),
        ("s.csv", CSV_HEAD + 'x,1,0,"[1, 2]",,2,5\nx,1,1,"[1, 3]",,2,5\n', "line 3, field 'prompt': other tokens"),
        ("t.json", '{\n  "uid": "x",\n  "step": 1\n}\n', "line 1: not valid JSON: Expecting property name"),
        (
            "u.json",
            '[{"uid": "x", "step": 1, "sample_idx": 0, "prompt_length": 3, "response_length": 3},\n7]',
            "line 2",
        ),
        ("v.json", '[\n  {"uid": "x", "step": 1}\n', "line 2, field 'sample_idx'"),
        ("w.json", '[{"uid": "x", "step": 1, "sample_idx": 0, "prompt_length": 3, "response_length": 3}] []', "line 1"),
    ],
)
def test_malformed_trace_names_file_line_and_field(tmp_path, name, text, where):
    path = write(tmp_path, name, text)
    with pytest.raises(TraceError) as err:
        load_trace(path, max_tokens=5000)
    assert str(path) in str(err.value) and where in str(err.value)


def test_missing_trace(tmp_path):
    with pytest.raises(TraceError, match="no such file"):
        load_trace(tmp_path / "nope.csv")


@pytest.mark.parametrize(
    ("name", "data", "message"),
    [
        ("bin.csv", bytes(range(256)) * 4, "not UTF-8 text"),
        ("latin.jsonl", '{"uid": "caf\u00e9"}\n'.encode("latin-1"), "line 1: not UTF-8 text"),
        ("zipped.csv", gzip.compress(CSV_HEAD.encode()), "gzip-compressed; decompress it first"),
        ("zipped.jsonl", gzip.compress(b"{}"), "gzip-compressed"),
    ],
)
def test_undecodable_files_are_one_clear_error(tmp_path, name, data, message):
    path = write(tmp_path, name, data)
    with pytest.raises(TraceError, match=message) as err:
        load_trace(path)
    assert str(path) in str(err.value)


def test_a_byte_order_mark_is_not_part_of_the_header(tmp_path):
    path = write(tmp_path, "bom.csv", "\ufeff" + CSV_HEAD + "x,1,0,,,3,5\n")
    assert load_trace(path).steps[0].lengths.tolist() == [5]


def test_a_folder_with_two_copies_of_a_file_is_refused(tmp_path):
    text = CSV_HEAD + "x,1,0,,,3,5\nx,1,1,,,3,6\n"
    write(tmp_path, "a.csv", text)
    write(tmp_path, "b.csv", text)
    with pytest.raises(TraceError, match=r"b\.csv, line 2: duplicate sample .* first at .*a\.csv, line 2"):
        load_trace(tmp_path)


# -- fuzz: clean error or valid workload, never a traceback ---------------------------------------------------
_values = st.one_of(
    st.integers(-5, 10**20),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(string.printable, max_size=6),
    st.booleans(),
    st.none(),
    st.lists(st.integers(-2, 2**40), max_size=4),
)
_rows = st.lists(
    st.dictionaries(
        st.sampled_from(["uid", "step", "sample_idx", "prompt", "prompt_length", "response_length", "other"]),
        _values,
    ),
    max_size=6,
)


def _check(path):
    try:
        w = load_trace(path)
    except TraceError as exc:
        assert str(path.name) in str(exc)  # names the file
        return
    assert isinstance(w, Workload) and w.steps
    for s in w.steps:  # a valid workload: every sample has a non-negative length, groups add up
        assert len(s.lengths) == s.batch.total_samples and (s.lengths >= 0).all()
        assert np.isfinite(s.batch.true_lengths).all()


@given(rows=_rows)
def test_random_jsonl_rows_load_or_fail_cleanly(tmp_path_factory, rows):
    path = tmp_path_factory.mktemp("fuzz") / "t.jsonl"
    path.write_text("".join(json.dumps(r, allow_nan=True) + "\n" for r in rows), encoding="utf-8")
    _check(path)


@given(rows=_rows)
def test_random_csv_rows_load_or_fail_cleanly(tmp_path_factory, rows):
    path = tmp_path_factory.mktemp("fuzz") / "t.csv"
    cols = ["uid", "step", "sample_idx", "prompt", "prompt_length", "response_length"]
    lines = [",".join(cols)] + [",".join(json.dumps(str(r.get(c, ""))) for c in cols) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    _check(path)


@given(data=st.binary(max_size=300), suffix=st.sampled_from([".csv", ".jsonl"]))
def test_random_bytes_load_or_fail_cleanly(tmp_path_factory, data, suffix):
    path = tmp_path_factory.mktemp("fuzz") / f"t{suffix}"
    path.write_bytes(data)
    _check(path)


def test_a_json_array_trace_loads_like_json_lines(tmp_path):
    """A pretty-printed JSON array of row objects is the same trace as its JSON lines; errors name the line an
    object starts on."""
    rows = [
        {"uid": u, "step": k, "sample_idx": i, "prompt_length": 3 + len(u), "response_length": 10 * (i + 1) + k}
        for k in (0, 1)
        for u in ("a", "bb")
        for i in (0, 1)
    ]
    array = load_trace(write(tmp_path, "t.json", json.dumps(rows, indent=2)))
    lines = load_trace(write(tmp_path, "t.jsonl", "".join(json.dumps(r) + "\n" for r in rows)))
    for a, b in zip(array.steps, lines.steps, strict=True):
        assert a.batch.uids == b.batch.uids and a.lengths.tolist() == b.lengths.tolist()
        assert a.batch.prompt_lengths.tolist() == b.batch.prompt_lengths.tolist()
    with pytest.raises(TraceError, match="holds no rows"):
        load_trace(write(tmp_path, "e.json", "\n  []\n"))
    bad = [*rows[:3], {**rows[3], "response_length": -1}]  # the 4th object: lines 23-29
    with pytest.raises(TraceError, match=r"bad\.json, line 23, field 'response_length'"):
        load_trace(write(tmp_path, "bad.json", json.dumps(bad, indent=2)))


def test_a_sample_beyond_the_kv_capacity_names_the_capacity_and_its_flag(tmp_path):
    path = write(tmp_path, "t.csv", CSV_HEAD + "x,1,0,,,150,37\n")
    with pytest.raises(TraceError) as err:
        load_trace(path, max_tokens=100, capacity_flag="--colocated-kv-tokens")
    assert str(err.value) == (
        f"{path}, line 2, field 'response_length': prompt + response = 187 tokens (150 + 37), more than an "
        "engine's KV capacity of 100 tokens (--colocated-kv-tokens), which must hold a whole sample"
    )


def test_the_docs_example_trace_replays(tmp_path):
    """docs/simulator.md's five-row example is a trace the simulator reads: two groups of 2 in step 1, then 1."""
    import re

    doc = (Path(__file__).resolve().parent.parent / "docs" / "simulator.md").read_text()
    (example,) = re.findall(r"```csv\n(.*?)```", doc, flags=re.S)
    workload = load_trace(write(tmp_path, "example.csv", example))
    assert [s.step for s in workload.steps] == [1, 2]
    assert workload.steps[0].lengths.tolist() == [480, 1310, 260, 305]
    assert workload.steps[1].lengths.tolist() == [702]


@pytest.mark.parametrize("sep, name", [("\t", "tab"), (";", "semicolon")])
def test_a_trace_separated_by_tabs_or_semicolons_is_named_so(tmp_path, sep, name):
    text = sep.join(["uid", "step", "sample_idx", "prompt_length", "response_length"]) + "\n"
    text += sep.join(["a", "1", "0", "10", "20"]) + "\n"
    with pytest.raises(TraceError, match=rf"line 1: is {name}-separated; a CSV trace is comma-separated"):
        load_trace(write(tmp_path, "t.tsv", text))
