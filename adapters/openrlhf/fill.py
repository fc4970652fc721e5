"""Fill engines: a stream's first batch generated on the learner's GPUs too (``pipeline: {fill_engines: true}``).

In OpenRLHF's async loop the learner has nothing to train until the first batch is complete, so its GPUs idle
through the pipeline's fill, the longest wait of a run (on long reasoning about twice a steady batch). With
``--train.colocate_actor_ref`` (or ``--train.colocate_all``) OpenRLHF builds the learner's models in a placement
group of their own, each model taking a share of each GPU; the launcher then builds one more vLLM engine on each of
those GPUs (``build``), sized to what the learner's state leaves (``LearnerState.beside_fraction``) and started
before the learner loads. They are not OpenRLHF's engines: its weight broadcast never reaches them, and they need
none, since they stop before the first update.

The stream feeds them as it feeds every engine until batch 0 forms. Then, before the batch goes to the learner,
``stop`` closes them to new work (``rl_close``), cuts every sample running there (vLLM's abort: the sample keeps
its tokens, their logprobs and the weights versions they came from), hands each to the rollout engines to go on
from those tokens (``StreamLoop.move``), and ends the fill engines, which frees all they held for the learner.
Nothing is lost or run twice: a sample that finished before its cut landed trains
as it is; one that reached a fill engine after its close never ran there and starts on a rollout engine.

A fill engine the stream is done with is ended (``end``: vLLM shut down in it, then its actor killed), not left
asleep: a sleeping engine keeps its CUDA context and graph pool on the learner's GPU, and host memory. So are fill
engines that cannot run: built at other weights than the rollout engines (a resumed run) or failing to wake (a
fill engine's failure is never the run's).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
from rlhfless_openrlhf.launch_split import critic_built
from rlhfless_openrlhf.launch_split import flag as _flag
from rlhfless_openrlhf.messages import CARRIED, CLOSED, Continuation
from rlhfless_openrlhf.plan import FillPlan
from rlhfless_openrlhf.ray_backend import ENGINE_ERRORS, engine_lost

log = logging.getLogger("rlhfless.openrlhf")


def plan(args: Any, launch: Any) -> FillPlan | None:
    """Whether this async launch (its ``LaunchPlan``) builds fill engines, and how: a ``FillPlan`` (one per learner
    GPU, vLLM's ``gpu_memory_utilization`` from the profile's learner block), or None with one line saying why not.
    Called once the split is sized (``--vllm.num_engines`` and ``--actor.num_gpus_per_node`` final)."""
    from rlhfless_sdk.api.learner import beside_learner

    if not launch.scheduler.pipeline.fill_engines:
        return None
    name = launch.name
    tp = max(int(_flag(args, "vllm", "tensor_parallel_size") or 1), 1)
    profile = launch.profile
    actor = int(_flag(args, "actor", "num_nodes") or 1) * int(_flag(args, "actor", "num_gpus_per_node") or 1)
    algo = "ppo" if critic_built(args) else "grpo"
    why = None
    if not (_flag(args, "train", "colocate_actor_ref") or _flag(args, "train", "colocate_all")):
        why = (
            "the learner's models hold whole GPUs; pass --train.colocate_actor_ref to build them in a placement group "
            "the fill engines can share"
        )
    elif tp != 1:
        why = f"--vllm.tensor_parallel_size {tp}: fill engines are one-GPU engines"
    elif profile.learner is None:
        why = f"profile {profile.name!r} has no learner block, so what the learner's state leaves is not known"
    if why is None and beside_learner(profile, algo, actor) is None:  # the simulator's own test of the same thing
        why = f"the {algo} learner's state on {actor} GPUs leaves an engine there under a tenth of its KV cache"
    memory = 0.0 if why is not None or profile.learner is None else profile.learner.beside_fraction(algo, actor)
    if why is not None:
        log.info("rlhfless: scheduler %r: no fill engines (%s)", name, why)
        return None
    log.info(
        "rlhfless: scheduler %r: %d fill engines on the learner's GPUs (vLLM memory %.2f each, beside the %s "
        "learner's state) generate until the first batch is complete, then sleep",
        name,
        actor,
        memory,
        algo,
    )
    return FillPlan(engines=actor, memory=round(memory, 3))


def build(
    create: Any, shared_pg: Any, fill: FillPlan, args: tuple, kwargs: dict[str, Any], sleep_mode: bool = True
) -> list[Any]:
    """The fill engines: OpenRLHF's ``create_vllm_engines`` (``create``, hooked to build RLHFless's engine class)
    with the engines' own arguments, but one engine per bundle of the learner's placement group ``shared_pg`` (a
    share of each GPU, as OpenRLHF's colocated engines take), ``fill.memory`` of its memory, seeds of their own,
    sleep mode on (``sleep_mode``: off for vLLM's CPU build, which has none; its sleep only pauses the scheduler).
    ``args``: the rollout engines' positional arguments (their count, TP size, model, seed)."""
    import inspect

    from openrlhf.trainer.ray import vllm_engine

    bound = inspect.signature(vllm_engine.create_vllm_engines).bind_partial(*args, **kwargs)
    bound.arguments.update(
        # engine i gets seed + i: after the rollout engines' seeds (a fill engine seeded as rollout engine 0 samples
        # what it samples, so the two halves of a group split across them came out the same)
        seed=int(bound.arguments["seed"]) + int(bound.arguments["num_engines"]),
        num_engines=fill.engines,
        tensor_parallel_size=1,
        shared_pg=shared_pg,
        gpu_memory_utilization=fill.memory,
        vllm_enable_sleep=sleep_mode,
    )
    engines = create(*bound.args, **bound.kwargs)  # sleep mode on: OpenRLHF has them built and asleep on return
    if not sleep_mode:
        ray.get([e.sleep.remote() for e in engines])
    log.info(
        "rlhfless: %d fill engine(s) built in the learner's placement group, asleep until the stream wakes them",
        len(engines),
    )
    return engines


def stop(st: Any, engines: list[int], key_of: Any, timeout_s: float) -> tuple[int, int]:
    """Stop the fill ``engines`` of the stream ``st`` (an ``EngineStream``; called with ``st.cond`` held, once
    batch 0 formed): close them, cut what runs there, wait for every call they hold to come back (``key_of``: a
    sample's piece key) and put them to sleep. Returns (samples moved with their tokens, tokens they took along)."""
    pool = st.pool
    pool.retired.update(engines)
    pool.gather("rl_close", engines)  # an engine lost meanwhile is marked dead: its samples are regenerated
    held = [(ref, sid, e) for ref, (sid, e) in st.pending.items() if e in engines]
    cuts = [(ref, sid, e, pool.handles[e].cut.remote(key_of(sid))) for ref, sid, e in held if e not in pool.dead]
    for _ref, sid, e, cut in cuts:
        try:
            info = ray.get(cut)
        except ENGINE_ERRORS as exc:
            if not engine_lost(exc):
                raise
            pool.mark_dead(e, exc)  # its samples go back to be regenerated (``_drop_dead``)
            continue
        if info is None:  # it finished before the cut landed, or never started here: its call says which
            continue
        st.moves.cut.add(sid)
        logprobs = None if info.sampling_params.logprobs is None else []
        back = Continuation(token_ids=[], logprobs=logprobs, finish_reason=CARRIED)  # its call returns what it has
        pool.handles[e].deliver.remote(key_of(sid), back)
    st._drop_dead()
    refs = [ref for ref, _sid, _e in held if ref in st.pending]
    deadline = time.time() + timeout_s
    while refs:
        ready, refs = ray.wait(refs, num_returns=len(refs), timeout=max(deadline - time.time(), 0.0))
        if not ready:
            raise RuntimeError(
                f"rlhfless: {len(refs)} sample(s) on the fill engines did not come back within {timeout_s:g} s of "
                "their cut (--scheduler.carry_timeout)"
            )
        st._collect(ready)
    moved, tokens = st.loop.moved, sum(len(c[0]) for c in st.moves.carried.values())
    end(pool, engines)  # the learner gets all their memory
    return moved, tokens


def end(pool: Any, engines: list[int], timeout_s: float = 60.0) -> None:
    """End the fill ``engines`` of ``pool`` for good: vLLM shut down in each still alive (``rl_end``), then its Ray
    actor killed; they are retired from the pool (no work reaches them). An engine whose shutdown fails is killed
    all the same, one line saying so."""
    pool.retired.update(engines)
    refs = {e: pool.handles[e].rl_end.remote() for e in engines if e not in pool.dead}
    for e, ref in refs.items():
        try:
            ray.get(ref, timeout=timeout_s)
        except Exception as exc:
            log.warning("rlhfless: fill engine %d did not shut vLLM down (%s); its actor is killed", e, exc)
    for e in engines:
        ray.kill(pool.handles[e], no_restart=True)


def wake(pool: Any, engines: list[int]) -> list[int]:
    """Wake the fill ``engines`` that sleep (OpenRLHF builds sleep-mode engines asleep); returns those awake. One
    that fails to (its asleep state unknown, a wake-up error such as a GPU short of memory beside the learner) is
    ended, one line saying why: a fill engine's failure is never the run's."""
    awake, failed = [], []
    for e in engines:
        try:
            if not pool.call(e, "rl_begin_step", pool.drafting):
                pool.call(e, "wake_up")
        except Exception as exc:
            log.warning("rlhfless: fill engine %d failed to wake (%s); the stream runs without it", e, exc)
            failed.append(e)
            continue
        if e in pool.dead:
            failed.append(e)
        else:
            awake.append(e)
    if failed:
        end(pool, failed)
    return awake


def closed(exc: BaseException) -> bool:
    """Whether a sample's call failed because its fill engine had closed before it started there."""
    return CLOSED in str(exc)
