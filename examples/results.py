"""Rebuild docs/results.md: each table is made by the command printed above it.

    python examples/results.py                    # every table (the real-engine ones need the adapter install)
    python examples/results.py --only lr-8k       # one table (repeat --only); the others are kept as they are
    python examples/results.py --list             # the tables and their commands
    python examples/results.py --check [--only ID] # each command's short variant runs and yields every row

The page records, per table, the date and the commit it was measured at. ``tests/test_results_page.py`` runs the
check in CI and holds the page to the commands here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "results.md"
GPQA = "../shared/data/traces/gpqa-qwen2.5-7b-ppo"  # the project's shared data, beside the repository

LR = "--prompts 512 --samples 8 --median-length 1500 --sample-sigma 0.5 --runaway 0.03 --steps 10"
FLEET = "--gpus 16 --memory dedicated --no-frontier --launch both --rollout-gpus best"
#: The baselines and presets every simulated table runs (EVERY adds the paper's scheduler; the drafter table: these).
PRESETS = (
    "openrlhf",
    "verl",
    "openrlhf-async",
    "openrlhf-async-partial",
    "rlhfless",
    "rlhfless-fast",
    "rlhfless-onpolicy",
)
EVERY = " ".join(f"--scheduler {s}" for s in (*PRESETS, "rlhfless-paper"))
SIM = "rlhfless simulate"
DRAFTED = " ".join(f"--scheduler {s}" for s in PRESETS)


@dataclass(frozen=True)
class Table:
    id: str
    title: str
    about: str  # what the workload is, in a sentence or two
    command: str  # exactly as a reader types it
    quick: str  # appended for the check: a short variant (later flags win)
    kind: str  # "simulate" | "demo" | "fidelity" | "drafters" | "plan" | "predictors" | "learning"
    engines: bool = False  # needs real vLLM engines (the adapter's install)


def _sim(id: str, title: str, about: str, workload: str, quick: str) -> Table:
    return Table(id, title, about, f"{SIM} {workload} {FLEET} {EVERY}", quick, "simulate")


SHORT_LR = "--prompts 16 --steps 2"
TABLES: list[Table] = [
    _sim(
        "lr-8k",
        "Long reasoning, 8k cap",
        "512 prompts x 8 samples a step, median 1,500 tokens, 3% runaway samples to the cap, 10 steps.",
        f"{LR} --max-length 8192",
        SHORT_LR,
    ),
    _sim(
        "lr-8k-growth",
        "Long reasoning, 8k cap, lengths growing 5x",
        "As above, with every length growing until the last step's are 5x the first's.",
        f"{LR} --max-length 8192 --length-growth 5",
        SHORT_LR,
    ),
    _sim(
        "lr-16k",
        "Long reasoning, 16k cap",
        "The 8k workload with a 16,384-token cap.",
        f"{LR} --max-length 16384",
        SHORT_LR,
    ),
    _sim(
        "lr-16k-growth",
        "Long reasoning, 16k cap, lengths growing 5x",
        "The 16k workload with lengths growing 5x over the run.",
        f"{LR} --max-length 16384 --length-growth 5",
        SHORT_LR,
    ),
    Table(
        "lr-16k-suffix",
        "Long reasoning, 16k cap, with the suffix drafter (ASSUMED acceptance)",
        "The 16k workload; each preset beside its twin with the `suffix` drafter (NAME.suffix), priced where it "
        "drafts. Its acceptance is an assumption (`configs/acceptance/suffix-assumption.yaml`): figures measured "
        "offline on real GRPO rollouts of a 1.5B math model, 2.31 tokens a verification step with finished "
        "siblings, 1.87 in a response's last quarter; the proposer's host time measured here.",
        f"{SIM} {LR} --max-length 16384 {FLEET} {DRAFTED} --drafter suffix --acceptance suffix-assumption",
        SHORT_LR,
        "simulate",
    ),
    _sim(
        "gpqa",
        "GPQA, PPO (a real trace)",
        "A PPO run of Qwen2.5-7B on GPQA, replayed step by step from the project's shared data.",
        f"--trace {GPQA}",
        "--steps 2",
    ),
    _sim(
        "grpo-4",
        "GSM8K-style GRPO, n=4",
        "The embedded synthetic workload (short answers) with 4 samples a prompt.",
        "--samples 4",
        SHORT_LR,
    ),
    _sim(
        "grpo-8",
        "GSM8K-style GRPO, n=8",
        "The embedded synthetic workload with 8 samples a prompt.",
        "--samples 8",
        SHORT_LR,
    ),
    Table(
        "demo",
        "Real engines: the main demo (`rlhfless demo`)",
        "SmolLM2-135M on vLLM's CPU build through OpenRLHF's engines; every sample stops at a long-tailed length. "
        "Sync rows: 3 epochs of 12 prompts x 4 samples on 2 engines. "
        "Async rows: OpenRLHF's async loop, 4 batches of 8 prompts on 1 engine. "
        "`openrlhf-again` repeats the first row, so its distance from 1.00x is the machine's noise.",
        "rlhfless demo",
        "--quick",  # what CI's main job runs: tests/test_results_page.py checks that run's report there
        "demo",
        engines=True,
    ),
    Table(
        "fidelity",
        "Real engines against the simulator (`rlhfless fidelity`)",
        "The demo's comparison on one engine, then the simulator on the same lengths and a profile measured here.",
        "rlhfless fidelity --lengths-from long-reasoning --runs 2",
        "--runs 1 --num-prompts 4 --epochs 1 --max-new-tokens 48 --profile configs/profiles/qwen2.5-3b-l40s.yaml",
        "fidelity",
        engines=True,
    ),
    Table(
        "drafters",
        "Drafters on a real engine (`rlhfless drafter-bench`)",
        "Speculative decoding against a plain engine: SmolLM2-135M, 16 GSM8K test questions, 4 samples each, "
        "temperature 1, 3 epochs. It writes the acceptance files the simulator reads.",
        "rlhfless drafter-bench --write-acceptance configs/acceptance",
        "--num-prompts 2 --samples 2 --epochs 1 --max-new-tokens 24",
        "drafters",
        engines=True,
    ),
    Table(
        "plan",
        "Planning overhead (`rlhfless bench plan`)",
        "The median wall time of a full plan of a fresh batch (predict, dedup, assign, scale, place). The default "
        "scheduler runs against the paper's preset in one run, in two states. In the first steps no estimate was "
        "measured yet, so the deadline scaler estimates the fleet only. In the steady state its estimates are "
        "trusted and it searches the engine counts from its last pick. The simulator charges each step its plan's "
        "time.",
        "rlhfless bench plan --prompts 1024 --samples 8 --actors 64 --scheduler rlhfless --baseline rlhfless-paper",
        "--prompts 64 --repeat 1",
        "plan",
    ),
    Table(
        "predictors",
        "Length predictors on the GPQA trace (`rlhfless compare-predictors`)",
        "Each predictor replayed in step order: its error, and the simulated step it gives the scheduler.",
        f"rlhfless compare-predictors --trace {GPQA} --predictors ewma,model,hybrid,group,prompt-length",
        "--steps 2",
        "predictors",
    ),
    Table(
        "learning",
        "Learning on a CPU: OpenRLHF's own training loop, through the launcher",
        "OpenRLHF 0.11.2's `train()` with its DeepSpeed learner on the CPU and the weight sync to a vLLM CPU engine "
        "(the test harness's shims), each launch 3 seeds. A tiny random Llama learns the toy reward "
        "`examples/openrlhf/reward_digits.py` (the share of digits in a response): GRPO, 8 prompts x 4 samples a "
        "step, 16 new tokens. Rewards are the mean of each launch's first and last 5 steps, over seeds (the "
        "seeds' range in brackets); seconds a step from the first step trained. ![reward per step and per "
        "second](learning.png)",
        "python tests/openrlhf_cpu_learning.py --seeds 3 --steps 20",
        "--seeds 1 --steps 2 --runs openrlhf-sync",
        "learning",
        engines=True,
    ),
]
BY_ID = {t.id: t for t in TABLES}


# -- running a command ------------------------------------------------------------------------------------------
def _argv(command: str) -> list[str]:
    words = shlex.split(command)
    assert words[0] in ("rlhfless", "python"), command
    if words[0] == "python":
        return [sys.executable, *words[1:]]
    return [str(Path(sys.executable).with_name("rlhfless")), *words[1:]]


def run(table: Table, quick: bool = False, echo: bool = True, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """The table's command (or its short variant, with ``extra`` flags), run from the repository root; its JSON
    report."""
    command = table.command + (f" {table.quick}" if quick else "")
    with tempfile.TemporaryDirectory(prefix=f"rlhfless-results-{table.id}-") as tmp:
        out = Path(tmp)
        argv = [*_argv(command), *extra]
        report_file = None
        if table.kind in ("simulate", "plan", "predictors"):
            argv.append("--json")
        elif table.kind == "drafters":
            report_file = out / "report.json"
            argv += ["--json", str(report_file)]
            if quick:  # the check leaves the shipped acceptance files alone
                argv += ["--write-acceptance", str(out / "acceptance")]
        else:
            report_file = out / ("fidelity.json" if table.kind == "fidelity" else "report.json")
            argv += ["--out", str(out)]
        if echo:
            print(f"$ {command}", file=sys.stderr, flush=True)
        done = subprocess.run(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=None if echo else subprocess.PIPE)
        if done.returncode != 0:
            tail = (done.stderr or b"").decode(errors="replace")[-2000:]
            raise RuntimeError(f"{table.id}: `{command}` exited with {done.returncode}\n{tail}")
        if report_file is None:
            return json.loads(done.stdout)
        if table.kind == "learning" and not quick:  # the page shows its plot
            (ROOT / "docs" / "learning.png").write_bytes((out / "learning.png").read_bytes())
        return json.loads(report_file.read_text())


# -- rendering ----------------------------------------------------------------------------------------------------
def _f(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _rows_simulate(r: dict[str, Any]) -> list[list[str]]:
    """Each scheduler against OpenRLHF's synchronous mode and against its fastest async mode (each at its best
    split), where the command runs them."""
    runs = {s["name"]: s for s in r["schedulers"]}
    sync = runs.get("openrlhf")
    asyncs = [runs[n] for n in ("openrlhf-async", "openrlhf-async-partial") if n in runs]
    fastest = min(asyncs, key=lambda s: s["total_time_s"]) if asyncs else None
    head = ["scheduler", "GPUs (rollout)", "time s", "vs OpenRLHF sync", "vs OpenRLHF async"]
    rows = [[*head, "steady step s", "busy GPU-s", "work bound", "token age"]]
    for s in r["schedulers"]:
        split = s.get("rollout_gpus")
        rows.append(
            [
                f"`{s['name']}`",
                f"{s['peak_gpus']}" + (f" ({split})" if split else ""),
                _f(s["total_time_s"]),
                _vs(sync, s),
                _vs(fastest, s),
                _f(s.get("steady_step_s"), 1),
                _f(s["total_gpu_seconds"]),
                f"{s['bound_fraction']:.0%}",
                str(s["max_token_age_steps"]),
            ]
        )
    return rows


def _vs(base: dict[str, Any] | None, run: dict[str, Any]) -> str:
    return "-" if base is None else f"{base['total_time_s'] / run['total_time_s']:.3f}x"


def _spread(lo_hi: list[float] | None) -> str:
    return "-" if not lo_hi else f"{lo_hi[0]:.2f}-{lo_hi[1]:.2f}x"


def _rows_demo(r: dict[str, Any]) -> list[list[str]]:
    """The sync part's rows (with each one's per-epoch range), then the async loop's."""
    rows = [["launch", "scheduler", "groups", "s / group", "vs OpenRLHF", "per-epoch range", "token age"]]
    sync = [
        ("sync", t["scheduler"], t["groups"], t["generation_s"], t["speedup"], t["speedup_range"], t["max_token_age"])
        for t in r["totals"]
    ]
    loop = (r.get("async_loop") or {}).get("all_runs", [])
    rest = [("async", t["row"], t["groups"], t["time_s"], t["speedup"], None, t["max_token_age"]) for t in loop]
    for launch, name, groups, seconds, speedup, spread, age in sync + rest:
        per = seconds / max(groups, 1)
        rows.append([launch, f"`{name}`", str(groups), f"{per:.2f}", f"{speedup:.2f}x", _spread(spread), str(age)])
    return rows


def _rows_fidelity(r: dict[str, Any]) -> list[list[str]]:
    rows = [["scheduler", "measured vs first", "runs' range", "simulated vs first", "simulated error"]]
    for s in r["all_runs"]:
        err = s.get("ratio_error")
        rows.append(
            [
                f"`{s['scheduler']}`",
                f"{s['measured_ratio']:.3f}x",
                _spread(s.get("measured_ratio_range")),
                f"{s['simulated_ratio']:.3f}x",
                "-" if err is None else f"{err:+.1%}",
            ]
        )
    return rows


def _rows_drafters(r: dict[str, Any]) -> list[list[str]]:
    rows = [
        [
            "drafter",
            "generation s",
            "speed vs none",
            "tokens a step",
            "accepted at position 1",
            "proposer host time",
            "greedy identical",
        ]
    ]
    plain = sum(e["wall_s"] for e in r["runs"]["none"]["epochs"])
    lossless = r.get("lossless") or {}
    for name, run in r["runs"].items():
        wall = sum(e["wall_s"] for e in run["epochs"])
        tokens = sum(e["tokens"] for e in run["epochs"])
        accepted = sum(e["spec"].get("num_accepted_tokens", 0) or 0 for e in run["epochs"])
        acc = (r.get("acceptance") or {}).get(name)
        same = lossless.get(name)
        rows.append(
            [
                f"`{name}`",
                f"{wall:.1f}",
                f"{plain / wall:.2f}x",
                f"{tokens / max(tokens - accepted, 1):.3f}",
                f"{acc['accepted_at'][0]:.2f}" if acc else "-",
                _search(run.get("search") or {}),
                f"{same['identical']}/{same['of']}" if isinstance(same, dict) else "-",
            ]
        )
    return rows


def _search(search: dict[str, float]) -> str:
    """The proposer's measured host time: per context token (a whole-sequence search) or per sequence, a step."""
    if "search_s_per_token" in search:
        return f"{search['search_s_per_token'] * 1e9:.1f} ns a context token"
    if "search_s_per_seq" in search:
        return f"{search['search_s_per_seq'] * 1e6:.0f} us a sequence"
    return "-"


def _rows_plan(r: dict[str, Any]) -> list[list[str]]:
    rows = [["scheduler", "regime", "engine counts estimated", "chosen", "median ms", "min ms", "x baseline"]]
    for p in r["rows"]:
        rows.append(
            [
                f"`{p['scheduler']}`",
                p["regime"],
                f"{p['candidates']:g}",
                str(p["chosen_actors"]),
                f"{p['median_ms']:.1f}",
                f"{p['min_ms']:.1f}",
                f"{p['ratio']:.2f}x",
            ]
        )
    return rows


def _rows_predictors(r: dict[str, Any]) -> list[list[str]]:
    rows = [["predictor", "MAE tokens", "Acc@50", "Acc@100", "Kendall tau", "simulated time s", "GPU-s"]]
    for p in r["predictors"]:
        rows.append(
            [
                f"`{p['name']}`",
                f"{p['mae']:.0f}",
                f"{p['acc50']:.0%}",
                f"{p['acc100']:.0%}",
                f"{p['kendall_tau']:.3f}",
                _f(p["sim_time_s"]),
                _f(p["sim_gpu_seconds"]),
            ]
        )
    return rows


def _rows_learning(r: dict[str, Any]) -> list[list[str]]:
    rows = [["launch", "seeds", "reward, first 5 steps", "reward, last 5 steps", "s / step"]]
    for s in r["summary"]:
        lo, hi = s["last_range"]
        rows.append(
            [f"`{s['run']}`", str(s["seeds"]), f"{s['first']:.3f}", f"{s['last']:.3f} ({lo:.3f}-{hi:.3f})",
             f"{s['s_per_step']:.2f}"]
        )  # fmt: skip
    if r.get("verdict"):
        rows.append([r["verdict"], "", "", "", ""])
    return rows


RENDER: dict[str, Callable[[dict[str, Any]], list[list[str]]]] = {
    "simulate": _rows_simulate,
    "demo": _rows_demo,
    "fidelity": _rows_fidelity,
    "drafters": _rows_drafters,
    "plan": _rows_plan,
    "predictors": _rows_predictors,
    "learning": _rows_learning,
}


def markdown(rows: list[list[str]]) -> str:
    head, *body = rows
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)


def _commit() -> str:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", ".", ":!docs/results.md"], cwd=ROOT, capture_output=True, text=True
        ).stdout
        return rev + ("+changes" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def section(table: Table, report: dict[str, Any], when: str, commit: str) -> str:
    return "\n".join(
        [
            f"<!-- table {table.id} -->",
            f"## {table.title}",
            "",
            table.about + (" Real engines: needs the adapter's install." if table.engines else ""),
            "",
            "```bash",
            table.command,
            "```",
            "",
            f"Measured {when} at commit `{commit}`.",
            "",
            markdown(RENDER[table.kind](report)),
            f"<!-- end {table.id} -->",
        ]
    )


HEADER = """# Results

Each table is made by the command above it, run from the repository root.
`python examples/results.py` reruns every command and rewrites this page; `--only ID` reruns one table.
Simulated tables use the Qwen2.5-7B profile on 16 L40S GPUs, engines on dedicated memory.
The profile is derived from public figures; its arithmetic is in `configs/profiles/qwen2.5-7b-l40s.yaml`.
In them, "vs OpenRLHF sync" is `openrlhf`'s time over the row's.
"vs OpenRLHF async" is the same against the faster of `openrlhf-async` and `openrlhf-async-partial`.
"Work bound" is the share of the time that no schedule can beat.
"Token age" is the oldest trained token, in weight updates.
OpenRLHF's async rows run at their best rollout/learner split in hindsight (the rollout GPUs in brackets).
`rlhfless.async` is what `--scheduler rlhfless` runs in an async launch (`rlhfless-stream`).
It runs at the split the launcher picks.
The GPQA trace is read from the project's shared data folder, `../shared/data`, beside the checkout.
Each table names the commit it was measured at; rerun its command to measure your checkout.
"""


def sections(text: str) -> dict[str, str]:
    """The page's tables by id, as written between their markers."""
    found = re.findall(r"(<!-- table ([\w-]+) -->.*?<!-- end \2 -->)", text, flags=re.S)
    return {ident: body for body, ident in found}


def write_page(new: dict[str, str]) -> None:
    """The page with ``new``'s tables replaced, the others as they were (two rebuilds at once take turns)."""
    import fcntl

    with open(PAGE.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _write_page(new)
    PAGE.with_suffix(".lock").unlink(missing_ok=True)


def _write_page(new: dict[str, str]) -> None:
    old = sections(PAGE.read_text()) if PAGE.exists() else {}
    parts = [HEADER]
    for t in TABLES:
        body = new.get(t.id) or old.get(t.id)
        parts.append(body if body else f"<!-- table {t.id} -->\n## {t.title}\n\nNot measured yet.\n<!-- end {t.id} -->")
    PAGE.write_text("\n\n".join(parts) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", choices=list(BY_ID), help="a table to rebuild (repeat)")
    ap.add_argument("--check", action="store_true", help="run each command's short variant; the page is not written")
    ap.add_argument("--no-engines", action="store_true", help="skip the tables that need real engines")
    ap.add_argument("--list", action="store_true", help="print each table's id and command")
    args = ap.parse_args(argv)
    chosen = [BY_ID[i] for i in args.only] if args.only else TABLES
    if args.no_engines:
        chosen = [t for t in chosen if not t.engines]
    if args.list:
        for t in chosen:
            print(f"{t.id:<14}{t.command}")
        return 0
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    new = {}
    for k, t in enumerate(chosen, start=1):
        print(f"[{k}/{len(chosen)}] {t.id}", file=sys.stderr, flush=True)
        commit = _commit()  # the code the command runs, before it writes anything (drafter-bench writes configs)
        report = run(t, quick=args.check)
        rows = RENDER[t.kind](report)
        if args.check:
            print(markdown(rows))
            continue
        new[t.id] = section(t, report, datetime.date.today().isoformat(), commit)
        write_page(new)  # after each table: an interrupted rebuild keeps what it measured
    return 0


if __name__ == "__main__":
    sys.exit(main())
