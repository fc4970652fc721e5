"""What an async launch runs, and on which split: decided once, after OpenRLHF has parsed its flags, before Ray.

A scheduler with an ``async_launch`` form (``rlhfless``) runs that form under ``--train.async_enable``. A stream
with no split of its own gets the rollout/learner split ``rlhfless_sdk.simulation.split`` picks: on the trace an
earlier run wrote at ``--scheduler.trace`` when there is one, else on a workload made from the launch's own
flags (prompts per step, samples per prompt, response cap) and the dataset's prompt lengths. The launcher then
sizes OpenRLHF's engines (``--vllm.num_engines``) and learner (``--actor.num_gpus_per_node``) to it within the
GPUs the two were given, saying so in one line (``--scheduler.split keep`` keeps the user's flags and only says
what it would pick). This is the one place the adapter runs the simulator: as a planner, once, before launch; the
steps themselves run on OpenRLHF's engines.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("rlhfless.openrlhf")

#: Characters per token when a dataset's prompts are measured without a tokenizer (English BPE averages about 4).
CHARS_PER_TOKEN = 4.0
#: A response-length prior for a launch with no trace: median this share of the response cap, long-tailed.
PRIOR_MEDIAN_SHARE = 0.18
PRIOR = {"prompt_sigma": 0.6, "sample_sigma": 0.5, "runaway": 0.03}
#: Steps of a workload the split is picked on.
PLAN_STEPS = 5


def flag(args: Any, group: str, name: str, default: Any = None) -> Any:
    """OpenRLHF's hierarchized flag ``--group.name`` from ``args``; ``default`` where it is absent or None."""
    value = getattr(getattr(args, group, None), name, default)
    return default if value is None else value


def prompt_tokens(args: Any) -> tuple[tuple[int, int], str]:
    """The dataset's prompt lengths (10th and 90th percentile, in tokens) when ``--data.prompt_dataset`` is a local
    JSON or JSON-lines file with ``--data.input_key``, measured at ``CHARS_PER_TOKEN``; else up to what
    ``--data.max_len`` leaves after ``--rollout.max_new_tokens``. Returns the range and where it came from."""
    path = Path(str(flag(args, "data", "prompt_dataset", "")))
    key = str(flag(args, "data", "input_key", "input"))
    cap = max(int(flag(args, "data", "max_len", 2048)) - int(flag(args, "rollout", "max_new_tokens", 1024)), 2)
    lengths: list[float] = []
    if path.is_file() and path.suffix in (".json", ".jsonl"):
        try:
            text = path.read_text(encoding="utf-8")
            rows = json.loads(text) if path.suffix == ".json" else [json.loads(x) for x in text.splitlines() if x]
            lengths = [len(str(r[key])) / CHARS_PER_TOKEN for r in rows if isinstance(r, dict) and key in r]
        except (OSError, ValueError) as exc:
            log.info("rlhfless: the split's prompt lengths: %s is unreadable (%s); using --data.max_len", path, exc)
    if not lengths:
        return (max(cap // 8, 1), max(cap // 2, 2)), f"up to {cap} tokens (--data.max_len less the responses)"
    lengths.sort()
    lo, hi = lengths[len(lengths) // 10], lengths[(9 * len(lengths)) // 10]
    return (max(int(lo), 1), max(int(hi), int(lo) + 1)), f"{len(lengths)} prompts of {path.name}"


def plan_workload(args: Any, trace: str | None, max_tokens: int) -> tuple[Any, str]:
    """The workload the split is picked on: the trace at ``--scheduler.trace`` when an earlier run wrote one, else
    one made from this launch's flags and the dataset's prompt lengths (``PRIOR``: a long-tailed response shape)."""
    from rlhfless_sdk.workloads.synthetic import SyntheticWorkload
    from rlhfless_sdk.workloads.traces import TraceError, load_trace, synthetic_workload

    if trace and Path(trace).is_file() and Path(trace).stat().st_size > 0:
        try:
            return load_trace(trace, max_tokens=max_tokens), f"the trace of an earlier run ({trace})"
        except TraceError as exc:
            log.info("rlhfless: the split is not picked on %s (%s); using the launch's flags", trace, exc)
    cap = int(flag(args, "rollout", "max_new_tokens", 1024))
    questions, where = prompt_tokens(args)
    synthetic = SyntheticWorkload(
        int(flag(args, "rollout", "batch_size", 64)),
        int(flag(args, "rollout", "n_samples_per_prompt", 1)),
        templates=1,
        template_tokens=0,
        question_tokens=questions,
        median_length=PRIOR_MEDIAN_SHARE * cap,
        max_length=cap,
        **PRIOR,
    )
    source = (
        f"this launch's flags (responses up to {cap} tokens, a long-tailed prior; prompts {where}; pass "
        "--scheduler.trace of an earlier run to pick on measured lengths)"
    )
    return synthetic_workload(synthetic, PLAN_STEPS), source


def plan_split(args: Any, plan: Any) -> tuple[Any, Any]:
    """Pick the split of a stream with none of its own and size OpenRLHF's engines and learner to it in ``plan``
    (``--scheduler.split keep``: only say what it would pick). Only splits OpenRLHF and DeepSpeed accept are tried
    (``split_problem``), and the user's own flags stand unless a tried split is faster than theirs or theirs would
    not start. Never slower: where the stream is priced no faster than OpenRLHF's async loop with the user's flags,
    the choice is marked ``fallback`` and nothing is resized (the caller runs that loop), unless
    ``--scheduler.force``. Returns the ``SplitChoice`` (None when the scheduler fixes its split) and the plan."""
    from rlhfless_sdk.api.errors import RlhflessError
    from rlhfless_sdk.api.history import isolated_history
    from rlhfless_sdk.api.plugins import get_plugin_manager
    from rlhfless_sdk.api.records import Cluster
    from rlhfless_sdk.simulation.simulator import Simulator
    from rlhfless_sdk.simulation.split import choose_split

    p, request = Pricing.of(args, plan), plan.request
    config, tp, engines = p.config, p.tp, p.engines
    if config.pipeline.rollout_gpus is not None or plan.mode.elastic or engines < 1:
        return None, plan  # the scheduler fixes its split, re-plans it as it runs, or OpenRLHF runs no engine
    nodes, per_node = int(flag(args, "actor", "num_nodes", 1)), int(flag(args, "actor", "num_gpus_per_node", 1))
    gpus, node_gpus = engines * tp + nodes * per_node, max(int(request.node_gpus), per_node)
    if request.split.isdigit():
        return None, pin_split(args, plan, int(request.split), gpus, node_gpus)
    yours = f"launching yours, {engines * tp} rollout GPUs and {nodes * per_node} learner GPUs"
    workload, source = p.workload()
    broken = split_problem(args, nodes * per_node, engines * tp, tp, node_gpus)  # yours, as OpenRLHF would run it
    sim = Simulator(p.profile, Cluster.of_gpus(gpus, max(per_node, tp)), registry=get_plugin_manager().registry)
    try:
        with isolated_history():
            choice = choose_split(
                sim,
                config,
                workload,
                source,
                allowed=lambda r: split_problem(args, gpus - r, r, tp, node_gpus) is None,
                current=engines * tp if broken is None else None,
            )
    except RlhflessError as exc:  # e.g. a profile whose learner needs more GPUs than this launch has
        log.info("rlhfless: no split picked for %s (%s); %s", config.name, exc, yours)
        return None, plan
    learner, given_s = gpus - choice.rollout_gpus, choice.tried.get(engines * tp)
    if choice.priced_slower() and not request.force and broken is None:
        choice.fallback = True
        action = "not applied (--scheduler.force applies it and runs the stream)"
    elif choice.rollout_gpus == engines * tp:
        action = "kept: the engines and learner are already sized so"
    elif request.split == "keep":
        action = f"not applied (--scheduler.split keep): {yours}"
    elif broken is None and given_s is not None and given_s <= choice.time_s:
        action = f"not applied: no split OpenRLHF and DeepSpeed accept beats yours ({given_s:,.0f} s expected); {yours}"
    else:
        plan, resized = resize(args, plan, choice.rollout_gpus // tp, learner // nodes)
        given = f"given: {engines} and {per_node}" + (f", which would not start: {broken}" if broken else "")
        action = f"applied: {resized} ({given}; --scheduler.split keep keeps yours)"
    log.info("rlhfless: %s; %s", choice.line(), action)
    return choice, plan


def pin_split(args: Any, plan: Any, rollout: int, gpus: int, node_gpus: int) -> Any:
    """``--scheduler.split N``: ``rollout`` GPUs generate and the rest of the ``gpus`` learn, checked as any split
    is (a split OpenRLHF or DeepSpeed would refuse is refused here, before Ray starts). Returns the plan sized so."""
    tp = max(int(flag(args, "vllm", "tensor_parallel_size", 1)), 1)
    why = split_problem(args, gpus - rollout, rollout, tp, node_gpus) if rollout < gpus else "no GPU is left to learn"
    if why is not None:
        raise SystemExit(f"error: --scheduler.split {rollout}: {why}")
    nodes = int(flag(args, "actor", "num_nodes", 1))
    plan, resized = resize(args, plan, rollout // tp, (gpus - rollout) // nodes)
    log.info("rlhfless: split for %s: %d rollout GPUs, %d learner GPUs (of %d), pinned by --scheduler.split %d; "
             "applied: %s", plan.name, rollout, gpus - rollout, gpus, rollout, resized)  # fmt: skip
    return plan


#: The GPUs a node is taken to have where ``--scheduler.node_gpus`` does not say (or the user's own learner has more
#: on a node): a split never puts more learner GPUs on a node than this.
NODE_GPUS = 8


def critic_built(args: Any) -> bool:
    """Whether OpenRLHF builds a critic (PPO): exactly under the ``gae`` advantage estimator, its default; it fills
    ``--critic.model_name_or_path`` from the reward model (or the actor) only after parsing (``cli/train_ppo_ray.py``
    644-650), and clears it under every other estimator, so the flag itself cannot tell at launch."""
    advantage = flag(args, "algo", "advantage", None)
    return str(getattr(advantage, "estimator", None) or "gae") == "gae"


def followers(args: Any) -> list[str]:
    """The model groups OpenRLHF places in the actor's placement group, which must keep the actor's size: the
    reference under ``--train.colocate_actor_ref`` or ``--train.colocate_all`` with KL on (``cli/train_ppo_ray.py``
    asserts it), and the critic and the reward model under ``--train.colocate_all``."""
    colocate_all = bool(flag(args, "train", "colocate_all", False))
    out = []
    kl = float(getattr(flag(args, "algo", "kl", None), "init_coef", 0) or 0)
    if kl > 0 and (colocate_all or flag(args, "train", "colocate_actor_ref", False)):
        out.append("ref")
    if colocate_all and critic_built(args):
        out.append("critic")
    if colocate_all and not flag(args, "reward", "remote_url", None):
        out.append("reward")
    return out


def resize(args: Any, plan: Any, engines: int, per_node: int) -> tuple[Any, str]:
    """``plan`` sizing OpenRLHF's engines and learner (and the groups that follow the actor), and the flags set."""
    groups = ["actor", *followers(args)]
    paths = ["vllm.num_engines", *(f"{group}.num_gpus_per_node" for group in groups)]
    for path in paths:
        plan = plan.setting(args, path, engines if path == "vllm.num_engines" else per_node)
    return plan, " and ".join(f"--{path} {engines if path == 'vllm.num_engines' else per_node}" for path in paths)


def learner_gpus(args: Any) -> int:
    """GPUs OpenRLHF's learner groups take after it built the engines (the placer leaves them free): actor and
    reference unless co-located (their group exists before the engines then), critic (GAE only) and reward
    model (unless remote). Read from OpenRLHF's own args once its CLI settled them."""

    def gpus(role: str) -> int:
        r = getattr(args, role)
        return int(r.num_nodes) * int(r.num_gpus_per_node)

    if args.train.colocate_all:
        return 0
    total = 0
    if not args.train.colocate_actor_ref:
        total += gpus("actor") + (gpus("ref") if args.algo.kl.init_coef > 0 else 0)
    critic = gpus("critic") if args.critic.model_name_or_path and args.algo.advantage.estimator == "gae" else 0
    reward = 0 if args.reward.remote_url else gpus("reward")
    total += max(critic, reward) if args.train.colocate_critic_reward and critic else critic + reward
    return total


def learner_replicas(args: Any) -> int:
    """Learner processes that hold one data-parallel rank's batch: ring attention x DeepSpeed tensor parallel."""
    return max(int(flag(args, "ds", "ring_attn_size", 1)), 1) * max(int(flag(args, "ds", "tensor_parallel_size", 1)), 1)


def deepspeed_batch_problem(args: Any, ranks: int) -> str | None:
    """Why DeepSpeed would refuse a learner of ``ranks`` processes, or None. OpenRLHF sets ``train_batch_size`` to
    ``--train.batch_size`` x ring x tensor parallel and the micro batch to ``--train.micro_batch_size``
    (``utils/deepspeed/deepspeed.py``); DeepSpeed asserts the batch is micro batch x accumulation x world
    (``runtime/config.py``), with accumulation the whole quotient. Dynamic batching sets neither."""
    if flag(args, "train", "dynamic_batch_enable", False):
        return None
    ring = learner_replicas(args)
    batch = int(flag(args, "train", "batch_size", 128)) * ring
    micro = max(int(flag(args, "train", "micro_batch_size", 1)), 1)
    if batch % (micro * ranks) or batch < micro * ranks:
        return (
            f"DeepSpeed needs the train batch ({batch}) to be a whole multiple of --train.micro_batch_size x learner "
            f"GPUs ({micro} x {ranks})"
        )
    return None


def split_problem(args: Any, learner: int, rollout: int, tp: int, node_gpus: int = NODE_GPUS) -> str | None:
    """Why OpenRLHF (or its DeepSpeed learner) could not run a learner of ``learner`` GPUs beside ``rollout``
    engine GPUs, or None."""
    nodes = int(flag(args, "actor", "num_nodes", 1))
    if learner < 1 or learner % nodes:
        return f"{learner} learner GPUs do not split over --actor.num_nodes {nodes}"
    if learner // nodes > node_gpus:
        return (
            f"{learner // nodes} learner GPUs on a node, more than the {node_gpus} a node has (--scheduler.node_gpus)"
        )
    if rollout % tp:
        return f"{rollout} rollout GPUs are not whole engines of --vllm.tensor_parallel_size {tp}"
    if "ref" in followers(args) and int(flag(args, "ref", "num_nodes", 1)) != nodes:
        return "the reference model is colocated with the learner on another node count"
    micro = max(int(flag(args, "rollout", "micro_batch_size", 1)), 1)
    batches = int(flag(args, "rollout", "n_samples_per_prompt", 1)) * int(flag(args, "rollout", "batch_size", 1))
    ring = learner_replicas(args)
    if batches // micro < learner // ring:
        return f"OpenRLHF needs at least as many sample micro-batches ({batches // micro}) as learner processes"
    return deepspeed_batch_problem(args, learner)


@dataclass(frozen=True)
class Pricing:
    """What the launcher prices a plan with, read from OpenRLHF's parsed flags and the launch plan: the scheduler,
    its profile, the engines OpenRLHF was given and their tensor-parallel size; ``workload()`` is the planning
    workload (``plan_workload``)."""

    args: Any
    trace: str | None
    config: Any
    profile: Any
    engines: int
    tp: int

    @classmethod
    def of(cls, args: Any, plan: Any) -> Pricing:
        tp = max(int(flag(args, "vllm", "tensor_parallel_size", 1)), 1)
        engines = int(flag(args, "vllm", "num_engines", 0))
        return cls(args, plan.request.trace, plan.scheduler, plan.profile, engines, tp)

    def workload(self) -> tuple[Any, str]:
        return plan_workload(self.args, self.trace, self.profile.kv_capacity_tokens)

    def simulator(self, registry: Any, acceptance: Any = None) -> Any:
        """The simulator of OpenRLHF's engines (one where none is set), beside the learner under
        ``--train.colocate_all``, drafting at ``acceptance`` (None: the one shipped for the drafter's name)."""
        from rlhfless_sdk.api.records import Cluster
        from rlhfless_sdk.simulation.simulator import Simulator

        memory = "colocated" if flag(self.args, "train", "colocate_all", False) else "dedicated"
        gpus = max(self.engines, 1) * self.tp
        cluster = Cluster.of_gpus(gpus, min(gpus, NODE_GPUS))
        return Simulator(self.profile, cluster, registry=registry, memory=memory, acceptance=acceptance)


@dataclass(frozen=True)
class SyncPrice:
    """A synchronous launch priced: the scheduler's time and OpenRLHF's own step's, and the workload's source."""

    ours: float
    theirs: float
    source: str

    @property
    def runs_plan(self) -> bool:
        """Whether the plan runs instead of OpenRLHF's step (the SDK's rule: it must gain ``MIN_GAIN`` on the model)."""
        from rlhfless_sdk.simulation.split import runs_plan

        return runs_plan(self.ours, self.theirs)


def price_sync(args: Any, plan: Any) -> SyncPrice | None:
    """A synchronous launch's plan and OpenRLHF's own step priced on the same simulator and planning workload as the
    stream's split (``plan_workload``), each step charged its plan's time: the engines OpenRLHF was given, beside the
    learner under ``--train.colocate_all``. None where nothing can be priced (no engine)."""
    from rlhfless_sdk.api.history import isolated_history
    from rlhfless_sdk.api.plugins import get_plugin_manager

    p = Pricing.of(args, plan)
    if p.engines < 1:
        return None
    registry = get_plugin_manager().registry
    workload, source = p.workload()
    sim = p.simulator(registry)
    with isolated_history():
        ours = sum(r.time_s for r in sim.run(p.config, workload).reports)
        theirs = sum(r.time_s for r in sim.run(registry.scheduler("openrlhf"), workload).reports)
    return SyncPrice(ours, theirs, source)


def price_drafter(args: Any, plan: Any, acceptance: Any) -> tuple[Any, str]:
    """The plan's drafter priced as the simulator prices it (``Simulator.price_drafter``: per running count at the
    planning workload's context, then its first two steps with and without it, a stream's steady token) at
    ``acceptance``, on the engines OpenRLHF was given (one where none is set) and the planning workload
    (``plan_workload``); and the workload's source."""
    from rlhfless_sdk.api.history import isolated_history
    from rlhfless_sdk.api.plugins import get_plugin_manager

    p = Pricing.of(args, plan)
    workload, source = p.workload()
    with isolated_history():
        return p.simulator(get_plugin_manager().registry, acceptance).price_drafter(p.config, workload), source
