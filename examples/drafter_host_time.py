"""Host time of a drafter's proposal on long sequences: ``python examples/drafter_host_time.py [--drafter suffix]``.

One proposal of k = 8 for a response of L tokens, with 7 running siblings of L tokens and 8 earlier responses of L
tokens to the same prompt (random token ids from a 50k vocabulary: matches are rare, so each source is searched
whole), for L = 1k, 4k and 16k; the mean of 50 proposals on one thread. This is the proposer's time on a
verification step's critical path, per running sequence (``search_s_per_seq`` in an acceptance file).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from rlhfless_sdk import get_plugin_manager


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", default="suffix")
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 50_000, 300).tolist()
    print(f"drafter {args.drafter}: one proposal of 8 tokens, 7 running siblings and 8 earlier responses of L each")
    for length in (1_000, 4_000, 16_000):
        drafter = get_plugin_manager().registry.create("drafter", args.drafter)
        drafter.observe(prompt, [rng.integers(0, 50_000, length).tolist() for _ in range(8)])
        response = rng.integers(0, 50_000, length).tolist()
        siblings = [rng.integers(0, 50_000, length) for _ in range(7)]
        began = time.perf_counter()
        for _ in range(args.repeat):
            drafter.propose(prompt, response, 8, siblings)
        print(f"L {length:>6,}: {(time.perf_counter() - began) / args.repeat * 1e3:.2f} ms a proposal")


if __name__ == "__main__":
    main()
