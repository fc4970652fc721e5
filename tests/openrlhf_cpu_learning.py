"""Learning, shown: OpenRLHF's own loop and RLHFless's, sync and async, train a tiny model on a toy reward on this CPU.

    python tests/openrlhf_cpu_learning.py --out DIR [--seeds 3] [--steps 20] [--runs openrlhf-sync,...]

Each run is a launch of the CPU training harness (``openrlhf_cpu_train.py``: OpenRLHF 0.11.2's ``train()``, its
DeepSpeed learner on the CPU, the weight sync to a vLLM CPU engine) with the tiny model built here and
``examples/openrlhf/reward_digits.py`` as the reward (the share of digits in a response, which a random model's
samples vary in). GRPO, 8 prompts x 4 samples a step, 16 new tokens, Adam at 1e-3. The reward of each step is the
mean over its samples, as the learner trained them (``openrlhf_cpu_probe``). Writes ``DIR/report.json`` and
``DIR/learning.png`` (reward per step and per second since the first step trained) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import openrlhf_cpu_probe  # noqa: E402

#: The launches compared: name -> (scheduler, OpenRLHF flags beyond the common ones).
RUNS = {
    "openrlhf-sync": ("openrlhf", ()),
    "openrlhf-async": ("openrlhf", ("--train.async_enable",)),
    "rlhfless-sync": ("rlhfless", ()),
    "rlhfless-async": ("rlhfless", ("--train.async_enable",)),  # the stream
}
BATCH, SAMPLES, WINDOW = 8, 4, 5  # prompts a step, samples a prompt, steps averaged at the start and the end


def _flags(model: Path, data: Path, out: Path, scheduler: str, extra: tuple[str, ...], seed: int) -> list[str]:
    flags = [
        "--scheduler", scheduler, "--actor.model_name_or_path", str(model), "--actor.num_nodes", "1",
        "--actor.num_gpus_per_node", "1", "--vllm.num_engines", "1", "--algo.advantage.estimator", "group_norm",
        "--rollout.n_samples_per_prompt", str(SAMPLES), "--algo.kl.init_coef", "0",
        "--data.prompt_dataset", str(data), "--data.input_key", "input", "--data.label_key", "label",
        "--reward.remote_url", str(HERE.parent / "examples" / "openrlhf" / "reward_digits.py"),
        "--rollout.batch_size", str(BATCH), "--train.batch_size", str(BATCH * SAMPLES),
        "--rollout.micro_batch_size", "8", "--train.micro_batch_size", "8", "--rollout.max_new_tokens", "16",
        "--data.max_len", "256", "--train.num_episodes", "1", "--train.seed", str(seed),
        "--ckpt.output_dir", str(out / "ckpt"), "--ckpt.path", str(out / "ckpt"),
        "--ds.attn_implementation", "sdpa", "--vllm.sync_backend", "gloo", "--vllm.enforce_eager",
        "--actor.adam.lr", "1e-3", "--actor.lr_warmup_ratio", "0", "--actor.lr_scheduler", "constant", *extra,
    ]  # fmt: skip
    if scheduler != "openrlhf":  # each run learns with its preset's own plan, however the launcher prices it
        flags += ["--scheduler.report", str(out / "steps.jsonl"), "--scheduler.force"]
        if "--scheduler.profile" not in extra:  # a tiny model is near no shipped profile
            flags += ["--scheduler.profile", "qwen2.5-7b-l40s"]
    return flags


def one_run(name: str, seed: int, steps: int, model: Path, work: Path) -> dict[str, Any]:
    """A launch of ``name`` with ``seed`` for ``steps`` steps: the reward and the time of each step."""
    out = work / f"{name}-{seed}"
    out.mkdir(parents=True)
    data = out / "prompts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"input": f"Tom has {i} apples and buys {i % 7} more. How many?", "label": f"q{i}"}) + "\n"
            for i in range(steps * BATCH)
        )
    )
    scheduler, extra = RUNS[name]
    cmd = [sys.executable, str(HERE / "openrlhf_cpu_train.py"), str(out / "run")]
    cmd += _flags(model, data, out, scheduler, extra, seed)
    done = subprocess.run(
        cmd, cwd=out, capture_output=True, text=True, env={**os.environ, "RLHFLESS_CPU_LAUNCH_GPUS": "2"}
    )
    (out / "launch.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"{name} (seed {seed}) failed, exit {done.returncode}: see {out / 'launch.log'}")
    trained = sorted(
        (r for r in openrlhf_cpu_probe.records(out / "run" / "probe") if r["kind"] == "train" and r["rank"] == 0),
        key=lambda r: r["trained_from"],
    )
    t0 = trained[0]["time"]
    return {
        "run": name,
        "seed": seed,
        "steps": [{"step": i + 1, "reward": r["status"]["reward"], "t": r["time"] - t0} for i, r in enumerate(trained)],
    }


def summary(runs: list[dict[str, Any]], steps: int) -> list[dict[str, Any]]:
    """Per launch: the mean reward of the first and last ``WINDOW`` steps (mean over seeds, and their range) and
    the seconds a step took once training began."""
    rows = []
    for name in dict.fromkeys(r["run"] for r in runs):
        mine = [r for r in runs if r["run"] == name]
        window = min(WINDOW, steps)
        first = [statistics.mean(s["reward"] for s in r["steps"][:window]) for r in mine]
        last = [statistics.mean(s["reward"] for s in r["steps"][-window:]) for r in mine]
        per_step = [r["steps"][-1]["t"] / max(len(r["steps"]) - 1, 1) for r in mine]
        rows.append(
            {
                "run": name,
                "seeds": len(mine),
                "first": statistics.mean(first),
                "last": statistics.mean(last),
                "last_range": [min(last), max(last)],
                "s_per_step": statistics.mean(per_step),
            }
        )
    return rows


def verdict(rows: list[dict[str, Any]]) -> str | None:
    """Whether the stream's final reward is within OpenRLHF sync's range over seeds, or by how much it is not."""
    by = {r["run"]: r for r in rows}
    if "openrlhf-sync" not in by or "rlhfless-async" not in by:
        return None
    lo, hi = by["openrlhf-sync"]["last_range"]
    got = by["rlhfless-async"]["last"]
    if lo <= got <= hi:
        return f"rlhfless-async's final reward {got:.3f} is within openrlhf-sync's range over seeds ({lo:.3f}-{hi:.3f})"
    off = got - hi if got > hi else got - lo
    return f"rlhfless-async's final reward {got:.3f} is {off:+.3f} outside openrlhf-sync's range ({lo:.3f}-{hi:.3f})"


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    colors = {name: f"C{i}" for i, name in enumerate(RUNS)}
    for r in runs:
        xs = [s["step"] for s in r["steps"]]
        ts = [s["t"] for s in r["steps"]]
        ys = [s["reward"] for s in r["steps"]]
        label = r["run"] if r["seed"] == min(x["seed"] for x in runs if x["run"] == r["run"]) else None
        by_step.plot(xs, ys, color=colors[r["run"]], alpha=0.7, label=label)
        by_time.plot(ts, ys, color=colors[r["run"]], alpha=0.7)
    by_step.set(xlabel="training step", ylabel="reward (share of digits)", title="reward per step")
    by_time.set(xlabel="seconds since the first step trained", title="reward per wall-clock second")
    by_step.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for report.json and learning.png")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of: {', '.join(RUNS)}")
    args = ap.parse_args(argv)
    names = [n for n in args.runs.split(",") if n]
    unknown = [n for n in names if n not in RUNS]
    if unknown or args.seeds < 1 or args.steps < 2:
        ap.error(f"--runs takes {', '.join(RUNS)}; --seeds >= 1, --steps >= 2 (got {unknown or ''})")
    from rlhfless_openrlhf.tools.tiny_model import tiny_model

    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    with tempfile.TemporaryDirectory(prefix="rlhfless-learning-") as tmp:
        work = Path(tmp)
        model = tiny_model(work / "cache")
        todo = [(name, seed) for seed in range(1, args.seeds + 1) for name in names]
        for k, (name, seed) in enumerate(todo, start=1):
            print(f"[{k}/{len(todo)}] {name} seed {seed}", file=sys.stderr, flush=True)
            runs.append(one_run(name, seed, args.steps, model, work))
    rows = summary(runs, args.steps)
    report = {"steps": args.steps, "batch": BATCH, "samples": SAMPLES, "summary": rows, "runs": runs}
    report["verdict"] = verdict(rows)
    (args.out / "report.json").write_text(json.dumps(report, indent=1))
    plot(runs, args.out / "learning.png")
    for row in rows:
        lo, hi = row["last_range"]
        print(
            f"{row['run']:<16} seeds {row['seeds']}  reward first {WINDOW} steps {row['first']:.3f}  last "
            f"{WINDOW} {row['last']:.3f} ({lo:.3f}-{hi:.3f})  {row['s_per_step']:.2f} s/step"
        )
    if report["verdict"]:
        print(report["verdict"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
