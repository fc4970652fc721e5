"""What a CPU training run did, read from the learner's and the engines' own state (not from logs).

Installed in every Ray worker of ``openrlhf_cpu_train.py`` (with the shims) around two methods of OpenRLHF's
``ActorPPOTrainer``, which every launch's policy ranks run:
- ``broadcast_to_vllm``: each rank keeps a float32 copy of the weights it sent (version 1, 2, ...; version 0: the
  weights step 1 trained from). Rank 0 then asks each engine for its logprobs of a fixed token sequence and writes
  them beside the float32 forward of the weights it sent and of the ones before (``sync`` records): the engine
  holds the learner's weights when it matches the new version and not the old one.
- ``ppo_train``: before training, each trained sample's rollout logprobs are matched token by token against the
  float32 forward of every kept version; the version that reproduces a token's logprob is the one it was sampled
  under, so its age is the versions between that and the weights this step trains from. After training: the loss
  and how far the weights moved (``train`` records: one per rank and step, with each sample's label).

Records are JSON lines under ``RLHFLESS_CPU_PROBE`` (one file per process).
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

#: A fixed token sequence the engines and the learner score after each weight sync.
FIXED = [1, *range(10, 58)]
#: Versions each rank keeps (the stream's bound is 2 updates; one more shows a token older than that).
KEEP = 5


class _State:
    def __init__(self) -> None:
        self.versions: list[tuple[int, dict[str, Any]]] = []  # (version, float32 state dict)
        self.config: Any = None
        self.lock = threading.Lock()

    @property
    def version(self) -> int:
        return self.versions[-1][0] if self.versions else -1


STATE = _State()


def _write(record: dict[str, Any]) -> None:
    folder = Path(os.environ["RLHFLESS_CPU_PROBE"])
    folder.mkdir(parents=True, exist_ok=True)
    with STATE.lock, open(folder / f"{os.getpid()}.jsonl", "a") as out:
        out.write(json.dumps(record) + "\n")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _snapshot(trainer: Any) -> dict[str, Any]:
    """The policy's weights as float32 copies, gathered under ZeRO-3 (a collective: every rank calls it)."""
    import deepspeed

    model = trainer.actor.model.module if hasattr(trainer.actor.model, "module") else trainer.actor.model
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=trainer.strategy.args.ds.zero_stage == 3):
        state = {name: tensor.detach().float().clone() for name, tensor in model.state_dict().items()}
    STATE.config = model.config
    return state


def _pretrained(path: str) -> dict[str, Any]:
    """Version 0 as the engines hold it: the checkpoint in float32 (the learner holds it rounded to bfloat16)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def _keep(version: int, state: dict[str, Any]) -> None:
    STATE.versions.append((version, state))
    del STATE.versions[:-KEEP]
    if (folder := os.environ.get("RLHFLESS_CPU_PROBE_KEEP")) and _rank() == 0:  # for a run resumed from this one
        import torch

        Path(folder).mkdir(parents=True, exist_ok=True)
        torch.save(state, Path(folder) / f"v{version}.pt")


def _resumed_at(trainer: Any) -> int | None:
    """The step a resumed run's checkpoint holds (OpenRLHF resumes from ``--ckpt.path``'s ``_actor/latest``), or
    None. Its weights are that step's version; the versions before it, where the run that wrote the checkpoint
    kept them (``RLHFLESS_CPU_PROBE_KEEP``), are loaded too: a carried sample's tokens from before the checkpoint
    were sampled under them."""
    latest = Path(trainer.args.ckpt.path) / "_actor" / "latest"
    if not (trainer.args.ckpt.load_enable and latest.exists()):
        return None
    step = int(latest.read_text().strip().removeprefix("global_step"))
    if folder := os.environ.get("RLHFLESS_CPU_PROBE_KEEP"):
        import torch

        for version in range(max(step - KEEP + 1, 0), step):
            if (path := Path(folder) / f"v{version}.pt").exists():
                STATE.versions.append((version, torch.load(path)))
    return step


def _reference(state: dict[str, Any]) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(STATE.config, torch_dtype=torch.float32, attn_implementation="eager")
    model.load_state_dict(state)
    return model.eval()


def token_logprobs(state: dict[str, Any], tokens: list[int]) -> list[float]:
    """log p(tokens[t] | tokens[:t]) for t >= 1 under ``state`` (float32, eager attention)."""
    import torch

    with torch.no_grad():
        logits = _reference(state)(torch.tensor([tokens])).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0].tolist()


def _sampled_logprobs(output: Any) -> list[float]:
    """An engine's prompt logprobs of ``FIXED`` (vLLM: one dict a position, the first None)."""
    return [d[tok].logprob for d, tok in zip(output.prompt_logprobs[1:], FIXED[1:], strict=True)]


def _check_engines(trainer: Any, version: int, now: list[float], before: list[float]) -> None:
    """Ask each engine (without waiting here: a paused engine answers once OpenRLHF resumes it) for its logprobs of
    ``FIXED``; a thread writes them beside the learner's."""
    import ray
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    engines = list(trainer.vllm_engines or [])
    refs = [engine.generate.remote(FIXED, params) for engine in engines]
    _write({"kind": "sent", "version": version, "engines": len(engines)})

    def wait() -> None:
        for i, ref in enumerate(refs):
            record: dict[str, Any] = {"kind": "sync", "version": version, "engine": i}
            try:
                got = _sampled_logprobs(ray.get(ref, timeout=300))
                record["err_now"] = max(abs(a - b) for a, b in zip(got, now, strict=True))
                record["err_before"] = max(abs(a - b) for a, b in zip(got, before, strict=True))
                if hasattr(engines[i], "rl_stats"):  # RLHFless's engines count the updates they resumed from
                    record["engine_version"] = ray.get(engines[i].rl_stats.remote(), timeout=60).weights_version
            except Exception as exc:  # written for the test to show
                record["error"] = f"{type(exc).__name__}: {exc}"
            _write(record)

    threading.Thread(target=wait, daemon=True).start()


def _after_broadcast(broadcast: Any) -> Any:
    @functools.wraps(broadcast)
    def broadcast_to_vllm(self: Any) -> Any:
        out = broadcast(self)
        # before the first broadcast the engines hold the checkpoint on disk (a resumed run's first broadcast sends
        # the weights it resumed from, before any training)
        previous = STATE.versions[-1][1] if STATE.versions else _pretrained(self.args.actor.model_name_or_path)
        resumed = _resumed_at(self) if not STATE.versions else None
        version = resumed if resumed is not None else STATE.version + 1
        state = _snapshot(self)
        _keep(version, state)
        if _rank() == 0 and self.vllm_engines:
            _check_engines(self, version, token_logprobs(state, FIXED), token_logprobs(previous, FIXED))
        return out

    return broadcast_to_vllm


#: What a change of version along a sample costs in the fit below (in summed logprob error): the engines' CPU
#: kernels and the learner's reference differ by up to ~3e-3 a token, so one token alone does not make a segment.
SWITCH = 0.01


def monotone_versions(errors: list[list[float]]) -> tuple[list[int], list[float]]:
    """The versions (indices into ``errors``, oldest first) under which a sample's tokens were sampled: a sample is
    generated in order and weights only get newer, so the versions along it never decrease; the fit minimises the
    summed error ``errors[v][t]`` plus ``SWITCH`` a change. Returns each token's version index and its error."""
    n_versions, n_tokens = len(errors), len(errors[0]) if errors else 0
    if n_tokens == 0:
        return [], []
    cost = [errors[v][0] for v in range(n_versions)]
    back: list[list[int]] = []
    for t in range(1, n_tokens):
        best_before, arg, came = float("inf"), 0, []
        new = []
        for v in range(n_versions):
            if cost[v] < best_before:
                best_before, arg = cost[v], v
            stay, switch = cost[v], best_before + SWITCH
            came.append(v if stay <= switch else arg)
            new.append(min(stay, switch) + errors[v][t])
        cost, _ = new, back.append(came)
    v = min(range(n_versions), key=cost.__getitem__)
    path = [v]
    for came in reversed(back):
        v = came[v]
        path.append(v)
    path.reverse()
    return path, [errors[v][t] for t, v in enumerate(path)]


def _sample_ages(items: list[Any], trained_from: int) -> list[dict[str, Any]]:
    """Each trained sample: its label and, where it carries rollout logprobs, the age of each token (the version
    whose float32 forward reproduces the token's logprob, fitted along the sample) and the largest error left."""
    import torch

    samples = []
    for item in items:
        sample: dict[str, Any] = {"label": (item.labels or [None])[0], "prompt": (item.prompts or [None])[0]}
        mask = item.action_mask.bool()
        sample["tokens"] = int(mask.sum())
        if item.rollout_log_probs is not None and STATE.versions:
            sequence = item.sequences[item.attention_mask.bool()].tolist()
            rollout = item.rollout_log_probs[mask].float()
            start = len(sequence) - mask.numel()
            per_version = {}
            for version, state in STATE.versions:
                lp = torch.tensor(token_logprobs(state, sequence))[start - 1 :][mask]
                per_version[version] = (lp - rollout).abs()
            versions = sorted(per_version)
            assigned, errors = monotone_versions([per_version[v].tolist() for v in versions])
            sample["ages"] = [trained_from - versions[i] for i in assigned]
            sample["max_err"] = max(errors) if errors else 0.0
        samples.append(sample)
    return samples


def _around_training(ppo_train: Any) -> Any:
    @functools.wraps(ppo_train)
    def train(self: Any, kl_ctl: float) -> Any:
        import torch

        if not STATE.versions:  # no broadcast yet: the engines sample from the checkpoint on disk
            _snapshot(self)  # the model's config
            _keep(0, _pretrained(self.args.actor.model_name_or_path))
        trained_from = STATE.version
        samples = _sample_ages(list(self.replay_buffer.items), trained_from)
        before = _snapshot(self)
        status = ppo_train(self, kl_ctl)
        after = _snapshot(self)
        moved = max(float((after[k] - before[k]).abs().max()) for k in before)
        _write(
            {
                "kind": "train",
                "rank": _rank(),
                "time": time.time(),
                "trained_from": trained_from,
                "status": {k: float(v) for k, v in status.items() if isinstance(v, int | float)},
                "moved": moved,
                "finite": all(bool(torch.isfinite(t).all()) for t in after.values()),
                "samples": samples,
            }
        )
        return status

    return train


def _held(broadcast: Any) -> Any:
    """The learner's first weight broadcast, held for ``RLHFLESS_CPU_PROBE_HOLD`` seconds once the engines wait in
    it (a ``broadcasting`` record says when): a test kills an engine then, to see a death during a broadcast."""

    @functools.wraps(broadcast)
    def hold_once(self: Any, tensor: Any, src: int, stream: Any = None) -> None:
        if self.rank == 0 and not hold_once.held:
            hold_once.held = True
            _write({"kind": "broadcasting"})
            time.sleep(float(os.environ["RLHFLESS_CPU_PROBE_HOLD"]))
        return broadcast(self, tensor, src, stream)

    hold_once.held = False
    return hold_once


def _logged(save: Any) -> Any:
    """OpenRLHF's ``save_logs_and_checkpoints``, recording the keys of each logs dict it hands its loggers (wandb,
    TensorBoard): a ``logged`` record with the ``rlhfless/*`` ones."""

    @functools.wraps(save)
    def save_logs_and_checkpoints(self: Any, global_step: int, logs_dict: Any = None, client_states: Any = None) -> Any:
        keys = sorted(k for k in (logs_dict or {}) if str(k).startswith("rlhfless/"))
        _write({"kind": "logged", "step": int(global_step), "keys": keys, "time": time.time()})
        return save(self, global_step, logs_dict, client_states)

    return save_logs_and_checkpoints


def install() -> None:
    """The shims, then the probes (Ray's ``worker_process_setup_hook`` in ``openrlhf_cpu_train.py``)."""
    import openrlhf_cpu_shims

    openrlhf_cpu_shims.install()
    from openrlhf.trainer.ppo_trainer import BasePPOTrainer
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

    if not hasattr(BasePPOTrainer.save_logs_and_checkpoints, "__wrapped__"):
        BasePPOTrainer.save_logs_and_checkpoints = _logged(BasePPOTrainer.save_logs_and_checkpoints)

    if os.environ.get("RLHFLESS_CPU_PROBE_HOLD") and not hasattr(openrlhf_cpu_shims.GlooBroadcast.broadcast, "held"):
        openrlhf_cpu_shims.GlooBroadcast.broadcast = _held(openrlhf_cpu_shims.GlooBroadcast.broadcast)
    if not hasattr(ActorPPOTrainer.ppo_train, "__wrapped__"):
        ActorPPOTrainer.ppo_train = _around_training(ActorPPOTrainer.ppo_train)
        ActorPPOTrainer.broadcast_to_vllm = _after_broadcast(ActorPPOTrainer.broadcast_to_vllm)


def records(folder: Path) -> list[dict[str, Any]]:
    """Every record a run's processes wrote."""
    return [json.loads(line) for path in sorted(Path(folder).glob("*.jsonl")) for line in path.read_text().splitlines()]


def unanswered(folder: Path) -> int:
    """Engine answers still to come: each ``sent`` version expects one ``sync`` record an engine."""
    found = records(folder)
    expected = sum(r["engines"] for r in found if r["kind"] == "sent")
    return expected - sum(1 for r in found if r["kind"] == "sync")
