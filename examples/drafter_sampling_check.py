"""Does an engine with a drafter sample what the target model would? ``python examples/drafter_sampling_check.py``.

Speculative decoding is lossless only if every emitted token is distributed as the target model's next token. This
check needs no drafts: at each position of an engine's rollouts, the probability the target gave the token emitted
there, p(x), has expectation sum_v p(v)^2 under lossless sampling. Each engine's rollouts (SmolLM2-135M, vLLM's CPU
build, 16 GSM8K questions x 4 samples, temperature 1, 256 new tokens) are scored by a plain engine's prompt
logprobs (the top 20 at each position, which hold nearly all the mass): the ratio of the mean p(x) to the mean
sum p(v)^2 is 1 for a lossless engine (a little above, from the mass outside the top 20), and above 1 for an engine
that emits tokens the drafter proposed more often than the target would.

Needs the adapter's install (vLLM) and the demo's SmolLM2 (converted from ../shared on first use).
"""

from __future__ import annotations

import argparse
import gc
import math


def engine(model, name: str, max_len: int, dtype: str):
    """A vLLM CPU engine drafting with ``name`` (``none``: plain) at its whole budget, as the bench builds it."""
    import os

    from rlhfless_openrlhf.drafting import speculative_config
    from rlhfless_openrlhf.tools.drafter_bench import WHOLE_BUDGET
    from vllm import LLM

    spec = speculative_config({"name": name, "params": WHOLE_BUDGET.get(name, {})}, "cpu")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return LLM(str(model), speculative_config=spec, max_model_len=max_len, enforce_eager=True, seed=0, dtype=dtype,
               enable_prefix_caching=False)  # fmt: skip


def rollouts(model, name: str, ids: list[list[int]], samples: int, max_new: int, dtype: str) -> list[list[int]]:
    """One epoch of the prompts on an engine drafting with ``name`` (``none``: plain), at its whole budget."""
    from rlhfless_openrlhf import drafting
    from vllm import SamplingParams

    llm = engine(model, name, max(len(p) for p in ids) + max_new + 16, dtype)
    if name not in ("none", "ngram"):
        drafting.expect(llm, ids)
    params = SamplingParams(temperature=1.0, max_tokens=max_new, n=samples)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    del llm
    gc.collect()
    return [[*ids[i], *c.token_ids] for i, o in enumerate(outs) for c in o.outputs]


def score(llm, seqs: list[list[int]], prompt_lengths: list[int]) -> tuple[float, float, int]:
    """Mean p(emitted token) and mean sum p(v)^2 (top 20) over the response positions of ``seqs``."""
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": s} for s in seqs], SamplingParams(max_tokens=1, prompt_logprobs=20),
                        use_tqdm=False)  # fmt: skip
    emitted = squared = 0.0
    n = 0
    for seq, start, out in zip(seqs, prompt_lengths, outs, strict=True):
        for pos in range(start, len(seq)):
            top = out.prompt_logprobs[pos]
            probs = {t: math.exp(lp.logprob) for t, lp in top.items()}
            emitted += probs.get(seq[pos], 0.0)
            squared += sum(p * p for p in probs.values())
            n += 1
    return emitted / n, squared / n, n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", action="append", help="drafters to check (default: ngram, suffix)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", help="the engines' dtype (vLLM's CPU default: bfloat16)")
    args = parser.parse_args()
    from rlhfless_openrlhf.tools.drafter_bench import BenchSettings, _questions
    from rlhfless_openrlhf.tools.workbench import chat_prompts, default_cache, smollm2_model
    from transformers import AutoTokenizer

    model = smollm2_model(default_cache(), print)
    tokenizer = AutoTokenizer.from_pretrained(model)
    questions, source = _questions(BenchSettings(num_prompts=args.num_prompts))
    prompts, _ = chat_prompts(tokenizer, questions)
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts][: args.num_prompts]
    names = ["none", *(args.drafter or ["ngram", "suffix"])]
    made = {name: rollouts(model, name, ids, args.samples, args.max_new_tokens, args.dtype) for name in names}
    starts = [len(ids[i]) for i in range(len(ids)) for _ in range(args.samples)]
    scorer = engine(model, "none", max(len(s) for seqs in made.values() for s in seqs) + 16, args.dtype)
    print(f"{source}, {args.samples} samples each, temperature 1, up to {args.max_new_tokens} new tokens, {args.dtype}")
    print(f"{'engine':<8} {'tokens':>7} {'mean p(x)':>10} {'mean sum p^2':>13} {'ratio':>6}  (lossless: about 1)")
    for name, seqs in made.items():
        emitted, squared, n = score(scorer, seqs, starts)
        print(f"{name:<8} {n:>7} {emitted:>10.3f} {squared:>13.3f} {emitted / squared:>6.2f}")


if __name__ == "__main__":
    main()
