"""Recorded rollouts replayed through a drafter, offline: how many tokens a verification step would yield.

The input is JSON lines, one group a line: ``{"uid": str, "step": int, "prompt": str, "responses": [str, ...]}``
(a prompt's responses in one training step), tokenized by the caller. Steps replay in order; after a step, each of
its groups reaches the drafter (``observe``), as finished groups reach it on the engines, so a prompt's earlier
responses are there for the steps after. Within a group the responses run side by side at the same position: at
position ``t`` of a response its siblings are their first ``t`` tokens, or the whole response where it is shorter
(finished). Each verification step the drafter proposes ``k`` tokens for the response so far; the step keeps the
drafted prefix that equals the recorded continuation, plus one token. At temperature 1 a drafted token ``d`` is
kept with probability ``p(d)``, so exact match against the sampled response is an unbiased estimate of acceptance.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhfless_sdk.api.errors import RlhflessError

#: Where in a response a verification step starts, as a share of the response's length: its first quarter, the
#: middle half, its last quarter (the slices the replay reports and ``Acceptance.by_position`` prices).
POSITIONS: tuple[tuple[str, float], ...] = (("first quarter", 0.25), ("middle", 0.75), ("last quarter", 1.0))


class RolloutFileError(RlhflessError):
    """A recorded-rollouts file that cannot be replayed; names the file, the line and what is wrong."""

    def __init__(self, path: str | Path, line: int, message: str) -> None:
        super().__init__(f"{path}:{line}: {message}")


@dataclass(frozen=True)
class RecordedGroup:
    """One prompt's responses in one step, as token ids."""

    uid: str
    step: int
    prompt: list[int]
    responses: list[list[int]]


def read_rollouts(path: str | Path, tokenize: Callable[[list[str]], list[list[int]]]) -> list[RecordedGroup]:
    """The groups of ``path`` in step order (stable within a step); ``tokenize`` maps texts to token ids."""
    raw: list[tuple[str, int, str, list[str]]] = []
    try:
        lines = Path(path).read_text(encoding="utf-8-sig").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise RolloutFileError(path, 0, f"cannot read it ({exc})") from None
    for n, line in enumerate(lines, 1):
        if line.strip():
            raw.append(_parse(path, n, line))
    if not raw:
        raise RolloutFileError(path, 0, "no groups: expected one JSON object a line")
    texts = [t for _, _, prompt, responses in raw for t in (prompt, *responses)]
    ids = iter(tokenize(texts))
    groups = [RecordedGroup(uid, step, next(ids), [next(ids) for _ in responses]) for uid, step, _, responses in raw]
    return sorted(groups, key=lambda g: g.step)


def _parse(path: str | Path, n: int, line: str) -> tuple[str, int, str, list[str]]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise RolloutFileError(path, n, f"not JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise RolloutFileError(path, n, "expected an object with uid, step, prompt and responses")
    missing = [k for k in ("uid", "step", "prompt", "responses") if k not in row]
    if missing:
        raise RolloutFileError(path, n, f"missing {', '.join(missing)}")
    uid, step, prompt, responses = row["uid"], row["step"], row["prompt"], row["responses"]
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise RolloutFileError(path, n, f"step must be a whole number >= 0, not {step!r}")
    if not isinstance(prompt, str):
        raise RolloutFileError(path, n, "prompt must be a string")
    if not isinstance(responses, list) or not responses or not all(isinstance(r, str) for r in responses):
        raise RolloutFileError(path, n, "responses must be a non-empty list of strings")
    return str(uid), step, prompt, responses


@dataclass
class Tally:
    """Verification steps of one slice: tokens they yielded, drafts, and how deep each draft was kept."""

    budget: int
    tokens: int = 0
    steps: int = 0
    drafts: int = 0
    drafted: int = 0
    kept_at: list[int] = field(init=False)  # drafts whose j-th token was kept, j = 1..budget

    def __post_init__(self) -> None:
        self.kept_at = [0] * self.budget

    def add(self, yielded: int, drafted: int, kept: int) -> None:
        self.tokens += yielded
        self.steps += 1
        if drafted:
            self.drafts += 1
            self.drafted += drafted
            for j in range(kept):
                self.kept_at[j] += 1

    def figures(self) -> dict[str, Any]:
        """Tokens per verification step, the share of steps with a draft, and the first drafted token's
        acceptance given a draft (None where the slice had no step, or no draft)."""
        return {
            "tokens_per_step": self.tokens / self.steps if self.steps else None,
            "draft_rate": self.drafts / self.steps if self.steps else None,
            "first_acceptance": self.kept_at[0] / self.drafts if self.drafts else None,
            "steps": self.steps,
        }

    def acceptance(self) -> dict[str, Any]:
        """The slice as ``Acceptance`` fields (draft_rate, accepted_at, drafted_per_draft)."""
        drafts = max(self.drafts, 1)
        return {
            "draft_rate": round(self.drafts / self.steps, 4) if self.steps else 0.0,
            "accepted_at": [round(c / drafts, 4) for c in self.kept_at],
            "drafted_per_draft": round(self.drafted / drafts, 4),
        }


@dataclass
class Replay:
    """One drafter at one budget over a file: every slice's tally and the proposer's host time."""

    budget: int
    overall: Tally = field(init=False)
    positions: list[Tally] = field(init=False)
    longest: Tally = field(init=False)
    by_step: dict[int, Tally] = field(default_factory=dict)
    propose_s: float = 0.0
    proposals: int = 0

    def __post_init__(self) -> None:
        self.overall, self.longest = Tally(self.budget), Tally(self.budget)
        self.positions = [Tally(self.budget) for _ in POSITIONS]

    def slices(self, step: int, share: float, longest: bool) -> list[Tally]:
        """The tallies a verification step at ``share`` of its response adds to."""
        at = next(i for i, (_, upto) in enumerate(POSITIONS) if share < upto)  # share < 1: a token is left
        out = [self.overall, self.positions[at], self.by_step.setdefault(step, Tally(self.budget))]
        return [*out, self.longest] if longest else out

    def report(self) -> dict[str, Any]:
        return {
            "k": self.budget,
            **self.overall.figures(),
            "positions": {name: t.figures() for (name, _), t in zip(POSITIONS, self.positions, strict=True)},
            "longest": self.longest.figures(),
            "by_step": {s: t.figures() for s, t in sorted(self.by_step.items())},
            "propose_ms": 1e3 * self.propose_s / self.proposals if self.proposals else None,
        }


def replay(
    drafter: Any, groups: Iterable[RecordedGroup], k: int, progress: Callable[[int], None] | None = None
) -> Replay:
    """``groups`` (in step order) through ``drafter`` at a budget of ``k`` draft tokens a verification step;
    ``progress`` is told each group's response tokens once the group is replayed."""
    out = Replay(k)
    pending: list[RecordedGroup] = []
    for group in groups:
        if pending and group.step != pending[0].step:
            _observe(drafter, pending)
            pending = []
        _replay_group(drafter, group, out)
        pending.append(group)
        if progress is not None:
            progress(sum(len(r) for r in group.responses))
    _observe(drafter, pending)
    return out


def _observe(drafter: Any, groups: Sequence[RecordedGroup]) -> None:
    for g in groups:
        drafter.observe(g.prompt, g.responses)


def _replay_group(drafter: Any, group: RecordedGroup, out: Replay) -> None:
    longest = max(range(len(group.responses)), key=lambda i: len(group.responses[i]))
    for i, response in enumerate(group.responses):
        others = [r for j, r in enumerate(group.responses) if j != i]
        t, length = 0, len(response)
        while t < length:
            siblings = [r if len(r) <= t else r[:t] for r in others]  # finished ones whole, running ones so far
            began = time.perf_counter()
            draft = [int(x) for x in drafter.propose(group.prompt, response[:t], out.budget, siblings)][: out.budget]
            out.propose_s += time.perf_counter() - began
            out.proposals += 1
            kept = 0
            while kept < len(draft) and t + kept < length and draft[kept] == response[t + kept]:
                kept += 1
            yielded = min(kept + 1, length - t)
            for tally in out.slices(group.step, t / length, i == longest):
                tally.add(yielded, len(draft), kept)
            t += yielded


def acceptance_record(name: str, result: Replay, source: str) -> dict[str, Any]:
    """The ``Acceptance`` a replay measured (overall, and by position in the response), as a plain dict."""
    return {
        "drafter": name,
        "source": source,
        **result.overall.acceptance(),
        "tokens_per_step_measured": round(result.overall.figures()["tokens_per_step"] or 1.0, 4),
        "search_s_per_seq": round(result.propose_s / max(result.proposals, 1), 7),
        "by_position": [
            {"upto": upto, **t.acceptance()} for (_, upto), t in zip(POSITIONS, result.positions, strict=True)
        ],
    }


__all__ = [
    "POSITIONS",
    "RecordedGroup",
    "Replay",
    "RolloutFileError",
    "Tally",
    "acceptance_record",
    "read_rollouts",
    "replay",
]
