"""A complete rlhfless plugin: a prompt assigner that gives the longest prompts to the lowest-numbered actors
round-robin (so every actor gets a mix). Register it from code, or install it with an entry point:

    [project.entry-points.rlhfless]
    my-assigner = "custom_assigner_plugin"
"""

import numpy as np

from rlhfless_sdk import PolicySpec, hookimpl


class LongestRoundRobin:
    def __init__(self, params):
        pass

    def assign(self, batch, predicted, num_actors):
        order = np.argsort(-predicted, kind="stable")  # longest first
        actor = np.empty(len(batch), dtype=np.int64)
        actor[order] = np.arange(len(batch)) % num_actors
        return actor  # one actor per prompt: its n samples stay together


@hookimpl
def rlhfless_register_assigners(register):
    register(PolicySpec(name="longest-rr", factory=LongestRoundRobin, description="longest first, dealt round-robin"))
