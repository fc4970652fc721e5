"""A tiny random-weight Llama and a tokenizer trained here, for tests and CPU profiling without any download.

The model is built with transformers from a config (hidden 128, 2 layers, head_dim 64), its tokenizer is a
byte-level BPE trained with ``tokenizers`` on generated GSM8K-style text. Its outputs are noise, which is all
a scheduler needs: real engine timings, real token counts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

DEFAULT_CACHE = Path(os.environ.get("RLHFLESS_CACHE", Path.home() / ".cache" / "rlhfless"))
_MARKER = "rlhfless-tiny-model.json"
_VERSION = 1


def _corpus(n: int = 2000) -> list[str]:
    names = ["Tom", "Ana", "Li", "Sam", "Ravi", "Mia"]
    things = ["apples", "books", "eggs", "coins", "pencils"]
    return [
        f"Question: {names[i % 6]} has {i % 97} {things[i % 5]} and buys {(i * 7) % 31} more, then gives away "
        f"{i % 13}. How many {things[i % 5]} are left? Let's think step by step. "
        f"Answer: {i % 97 + (i * 7) % 31 - i % 13}"
        for i in range(n)
    ]


def build_tiny_model(out: str | Path, *, vocab_size: int = 512, seed: int = 0) -> Path:
    """Write a tiny Llama (float32 safetensors) and its tokenizer to ``out``; returns the folder."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=fast.vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(out, safe_serialization=True)
    (out / _MARKER).write_text(json.dumps({"version": _VERSION, "seed": seed, "vocab_size": vocab_size}))
    return out


def tiny_model(cache: str | Path | None = None) -> Path:
    """The cached tiny model folder, built on first use (or rebuilt if incomplete)."""
    folder = Path(cache or DEFAULT_CACHE) / "tiny-llama"
    marker = folder / _MARKER
    ok = marker.exists() and (folder / "model.safetensors").exists() and (folder / "tokenizer.json").exists()
    if ok:
        try:
            ok = json.loads(marker.read_text()).get("version") == _VERSION
        except (OSError, ValueError):
            ok = False
    return folder if ok else build_tiny_model(folder)
