"""A mode on OpenRLHF: one object, chosen once from the launch plan, that runs the samples generator's batches.

The generator only serves engines and the learner; how its batches are formed, and what a checkpoint keeps of
them, is its ``ModeRun``'s (as vLLM's engine core holds one scheduler object, chosen once):

- ``PlainRun``: each batch one plain step (``PlainStep``), every sample to its end; with dynamic filtering, the
  dropped groups refilled from the dataloader in rounds, as OpenRLHF does;
- ``RoundsRun``: the session of any driver that carries no tokens (tail batching's ``TailSession``, or a plugin's),
  over the prompts drawn from the dataloader, one at a time (``DrawnPrompts``): what it defers survives a checkpoint;
- ``CarriedRun``: partial rollouts cut when B groups are complete (``BatchCutSession``), their tokens carried
  between steps in a ``CarriedWork``;
- ``StreamRun`` (``rlhfless_openrlhf.stream``): the streaming pipeline, inside OpenRLHF's async loop.

The generator picks one, once (``generator.run_for``), from the mode and the registry's driver spec;
``capabilities.runs`` names the modes it can pick. A new driver whose session carries no tokens runs here with no
change in this package.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any, Protocol

from rlhfless_openrlhf.carried import CarriedWork
from rlhfless_openrlhf.step_io import EnginesIO, GeneratorSide

from rlhfless_sdk.rollout.drivers import BatchCutSession, DriverSession, PlainStep, session_for
from rlhfless_sdk.rollout.modes import BATCH_CUT

log = logging.getLogger("rlhfless.openrlhf")

#: A batch's result, as OpenRLHF's ``_generate_vllm`` returns it: (experiences, prompts taken from the dataloader,
#: exhausted).
Batch = tuple[list, int, bool]


class ModeHost(GeneratorSide, Protocol):
    """What a mode reads and calls of the samples generator (``RlhflessSamplesGenerator``), besides a step's."""

    log: Any  # the run log (``RunLog``): trace, reports, metrics
    prompts_dataloader: Any
    carry_timeout_s: float
    check_interval_s: float
    last_cuts: list
    last_trained_groups: list[int]

    def finish_driven(self, io: EnginesIO, driven: Any) -> list: ...

    def finish_step(self, report: Any, outcome: Any, plan: Any) -> None: ...

    def filter_groups(self, experiences: list, n: int) -> list: ...


class ModeRun:
    """How the generator's batches run in one mode: ``batch`` (OpenRLHF's ``_generate_vllm`` of a training batch),
    ``own_batches`` (a whole ``generate_samples`` where the mode forms its batches itself; None: OpenRLHF's), and
    what a checkpoint keeps (``snapshot``; ``restore_deferred``/``restore_carried`` take it back, or drop what this
    mode cannot continue, saying how much)."""

    name = ""

    def __init__(self, gen: ModeHost) -> None:
        self.gen = gen

    def batch(self, dataloader_iter: Any, b: int, dynamic_filtering: bool, kw: dict[str, Any]) -> Batch:
        raise NotImplementedError

    def own_batches(self, kw: dict[str, Any]) -> tuple | None:
        return None

    def snapshot(self) -> dict[str, Any]:
        return {}

    def restore_deferred(self, deferred: list, step: int) -> int:
        log.warning(
            "rlhfless: the checkpoint holds %d deferred prompt(s) that scheduler %s does not re-run; they are "
            "dropped (their prompts were consumed: they will not train this epoch)",
            len(deferred),
            self.gen.planner.config.name,
        )
        return 0

    def restore_carried(self, snapshot: dict[str, Any]) -> int:
        log.warning(
            "rlhfless: the checkpoint carries %d partial sample(s) in %d open group(s) that scheduler %s cannot "
            "continue; they are dropped (their prompts were consumed: they will not train this epoch)",
            len(snapshot.get("carried", [])),
            len(snapshot.get("groups", {})),
            self.gen.planner.config.name,
        )
        return 0

    def refuse_filtering(self, dynamic_filtering: bool) -> None:
        """Dynamic filtering drops groups, which would break "B groups a step" (refused at launch too)."""
        if dynamic_filtering:
            raise RuntimeError(
                f"rlhfless: the {self.name} mode of scheduler {self.gen.planner.config.name} cannot run with "
                "dynamic filtering"
            )


def plain_step(gen: ModeHost, drawn: list[tuple[str, Any, Any]], kw: dict[str, Any]) -> list:
    """One plain step (``PlainStep``) of the (prompt, label, image) ``drawn``: every sample to its end; the
    experiences grouped by prompt, in order."""
    io = EnginesIO(gen, kw, source=drawn)
    driven = PlainStep(gen.planner, gen.step).run(io, io.batch(list(range(len(drawn)))))
    return gen.finish_driven(io, driven)


class PlainRun(ModeRun):
    """Plain steps (``PlainStep``), as OpenRLHF's own generator runs them; with dynamic filtering, each group the
    filter drops is replaced by a fresh prompt, in refill rounds (each one a scheduled step of its own in the
    report) until the batch is full or the data ends."""

    def __init__(self, gen: ModeHost, name: str) -> None:
        super().__init__(gen)
        self.name = name

    def batch(self, dataloader_iter: Any, b: int, dynamic_filtering: bool, kw: dict[str, Any]) -> Batch:
        gen = self.gen
        n = int(kw.get("n_samples_per_prompt", gen.args.rollout.n_samples_per_prompt))
        accepted: list = []
        consumed, want, exhausted = 0, b, False
        while want > 0 and not exhausted:
            drawn, exhausted = gen.take_prompts(dataloader_iter, want)
            if not drawn:
                exhausted = True
                break
            consumed += len(drawn)
            experiences = plain_step(gen, drawn, kw)
            if not dynamic_filtering:
                return experiences, consumed, exhausted
            kept = gen.filter_groups(experiences, n)
            accepted.extend(kept)
            want = len(drawn) - len(kept) // n
            if want:
                log.info("dynamic filtering dropped %d of %d groups; refilling from the dataloader", want, len(drawn))
        return accepted, consumed, exhausted


class DrawnPrompts:
    """Prompts drawn from OpenRLHF's dataloader one at a time and not trained yet, by id, in the order drawn: what a
    checkpoint keeps of a session that defers prompts, and what a resumed run re-runs first (``pending``)."""

    def __init__(self, take: Callable[[Any, int], tuple[list[tuple[str, Any, Any]], bool]]) -> None:
        self.take = take  # the generator's ``take_prompts``
        self.table: dict[int, tuple[str, Any, Any]] = {}  # id -> prompt, label, image
        self.count = 0  # ids handed out
        self.pending: list[int] = []  # in the table, not in a session yet (restored, or left by an ended one)

    def add(self, prompt: str, label: Any, image: Any) -> int:
        k = self.count
        self.count += 1
        self.table[k] = (prompt, label, image)
        return k

    def ids(self, dataloader_iter: Any) -> Iterator[int]:
        """Every prompt of the dataloader, one at a time (none of a batch dropped), as an id; the pending ones
        first."""
        while True:
            if self.pending:
                yield self.pending.pop(0)
                continue
            drawn, _exhausted = self.take(dataloader_iter, 1)
            if not drawn:
                return
            for prompt, label, image in drawn:
                yield self.add(prompt, label, image)

    def dry(self, dataloader_iter: Any) -> bool:
        """Nothing drawn is left and the dataloader has no more (a prompt drawn to see is pending)."""
        if self.table:
            return False
        drawn, _exhausted = self.take(dataloader_iter, 1)
        self.pending += [self.add(*row) for row in drawn]
        return not drawn

    def restart(self) -> None:
        """A new session: every prompt drawn and not trained is pending, in the order drawn."""
        self.pending = list(self.table)

    def rows(self) -> list[list[Any]]:
        return [[prompt, label] for prompt, label, _image in self.table.values()]

    def restore(self, deferred: list) -> int:
        self.pending += [self.add(prompt, label, None) for prompt, label in deferred]
        return len(deferred)


class DrawingRun(ModeRun):
    """A mode that draws its prompts one at a time (``DrawnPrompts``): what it drew and has not trained is what a
    checkpoint keeps, and what a resumed run re-runs first."""

    def __init__(self, gen: ModeHost) -> None:
        super().__init__(gen)
        self.prompts = DrawnPrompts(gen.take_prompts)

    def snapshot(self) -> dict[str, Any]:
        return {"deferred": self.prompts.rows()} if self.prompts.table else {}

    def restore_deferred(self, deferred: list, step: int) -> int:
        self.gen.step = step
        log.info("rlhfless: restored %d deferred prompt(s) from the checkpoint", len(deferred))
        return self.prompts.restore(deferred)


class RoundsRun(DrawingRun):
    """The session of a driver that carries no tokens between steps (``DriverSpec.session``; tail batching's rounds,
    or a plugin's), over ``DrawnPrompts``: a step trains the groups its driver says; the others' prompts stay drawn
    until a later step trains them (a checkpoint keeps them). A new epoch (another dataloader iterator) starts a new
    session with what was left first. Exhausted: nothing left and the dataloader dry."""

    def __init__(self, gen: ModeHost, name: str) -> None:
        super().__init__(gen)
        self.name = name
        self.session: DriverSession | None = None
        self.source: Any = None  # the dataloader iterator the session draws from

    def batch(self, dataloader_iter: Any, b: int, dynamic_filtering: bool, kw: dict[str, Any]) -> Batch:
        self.refuse_filtering(dynamic_filtering)
        gen, prompts = self.gen, self.prompts
        if self.session is None or dataloader_iter is not self.source:
            prompts.restart()
            ids = prompts.ids(dataloader_iter)
            self.session = session_for(self.name, gen.planner, b, ids)
            self.source, self.draw = dataloader_iter, lambda k: list(islice(ids, b if k is None else k))
        before = prompts.count
        io = EnginesIO(gen, kw, source=prompts.table, draw=self.draw)
        driven = self.session.next(io, gen.step)
        if driven is None:
            return [], prompts.count - before, prompts.dry(dataloader_iter)
        experiences = gen.finish_driven(io, driven)
        for i in driven.trained_rows:
            del prompts.table[io.refs[i]]
        exhausted = prompts.dry(dataloader_iter)
        return experiences, prompts.count - before, exhausted


class CarriedRun(ModeRun):
    """Partial rollouts cut when B groups are complete (the SDK's ``BatchCutStep``, APRIL-style): every group carried
    from the step before, plus fresh prompts up to (1 + over_provision) x B groups in flight; the step ends once the
    carried groups and ``B - carried`` fresh ones are complete, and every other sample is cut where it is and
    carried, with its tokens and their logprobs, into the next step, where it goes on under the new weights on
    whichever engine the plan picks. A group trains once, complete, its n samples in order; each carried token keeps
    the logprob of the policy that generated it, so OpenRLHF's importance correction applies. Once the dataloader
    runs dry the last steps train what is left, B a step; the epoch ends when nothing is carried."""

    name = BATCH_CUT

    def __init__(self, gen: ModeHost) -> None:
        super().__init__(gen)
        self.carried = CarriedWork()

    def batch(self, dataloader_iter: Any, b: int, dynamic_filtering: bool, kw: dict[str, Any]) -> Batch:
        self.refuse_filtering(dynamic_filtering)
        gen, work = self.gen, self.carried
        io = EnginesIO(gen, kw, dataloader_iter=dataloader_iter, carried=work)
        driven = BatchCutSession(gen.planner, b, work.book).next(io, gen.step)
        if driven is None:
            return [], 0, True
        assert driven.settled is not None and io.backend is not None
        outcome, settled, backend = driven.outcome, driven.settled, io.backend
        work.keep(outcome.outputs, set(outcome.carried), backend.carried_out)
        gen.log.trace((work.prompts[tg.group][3], work.prompts[tg.group][4], tg.lengths) for tg in settled.trained)
        experiences = [
            gen._process_response_into_experience(response, **kw)
            for tg in settled.trained
            for response in work.take(tg.group, len(tg.lengths))
        ]
        gen.last_cuts = backend.cut_log
        gen.last_trained_groups = driven.trained_rows  # the experiences' groups, in order
        gen.finish_step(outcome.report.model_copy(update=driven.fields), outcome, driven.plan)
        return experiences, len(io.drawn), io.exhausted and not work.book.open_group_ids()

    def snapshot(self) -> dict[str, Any]:
        return self.carried.state() if self.carried.book.groups else {}

    def restore_carried(self, snapshot: dict[str, Any]) -> int:
        self.carried = CarriedWork.from_state(snapshot)
        self.gen.step = int(snapshot["step"])
        carried = len(snapshot.get("carried", []))
        log.info(
            "rlhfless: restored %d carried sample(s) in %d open group(s) from the checkpoint",
            carried,
            len(self.carried.book.groups),
        )
        return carried
