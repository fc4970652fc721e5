"""GSM8K reward for OpenRLHF's ``--reward.remote_url reward_gsm8k.py``: 1.0 when the last number in the
response equals the reference answer (the text after ``####``), else 0.0."""

import re

import torch

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "").rstrip(".") if found else None


def reward_func(queries, prompts, labels, **kwargs):
    rewards = []
    for query, prompt, label in zip(queries, prompts, labels, strict=True):
        answer = label.split("####")[-1].strip().replace(",", "")
        response = query[len(prompt) :] if query.startswith(prompt) else query
        rewards.append(1.0 if _last_number(response) == answer else 0.0)
    scores = torch.tensor(rewards)
    return {"rewards": scores, "scores": scores, "extra_logs": {"accuracy": scores.mean()}}
