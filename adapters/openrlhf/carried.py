"""What partial rollouts cut at B groups carry from one step to the next on OpenRLHF's engines (``CarriedWork``), and
the JSON a checkpoint keeps it as (a response's tensors with their shape and dtype)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlhfless_sdk.rollout.carry import CarryBook

#: The key marking a tensor in a checkpoint's JSON.
TENSOR = "__rlhfless_tensor__"


def tensor_to_json(value: Any) -> Any:
    """A checkpoint's JSON for ``value``: a tensor as its values, shape and dtype (``tensors_from_json`` rebuilds
    it); another array as its values; anything else as its text."""
    import torch

    if isinstance(value, torch.Tensor):
        return {TENSOR: value.tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    return value.tolist() if hasattr(value, "tolist") else str(value)


def tensors_from_json(value: Any) -> Any:
    """``value`` with every tensor ``tensor_to_json`` wrote rebuilt (a 0-d reward stays 0-d, a [1] one [1])."""
    import torch

    if isinstance(value, dict):
        if TENSOR in value:
            return torch.tensor(value[TENSOR], dtype=getattr(torch, value["dtype"]))
        return {k: tensors_from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [tensors_from_json(v) for v in value]
    return value


#: An open group's prompt as OpenRLHF gave it: (prompt, label, image, uid, prompt token ids).
GroupPrompt = tuple[str, Any, Any, str, list[int]]


@dataclass
class CarriedWork:
    """The carry book (open groups, carried samples) and, by group or by (group, sample index), what OpenRLHF's side
    of them needs: each open group's prompt, each carried sample's tokens and their logprobs so far, and the
    responses of samples that ended in a group still open (they train with it)."""

    book: CarryBook = field(default_factory=CarryBook)
    prompts: dict[int, GroupPrompt] = field(default_factory=dict)
    tokens: dict[tuple[int, int], tuple[list[int], list[float] | None]] = field(default_factory=dict)
    ended: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)

    def keep(self, outputs: list[dict[str, Any]], carried: set[int], carried_out: dict[int, dict[str, Any]]) -> None:
        """After a step: each ended sample's response kept for its group, each carried one's tokens and logprobs
        (``carried_out``: what a carried sample's engine handed back; one whose engine died keeps what it had)."""
        for sid, p in enumerate(self.book.step_pieces):
            key = (p.group, p.sample_index)
            if sid not in carried:
                self.ended[key] = outputs[sid]
                self.tokens.pop(key, None)
            elif sid in carried_out:  # everything it has now, prompt excluded
                resp = carried_out[sid]
                start = resp["action_ranges"][0][0]
                lps = resp["rollout_log_probs"]
                self.tokens[key] = (list(resp["observation_tokens"][start:]), None if lps is None else lps[start:])

    def take(self, group: int, n: int) -> list[dict[str, Any]]:
        """A group that trains: its n responses in order; it leaves the work."""
        self.prompts.pop(group, None)
        return [self.ended.pop((group, j)) for j in range(n)]

    def state(self) -> dict[str, Any]:
        """The work as a checkpoint's plain data (tensors as ``tensor_to_json`` writes them, by the caller)."""
        return {
            **self.book.state(),
            "group_meta": {str(g): [m[0], m[1], None, m[3], list(m[4])] for g, m in self.prompts.items()},
            "carry_state": [[g, j, list(t), lp] for (g, j), (t, lp) in self.tokens.items()],
            "ended": [[g, j, r] for (g, j), r in self.ended.items()],
        }

    @classmethod
    def from_state(cls, snapshot: dict[str, Any]) -> CarriedWork:
        return cls(
            CarryBook.from_state(snapshot),
            {int(g): (m[0], m[1], None, m[3], list(m[4])) for g, m in snapshot["group_meta"].items()},
            {(int(g), int(j)): (list(t), lp) for g, j, t, lp in snapshot["carry_state"]},
            {(int(g), int(j)): tensors_from_json(r) for g, j, r in snapshot["ended"]},
        )
