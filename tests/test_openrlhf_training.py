"""OpenRLHF's own training loop, launched through the drop-in launcher, trains on this CPU with every preset.

Each row runs ``python tests/openrlhf_cpu_train.py OUT <launcher flags>`` (``openrlhf_cpu_train.py``: OpenRLHF
0.11.2's ``train()``, DeepSpeed's learner on its CPU accelerator, the weight broadcast to vLLM CPU engines, a tiny
model built here and the toy reward ``examples/openrlhf/reward_digits.py``) for an epoch of 3 or more steps, then
checks what ``openrlhf_cpu_probe`` read from the learner's and the engines' own state:
- every step trains: finite weights and loss, and the weights move;
- after each weight sync each engine scores a fixed sequence as the learner's new weights do, not as the old;
- each trained token's rollout logprob is reproduced by the weights of a version within the preset's age bound;
- every prompt of the epoch is trained exactly once (each of its samples once), none lost or doubled.

CI runs every preset once (``CI_ROWS``); ``RLHFLESS_TRAIN_MATRIX=full`` runs the rest of the matrix.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import rlhfless_test_helpers as H  # registered by conftest.py

HERE = Path(__file__).resolve().parent
SHIMS = H.sibling("openrlhf_cpu_shims")
PROBE = H.sibling("openrlhf_cpu_probe")
BUILT = H.sibling("openrlhf_built").BUILT

TRAIN = HERE / "openrlhf_cpu_train.py"
REWARD = HERE.parent / "examples" / "openrlhf" / "reward_digits.py"
PROMPTS = 12  # an epoch: 3 steps of B = 4 groups


@dataclass(frozen=True)
class Row:
    """One launch of the matrix: the scheduler, OpenRLHF flags beyond the common ones, the oldest a trained token
    may be (in weight updates), and what else to expect."""

    scheduler: str
    flags: tuple[str, ...] = ()
    max_age: int = 0
    samples: int = 2  # --rollout.n_samples_per_prompt
    gpus: int = 2  # logical GPUs Ray gets
    ranks: int = 1  # learner ranks
    built: str = "sync"  # the trainer classes the launcher builds through Ray (``BUILT``; none: OpenRLHF's own)
    launched: str = ""  # the scheduler OpenRLHF runs, where the launcher picks another (its async form)
    correction: bool = True  # pass --algo.advantage.is_correction_level token (else the launcher must turn it on)
    once: tuple[str, ...] = field(default=())  # text each of exactly one line of the launch's output holds
    reward_model: bool = False  # a reward model (the tiny model with a value head) instead of the toy reward


ASYNC = ("--train.async_enable",)
#: What the launcher says when it turns OpenRLHF's importance correction on for a preset that trains stale tokens.
CORRECTION_ON = "importance-sampling correction on, --algo.advantage.is_correction_level token"
ROWS = {
    "openrlhf-sync": Row("openrlhf", built=""),
    "openrlhf-async": Row("openrlhf", ASYNC, max_age=2, built=""),
    "rlhfless-sync": Row("rlhfless"),
    "rlhfless-async": Row(
        "rlhfless",
        ASYNC,
        max_age=2,
        built="async",
        launched="rlhfless-stream",
        correction=False,
        once=(
            "in an async launch (--train.async_enable) runs 'rlhfless-stream'",
            "--train.partial_rollout_enable on",
            "no token more than 2 weight updates old",
            CORRECTION_ON,
        ),
    ),
    "rlhfless-fast-sync": Row("rlhfless-fast", max_age=1, correction=False, once=(CORRECTION_ON,)),
    "rlhfless-fast-async": Row(
        "rlhfless-fast",
        ASYNC,
        max_age=2,
        built="async",
        correction=False,
        once=(CORRECTION_ON, "a trained token is at most 2 weight updates old"),
    ),
    "rlhfless-onpolicy-sync": Row("rlhfless-onpolicy"),
    "rlhfless-zero2-two-ranks": Row("rlhfless", ("--ds.zero_stage", "2"), ranks=2, gpus=3),
    "rlhfless-zero3-two-ranks": Row("rlhfless", ("--ds.zero_stage", "3"), ranks=2, gpus=3),
    # the stream's split resizes the learner given 2 engines + 1 GPU to 1 engine + 2 ranks (DeepSpeed's batch check)
    "rlhfless-async-split-two-ranks": Row(
        "rlhfless",
        (*ASYNC, "--vllm.num_engines", "2", "--actor.num_gpus_per_node", "1", "--scheduler.split", "1"),
        max_age=2,
        ranks=2,
        gpus=3,
        built="async",
        launched="rlhfless-stream",
        correction=False,
        once=("pinned by --scheduler.split 1; applied: --vllm.num_engines 1 and --actor.num_gpus_per_node 2",),
    ),
    "rlhfless-onpolicy-ppo-critic": Row(
        "rlhfless-onpolicy",
        (
            "--algo.advantage.estimator",
            "gae",
            "--critic.model_name_or_path",
            "{model}",
            "--critic.num_gpus_per_node",
            "1",
            "--critic.adam.lr",
            "1e-3",
        ),
        samples=1,
        gpus=3,
    ),
    # the suffix drafter on the engines OpenRLHF trains with: forced, since a CPU launch builds none (vLLM's CPU build
    # does not sample the target's tokens while verifying drafts); the mechanics only
    "rlhfless-drafter-suffix": Row(
        "rlhfless",
        ("--scheduler.drafter", "suffix", "--scheduler.force"),
        once=("drafter 'suffix' drafts its own budget, unpriced (--scheduler.force)",),
    ),
    # OpenRLHF's README launches (tests/test_openrlhf_launcher.py: SHAPES), trained: PPO with a critic, a reward
    # model and a reference under --train.colocate_all; GRPO async with evaluation and --train.colocate_actor_ref,
    # where the stream builds a fill engine beside the learner
    "ppo-critic-reward-colocate-all": Row(
        "rlhfless-onpolicy",
        (
            "--algo.advantage.estimator",
            "gae",
            "--critic.model_name_or_path",
            "{model}",
            "--train.colocate_all",
            "--critic.num_gpus_per_node",
            "1",
            "--reward.num_gpus_per_node",
            "1",
            "--ref.num_gpus_per_node",
            "1",
            "--algo.kl.init_coef",
            "0.01",
            "--critic.adam.lr",
            "1e-3",
        ),
        samples=1,
        gpus=2,
        reward_model=True,
    ),
    "grpo-async-eval-colocate-actor-ref": Row(
        "rlhfless",
        (
            *ASYNC,
            "--eval.dataset",
            "{data}",
            "--eval.steps",
            "2",
            "--train.colocate_actor_ref",
            "--algo.kl.init_coef",
            "0.01",
            "--ref.num_gpus_per_node",
            "1",
            "--scheduler.profile",
            "{small}",  # a learner whose state leaves a fill engine room beside it (``small_learner_profile``)
        ),
        max_age=2,
        built="async",
        launched="rlhfless-stream",
        correction=False,
        once=("1 fill engines on the learner's GPUs", CORRECTION_ON),
    ),
    "rlhfless-onpolicy-colocate-all": Row("rlhfless-onpolicy", ("--train.colocate_all",), gpus=1),
}
#: What CI trains: OpenRLHF's own loop (the harness's control) and OpenRLHF's README launches with ``rlhfless``'s
#: async form (the stream, with a fill engine) and ``rlhfless-onpolicy``; ``rlhfless-fast`` trains in the resume
#: test, ``rlhfless`` sync in the engine-kill test (each with the launch-path checks).
CI_ROWS = ["openrlhf-sync", "grpo-async-eval-colocate-actor-ref", "ppo-critic-reward-colocate-all"]


def _rows() -> list[str]:
    """The matrix rows to run, and (``after-step-1``) whether the engine-kill test also kills between steps (the
    generator's own path, which ``test_openrlhf_rollout.py`` covers on engines without a learner)."""
    full = os.environ.get("RLHFLESS_TRAIN_MATRIX") == "full"
    return [*ROWS, "after-step-1"] if full else CI_ROWS


def test_each_shim_names_the_line_it_stands_in_for():
    """The shims' table names lines of the pinned OpenRLHF and vLLM: each still holds the text it quotes."""
    pytest.importorskip("openrlhf")
    pytest.importorskip("vllm")
    site = Path(importlib.util.find_spec("openrlhf").origin).parent.parent
    for shim in SHIMS.SHIMS:
        line = (site / shim.file).read_text().splitlines()[shim.line - 1]
        assert shim.text in line, f"{shim.file}:{shim.line} now reads {line.strip()!r}"


def test_the_version_fit_finds_where_a_sample_changed_weights():
    """A sample of 12 tokens sampled under version 1, then (from its 5th token) version 2, with errors of a CPU
    kernel's size on top: the fit puts the change where it is, and one noisy token alone moves nothing."""
    noise = [0.002, 0.0, 0.003, 0.001] * 3
    errors = [
        [0.08 + n for n in noise],  # version 0: far from every token
        [n if t < 4 else 0.05 for t, n in enumerate(noise)],
        [0.05 if t < 4 else n for t, n in enumerate(noise)],
    ]
    errors[0][7] = 0.0  # one token that version 0 happens to match better
    versions, left = PROBE.monotone_versions(errors)
    assert versions == [1] * 4 + [2] * 8 and max(left) <= 0.003


def _inputs(tmp_path: Path, prompts: int = PROMPTS) -> tuple[Path, Path]:
    for module in ("peft", "deepspeed", "datasets", "torchdata", "vllm", "ray"):
        pytest.importorskip(module, reason="OpenRLHF's training loop needs it (the README's test install has it)")
    from rlhfless_openrlhf.tools.tiny_model import tiny_model

    model = tiny_model(tmp_path / "cache")
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"input": f"Tom has {i} apples and buys {i} more. How many?", "label": f"q{i}"}) + "\n"
            for i in range(prompts)
        )
    )
    return model, data


def _command(
    tmp_path: Path, row: Row, run: str = "run", prompts: int = PROMPTS, engines: int = 1, *extra: str, **env_extra: str
):
    """The harness's command line for ``row``: its probe records go to ``tmp_path / run / "probe"``, its
    checkpoints (OpenRLHF's ``--ckpt.path``) to ``tmp_path / "ckpt"``; and the environment it runs in."""
    model, data = _inputs(tmp_path, prompts)
    flags = [
        "--scheduler", row.scheduler, "--actor.model_name_or_path", str(model), "--actor.num_nodes", "1",
        "--actor.num_gpus_per_node", str(row.ranks), "--vllm.num_engines", str(engines),
        "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", str(row.samples),
        "--algo.kl.init_coef", "0", "--data.prompt_dataset", str(data), "--data.input_key", "input",
        "--data.label_key", "label", "--rollout.batch_size", "4",
        "--train.batch_size", str(4 * row.samples), "--rollout.micro_batch_size", "2",
        "--train.micro_batch_size", "2", "--rollout.max_new_tokens", "16", "--data.max_len", "256",
        "--train.num_episodes", "1", "--ckpt.output_dir", str(tmp_path / "out"),
        "--ckpt.path", str(tmp_path / "ckpt"), "--ds.attn_implementation", "sdpa", "--vllm.sync_backend", "gloo",
        "--vllm.enforce_eager", "--actor.adam.lr", "1e-3", "--actor.lr_warmup_ratio", "0",
        "--actor.lr_scheduler", "constant",
        *(flag.format(model=model, data=data, small=H.small_learner_profile(tmp_path)) for flag in row.flags), *extra,
    ]  # fmt: skip
    reward = ("--reward.model_name_or_path", str(model)) if row.reward_model else ("--reward.remote_url", str(REWARD))
    flags += reward
    if row.correction:  # rollout logprobs on every token, for the age check
        flags += ["--algo.advantage.is_correction_level", "token"]
    if row.scheduler != "openrlhf":  # the row trains its preset's own plan, whatever the launcher prices it at
        flags += ["--scheduler.report", str(tmp_path / f"{run}-steps.jsonl"), "--scheduler.force"]
        if "--scheduler.profile" not in row.flags:  # a tiny model is near no shipped profile
            flags += ["--scheduler.profile", "qwen2.5-7b-l40s"]
    env = {**os.environ, "RLHFLESS_CPU_LAUNCH_GPUS": str(row.gpus + engines - 1), **env_extra}
    return [sys.executable, str(TRAIN), str(tmp_path / run), *flags], env


def _launch(tmp_path: Path, row: Row, run: str = "run", prompts: int = PROMPTS, *extra: str, **env_extra: str):
    cmd, env = _command(tmp_path, row, run, prompts, 1, *extra, **env_extra)
    return H.run_launch(cmd, tmp_path, env, timeout=900)


def _trained(folder: Path) -> list[list[str]]:
    """The labels each step trained (rank 0's view is each rank's share: all ranks' samples, by step)."""
    steps: dict[int, list[str]] = {}
    for r in PROBE.records(folder):
        if r["kind"] == "train":
            steps.setdefault(r["trained_from"], []).extend(s["label"] for s in r["samples"])
    return [sorted(steps[k]) for k in sorted(steps)]


def check_launch_path(out: str, row: Row) -> None:
    """The launcher's own path through OpenRLHF: every class it swaps in built through Ray by OpenRLHF's own
    constructors, its engines placed by the scheduler's placer, the samples generator swapped inside the actor that
    generates, the launch plan's line naming the scheduler, and OpenRLHF's printed args (which every actor
    receives) holding the correction the plan set."""
    launched = row.launched or row.scheduler
    assert BUILT[row.built] in out.splitlines(), out[-4000:]
    assert f"rlhfless: launch plan: scheduler {launched!r}" in out and "is_correction_level='token'" in out, out[-4000:]
    assert "is_correction_level='off'" not in out
    placed = "OpenRLHF places the engines itself" if "--train.colocate_all" in row.flags else "placed by the scheduler"
    assert placed in out and "(RlhflessRolloutActorImpl pid=" in out, out[-4000:]
    generating = "RlhflessPPOTrainerImpl" if row.built == "sync" else "RlhflessGenerateSamplesActorImpl"
    swapped = [line for line in out.splitlines() if "is replaced by RlhflessSamplesGenerator" in line]
    assert len(swapped) == 1 and generating in swapped[0] and f"scheduler {launched}" in swapped[0], swapped
    assert "importance correction token" in swapped[0], swapped
    if launched == "rlhfless-stream":
        assert "partial_rollout_enable=True" in out


def check_training(folder: Path, row: Row, steps: int, prompts: int = PROMPTS) -> dict[str, float]:
    """The checks of the module docstring on a run's probe records; returns figures for the closing note."""
    found = PROBE.records(folder)
    trained = [r for r in found if r["kind"] == "train"]
    assert len(trained) == steps * row.ranks, [r["trained_from"] for r in trained]
    for record in trained:
        assert record["finite"] and record["moved"] > 0, record
        assert all(math.isfinite(v) for v in record["status"].values()), record["status"]
    syncs = [r for r in found if r["kind"] == "sync"]
    assert sorted(r["version"] for r in syncs) == list(range(1, steps + 1)), syncs
    for sync in syncs:
        assert "error" not in sync, sync
        assert sync["err_now"] <= 0.01 < 0.02 <= sync["err_before"], sync  # holds the new weights, not the old
        if (row.launched or row.scheduler) == "rlhfless-stream":  # partial-rollout broadcasts: each one counted
            assert sync["engine_version"] == sync["version"], sync
    ages = [a for r in trained for s in r["samples"] for a in s.get("ages", [])]
    assert ages and max(ages) <= row.max_age and min(ages) >= 0, Counter(ages)
    errors = [s["max_err"] for r in trained for s in r["samples"] if "max_err" in s]
    assert max(errors) <= 0.01, max(errors)
    labels = Counter(s["label"] for r in trained for s in r["samples"])
    assert labels == {f"q{i}": row.samples for i in range(prompts)}, labels
    if row.scheduler != "openrlhf":  # what OpenRLHF hands wandb / TensorBoard each step: the scheduler's figures,
        # sync and async alike (the control rows' trainer, OpenRLHF's own, is not one the probe records)
        logged = [r for r in found if r["kind"] == "logged"]
        assert len(logged) == steps, logged
        for record in logged:
            assert {"rlhfless/step_s", "rlhfless/rollout_s", "rlhfless/max_token_age"} <= set(record["keys"]), record
    times = sorted(r["time"] for r in trained if r["rank"] == 0)
    return {
        "max_age": max(ages),
        "max_logprob_err": max(errors),
        "s_per_step": (times[-1] - times[0]) / max(len(times) - 1, 1),
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", [r for r in _rows() if r in ROWS])
def test_openrlhf_trains_on_cpu_with_the_preset(tmp_path, name):
    row = ROWS[name]
    run = _launch(tmp_path, row)
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "rlhfless-cpu-train: train() returned" in out, out[-4000:]
    assert "Exception raised in creation task" not in out and "RayTaskError" not in out, out[-4000:]
    for text in row.once:
        assert len([line for line in out.splitlines() if text in line]) == 1, (text, out[-4000:])
    if row.built:
        check_launch_path(out, row)
    figures = check_training(tmp_path / "run" / "probe", row, PROMPTS // 4)
    H.note_figures("training", name, figures)


def _flat(steps: list[list[str]]) -> list[str]:
    return [label for step in steps for label in step]


def _syncs_hold_the_learners_weights(folder: Path) -> list[int]:
    """Each engine answer after a weight sync: the learner's new weights, not the old (the versions answered)."""
    syncs = [r for r in PROBE.records(folder) if r["kind"] == "sync"]
    for sync in syncs:
        assert "error" not in sync and sync["err_now"] <= 0.01 < 0.02 <= sync["err_before"], sync
    return sorted(r["version"] for r in syncs)


@pytest.mark.slow
def test_a_plugins_pipeline_trains_through_the_cpu_launch(tmp_path):
    """The toy modes (``tests/rlhfless_toy_mode.py``: a straggler policy, its driver, a pipeline with its own run on
    OpenRLHF, and their presets, in one file), installed as pip installs a plugin (an ``rlhfless`` entry point) and
    nothing else changed: ``--scheduler toy-pipe`` trains through OpenRLHF's own loop, its launch path the presets'
    (the generator swapped in the actor that generates, built through Ray), each batch run by the plugin's pipeline
    and each step by its driver's session (their lines, from the actor), every prompt trained n times, the engines
    holding the learner's weights after each sync."""
    toy = H.toy_mode()
    row = Row(toy.PIPE)
    prompts = 8  # two steps of B = 4 groups
    run = _launch(tmp_path, row, "run", prompts, **H.install_toy_mode(tmp_path / "site"))
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "rlhfless-cpu-train: train() returned" in out, out[-4000:]
    assert f"(mode {toy.PIPE})" in out, out[-4000:]
    check_launch_path(out, row)
    said = re.findall(rf"({toy.PIPE}: batch \d+|{toy.NAME}: step \d+ runs \d+ prompts)", out)  # the actor's lines
    assert said == [f"{toy.PIPE}: batch 1", f"{toy.NAME}: step 1 runs 4 prompts", f"{toy.PIPE}: batch 2",
                    f"{toy.NAME}: step 2 runs 4 prompts"], said  # fmt: skip
    check_training(tmp_path / "run" / "probe", row, prompts // 4, prompts)


@pytest.mark.slow
def test_a_run_resumed_from_its_step_2_checkpoint_trains_what_the_unbroken_run_trained(tmp_path):
    """``rlhfless-fast`` (partial rollouts: cut samples carried into the next step, and into each checkpoint) for 4
    steps, a checkpoint every 2; then from the step-2 checkpoint (``latest`` set back to it) with
    ``--ckpt.load_enable``: steps 3 and 4 train the same samples as the unbroken run's, carried ones included,
    the engines first get the weights the run resumed from, and no token is older than one update (a carried
    sample's tokens from before the checkpoint are matched against the weights the unbroken run kept)."""
    row = Row("rlhfless-fast", correction=False)
    every_2 = ("--ckpt.save_steps", "2")
    keep = {"RLHFLESS_CPU_PROBE_KEEP": str(tmp_path / "versions")}  # the weights each version had, for the resume
    run = _launch(tmp_path, row, "unbroken", 16, *every_2, **keep)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    check_launch_path(run.stdout + run.stderr, row)
    check_training(tmp_path / "unbroken" / "probe", Row("rlhfless-fast", max_age=1), 4, 16)
    unbroken = _trained(tmp_path / "unbroken" / "probe")
    latest = tmp_path / "ckpt" / "_actor" / "latest"
    assert latest.read_text().strip() == "global_step4"
    latest.write_text("global_step2")
    run = _launch(tmp_path, row, "resumed", 16, *every_2, "--ckpt.load_enable", **keep)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    resumed = _trained(tmp_path / "resumed" / "probe")
    assert sorted(_flat(resumed)) == sorted(_flat(unbroken[2:])), (resumed, unbroken)
    assert _syncs_hold_the_learners_weights(tmp_path / "resumed" / "probe") == [2, 3, 4]  # 2: the resume's own
    trained = [r for r in PROBE.records(tmp_path / "resumed" / "probe") if r["kind"] == "train"]
    assert max(a for r in trained for s in r["samples"] for a in s["ages"]) <= 1
    assert max(s["max_err"] for r in trained for s in r["samples"]) <= 0.01
    H.note_figures("training", "resume", {"steps": len(resumed), "samples": len(_flat(resumed))})


@pytest.mark.slow
@pytest.mark.parametrize("when", ["in-a-broadcast", *(["after-step-1"] if "after-step-1" in _rows() else [])])
def test_an_engine_killed_mid_run_stops_the_run_naming_it_and_the_resume_loses_no_prompt(tmp_path, when):
    """``rlhfless`` on two engines, a checkpoint every step, 24 prompts (6 steps). One engine's Ray actor is killed
    (SIGKILL) once step 1 trained, or while the engines wait in the learner's first weight broadcast (the probe
    holds that broadcast 20 s, a delay only, to kill inside it): the run stops with the documented error naming
    the engine, before training on a step it could not finish, and without waiting for the broadcast's collective.
    Resumed from its last checkpoint with ``--ckpt.load_enable`` (two fresh engines), the run ends, and the steps up
    to that checkpoint plus the resumed ones train every prompt of the epoch exactly once, each sample once."""
    import signal
    import time

    row = Row("rlhfless")
    hold = {"RLHFLESS_CPU_PROBE_HOLD": "20"} if when == "in-a-broadcast" else {}
    cmd, env = _command(tmp_path, row, "killed", 24, 2, "--ckpt.save_steps", "1", **hold)
    proc = H.start_launch(cmd, tmp_path, env)
    signal_kind = "broadcasting" if hold else "train"
    probe = tmp_path / "killed" / "probe"
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        if probe.exists() and any(r["kind"] == signal_kind for r in PROBE.records(probe)):
            break
        time.sleep(0.2)
    engines = H.launch_processes(proc, "ray::RlhflessRolloutActorImpl")
    assert len(engines) == 2, engines
    os.kill(engines[0], signal.SIGKILL)
    run = H.end_launch(proc, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-4000:]
    assert "rlhfless: rollout engine(s) " in out and "--ckpt.load_enable" in out, out[-4000:]
    latest = tmp_path / "ckpt" / "_actor" / "latest"  # none if it died in step 1's broadcast, before the save
    saved = int(latest.read_text().strip().removeprefix("global_step")) if latest.exists() else 0
    before = _trained(probe)[:saved]  # a step trained after the last checkpoint is trained again on resume
    cmd, env = _command(tmp_path, row, "resumed", 24, 2, "--ckpt.save_steps", "1", "--ckpt.load_enable")
    run = H.run_launch(cmd, tmp_path, env, timeout=900)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    check_launch_path(run.stdout + run.stderr, row)
    after = _trained(tmp_path / "resumed" / "probe")
    assert len(before) + len(after) == 6, (before, after)
    assert sorted(_flat(before + after)) == sorted(f"q{i}" for i in range(24) for _ in range(row.samples))
    assert _syncs_hold_the_learners_weights(tmp_path / "resumed" / "probe")[0] == (saved or 1)  # saved: the resume's
    H.note_figures("training", f"engine-killed-{when}", {"checkpoint_step": saved, "resumed_steps": len(after)})
