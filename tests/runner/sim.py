"""A simulated run for the runner's property tests: the real dispatcher, reporter, ledger and
trainer supervisor (``asyncrl.run_loops`` / ``run_ledger`` / ``run_supervisor``) driven by a
fake controller, a fake trainer, a fake launcher and an in-memory checkpoint store, on an
event loop with a virtual clock. One seed is one run: its timings (generation, training,
saving, restarting, store latency, extra scheduling turns), its flow-control credit and its
trainer kills are drawn from ``random.Random(seed)``, so a seed replays the same ordering.

What the fakes assume of the real processes (and nothing more):

- the trainer takes batches and ``Save`` requests in the order sent, trains step ``s`` on
  the state of steps ``0..s-1``, reports ``Saved(k)`` once its state of steps ``0..k-1``
  is written into the checkpoint's ``trainer`` folder, and ``StepDone(s)`` once step
  ``s``'s weight push is done (pushes in step order, in the background as the real
  trainer's: ``Saved(k)`` may come before ``StepDone(k - 1)``, and a death between the
  two loses that ``StepDone``);
- reports arrive in the order sent, a dead incarnation's (still queued when it died)
  before its successor's first (a restart takes seconds; the receive loop drains the old
  connection meanwhile); batches sent to a dead trainer are lost (credit runs out);
- a restarted trainer restores the checkpoint the resume file names (it must still be
  complete) and reports ``Synced`` before taking batches; the watchdog sees a death within
  half a second.

Whatever a fake sees that the contract forbids (a step trained on the wrong state, a
checkpoint restored after it was pruned, a manifest over a folder without the trainer's
part) is recorded in ``Sim.violations``; :func:`check` adds the end-of-run invariants.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.config import load_config
from asyncrl.controllers.state import ControllerState
from asyncrl.core import Batch
from asyncrl.run_ledger import CheckpointLedger
from asyncrl.run_loops import Pipeline, RunStopped, first
from asyncrl.run_steplog import StepLog
from asyncrl.run_supervisor import TrainerSupervisor
from asyncrl.transports.experience.control import Save, Saved, StepDone, Synced

HANG_S = 100_000.0
"""Virtual seconds after which a run that has not ended counts as hung."""


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop on a virtual clock: when nothing is ready to run, time jumps to the next
    timer (a 600 s timeout costs nothing); executor work (``asyncio.to_thread``) runs inline,
    so a seed's ordering does not depend on threads."""

    def __init__(self) -> None:
        super().__init__()
        self._now = 0.0

    def time(self) -> float:
        return self._now

    def _run_once(self) -> None:
        live = [h.when() for h in self._scheduled if not h.cancelled()]  # type: ignore[attr-defined]
        if not self._ready and live:  # type: ignore[attr-defined]
            self._now = max(self._now, min(live))
        super()._run_once()  # type: ignore[misc]

    def run_in_executor(self, executor: Any, func: Callable[..., Any], *args: Any) -> Any:
        fut = self.create_future()
        try:
            fut.set_result(func(*args))
        except BaseException as exc:  # handed to the awaiting coroutine
            fut.set_exception(exc)
        return fut


@dataclass
class Plan:
    """One run's draw."""

    total: int
    every: int
    keep: int
    credit: int
    max_restarts: int
    kills: list[float]
    stop_at: float | None

    @classmethod
    def draw(cls, rng: random.Random) -> Plan:
        total = rng.randint(2, 8)
        n_kills = rng.choice([0, 1, 1, 2, 2, 3])
        return cls(
            total=total,
            every=rng.choice([0, 1, 1, 2, 3]),
            keep=rng.choice([1, 1, 2]),
            credit=rng.choice([1, 2, 3]),
            max_restarts=2,
            kills=sorted(
                rng.randint(0, 4 * total) + rng.choice([0.0, 0.5]) for _ in range(n_kills)
            ),
            # a stop at any time, before the trainer's first Hello too
            stop_at=rng.choice([None, None, None, rng.randint(0, 4 * total + 4)]),
        )


@dataclass
class Folder:
    step: int
    trainer: tuple[int, ...] | None = None
    complete: bool = False


class MemStore:
    """:class:`CheckpointStore` in memory, with ``controllers.checkpoints``' prune rule."""

    def __init__(self, sim: Sim, keep: int) -> None:
        self.sim, self.keep = sim, keep
        self.folders: dict[Path, Folder] = {}

    def folder(self, step: int) -> Path:
        return Path(f"checkpoints/step-{step}")

    async def prepare(self, folder: Path, controller_state: bytes) -> None:
        await self.sim.turns()
        self.folders[folder] = Folder(int(folder.name.removeprefix("step-")))

    async def clear_trainer(self, folder: Path) -> None:
        await self.sim.turns()
        if folder in self.folders:
            self.folders[folder].trainer = None

    async def commit(self, folder: Path, step: int) -> None:
        await self.sim.sleep(0, 0, 1, 2)  # fsync every file
        f = self.folders.get(folder)
        if f is None or f.trainer is None:
            self.sim.violation(f"checkpoint {step} committed without the trainer's part")
            return
        f.complete = True
        self.sim.commits_in_recovery += self.sim.ledger.recovering

    async def prune(self) -> None:
        await self.sim.turns()
        done = sorted((f.step, p) for p, f in self.folders.items() if f.complete)
        if not done:
            return
        keep = {p for _, p in done[-self.keep :]}
        for p in [p for p, f in self.folders.items() if p not in keep and f.step <= done[-1][0]]:
            del self.folders[p]

    async def latest(self) -> tuple[int, Path] | None:
        await self.sim.turns()
        done = sorted((f.step, p) for p, f in self.folders.items() if f.complete)
        return done[-1] if done else None


class SimChannel:
    """:class:`TrainerChannel` to one trainer rank, with ``credit`` batches in flight."""

    def __init__(self, sim: Sim, credit: int) -> None:
        self.sim, self.credit = sim, credit
        self.peer: SimTrainer | None = None
        self.early: list[Any] = []  # broadcast while no rank is connected: sent on its Hello
        self.reports: asyncio.Queue[Any] = asyncio.Queue()
        self.changed = asyncio.Event()

    async def send_groups(self, groups: Any, step: int = -1) -> list[int]:
        while self.peer is None or self.peer.batches_queued() >= self.credit:
            self.changed.clear()
            await self.changed.wait()
        self.peer.inbox.put_nowait(step)
        return [0 for _ in groups]

    async def broadcast(self, msg: Any) -> int:
        if self.peer is None:  # as ExperienceSender: kept for the next Hello, not counted
            self.early.append(msg)
            return 0
        self.peer.inbox.put_nowait(msg)
        return 1

    async def recv_report(self) -> Any:
        return await self.reports.get()

    def forget(self, rank: int) -> list[int]:
        self.peer, self.early = None, []
        self.changed.set()
        return []

    async def wait_peers(self, timeout_s: float) -> None:
        async with asyncio.timeout(timeout_s):
            while self.peer is None:
                self.changed.clear()
                await self.changed.wait()

    def hello(self, trainer: SimTrainer) -> None:
        self.peer = trainer
        for msg in self.early:
            trainer.inbox.put_nowait(msg)
        self.early = []
        self.changed.set()


class SimTrainer:
    """One incarnation of the trainer (see the module doc)."""

    def __init__(self, sim: Sim, checkpoint: Path | None, sync: bool) -> None:
        self.sim, self.checkpoint, self.sync = sim, checkpoint, sync
        self.inbox: asyncio.Queue[Any] = asyncio.Queue()
        self.state: list[int] = []
        sim.incarnations += 1
        self.incarnation = sim.incarnations
        self.pushes: asyncio.Queue[int] = asyncio.Queue()
        self.unreported: set[int] = set()  # trained, StepDone not yet sent
        self.task = asyncio.ensure_future(self.run())
        self.pusher = asyncio.ensure_future(self.push())

    def batches_queued(self) -> int:
        return sum(isinstance(x, int) for x in self.inbox._queue)  # type: ignore[attr-defined]

    def report(self, msg: Any) -> None:
        self.sim.chan.reports.put_nowait(msg)

    async def run(self) -> None:
        sim = self.sim
        await sim.sleep(1, 2, 3)  # start, restore
        if self.checkpoint is not None:
            f = sim.store.folders.get(self.checkpoint)
            if f is None or not f.complete or f.trainer is None:
                sim.violation(f"restored checkpoint {self.checkpoint} is gone (pruned)")
                return
            self.state = list(f.trainer)
        sim.chan.hello(self)
        if self.sync:
            self.report(Synced(step=len(self.state), version=len(self.state)))
        while True:
            item = await self.inbox.get()
            sim.chan.changed.set()  # a credit back
            if isinstance(item, int):
                await sim.sleep(0, 1, 1, 2)
                if item != len(self.state):
                    sim.violation(
                        f"step {item} trained on the state of steps 0..{len(self.state) - 1}"
                    )
                self.state.append(item)
                self.unreported.add(item)
                self.pushes.put_nowait(item)
            elif isinstance(item, Save):
                await sim.sleep(0, 1, 2)
                if item.step != len(self.state):
                    sim.violation(f"Save({item.step}) after {len(self.state)} trained steps")
                f = sim.store.folders.get(Path(item.checkpoint).parent)
                if f is not None:  # (gone: a bug the store's commit or restore reports)
                    f.trainer = tuple(self.state)
                sim.saved_first += any(s < item.step for s in self.unreported)
                self.report(Saved(step=item.step))

    async def push(self) -> None:
        """Each trained step's weights to the engines, in order; then its ``StepDone``."""
        while True:
            step = await self.pushes.get()
            await self.sim.sleep(0, 0, 0.5, 1, 2)
            self.unreported.discard(step)
            self.report(StepDone(step=step, version=step + 1))

    def kill(self) -> None:
        self.task.cancel()
        self.pusher.cancel()


class SimController:
    """:class:`BatchSource`: a batch is formed after a random generation time."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.step = 0

    async def next_batch(self) -> Batch:
        await self.sim.sleep(0, 0, 1, 2)
        self.step += 1  # counted as it is formed (as Controller.next_batch does)
        return Batch(step=self.step - 1, groups=[[]])

    def snapshot(self) -> ControllerState:
        return ControllerState(
            step=self.step, version=self.step, admitted=0, released=0, counters={},
            next_gid=0, next_eid=0, drawn=0, queued=[], ready=[], running=[],
        )  # fmt: skip

    async def interrupt(self, timeout_s: float) -> bool:
        return True


@dataclass
class Sim:
    """One simulated run (see the module doc). ``make_ledger``, ``channel_type``,
    ``pipeline_type``: the ledger, channel and pipeline under test."""

    seed: int
    run_dir: Path
    make_ledger: Callable[[Sim], CheckpointLedger] = lambda sim: CheckpointLedger(sim.plan.total)
    channel_type: type[SimChannel] = SimChannel
    pipeline_type: type[Pipeline] = Pipeline
    violations: list[str] = field(default_factory=list)
    outcome: str = ""
    stopped_at: int | None = None

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.plan = Plan.draw(self.rng)
        self.deaths: list[str] = []
        self.trainer: SimTrainer | None = None
        self.incarnations = 0
        self.commits_in_recovery = 0  # the ordering of cde797b: a commit while recovering
        self.saved_first = 0  # Saved(k) reported before StepDone(k - 1)

    def violation(self, what: str) -> None:
        self.violations.append(what)

    async def turns(self) -> None:
        """0-2 extra scheduling turns: other coroutines may run in between."""
        for _ in range(self.rng.choice([0, 0, 1, 2])):
            await asyncio.sleep(0)

    async def sleep(self, *choices: float) -> None:
        await asyncio.sleep(self.rng.choice(choices))
        await self.turns()

    # -- fake launcher ---------------------------------------------------------------------
    async def restart(self, checkpoint: Path | None) -> None:
        """:class:`TrainerHost`: the old incarnation ends, a new one restores ``checkpoint``."""
        await self.turns()
        if self.trainer is not None:
            self.trainer.kill()
        self.trainer = SimTrainer(self, checkpoint, sync=True)

    async def killer(self) -> None:
        for t in self.plan.kills:
            await asyncio.sleep(max(0.0, t - asyncio.get_running_loop().time()))
            if self.trainer is not None and not self.trainer.task.done():
                self.trainer.kill()
                self.deaths.append("trainer0")
        await asyncio.get_running_loop().create_future()

    async def stopper(self, stop_event: asyncio.Event) -> None:
        """A stop request (SIGTERM) at ``plan.stop_at``."""
        if self.plan.stop_at is not None:
            await asyncio.sleep(self.plan.stop_at)
            stop_event.set()
        await asyncio.get_running_loop().create_future()

    async def watchdog(self, sup: TrainerSupervisor) -> None:
        while True:
            for d in self.deaths:
                sup.failure(f"{d} died")
            self.deaths.clear()
            await asyncio.sleep(0.5)

    # -- the run -----------------------------------------------------------------------------
    async def main(self) -> None:
        p = self.plan
        cfg = load_config(None, [
            f"--controller.total_steps={p.total}", f"--checkpoint.every_steps={p.every}",
            f"--checkpoint.keep={p.keep}", f"--trainer.max_restarts={p.max_restarts}",
            "--trainer.restart_window_s=0",
        ])  # fmt: skip
        self.store = MemStore(self, p.keep)
        self.chan = self.channel_type(self, p.credit)
        self.steplog = StepLog(self.run_dir, dict)
        self.ctl = SimController(self)
        self.ledger = self.make_ledger(self)
        loop = asyncio.get_running_loop()
        self.sup = TrainerSupervisor(
            cfg, self.ledger, self.chan, self.store, self, self.steplog, asyncio.Lock(),
            "final", clock=loop.time,
        )  # fmt: skip
        self.pipeline = self.pipeline_type(
            cfg, self.ctl, self.chan, self.store, self.sup, self.steplog, self.on_step
        )
        self.trainer = SimTrainer(self, None, sync=False)
        stop = asyncio.Event()
        await first(
            self.pipeline.report(), self.pipeline.dispatch(stop), self.watchdog(self.sup),
            self.killer(), self.stopper(stop),
        )  # fmt: skip

    async def on_step(self, msg: StepDone, batch: Batch) -> None:
        await self.sleep(0, 0, 0.5, 1)  # the new version to every engine (HTTP)
        self.steplog.add({"step": msg.step, "trainer": self.trainer and self.trainer.incarnation})

    def run(self) -> Sim:
        loop = VirtualLoop()
        try:
            loop.run_until_complete(asyncio.wait_for(self.main(), HANG_S))
            self.outcome = "ok"
        except RunStopped as exc:
            self.outcome, self.stopped_at = "stopped", exc.step
        except (RuntimeError, TimeoutError) as exc:
            self.outcome = f"failed: {type(exc).__name__}: {exc}"
        finally:
            if self.trainer is not None:
                self.trainer.kill()
            loop.run_until_complete(asyncio.sleep(0))
            loop.close()
        self.end_time = loop.time()
        return self


def check(sim: Sim) -> list[str]:
    """Every invariant the run broke (empty: none), after :meth:`Sim.run`."""
    bad = list(sim.violations)
    p = sim.plan
    if sim.outcome == "stopped":  # the checkpoint it names holds every step before it
        at = sim.stopped_at
        f = sim.store.folders.get(sim.store.folder(at or 0))
        if at and (f is None or not f.complete or f.trainer != tuple(range(at))):
            bad.append(f"stopped 'with checkpoint {at} written' but it is {f}")
        return bad
    if sim.outcome != "ok":
        used_up = "used up" in sim.outcome and len(p.kills) > p.max_restarts
        if not used_up:  # rc != 0 only when the restart budget really ran out
            bad.append(f"the run failed with {len(p.kills)} kill(s): {sim.outcome}")
        return bad
    steps = [r["step"] for r in sim.steplog.rows]
    if steps != list(range(p.total)):
        bad.append(f"rc 0 with metrics rows of steps {steps} (expected 0..{p.total - 1})")
    final = sim.store.folders.get(sim.store.folder(p.total))
    if final is None or not final.complete or final.trainer != tuple(range(p.total)):
        bad.append(f"rc 0 without the final checkpoint of every step: {final}")
    if not sim.ledger.finished:
        bad.append("rc 0 with the ledger not finished")
    return bad


def explore(
    seeds: range,
    make_ledger: Callable[[Sim], CheckpointLedger] | None = None,
    channel: type[SimChannel] = SimChannel,
    pipeline: type[Pipeline] = Pipeline,
    until: Callable[[list[str]], bool] | None = None,
) -> dict[int, list[str]]:
    """Run every seed (with ``until``: up to the first seed whose broken invariants it
    accepts); the broken invariants of each seed that broke any."""
    with tempfile.TemporaryDirectory() as tmp:
        found = {}
        for seed in seeds:
            sim = Sim(seed, Path(tmp), channel_type=channel, pipeline_type=pipeline)
            if make_ledger is not None:
                sim.make_ledger = make_ledger
            sim.run()
            if bad := check(sim):
                found[seed] = bad
                if until is not None and until(bad):
                    break
        return found
