"""A toy reward for OpenRLHF's ``--reward.remote_url reward_digits.py``: the share of the response's characters that
are digits (0.0 to 1.0). Samples of a random model differ in it, so its advantages and gradients are not zero, and a
tiny model learns to raise it within tens of steps: the CPU training runs use it to show learning."""

import torch


def reward_func(queries, prompts, labels, **kwargs):
    rewards = []
    for query, prompt in zip(queries, prompts, strict=True):
        response = query[len(prompt) :] if query.startswith(prompt) else query
        rewards.append(sum(c.isdigit() for c in response) / max(len(response), 1))
    scores = torch.tensor(rewards)
    return {"rewards": scores, "scores": scores, "extra_logs": {"digit_share": scores.mean()}}
