"""Workloads for the simulator: real rollout traces (CSV or JSON lines) and synthetic GSM8K-style steps.

A trace row is one generated sample: at least ``uid, step, sample_idx, prompt_length, response_length``;
``prompt`` (a list of token ids, left padding stripped) enables prefix deduplication. Rows of one step that
share a uid form one prompt's group, in the order they appear. A malformed row is an error naming the file,
the line and the field: a value that is not a whole number, negative or absurdly large, a sample that appears
twice (also across the files of a folder), a sample of a group whose prompt length (or tokens) differs from its
first sample's, a sample longer than an engine's KV capacity, a file that is not UTF-8 text. A UTF-8 byte-order
mark is skipped. JSON comes as JSON lines (one object per line) or as one JSON array of objects (pretty-printed or
not).
"""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from rlhfless_sdk.api.batch import PromptBatch
from rlhfless_sdk.api.errors import RlhflessError
from rlhfless_sdk.workloads.synthetic import SyntheticWorkload

REQUIRED = ("uid", "step", "sample_idx", "prompt_length", "response_length")
#: Qwen2.5's pad token, used to left-pad ``prompt`` in the verl traces.
DEFAULT_PAD_ID = 151643
#: Longest prompt or response a trace may hold (tokens) unless the caller gives a tighter bound.
MAX_TOKENS = 10_000_000
_MAX_INDEX = 2**31 - 1  # steps, sample indices and token ids


class TraceError(RlhflessError):
    """A trace that cannot be replayed; names the file, the line and the field."""

    def __init__(self, path: str | Path, line: int | None, field_name: str | None, message: str) -> None:
        where = str(path) + (f", line {line}" if line else "") + (f", field {field_name!r}" if field_name else "")
        super().__init__(f"{where}: {message}")


@dataclass
class WorkloadStep:
    """One training step of a workload: its prompts and every sample's true response length."""

    step: int
    batch: PromptBatch
    lengths: np.ndarray  # per sample, samples in prompt order


@dataclass
class Workload:
    name: str
    steps: list[WorkloadStep] = field(default_factory=list)
    max_length: int | None = None  # the run's response cap, when the workload knows it (a synthetic one does)

    @property
    def cap(self) -> int:
        """The response cap a run of this workload would set: ``max_length``, or else the longest response it holds
        (a trace records lengths, not the cap it ran under)."""
        if self.max_length is not None:
            return self.max_length
        return max((int(s.lengths.max(initial=0)) for s in self.steps), default=0)

    @property
    def algo(self) -> str:
        """The learner this workload implies: ``grpo`` (critic-free) when prompts have several samples each,
        else ``ppo``."""
        return "grpo" if any(int(s.batch.n_samples.max(initial=1)) > 1 for s in self.steps) else "ppo"

    @property
    def total_samples(self) -> int:
        return sum(s.batch.total_samples for s in self.steps)


@dataclass
class _Row:
    uid: str
    prompt_length: int
    response_length: int
    tokens: list[int] | None


def _int(path: Path, line: int, name: str, value: Any, minimum: int = 0, maximum: int = _MAX_INDEX) -> int:
    try:
        if isinstance(value, bool):
            raise ValueError
        out = int(value)
        if isinstance(value, float) and value != out:
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        raise TraceError(path, line, name, f"expected an integer, got {value!r}") from None
    if out < minimum:
        raise TraceError(path, line, name, f"must be >= {minimum}, got {out}")
    if out > maximum:
        raise TraceError(path, line, name, f"{out} is beyond the largest allowed value, {maximum:,}")
    return out


def _tokens(path: Path, line: int, value: Any, pad_id: int) -> list[int] | None:
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise TraceError(path, line, "prompt", f"expected a list of token ids: {exc.msg}") from None
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _MAX_INDEX for t in value
    ):
        raise TraceError(path, line, "prompt", f"expected a list of integer token ids in [0, {_MAX_INDEX}]")
    start = 0
    while start < len(value) and value[start] == pad_id:  # left padding only: a pad id inside stays
        start += 1
    return value[start:]


def _records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, row) pairs of a CSV or JSON-lines file; text that is not UTF-8 is an error naming the line."""
    try:
        with path.open("rb") as raw:
            magic = raw.read(2)
        fh = path.open(encoding="utf-8-sig", newline="")  # -sig: a byte-order mark is not part of the header
    except OSError as exc:
        raise TraceError(path, None, None, f"cannot read: {exc.strerror or exc}") from None
    if magic == b"\x1f\x8b":
        raise TraceError(path, None, None, "is gzip-compressed; decompress it first (gunzip)")
    line = 0
    try:
        for line, row in _parse(path, fh):
            yield line, row
    except UnicodeDecodeError as exc:
        raise TraceError(
            path, line + 1, None, f"not UTF-8 text ({exc.reason}); a binary file or another encoding?"
        ) from None
    finally:
        fh.close()


#: What a JSON trace may look like, for the errors to say.
JSON_FORMATS = "expected one JSON object per line (JSON lines) or one JSON array of objects"


def _parse(path: Path, fh: Any) -> Iterator[tuple[int, dict[str, Any]]]:
    if path.suffix in (".jsonl", ".json", ".ndjson"):
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            if line.lstrip().startswith("["):  # one JSON array (pretty-printed or not), from this line on
                yield from _json_array(path, line + fh.read(), line_no)
                return
            try:
                row = json.loads(line)
            except (json.JSONDecodeError, RecursionError) as exc:
                raise TraceError(
                    path, line_no, None, f"not valid JSON: {getattr(exc, 'msg', exc)}; {JSON_FORMATS}"
                ) from None
            if not isinstance(row, dict):
                raise TraceError(path, line_no, None, f"a JSON {type(row).__name__}; {JSON_FORMATS}")
            yield line_no, row
    else:
        csv.field_size_limit(sys.maxsize)
        reader = csv.DictReader(fh)
        try:
            header = reader.fieldnames
        except csv.Error as exc:
            raise TraceError(path, 1, None, f"not a CSV header: {exc}") from None
        if not header:
            raise TraceError(path, None, None, f"is empty: expected a CSV header with {', '.join(REQUIRED)}")
        for sep, name in (("\t", "tab"), (";", "semicolon")):
            if len(header) == 1 and sep in header[0]:
                raise TraceError(
                    path,
                    1,
                    None,
                    f"is {name}-separated; a CSV trace is comma-separated (columns {', '.join(REQUIRED)}): "
                    f"convert it, e.g. with tr '{sep.encode('unicode_escape').decode()}' ',', or write JSON lines",
                )
        missing = [c for c in REQUIRED if c not in header]
        if missing:
            raise TraceError(path, 1, missing[0], f"missing column(s) {missing}; found {header}")
        try:
            for row in reader:
                yield reader.line_num, row
        except csv.Error as exc:
            raise TraceError(path, reader.line_num, None, f"not valid CSV: {exc}") from None


def _json_array(path: Path, text: str, first_line: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """The objects of a JSON array file (``text`` starts on line ``first_line``), each with the line it starts on."""
    decoder = json.JSONDecoder()
    line, counted = first_line, 0

    def line_at(pos: int) -> int:
        nonlocal line, counted
        line += text.count("\n", counted, pos)
        counted = pos
        return line

    def skip(pos: int) -> int:
        while pos < len(text) and text[pos] in " \t\r\n":
            pos += 1
        return pos

    def fail(pos: int, what: str) -> TraceError:
        return TraceError(path, line_at(pos), None, f"not valid JSON: {what}; {JSON_FORMATS}")

    pos = skip(skip(0) + 1)  # past the opening bracket
    if text.startswith("]", pos):
        pos = skip(pos + 1)
    else:
        while True:
            try:
                row, end = decoder.raw_decode(text, pos)
            except json.JSONDecodeError as exc:
                raise fail(exc.pos, exc.msg) from None
            except RecursionError:
                raise fail(pos, "nested too deeply") from None
            if not isinstance(row, dict):
                raise fail(pos, f"a JSON {type(row).__name__} in the array, not an object")
            yield line_at(pos), row
            pos = skip(end)
            if text.startswith(",", pos):
                pos = skip(pos + 1)
            elif text.startswith("]", pos):
                pos = skip(pos + 1)
                break
            else:
                raise fail(pos, "expected ',' or ']' after an object of the array")
    if pos < len(text):
        raise fail(pos, "more text after the array")


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".csv", ".jsonl", ".json", ".ndjson"))
        if not files:
            raise TraceError(path, None, None, "folder holds no .csv or .jsonl trace file")
        return files
    if not path.exists():
        raise TraceError(path, None, None, "no such file or folder")
    return [path]


def trace_row(uid: str, step: int, sample_idx: int, prompt: Sequence[int], response_length: int) -> dict[str, Any]:
    """One sample as a trace row (a JSON line), as ``load_trace`` reads it back: the one schema a trace's writers
    (the OpenRLHF adapter's ``--scheduler.trace``, the demo's ``--trace``) and its reader share."""
    row = dict(zip(REQUIRED, (uid, int(step), int(sample_idx), len(prompt), int(response_length)), strict=True))
    return {**row, "prompt": [int(t) for t in prompt]}


def capacity_words(max_tokens: int, flag: str | None = None) -> str:
    """How an error names the bound on a sample's prompt + response: an engine's KV capacity (and the flag that
    sets it), or the largest a trace may hold."""
    if flag is None:
        return f"the largest sample allowed, {max_tokens:,} tokens"
    unit = "token" if max_tokens == 1 else "tokens"
    return f"an engine's KV capacity of {max_tokens:,} {unit} ({flag}), which must hold a whole sample"


def load_trace(
    path: str | Path,
    *,
    pad_id: int = DEFAULT_PAD_ID,
    max_steps: int | None = None,
    max_tokens: int = MAX_TOKENS,
    capacity_flag: str | None = None,
) -> Workload:
    """Read a trace file or a folder of them; steps in ascending order, groups by uid within a step.
    ``max_tokens`` bounds a sample's prompt + response (the simulator passes its engines' KV capacity, and
    ``capacity_flag``, the option that sets it, for the error to name). The rows of one group (uid and step)
    must agree on the prompt: its length, and its tokens where given."""
    path = Path(path)
    reader = _TraceReader(pad_id, max_tokens, capacity_flag)
    for file in _files(path):
        for line, row in _records(file):
            reader.add(file, line, row)
    steps = sorted(reader.by_step)[:max_steps]
    if not steps:
        raise TraceError(path, None, None, "holds no rows")
    return Workload(name=path.name, steps=[_step(s, reader.by_step[s]) for s in steps])


class _TraceReader:
    """A trace's rows as they are read, each checked: its fields, against the samples read before it (no sample
    twice), and against its group's first row (the same prompt)."""

    def __init__(self, pad_id: int, max_tokens: int, capacity_flag: str | None) -> None:
        self.pad_id, self.max_tokens, self.capacity_flag = pad_id, max_tokens, capacity_flag
        self.by_step: dict[int, dict[str, list[_Row]]] = {}
        self.seen: dict[tuple[str, int, int], tuple[Path, int]] = {}
        self.first_of: dict[tuple[str, int], tuple[Path, int]] = {}  # each group's first row

    def add(self, file: Path, line: int, row: dict[str, Any]) -> None:
        step, index, plen, rlen = self._fields(file, line, row)
        key = (str(row["uid"]), step, index)
        if key in self.seen:
            first, first_line = self.seen[key]
            raise TraceError(
                file,
                line,
                None,
                f"duplicate sample (uid {key[0]!r}, step {step}, sample_idx {index}): first at {first}, line "
                f"{first_line}",
            )
        self.seen[key] = (file, line)
        tokens = _tokens(file, line, row.get("prompt"), self.pad_id)
        if tokens is not None and len(tokens) != plen:
            raise TraceError(
                file, line, "prompt", f"has {len(tokens)} tokens after stripping padding, prompt_length={plen}"
            )
        uid = key[0]
        group = self.by_step.setdefault(step, {}).setdefault(uid, [])
        if group:  # a sample of a prompt seen before: the same prompt
            head, (first, first_line) = group[0], self.first_of[(uid, step)]
            where = f"the same prompt's first sample (uid {uid!r}, step {step}) at {first}, line {first_line}"
            if plen != head.prompt_length:
                raise TraceError(
                    file, line, "prompt_length", f"{plen} disagrees with the {head.prompt_length} of {where}"
                )
            if tokens is not None and head.tokens is not None and tokens != head.tokens:
                raise TraceError(file, line, "prompt", f"other tokens than those of {where}")
        else:
            self.first_of[(uid, step)] = (file, line)
        group.append(_Row(uid, plen, rlen, tokens))

    def _fields(self, file: Path, line: int, row: dict[str, Any]) -> tuple[int, int, int, int]:
        """The row's step, sample index, prompt and response lengths, each checked; its uid checked too."""
        for name in REQUIRED:
            if name not in row or row[name] in (None, ""):
                raise TraceError(file, line, name, "missing value")
        largest = max(self.max_tokens, MAX_TOKENS)
        step = _int(file, line, "step", row["step"])
        index = _int(file, line, "sample_idx", row["sample_idx"])
        plen = _int(file, line, "prompt_length", row["prompt_length"], maximum=largest)
        rlen = _int(file, line, "response_length", row["response_length"], maximum=largest)
        if plen + rlen > self.max_tokens:
            raise TraceError(
                file,
                line,
                "response_length",
                f"prompt + response = {plen + rlen:,} tokens ({plen:,} + {rlen:,}), more than "
                f"{capacity_words(self.max_tokens, self.capacity_flag)}",
            )
        if not isinstance(row["uid"], str | int) or isinstance(row["uid"], bool):
            raise TraceError(file, line, "uid", f"expected a string, got {row['uid']!r}")
        return step, index, plen, rlen


def _step(step: int, groups: dict[str, list[_Row]]) -> WorkloadStep:
    rows = list(groups.values())
    lengths = np.array([r.response_length for g in rows for r in g], dtype=np.int64)
    prompt_lengths = np.array([g[0].prompt_length for g in rows], dtype=np.int64)
    flat = None
    if all(g[0].tokens is not None for g in rows):
        flat = np.fromiter(
            (t for g in rows for t in g[0].tokens or ()), dtype=np.int64, count=int(prompt_lengths.sum())
        )
    n = np.array([len(g) for g in rows], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(n)])
    true_mean = np.array([lengths[offsets[i] : offsets[i + 1]].mean() for i in range(len(rows))])
    batch = PromptBatch(
        uids=list(groups), prompt_lengths=prompt_lengths, n_samples=n, token_flat=flat, true_lengths=true_mean
    )
    return WorkloadStep(step=step, batch=batch, lengths=lengths)


def synthetic_workload(synthetic: SyntheticWorkload, steps: int, length_growth: float = 1.0) -> Workload:
    """``steps`` epochs over the same synthetic prompts, lengths drifting from step to step; with
    ``length_growth`` X the lengths grow geometrically over the run, the last step's X times the first's (as
    responses lengthen during reasoning RL), before the cap."""
    name = f"synthetic-{synthetic.num_prompts}x{synthetic.n_samples}"
    out = Workload(
        name=name if length_growth == 1.0 else f"{name}-grow{length_growth:g}", max_length=synthetic.max_length
    )
    for s in range(steps):
        scale = length_growth ** (s / (steps - 1)) if steps > 1 else 1.0
        batch, lengths = replace(synthetic, step=s, scale=synthetic.scale * scale).batch()
        out.steps.append(WorkloadStep(step=s, batch=batch, lengths=lengths))
    return out


def workload_summary(workload: Workload) -> dict[str, Any]:
    lengths = np.concatenate([s.lengths for s in workload.steps])
    return {
        "name": workload.name,
        "steps": len(workload.steps),
        "prompts_per_step": int(np.mean([len(s.batch) for s in workload.steps])),
        "samples": int(lengths.size),
        "response_length": {
            "min": int(lengths.min()),
            "median": float(np.median(lengths)),
            "max": int(lengths.max()),
        },
        "has_tokens": all(s.batch.has_tokens for s in workload.steps),
    }
