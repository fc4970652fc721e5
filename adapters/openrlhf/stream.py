"""The streaming pipeline on OpenRLHF's engines, inside its async loop (``--train.async_enable`` with
``--train.partial_rollout_enable``).

The SDK's ``StreamLoop`` (``rlhfless_sdk.rollout.stream_loop``), the object the simulator's stream runs, decides
here too: which engine with a free slot gets which sample next (a started group's samples first, a new group only as
the admission rule allows, the engine with the most free slots first), how many an engine may run (``KvSlots``),
which groups a batch trains (those that would be too old for the next batch, then the earliest-started complete
ones, B in all) and so the bound on token age. ``EngineStream`` only serves it: samples go one per Ray call to the
engine the loop chose and run there across calls of the generator, so the engines never wait for a batch
boundary; a call returns as soon as the loop can form its batch. OpenRLHF's learner trains each batch
and its partial-rollout broadcast pauses the engines between decode iterations, loads the weights and resumes
them: the running samples go on under the new weights. Each engine counts those updates (``weights_version``) and
each sample's response says under which version each run of its tokens was generated, so a batch's token ages are
measured, not assumed.

Between the generator's calls OpenRLHF's actor waits (for a queue slot, for the learner to take a batch), often for
a whole learning step; the stream keeps the engines fed meanwhile from a feeder thread of its own (``feed``), as
the simulator's stream dispatches without pause. The feeder draws no prompt from the dataloader itself: the
generator draws, inside its call, the groups the admission rule may start before its next call (``draw_ahead``),
so a checkpoint's dataloader state and the prompts it keeps always agree.

OpenRLHF's learner holds the GPUs it was launched with, so the split between generation and learning is the one
launched; an elastic split is research, simulated only (``research-elastic-stream``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
from rlhfless_openrlhf import fill
from rlhfless_openrlhf.capabilities import STREAM_NEEDS
from rlhfless_openrlhf.ray_backend import ENGINE_ERRORS, EnginePool, engine_gpus, engine_lost
from rlhfless_openrlhf.run_modes import Batch, DrawingRun

from rlhfless_sdk.api.errors import RlhflessError
from rlhfless_sdk.rollout.billing import window_gpu_seconds
from rlhfless_sdk.rollout.modes import STREAM
from rlhfless_sdk.rollout.run_log import fresh_uid
from rlhfless_sdk.rollout.stream import BatchWindow, batch_ages, version_runs
from rlhfless_sdk.rollout.stream_book import GroupBook
from rlhfless_sdk.rollout.stream_loop import KvSlots, StreamLoop

log = logging.getLogger("rlhfless.openrlhf")


@dataclass
class StreamPrompt:
    """A group's prompt as the engines receive it: its id in the generator's prompt store, text, label, image, uid
    (length-history key) and token ids."""

    prompt_id: int
    prompt: str
    label: Any
    image: Any
    uid: str
    token_ids: list[int]


@dataclass
class Moves:
    """Samples cut on a stopped fill engine (``fill.stop``): those whose call is to bring back their tokens
    (``cut``), and what each moved sample goes on from on a rollout engine (``carried``: its response tokens, their
    logprobs, the (version, tokens) marks they came from)."""

    cut: set[int] = field(default_factory=set)
    carried: dict[int, tuple[list[int], list[float] | None, list]] = field(default_factory=dict)


#: Submits sample ``j`` of a group to an engine: (engine, the group's prompt, j, what it carries) -> a Ray reference
#: to a one-element list of OpenRLHF's response dict. What it carries: None, or the response tokens a sample moved
#: off a stopped fill engine has, their logprobs and the (version, tokens) marks they came from; it goes on from them.
Submit = Callable[[int, StreamPrompt, int, Any], Any]


class EngineStream:
    """One epoch's stream on the pool's engines: the book, the prompts of its groups, the samples in flight (Ray
    references that outlive a generator call) and the finished samples' responses until their group trains."""

    def __init__(
        self,
        pool: EnginePool,
        book: GroupBook,
        draw: Callable[[], StreamPrompt | None],
        *,
        n: int,
        slots: int,
        base: int,
        source: Any = None,
        uids: set[str] | None = None,
        kv: KvSlots | None = None,
    ) -> None:
        """``draw``: the next prompt of the epoch, None once the dataloader is dry; ``n``: samples a group;
        ``slots``: samples an engine runs at once (more wait in the generator, so late ones go to the engine that
        frees first); ``base``: the engines' weights version when the run's stream began (batch k trains with
        version ``base + k``); ``source``: the dataloader iterator it draws from (a new one is a new epoch);
        ``uids``: the uids of its groups not trained yet (``draw`` makes a repeated prompt's distinct); ``kv``: holds
        an engine to fewer samples where its KV cache binds (the SDK's ``KvSlots``, read from the finished lengths)."""
        self.pool, self.draw = pool, draw
        self.loop = StreamLoop(book, slots, kv)  # the stream's decisions, the simulator's too
        self.n, self.base, self.source = n, base, source
        self.prompts: dict[int, StreamPrompt] = {}  # group -> its prompt, until it trains
        self.pending: dict[Any, tuple[int, int]] = {}  # Ray reference -> (sample, engine)
        self.load: dict[int, int] = defaultdict(int)  # engine -> its samples in flight
        self.responses: dict[int, dict[str, Any]] = {}  # finished sample -> response, until its group trains
        self.moves = Moves()  # samples cut on a stopped fill engine, and what each goes on from
        self.uids = set() if uids is None else uids
        # the feeder thread (``feed``) and the generator's calls share the stream's state under this lock
        self.cond = threading.Condition()
        self.drawing = True  # prompts may be drawn from the dataloader now (inside a generator call only)
        self.submit: Submit | None = None
        self.quiet_since = time.time()  # the last time a sample was dispatched or finished
        self.error: BaseException | None = None  # what stopped the feeder, for the generator to raise
        self._feeder: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def book(self) -> GroupBook:
        return self.loop.book

    @property
    def slots(self) -> int:
        return self.loop.slots

    @property
    def kv(self) -> KvSlots | None:
        return self.loop.kv

    @kv.setter
    def kv(self, kv: KvSlots | None) -> None:
        self.loop.kv = kv

    @property
    def redone(self) -> int:
        """Samples regenerated after their engine died."""
        return self.loop.redone

    def limit(self) -> int:
        """Samples an engine runs at once now: ``slots``, fewer where ``kv`` holds it back."""
        return self.loop.limit()

    def version(self) -> int:
        """The live engines' weights version, relative to ``base`` (the least updated one: an update resumes the
        engines one after the other)."""
        stats = self.pool.stats(self.pool.live())
        if not stats:
            raise RuntimeError("every rollout engine has died; cannot generate")
        return min(s.weights_version for s in stats.values()) - self.base

    def _more(self) -> bool:
        """A new group for the loop, drawn from the dataloader: only inside a generator call (``drawing``)."""
        return self.drawing and self._draw_one()

    def _draw_one(self) -> bool:
        """The dataloader's next prompt as a new group at the end of the book (False: dry, the book closed)."""
        prompt = self.draw()
        if prompt is None:
            self.book.close()
            return False
        self.prompts[self.book.add(self.n)] = prompt
        return True

    def draw_ahead(self, version: int) -> int:
        """Draw now the groups the admission rule may start under weights ``version`` (the newest the engines can
        reach before the generator's next call), so that the feeder has them without touching the dataloader;
        returns how many were drawn. Called with ``cond`` held."""
        drawn = 0
        while self.loop.to_draw(version) > 0:
            if not self._draw_one():
                break
            drawn += 1
        return drawn

    def dispatch(self, version: int, submit: Submit) -> int:
        """Give every free slot of the live engines a sample, as the SDK's ``StreamLoop`` hands them out (the
        engine with the most free slots first); returns how many."""
        live = self.pool.live()
        if not live:
            raise RuntimeError("every rollout engine has died; cannot generate")
        fill = self.loop.fill(self.loop.free({e: self.load[e] for e in live}), version, self._more)
        for sid, engine in fill.sent:
            gid = self.book.group_of[sid]
            had = self.moves.carried.pop(sid, None)
            ref = submit(engine, self.prompts[gid], sid - self.book.groups[gid].samples[0], had)
            self.pending[ref] = (sid, engine)
            self.load[engine] += 1
        return len(fill.sent)

    # -- the feeder: engines fed between the generator's calls ------------------------------------------------
    def feed(self, submit: Submit, interval_s: float) -> None:
        """Keep every free slot busy from a thread of its own until the stream is done or ``stop`` (started once;
        ``submit`` is replaced on each call: the generator's sampling settings of its latest call)."""
        with self.cond:
            self.submit = submit
            if self._feeder is not None:
                return
            self._feeder = threading.Thread(target=self._feed, args=(interval_s,), name="rlhfless-stream", daemon=True)
        self._feeder.start()

    def stop(self) -> None:
        self._stop.set()

    def _feed(self, interval_s: float) -> None:
        try:
            while not self._stop.is_set():
                with self.cond:
                    if self.book.closed and not self.book.untrained:
                        return
                    if self.dispatch(self.version(), self.submit):
                        self.quiet_since = time.time()
                        self.cond.notify_all()
                    self._drop_dead()
                    refs = list(self.pending)
                if not refs:
                    self._stop.wait(interval_s)
                    continue
                ready, _ = ray.wait(refs, num_returns=1, timeout=interval_s)
                if ready:
                    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
                with self.cond:
                    if self._collect(ready):
                        self.quiet_since = time.time()
                    self.cond.notify_all()
        except BaseException as exc:  # the generator raises it: a thread's error is nobody's otherwise
            with self.cond:
                self.error = exc
                self.cond.notify_all()

    def check(self) -> None:
        """Raise what stopped the feeder, if anything did. Called with ``cond`` held."""
        if self.error is not None:
            raise self.error

    def _drop_dead(self) -> None:
        """Samples on an engine marked dead elsewhere (e.g. its EngineCore died) go back to be regenerated."""
        for ref, (sid, engine) in list(self.pending.items()):
            if engine in self.pool.dead:
                del self.pending[ref]  # never read: a late answer cannot make the sample twice
                self.load[engine] -= 1
                self.moves.cut.discard(sid)
                self.loop.requeue(sid)

    def _collect(self, ready: list) -> list[int]:
        """The finished samples among the returned references ``ready`` (the book told). A sample whose engine died
        (its actor, or its vLLM EngineCore under a live actor) goes back to be regenerated from scratch on another
        (nothing lost, nothing twice)."""
        done = []
        for ref in ready:
            if ref not in self.pending:  # dropped meanwhile: its engine was marked dead
                continue
            sid, engine = self.pending.pop(ref)
            self.load[engine] -= 1
            try:
                (response,) = ray.get(ref)
            except ENGINE_ERRORS as exc:
                self.moves.cut.discard(sid)  # whatever it had is gone with the error: it starts over, below
                if engine in self.pool.retired and fill.closed(exc):  # it reached a stopped fill engine: never ran
                    self.loop.move(sid)
                    continue
                if not engine_lost(exc):
                    raise
                self.pool.mark_dead(engine, exc)
                self.loop.requeue(sid)
                continue
            if sid in self.moves.cut:  # cut on a stopped fill engine: it goes on elsewhere from the tokens it has
                self.moves.cut.discard(sid)
                start = response["action_ranges"][0][0]
                lps = response["rollout_log_probs"]
                tokens = list(response["observation_tokens"][start:])
                if tokens:
                    kept = None if lps is None else lps[start:]
                    self.moves.carried[sid] = (tokens, kept, response["rlhfless_versions"])
                self.loop.move(sid)
                continue
            self.responses[sid] = response
            self.pool.finished(response, self.siblings_on(sid, engine))
            done.append(sid)
        if done:
            self.loop.finished(
                done,
                time.time(),
                [len(self.prompts[self.book.group_of[sid]].token_ids) for sid in done],
                [response_tokens(self.responses[sid]) for sid in done],
            )
        return done

    def siblings_on(self, sid: int, engine: int) -> list[int]:
        """The engines other than ``engine`` running samples of ``sid``'s group now."""
        gid = self.book.group_of[sid]
        return sorted({e for s, e in self.pending.values() if e != engine and self.book.group_of[s] == gid})

    def key_of(self, sid: int) -> str:
        """Sample ``sid``'s piece key on the engines (its group's uid and its index in the group)."""
        gid = self.book.group_of[sid]
        return f"{self.prompts[gid].uid}/{sid - self.book.groups[gid].samples[0]}"

    def running(self) -> int:
        """Samples in flight on the engines (or waiting to be regenerated)."""
        return len(self.pending) + len(self.loop.retry)


def response_tokens(response: dict[str, Any]) -> int:
    """A finished response's length in tokens (its action ranges' span)."""
    ranges = response["action_ranges"]
    return int(ranges[-1][1]) - int(ranges[0][0])


def response_runs(response: dict[str, Any]) -> list[tuple[int, int]]:
    """(version, tokens) runs of a finished response, from the versions its engine recorded (``rlhfless_versions``)
    and its response length."""
    return version_runs(response["rlhfless_versions"], response_tokens(response))


def stall_error(waited_s: float, version: int, book: GroupBook, batch: int) -> RlhflessError:
    """Why a stream gave up waiting: nothing ran and the batch could not form for ``waited_s`` seconds, with no
    weight update to wait for (while batches wait for the learner, the stream waits as long as it takes)."""
    return RlhflessError(
        f"rlhfless: the stream cannot form batch {batch}: no sample has run for {waited_s:.0f} s although every "
        f"batch handed to training has updated the weights (engines at version {version}; {book.started} groups "
        f"started, {book.trained} trained, {book.B} a batch, at most {book.max_age} updates old); this is a bug in "
        "the stream's admission, please report it with this line"
    )


class StreamRun(DrawingRun):
    """The streaming pipeline as the samples generator's mode (``rlhfless_openrlhf.run_modes``): one batch a call of
    OpenRLHF's async loop (its ``generate_samples``: B groups, never more, ``GroupBook.form``), its engines fed by
    an ``EngineStream`` between calls, its report and metrics; what a checkpoint keeps: the prompts of the groups not
    trained yet (their tokens are not kept: a resumed run re-runs them from scratch under the restored weights)."""

    name = STREAM

    def __init__(self, gen: Any, learner_gpus: int = 0, fill_engines: list | None = None) -> None:
        """No stream yet: the epoch's stream, the engines' weights version when the run's first stream began and
        the batches it formed (batch k trains with version base + k); ``learner_gpus``: the GPUs OpenRLHF's learner
        holds beside the engines; ``fill_engines``: the fill engines the launcher built (``fill``)."""
        super().__init__(gen)  # its groups' prompts, drawn one at a time, until they train (``prompts``)
        self.dataloader_iter: Any = None  # the epoch's, from OpenRLHF's prompts dataloader
        self.stream: EngineStream | None = None
        self.base: int | None = None
        self.batches = 0
        self.mark: tuple[float, dict[int, float]] | None = None  # (time, engine busy s) at the last batch
        self.began: float | None = None  # wall clock of the stream's start
        self.handed: list[float] = []  # wall clock each stream batch was handed to OpenRLHF's learner
        self.fill_engines: list[int] = []  # the stream's fill engines in the pool, until batch 0 (``fill``)
        self.fill_stopped: dict[str, float] | None = None  # their stop: start, end (wall clock), moved, tokens
        self.learner_gpus = learner_gpus
        self.fill_handles = list(fill_engines or [])  # until the stream attaches them
        self.last_billing: dict[str, Any] = {}  # what the last stream batch billed, as window_gpu_seconds read it

    def own_batches(self, kw: dict[str, Any]) -> tuple[list, float | None, int, bool]:
        """OpenRLHF's ``generate_samples`` for the stream: (experiences, filter pass rate, prompts consumed,
        exhausted), one stream batch as it is: B groups (the last one: what is left)."""
        if self.dataloader_iter is None:
            self.dataloader_iter = iter(self.gen.prompts_dataloader)
        experiences, consumed, exhausted = self.batch(
            self.dataloader_iter, int(self.gen.args.rollout.batch_size), False, kw
        )
        if exhausted:
            self.dataloader_iter = None
        return experiences, None, consumed, exhausted

    def snapshot(self) -> dict[str, Any]:
        lock = self.stream.cond if self.stream is not None else contextlib.nullcontext()
        with lock:  # its feeder draws nothing between the generator's calls; held all the same
            return super().snapshot()

    def check_loop(self) -> None:
        """The stream runs only where a weight broadcast pauses its running samples (see ``STREAM_NEEDS``)."""
        train, vllm = getattr(self.gen.args, "train", None), getattr(self.gen.args, "vllm", None)
        if not (getattr(train, "async_enable", False) and getattr(train, "partial_rollout_enable", False)):
            raise RlhflessError(f"rlhfless: scheduler {self.gen.planner.config.name!r} {STREAM_NEEDS}")
        if getattr(vllm, "enable_sleep", False):
            raise RlhflessError(
                f"rlhfless: scheduler {self.gen.planner.config.name!r} streams: --vllm.enable_sleep would free the KV "
                "cache of its running samples between batches; run it without"
            )

    def stream_for(self, dataloader_iter: Any, b: int, n: int) -> EngineStream:
        """The epoch's stream: the one running, or a new one over ``dataloader_iter`` (a new epoch, or a resumed run,
        whose restored prompts come first)."""
        st = self.stream
        if st is not None and st.source is dataloader_iter:
            return st
        if st is not None:
            st.stop()
        self.prompts.restart()  # what was drawn and not trained first (a resumed run's, or the last epoch's)
        ids = self.prompts.ids(dataloader_iter)
        taken: set[str] = set()

        def draw() -> StreamPrompt | None:
            pid = next(ids, None)
            if pid is None:
                return None
            prompt, label, image = self.prompts.table[pid]
            return StreamPrompt(pid, prompt, label, image, fresh_uid(prompt, taken), self.gen._tokenize(prompt))

        pipeline = self.gen.planner.config.pipeline
        if self.base is None:
            self._attach_fill()
            stats = self.gen.pool.stats(self.gen.pool.live())
            self.base = min((s.weights_version for s in stats.values()), default=0)
            self.mark = (time.time(), {e: s.busy_s for e, s in stats.items()})
            self.began = self.mark[0]
        book = GroupBook([], b, int(pipeline.max_age), closed=False, first_batch=self.batches)
        self.stream = st = EngineStream(
            self.gen.pool,
            book,
            draw,
            n=n,
            slots=self.gen.engine_profile.max_num_seqs,
            base=self.base,
            source=dataloader_iter,
            uids=taken,
            kv=KvSlots(self.gen.engine_profile, pipeline.kv_slots) if pipeline.kv_slots is not None else None,
        )
        return st

    def _attach_fill(self) -> None:
        """The fill engines the launcher built on the learner's GPUs (``fill.build``), into the pool after the
        rollout engines, awake (OpenRLHF builds sleep-mode engines asleep), for a run's first stream only."""
        handles = list(self.fill_handles)
        if not handles or self.batches:
            return
        first = len(self.gen.pool.handles)
        rollout = {s.weights_version for s in self.gen.pool.stats(self.gen.pool.live()).values()}
        self.gen.pool.handles = list(self.gen.pool.handles) + handles
        fills = list(range(first, first + len(handles)))
        versions = {s.weights_version for s in self.gen.pool.stats(fills).values()}
        if versions != rollout or len(rollout) != 1:  # e.g. a resumed run whose engines got the checkpoint's weights
            log.info(
                "rlhfless: the fill engines are ended unused: the rollout engines hold weights version(s) %s, the "
                "fill engines %s (they get no broadcast)",
                sorted(rollout),
                sorted(versions),
            )
            fill.end(self.gen.pool, fills)
            return
        self.fill_engines = fill.wake(self.gen.pool, fills)

    def _stop_fill(self, st: EngineStream) -> None:
        """Batch 0 formed: the fill engines stop before the learner takes it (``fill.stop``), one line says what
        moved."""
        t0 = time.time()
        moved, tokens = fill.stop(st, self.fill_engines, st.key_of, self.gen.carry_timeout_s)
        self.fill_stopped = {"start": t0, "end": time.time(), "moved": moved, "tokens": tokens}
        log.info(
            "rlhfless: batch 0 is complete: %d fill engine(s) on the learner's GPUs stopped and sleep (%.1f s); %d "
            "sample(s) go on on the rollout engines with the %d tokens they had",
            len(self.fill_engines),
            self.fill_stopped["end"] - t0,
            moved,
            tokens,
        )

    def batch(self, dataloader_iter: Any, b: int, dynamic_filtering: bool, kw: dict[str, Any]) -> Batch:
        """One batch of the streaming pipeline (the SDK's ``GroupBook`` on ``EngineStream``): the engines keep
        every free slot busy with the stream's next sample, new groups as the age bound allows, and the call returns
        as soon as the book forms batch k: the groups too old to wait for the next batch, then the earliest-started
        complete ones, B groups, each whole and in order. The other samples go on running on the engines through
        OpenRLHF's training of this batch and its weight broadcast (which pauses them between decode iterations):
        a sample's tokens then come from more than one weights version, each with the logprob of the weights that
        produced it, and the importance correction weighs them. Every token's age is measured from the engines'
        update counts and never exceeds the pipeline's ``max_age``. Returns (experiences, prompts taken from the
        dataloader, exhausted: the dataloader is dry and every group trained)."""
        self.refuse_filtering(dynamic_filtering)
        self.check_loop()
        gen = self.gen
        n = int(kw.get("n_samples_per_prompt", gen.args.rollout.n_samples_per_prompt))
        st = self.stream_for(dataloader_iter, b, n)
        book, k, drawn = st.book, self.batches, self.prompts.count
        t0 = time.time()
        st.feed(self.submitter(n, kw), gen.check_interval_s)  # the feeder keeps the engines busy, in and between calls
        with st.cond:
            st.drawing = True
            chosen = self.wait_for_batch(st, k)
            if chosen is None:  # the epoch is over: every group trained
                st.stop()
                self.stream = None
                return [], self.prompts.count - drawn, True
            if self.fill_engines and not gen.pool.retired.issuperset(self.fill_engines):
                self._stop_fill(st)  # before the learner takes batch 0: it needs the memory they hold
            taken = [
                (st.prompts.pop(gid), [st.responses.pop(sid) for sid in book.groups[gid].samples]) for gid in chosen
            ]
            for prompt, _ in taken:
                st.uids.discard(prompt.uid)
                del self.prompts.table[prompt.prompt_id]
            # until the next call the feeder draws nothing from the dataloader (a checkpoint's dataloader state and
            # the prompts it keeps must agree): the groups that may start before then (the engines reach at most
            # version k + 1 meanwhile: batch k trained) are drawn now
            st.draw_ahead(k + 1)
            st.drawing = False
            consumed = self.prompts.count - drawn
        experiences, runs, groups = [], [], []
        for prompt, responses in taken:
            for response in responses:
                runs.append(response_runs(response))
                experiences.append(gen._process_response_into_experience(response, **kw))
            groups.append((prompt.uid, prompt.token_ids, [response_tokens(r) for r in responses]))
        gen.log.trace(groups)
        self.batches += 1
        self.finish_batch(st, chosen, groups, batch_ages(runs, st.base + k), t0)
        self.handed.append(time.time())
        exhausted = book.closed and not book.untrained
        if exhausted:
            st.stop()
            self.stream = None
        return experiences, consumed, exhausted

    def submitter(self, n: int, kw: dict[str, Any]) -> Submit:
        """How the stream's sample ``j`` of a group goes to an engine: one Ray call, under OpenRLHF's sampling
        parameters (a length replay forcing its length)."""
        gen = self.gen
        params, max_len, tokenizer = gen._sampling_params(**kw), kw.get("max_len", 2048), gen.shared_tokenizer()
        replay = gen.replay

        def submit(engine: int, prompt: StreamPrompt, j: int, carried: Any = None) -> Any:
            key = f"{prompt.uid}/{j}"
            forced = None if replay is None else {key: replay.lengths(prompt.uid, n)[j]}
            had = None if carried is None else {key: carried}
            return gen.pool.handles[engine].generate_group.remote(
                prompt.prompt, prompt.label, params, max_len, tokenizer, [key], prompt.image, had, forced
            )

        return submit

    def wait_for_batch(self, st: EngineStream, k: int) -> list[int] | None:
        """Batch ``k``'s groups, once the book forms it (under ``st.cond``); None: the epoch is over. A stream
        whose engines have all been quiet for the carry timeout after every batch updated the weights is stalled
        (an error naming why); one waiting for the learner's next update says so once."""
        book, told = st.book, False
        while True:
            st.check()
            chosen = st.loop.form(k)
            if chosen is not None:
                return chosen
            if book.closed and not book.untrained:
                return None
            if not st.running() and time.time() - st.quiet_since > self.gen.carry_timeout_s:
                version = st.version()
                if version >= k:  # every batch handed to training has updated the weights: nothing will come
                    raise stall_error(time.time() - st.quiet_since, version, book, k)
                if not told:  # batches wait for (or are in) training: its next update lets new groups start
                    told = True
                    log.info(
                        "rlhfless: the stream waits for the learner: batch %d may take only groups that start after "
                        "its next weight update (engines at version %d, %d batch(es) handed to training, at most %d "
                        "update(s) old)",
                        k,
                        version,
                        k,
                        book.max_age,
                    )
            st.cond.wait(self.gen.check_interval_s)

    def billing(self, lo: float, hi: float, engines: int, gpus: int, stats: dict[int, Any]) -> dict[str, Any]:
        """What the window [lo, hi] of a stream batch bills, by the formula the simulated stream bills with
        (``rlhfless_sdk.rollout.billing.window_gpu_seconds``): each live engine held for the whole window (real
        engines are never stopped), the learner's GPUs while they train each batch handed to them (from its
        hand-over, or the end of the update before, to the start of the update after; to now while it trains) and
        during the weight updates (the engines' pause to resume); serverful, every GPU for the window."""
        # the i-th update: from the first engine's pause to the last one's resume (the broadcast pauses them all)
        per_engine = [s.updates for s in stats.values()]
        count = min((len(u) for u in per_engine), default=0)
        updates = [(min(u[i][0] for u in per_engine), max(u[i][1] for u in per_engine)) for i in range(count)]
        updates = [u for u in updates if u[0] >= (self.began or lo)]  # those since the stream began
        trains = []
        for j, handed in enumerate(self.handed):
            if j > len(updates):  # batch j - 1 has not updated the weights yet: the learner has not taken batch j
                break
            start = handed if j == 0 else max(handed, updates[j - 1][1])
            trains.append((self.learner_gpus, (start, updates[j][0] if j < len(updates) else hi)))
        spans = [[(lo, hi)]] * engines
        began, stopped = self.began or lo, (self.fill_stopped or {"end": hi})["end"]
        if self.fill_engines and min(stopped, hi) > max(lo, began):  # the fill engines, held until their stop
            spans = spans + [[(max(lo, began), min(stopped, hi))]] * len(self.fill_engines)
        learner_updates = (self.learner_gpus, updates)
        self.last_billing = {
            "lo": lo,
            "hi": hi,
            "engines": spans,
            "gpus_per_engine": gpus,
            "trains": trains,
            "updates": learner_updates,
            "gpus": engines * gpus + self.learner_gpus,
        }
        return {
            "gpu_seconds": window_gpu_seconds(lo, hi, spans, gpus, trains, learner_updates),
            "gpu_seconds_serverful": (engines * gpus + self.learner_gpus) * (hi - lo),
        }

    def finish_batch(
        self, st: EngineStream, chosen: list[int], groups: list, ages: tuple[int, int, int], t0: float
    ) -> None:
        """A stream batch's report and metrics: wall time since the last batch, the engines' busy share of it, the
        token ages measured (``batch_ages``: tokens, those older than the weights that train them, the largest
        age)."""
        self.gen.pool.share_history()  # the drafters' history, once a batch (the stream has no step start)
        now = time.time()
        live = self.gen.pool.live()
        stats = self.gen.pool.stats(live)
        busy = {e: s.busy_s for e, s in stats.items()}
        since, before = self.mark if self.mark is not None else (t0, {})
        self.mark = (now, busy)
        window = max(now - since, 1e-9)
        used = [max(busy[e] - before.get(e, 0.0), 0.0) for e in busy]
        gpus = engine_gpus(self.gen.args)
        lengths = [x for _, _, ls in groups for x in ls]
        billed = self.billing(since, now, len(live), gpus, stats)
        batch = BatchWindow(
            self.gen.step, self.gen.planner.config.name, since, since + window, window, billed["gpu_seconds"],
            billed["gpu_seconds_serverful"], 1.0 - sum(used) / (window * max(len(used), 1)), used, len(live),
            len(lengths), int(sum(lengths)), ages, len(chosen), len(live) * gpus + self.learner_gpus,
        )  # fmt: skip
        report = batch.report(actor_busy_s=used, carried_samples=st.running())
        report = self.gen.log.replayed(report)
        self.gen.log.record(
            report,
            {
                "rlhfless/actual_length_mean": float(np.mean(lengths)) if lengths else 0.0,
                "rlhfless/active_engines": float(len(live)),
                "rlhfless/idle_fraction": report.idle_fraction,
                "rlhfless/gpu_seconds": report.gpu_seconds,
                "rlhfless/max_token_age": float(report.max_token_age_steps),
                "rlhfless/stale_token_fraction": report.stale_token_fraction,
                "rlhfless/in_flight_samples": float(report.carried_samples),
                "rlhfless/samples_regenerated": float(st.redone),
                "rlhfless/engine_slots": float(st.limit()),
            },
        )
