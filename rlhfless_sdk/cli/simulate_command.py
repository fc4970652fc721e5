"""``rlhfless simulate`` in three parts: the request (the command's options, grouped), the run (the workload, the
schedulers and the simulators made from it, then every scheduler simulated) and the render (tables, JSON, plots).

``simulate_main(registry, **options)`` runs the three; each part is a function of the one before, so a test or a
tool can build a request, run it and read the outcome without the command line.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from rlhfless_sdk.api.config import SchedulerConfig
from rlhfless_sdk.api.plugins import Registry
from rlhfless_sdk.api.records import TimePerTokenProfile, dumps
from rlhfless_sdk.cli.args import engine_profiles, run_profile
from rlhfless_sdk.cli.drafting import acceptance_arg, drafter_arg, drafter_lines, with_drafter
from rlhfless_sdk.cli.plots import plot, plot_frontier
from rlhfless_sdk.cli.simulate import (
    ABLATION,
    check_split_takers,
    check_workload_flags,
    comparable_configs,
    compare,
    engine_workload,
    frontier_sizes,
    make_cluster,
    parse_rollout_gpus,
    print_tables,
    run_simulation,
)
from rlhfless_sdk.rollout.modes import mode_for
from rlhfless_sdk.simulation.simulator import Simulator
from rlhfless_sdk.workloads.traces import Workload, workload_summary


# -- the request -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkloadRequest:
    """What is replayed: a trace, or a synthetic workload of this shape."""

    trace: str | None
    prompts: int
    samples: int
    steps: int | None
    seed: int
    median_length: float = 300.0
    length_sigma: float = 0.6
    sample_sigma: float = 0.35
    max_length: int = 1024
    runaway: float = 0.0
    length_growth: float = 1.0

    @property
    def shape(self) -> dict[str, Any]:
        """The synthetic workload's length shape (``engine_workload``'s ``shape``)."""
        names = ("median_length", "length_sigma", "sample_sigma", "max_length", "runaway", "length_growth")
        return {name: getattr(self, name) for name in names}


@dataclass(frozen=True)
class ClusterRequest:
    """Where it runs: the profile's engines, the GPUs and their memory, the learner's algorithm."""

    profile: str = "qwen2.5-7b-l40s"
    gpus: int = 16
    gpus_per_node: int = 8
    memory: str = "colocated"
    dedicated_kv_tokens: int | None = None
    colocated_kv_tokens: int | None = None
    algo: str = "auto"
    prefix_caching: bool = False
    tensor_parallel: int = 1


@dataclass(frozen=True)
class SchedulersRequest:
    """What runs: the schedulers (or the ablation), how they launch, and what they may do."""

    schedulers: tuple[str, ...] = ()
    ablation: bool = False
    rollout_gpus: str | None = None
    max_actors: int | None = None
    allow_burst_engines: bool = False
    launch: str = "sync"
    drafter: str | None = None
    acceptance: str | None = None
    plan_s: float | None = None

    @property
    def names(self) -> list[str]:
        names = list(self.schedulers) or (ABLATION if self.ablation else ["openrlhf", "rlhfless"])
        if self.ablation and self.schedulers:
            names = list(self.schedulers) + [n for n in ABLATION if n not in self.schedulers]
        return names


@dataclass(frozen=True)
class OutputRequest:
    """What is shown: JSON or tables, the plots, and the time-cost frontier."""

    as_json: bool = False
    plot_path: Path | None = None
    frontier_plot: Path | None = None
    frontier_gpus: str | None = None
    frontier: bool = True


@dataclass(frozen=True)
class SimulateRequest:
    """``rlhfless simulate``'s options, grouped by what they say."""

    workload: WorkloadRequest
    cluster: ClusterRequest
    schedulers: SchedulersRequest
    output: OutputRequest

    @classmethod
    def of(cls, **options: Any) -> SimulateRequest:
        """The request of the command's options (by parameter name); an unknown one is a ``TypeError``."""
        parts = {
            "workload": WorkloadRequest,
            "cluster": ClusterRequest,
            "schedulers": SchedulersRequest,
            "output": OutputRequest,
        }
        made = {}
        for field, part in parts.items():
            names = {f.name for f in dataclasses.fields(part)}
            made[field] = part(**{k: v for k, v in options.items() if k in names})
        unknown = set(options) - {f.name for part in parts.values() for f in dataclasses.fields(part)}
        if unknown:
            raise TypeError(f"unknown simulate option(s): {', '.join(sorted(unknown))}")
        return cls(**made)


# -- the run ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Profiles:
    """The request's profile three ways: the engines' dedicated capacity (async and burst engines), a synchronous
    engine's (``memory``), and one-GPU engines (the work bound's, None where the engines are one GPU already)."""

    dedicated: TimePerTokenProfile
    sync: TimePerTokenProfile
    one_gpu: TimePerTokenProfile | None

    @classmethod
    def of(cls, c: ClusterRequest) -> Profiles:
        kv = (c.dedicated_kv_tokens, c.colocated_kv_tokens)
        dedicated, sync = engine_profiles(c.profile, *kv, c.memory, c.tensor_parallel)
        # the work bound is on one-GPU engines whatever the engines run: sharding only adds GPU work (all-reduces,
        # each shard below one GPU's bandwidth), so no schedule at any tensor-parallel size beats it
        one_gpu = run_profile(c.profile, None, None) if c.tensor_parallel > 1 else None
        if c.gpus < sync.gpus_per_actor:
            raise click.ClickException(f"--gpus {c.gpus} is fewer than one actor of profile {c.profile} needs")
        return cls(dedicated, sync, one_gpu)


@dataclass(frozen=True)
class Prepared:
    """A request made ready to run: the schedulers, the workload, the profiles, and how a simulator is built."""

    request: SimulateRequest
    registry: Registry
    configs: list[SchedulerConfig]
    workload: Workload
    profiles: Profiles
    algo: str
    probe: int | None
    plan_on: tuple[Workload, str] | None
    acceptance: Any
    frontier_sizes: list[int]

    def simulator(self, gpus: int) -> Simulator:
        c = self.request.cluster
        return Simulator(
            self.profiles.dedicated,
            make_cluster(gpus, c.gpus_per_node),
            registry=self.registry,
            algo=self.algo,
            memory=c.memory,
            split_probe_steps=self.probe,
            prefix_caching=c.prefix_caching,
            bound_profile=self.profiles.one_gpu,
            split_plan=self.plan_on,
            acceptance=self.acceptance,
            plan_s=self.request.schedulers.plan_s,
        )

    @property
    def baselines(self) -> list[SchedulerConfig]:
        """The schedulers with a fixed engine count: what the frontier draws at other cluster sizes."""
        return [c for c in self.configs if c.policy("scaler").name == "fixed"]


def schedulers_of(registry: Registry, request: SimulateRequest, gpus_per_actor: int) -> list[SchedulerConfig]:
    """The schedulers to compare, made comparable (equal peak, the launch form, the drafter, the split)."""
    s, c = request.schedulers, request.cluster
    configs = comparable_configs(
        s.names, registry, s.max_actors, s.allow_burst_engines, c.gpus, gpus_per_actor, s.launch
    )
    configs = with_drafter(configs, drafter_arg(registry, s.drafter))
    split = parse_rollout_gpus(s.rollout_gpus)
    modes = [mode_for(config, registry) for config in configs]
    if split is not None:
        check_split_takers(s.rollout_gpus or "", configs, modes)
    if isinstance(split, int):  # a fixed split for every pipeline that has one (an elastic stream re-plans its own)
        configs = [
            config.derive(pipeline={**config.pipeline.model_dump(), "rollout_gpus": split}) if m.fixed_split else config
            for config, m in zip(configs, modes, strict=True)
        ]
    return configs


def prepare(registry: Registry, request: SimulateRequest) -> Prepared:
    """The request checked and made ready to run (a bad flag is refused here, before anything is simulated)."""
    w, c, out = request.workload, request.cluster, request.output
    profiles = Profiles.of(c)
    check_workload_flags(w.trace, w.steps, w.length_growth)
    if out.frontier_gpus is not None and out.frontier_plot is None:
        raise click.BadParameter(
            f"{out.frontier_gpus}: the cluster sizes of the baselines drawn on --frontier-plot; without it nothing "
            "uses them: add --frontier-plot FILE or drop --frontier-gpus",
            param_hint="'--frontier-gpus'",
        )
    configs = schedulers_of(registry, request, profiles.sync.gpus_per_actor)
    accepted = acceptance_arg(request.schedulers.acceptance)
    workload = engine_workload(w.trace, w.prompts, w.samples, w.steps, w.seed, profiles.sync, c.memory, w.shape)
    # a stream's split is planned as a launch plans it, on a trace of the user's run: for a synthetic workload, the
    # same recipe drawn with another seed (an earlier run), never the samples it replays; a trace plans on itself
    earlier = (w.trace, w.prompts, w.samples, w.steps, w.seed + 1, profiles.sync, c.memory, w.shape)
    plan_on = (
        None if w.trace else (engine_workload(*earlier), f"an earlier run of the same workload (seed {w.seed + 1})")
    )
    probe = None if parse_rollout_gpus(request.schedulers.rollout_gpus) == "best" else 3
    prepared = Prepared(
        request,
        registry,
        configs,
        workload,
        profiles,
        workload.algo if c.algo == "auto" else c.algo,
        probe,
        plan_on,
        accepted,
        [],
    )
    if out.frontier_plot is not None:  # checked before the run, not after it
        if not prepared.baselines:
            raise click.ClickException(
                "--frontier-plot draws the baselines (schedulers with a fixed engine count: openrlhf, verl, "
                "openrlhf-async...) at several cluster sizes: give at least one with --scheduler"
            )
        sizes = frontier_sizes(out.frontier_gpus, c.gpus, profiles.sync.gpus_per_actor)
        prepared = dataclasses.replace(prepared, frontier_sizes=sizes)
    return prepared


@dataclass(frozen=True)
class Outcome:
    """A run's figures: a row per scheduler, what the run was (``meta``), the frontier's rows and the work bound."""

    rows: list[dict[str, Any]]
    meta: dict[str, Any]
    frontier_rows: list[dict[str, Any]]
    work: Any


def run(prepared: Prepared) -> Outcome:
    """Every scheduler simulated on the request's cluster (and the baselines at each frontier size)."""
    request, gpus = prepared.request, prepared.request.cluster.gpus
    show = not request.output.as_json
    sim = prepared.simulator(gpus)
    for config in prepared.configs:
        refused = sim.refusal(config)
        if refused is not None:
            raise click.BadParameter(refused, param_hint="'--scheduler'")
    results = run_simulation(prepared.configs, prepared.workload, sim, progress=show, frontier=request.output.frontier)
    rows = compare(results)
    for row in rows:
        if row.get("split_search"):
            probe = prepared.probe
            row["split_tried_on"] = "on the whole workload" if probe is None else f"on the first {probe} steps"
    frontier_rows: list[dict[str, Any]] = []
    for n in prepared.frontier_sizes:
        if n == gpus:
            res = [r for r, c in zip(results, prepared.configs, strict=True) if c in prepared.baselines]
        else:
            res = run_simulation(
                prepared.baselines, prepared.workload, prepared.simulator(n), progress=show, frontier=False
            )
        frontier_rows += [{"name": r.scheduler, "gpus": n, **r.totals()} for r in res]
    meta = run_meta(prepared, results[0].work)
    if request.output.frontier_plot is not None:
        meta["frontier"] = frontier_rows
    return Outcome(rows, meta, frontier_rows, results[0].work)


def run_meta(prepared: Prepared, work: Any) -> dict[str, Any]:
    """What the run was: the workload, the profile and its memory, the learner, the GPUs, the work bound."""
    c, p = prepared.request.cluster, prepared.profiles
    return {
        "workload": workload_summary(prepared.workload),
        "profile": p.sync.name,
        "memory": c.memory,
        "kv_capacity_tokens": p.sync.kv_capacity_tokens,
        "dedicated_kv_capacity_tokens": p.dedicated.kv_capacity_tokens,
        "colocated_kv_capacity_tokens": p.dedicated.colocated_kv_capacity_tokens,
        "cold_start_s": p.dedicated.cold_start_s,
        "algo": prepared.algo,
        "gpus": c.gpus,
        "burst_allowed": prepared.request.schedulers.allow_burst_engines,
        "work_gpu_seconds": work.gpu_s if work is not None else None,
        "bound_s": work.bound_s(c.gpus) if work is not None else None,
    }


# -- the render ------------------------------------------------------------------------------------------------
def render(prepared: Prepared, outcome: Outcome) -> None:
    """The outcome as JSON or as tables, then the plots asked for."""
    out, c = prepared.request.output, prepared.request.cluster
    if out.as_json:
        click.echo(dumps({**outcome.meta, "schedulers": outcome.rows}, indent=2))
    else:
        for line in header_lines(prepared, outcome):
            click.echo(line)
        print_tables(outcome.rows, c.gpus)
        for line in drafter_lines(outcome.rows, c.gpus):
            click.echo(line)
    name, dedicated = prepared.workload.name, prepared.profiles.dedicated
    if out.plot_path is not None:
        plot(outcome.rows, out.plot_path, f"{name}, {prepared.profiles.sync.name}, {c.gpus} GPUs")
        if not out.as_json:
            click.echo(f"\nplot: {out.plot_path}")
    if out.frontier_plot is not None:
        title = f"{name}, {dedicated.name}, {c.memory} memory"
        plot_frontier(outcome.rows, outcome.frontier_rows, out.frontier_plot, title)
        if not out.as_json:
            click.echo(f"\nfrontier plot: {out.frontier_plot}")


def header_lines(prepared: Prepared, outcome: Outcome) -> list[str]:
    """The lines above the tables: the workload, the engines' memory, the work bound."""
    c, p, w = prepared.request.cluster, prepared.profiles, outcome.meta["workload"]
    burst = "burst allowed" if prepared.request.schedulers.allow_burst_engines else "equal peak: no burst"
    lines = [
        f"workload {w['name']}: {w['steps']} steps x {w['prompts_per_step']} prompts, {w['samples']} samples, "
        f"response length {w['response_length']['min']}-{w['response_length']['max']} "
        f"(median {w['response_length']['median']:.0f}); profile {p.dedicated.name}; {prepared.algo} learner; "
        f"{c.gpus} GPUs ({burst})",
        f"memory: synchronous engines {c.memory} ({p.sync.kv_capacity_tokens:,} KV tokens each); async and burst "
        f"engines dedicated ({p.dedicated.kv_capacity_tokens:,}); the profile's colocated capacity "
        f"{_count(p.dedicated.colocated_kv_capacity_tokens)}, dedicated {p.dedicated.kv_capacity_tokens:,}; "
        f"engine start-up {p.dedicated.cold_start_s:g} s",
    ]
    work = outcome.work
    if work is not None:
        lines.append(
            f"work bound: {work.gpu_s:,.0f} GPU-s (decode {work.decode_gpu_s:,.0f}, prefill {work.prefill_gpu_s:,.0f}, "
            f"learning {work.learn_gpu_s:,.0f}) / {c.gpus} GPUs = {work.bound_s(c.gpus):,.1f} s; no schedule on "
            f"{c.gpus} GPUs is faster"
        )
    return lines


def simulate_main(registry: Registry, **options: Any) -> None:
    """``rlhfless simulate`` with these options (the command's parameters, by name)."""
    prepared = prepare(registry, SimulateRequest.of(**options))
    render(prepared, run(prepared))


def _count(n: int | None) -> str:
    return "unknown" if n is None else f"{n:,}"
