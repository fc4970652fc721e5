"""What a real run keeps of its steps, whatever framework serves its engines: the prompts' uids, the step count, the
step reports (JSON lines), the trace of the samples trained (JSON lines, ``rlhfless simulate --trace`` replays it)
and, under length replay, how many trained samples did not stop at their replayed length."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from rlhfless_sdk.api.records import StepReport
from rlhfless_sdk.workloads.replay import LengthReplay
from rlhfless_sdk.workloads.traces import trace_row


def prompt_uid(prompt: str) -> str:
    """A stable id for a prompt's text: its length history follows it across epochs."""
    return hashlib.sha1(prompt.encode("utf-8")).hexdigest()[:16]


def fresh_uid(prompt: str, taken: set[str]) -> str:
    """The prompt's uid (``prompt_uid``), with ``#k`` appended while it is in ``taken`` (the same prompt twice in a
    batch, or in a group still open); added to ``taken``. The length history's key drops the ``#k``."""
    base, k = prompt_uid(prompt), 0
    while (uid := base if k == 0 else f"{base}#{k}") in taken:
        k += 1
    taken.add(uid)
    return uid


class RunLog:
    """A run's step numbering and what it writes after each step (or stream batch): the report, appended to
    ``report_path``; the groups trained, appended to ``trace_path``; the latest report and metrics, for the
    framework's own logs. ``replay``: the length replay the run's engines stop at, if any."""

    def __init__(
        self,
        report_path: str | Path | None = None,
        trace_path: str | Path | None = None,
        replay: LengthReplay | None = None,
    ) -> None:
        self.report_path = None if report_path is None else Path(report_path)
        self.trace_path = None if trace_path is None else Path(trace_path)
        self.replay = replay
        self.step = 0  # the step (or stream batch) under way
        self.finished = 0  # steps finished in this process
        self.replay_off = 0  # trained samples of this step that did not stop at their replayed length
        self.last_report: StepReport | None = None
        self.last_metrics: dict[str, float] = {}

    def trace(self, groups: Iterable[tuple[str, Sequence[int], Sequence[int]]]) -> None:
        """Groups (uid, prompt token ids, each sample's response length) as trained in this step, appended to the
        trace in the format ``load_trace`` reads (``trace_row``): the prompt's uid (stable across epochs; a prompt
        repeated within a batch gets ``#k``), the step, the sample index, prompt and response lengths, and the
        prompt's token ids (so a replay deduplicates prefixes). A replay's step is the groups that trained in it,
        each sample at its full length (a carried sample's pieces summed)."""
        groups = list(groups)
        if self.replay is not None:  # a trained group is done with its lengths; its prompt may come back as new
            for uid, _prompt, lengths in groups:
                want = self.replay.given(uid, len(lengths))
                if want is not None:
                    self.replay_off += sum(int(a) != b for a, b in zip(lengths, want, strict=True))
                self.replay.release(uid)
        if self.trace_path is None:
            return
        self.trace_path.parent.mkdir(parents=True, exist_ok=True)
        with self.trace_path.open("a", encoding="utf-8") as fh:
            for uid, prompt, lengths in groups:
                for k, length in enumerate(lengths):
                    fh.write(json.dumps(trace_row(uid, self.step, k, prompt, length)) + "\n")

    def replayed(self, report: StepReport) -> StepReport:
        """``report`` with the replay's name and this step's samples off their replayed length (as is without a
        replay); the count starts again for the next step."""
        if self.replay is None:
            return report
        report = report.model_copy(
            update={"lengths_replayed_from": self.replay.name, "replay_off_length": self.replay_off}
        )
        self.replay_off = 0
        return report

    def record(self, report: StepReport, metrics: dict[str, Any]) -> None:
        """A finished step's (or stream batch's) report and metrics kept for the framework's logs (``metrics``, and
        the figures every mode has: ``report_metrics``), the report appended to the JSON-lines file; the next step
        begins."""
        self.last_report = report
        self.last_metrics = {**report_metrics(report), **metrics}
        if self.report_path is not None:
            self.report_path.parent.mkdir(parents=True, exist_ok=True)
            with self.report_path.open("a", encoding="utf-8") as fh:
                fh.write(json.dumps(report.model_dump(mode="json")) + "\n")
        self.finished += 1
        self.step += 1


def report_metrics(report: StepReport) -> dict[str, float]:
    """The figures of a step (or stream batch) every mode reports to the framework's logger: its time and its
    rollout's, the learner's, the engines and their busy share, token age, the samples carried or cut, GPUs."""
    return {
        "rlhfless/step_s": report.time_s,
        "rlhfless/rollout_s": report.generation_s,
        "rlhfless/learn_s": report.prepare_s + report.learn_s,
        "rlhfless/engines": float(report.num_actors),
        "rlhfless/busy_share": 1.0 - report.idle_fraction,
        "rlhfless/max_token_age": float(report.max_token_age_steps),
        "rlhfless/stale_token_fraction": report.stale_token_fraction,
        "rlhfless/carried_samples": float(report.carried_samples),
        "rlhfless/migrations": float(report.migrations),
        "rlhfless/peak_gpus": float(report.peak_gpus),
    }
