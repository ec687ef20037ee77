"""The trainer supervisor of ``asyncrl run``: a failed trainer is restarted from the newest
complete checkpoint and sent again every batch that checkpoint does not hold.

Contract of :meth:`TrainerSupervisor.recover` (one recovery, started by
:meth:`TrainerSupervisor.failure` within the restart budget):

1. the ledger is told a recovery began (commits meanwhile prune nothing);
2. the newest complete checkpoint ``n`` is chosen (none: ``0``, the model);
3. every rank is forgotten by the channel and restarted to restore ``n`` and push its
   weights to the engines; the supervisor waits for its ``Synced`` and every rank's Hello;
4. the step log forgets the rows of steps ``>= n``; every kept batch from ``n`` on is sent
   again in order, with a checkpoint still pending re-asked behind its batch;
5. the ledger is told the recovery ended.

A failure during 3 or 4 leaves the recovery unfinished (``failed`` set again): the caller
runs :meth:`recover` again, or the budget ends the run. Nothing here reads the wall clock
but ``clock`` (``time.monotonic`` in a run, a virtual one in tests).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from asyncrl.config import RunConfig
from asyncrl.controllers import checkpoints as ckpts
from asyncrl.controllers.restarts import RestartBudget
from asyncrl.core import Trajectory
from asyncrl.run_ledger import CheckpointLedger
from asyncrl.run_steplog import StepLog
from asyncrl.transports.experience.control import Save, Synced
from asyncrl.transports.experience.wire import Message

__all__ = [
    "CheckpointStore",
    "DiskCheckpoints",
    "TrainerChannel",
    "TrainerHost",
    "TrainerSupervisor",
    "is_set",
    "unless",
]

log = logging.getLogger("asyncrl.run")


class TrainerChannel(Protocol):
    """The controller's end of the experience channel (``ExperienceSender``), as the
    dispatcher, the reporter and the supervisor use it."""

    async def send_groups(
        self, groups: Sequence[Sequence[Trajectory]], step: int = -1
    ) -> list[int]:
        """Send one step's groups to the ranks (waits for credit)."""
        ...

    async def broadcast(self, msg: Message) -> int:
        """Send a control message to every connected rank, in order after its batches."""
        ...

    async def recv_report(self) -> Message:
        """The next report of any rank (StepDone, Saved, Synced, ...), in arrival order."""
        ...

    def forget(self, rank: int) -> list[int]:
        """Rank ``rank`` is being restarted: drop what it had not acknowledged."""
        ...

    async def wait_peers(self, timeout_s: float) -> None:
        """Every rank has said Hello (TimeoutError naming the missing ranks)."""
        ...


class CheckpointStore(Protocol):
    """The run's checkpoints where they are kept (:class:`DiskCheckpoints`: the run folder)."""

    def folder(self, step: int) -> Path:
        """Where checkpoint ``step`` goes (nothing is written yet)."""
        ...

    async def prepare(self, folder: Path, controller_state: bytes) -> None:
        """Make ``folder`` a clean checkpoint folder holding the controller's state (an
        unfinished one of a run that died is cleared first); the trainer writes into
        ``folder / "trainer"``."""
        ...

    async def clear_trainer(self, folder: Path) -> None:
        """Empty ``folder / "trainer"`` (a dead trainer's attempt) for a new one."""
        ...

    async def commit(self, folder: Path, step: int) -> None:
        """Write the manifest: checkpoint ``step`` is complete."""
        ...

    async def prune(self) -> None:
        """Delete all but the newest ``checkpoint.keep`` complete checkpoints."""
        ...

    async def latest(self) -> tuple[int, Path] | None:
        """The newest complete checkpoint (step, folder), or None."""
        ...


class DiskCheckpoints:
    """:class:`CheckpointStore` in ``RUN_DIR/checkpoints`` (``controllers.checkpoints``;
    blocking file work in a thread)."""

    def __init__(self, run_dir: Path, keep: int) -> None:
        self.run_dir, self.keep = run_dir, keep

    def folder(self, step: int) -> Path:
        return ckpts.checkpoint_dir(self.run_dir, step)

    async def prepare(self, folder: Path, controller_state: bytes) -> None:
        if folder.exists():  # an unfinished checkpoint of a run that died: start clean
            await asyncio.to_thread(shutil.rmtree, folder)
        (folder / "trainer").mkdir(parents=True)
        path = folder / ckpts.CONTROLLER_FILE
        await asyncio.to_thread(ckpts.write_atomic, path, controller_state)

    async def clear_trainer(self, folder: Path) -> None:
        await asyncio.to_thread(shutil.rmtree, folder / "trainer", True)
        (folder / "trainer").mkdir(parents=True)

    async def commit(self, folder: Path, step: int) -> None:
        await asyncio.to_thread(ckpts.write_manifest, folder, step)

    async def prune(self) -> None:
        await asyncio.to_thread(ckpts.prune, self.run_dir, self.keep)

    async def latest(self) -> tuple[int, Path] | None:
        return await asyncio.to_thread(ckpts.latest_checkpoint, self.run_dir)


class TrainerHost(Protocol):
    """Where the trainer ranks run (the launcher, seen by the supervisor)."""

    async def restart(self, checkpoint: Path | None) -> None:
        """Restart every rank to restore ``checkpoint`` (None: the model), push its weights
        to the engines and report ``Synced``."""
        ...


class TrainerSupervisor:
    """Trainer failures and recoveries of one run (see the module doc)."""

    def __init__(
        self,
        cfg: RunConfig,
        ledger: CheckpointLedger,
        chan: TrainerChannel,
        store: CheckpointStore,
        host: TrainerHost,
        steplog: StepLog,
        send_lock: asyncio.Lock,
        final_export: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg, self.ledger, self.chan, self.store = cfg, ledger, chan, store
        self.host, self.steplog, self.send_lock = host, steplog, send_lock
        self.final_export, self.clock = final_export, clock
        tc = cfg.trainer
        self.budget = RestartBudget(tc.max_restarts, tc.restart_window_s)
        self.failed = asyncio.Event()
        """Set by a failure; cleared when its recovery starts."""
        self.restarts = 0
        self.failed_at = 0.0
        self.startup_s = cfg.rollout.startup_timeout_s or 120.0  # set from the model: run_job
        self.synced: asyncio.Future[Synced] | None = None  # a restarted trainer's Synced
        self.recoveries: list[dict[str, float]] = []

    @property
    def sync_timeout_s(self) -> float:
        """How long a (re)started trainer may take to restore and sync the engines."""
        return self.startup_s + self.cfg.weights.timeout_s

    def failure(self, why: str) -> None:
        """A trainer rank died or failed: ask for a recovery while the budget allows it,
        else fail the run (RuntimeError with ``why``)."""
        if self.failed.is_set():
            return  # this failure's recovery is already asked for
        if not self.budget.take(self.clock()):
            tc = self.cfg.trainer
            raise RuntimeError(
                f"{why} (trainer.max_restarts={tc.max_restarts} per "
                f"trainer.restart_window_s={tc.restart_window_s:g} used up: "
                f"{self.budget.describe()})"
            )
        log.warning("%s: restarting the trainer from the last checkpoint", why)
        self.failed_at = self.clock()
        self.failed.set()

    def reported_synced(self, msg: Synced) -> None:
        """The reporter got ``Synced``: a restarted trainer restored and synced."""
        if self.synced is not None and not self.synced.done():
            self.synced.set_result(msg)

    async def recover(self) -> None:
        """One recovery (see the module doc); returns early if the trainer fails again."""
        self.failed.clear()
        self.restarts += 1
        self.ledger.begin_recovery()  # until every batch from n on is sent again (below)
        t0 = self.clock()
        found = await self.store.latest()
        n, folder = found if found is not None else (0, None)
        for r in range(self.cfg.trainer.world_size):
            self.chan.forget(r)
        self.synced = asyncio.get_running_loop().create_future()
        await self.host.restart(folder)
        timeout = self.sync_timeout_s
        if await unless(asyncio.wait_for(self.synced, timeout), self.failed) is None:
            return  # it failed again: the caller recovers again (or gives up)
        await self.chan.wait_peers(timeout)
        redo = self.ledger.restore(n)
        await self.steplog.rewind(n)
        for step in redo:
            if not await self.send(step):
                return
        self.ledger.end_recovery()
        rec = {
            "restart": self.restarts,
            "from_step": n,
            "steps_redone": len(redo),
            "detect_to_sent_s": self.clock() - self.failed_at,
            "restart_s": self.clock() - t0,
        }
        self.recoveries.append(rec)
        self.steplog.recovery(rec)
        log.warning("trainer restarted from step %d; %d step(s) sent again", n, len(redo))

    async def send(self, step: int) -> bool:
        """Send the kept batch of ``step`` again, and the checkpoint behind it if it is still
        pending; False: the trainer failed meanwhile."""
        batch = self.ledger.batch(step)
        async with self.send_lock:
            sent = await unless(self.chan.send_groups(batch.groups, step=step), self.failed)
        if not sent:
            return False
        if (save := self.ledger.ask_again(step + 1)) is not None:
            await self.store.clear_trainer(save.folder)  # its old attempt died
            final = step + 1 == self.cfg.controller.total_steps
            await self.broadcast_save(step + 1, save.folder, self.final_export if final else "")
        return True

    async def broadcast_save(self, step: int, folder: Path, export: str) -> None:
        """Ask every rank for checkpoint ``step`` in ``folder`` (and an HF export)."""
        msg = Save(step=step, checkpoint=str(folder / "trainer"), export=export)
        async with self.send_lock:  # every rank sees Save and Engines in one order
            await self.chan.broadcast(msg)


def is_set(event: asyncio.Event | None) -> bool:
    return event is not None and event.is_set()


async def unless(coro: Awaitable[Any], *events: asyncio.Event | None) -> Any:
    """``await coro``, unless one of ``events`` is set first (then the coroutine is cancelled
    and None returned; a result it produced meanwhile is still returned). A coroutine that
    returns None itself reads as True, so callers can tell "done" from "interrupted"."""
    watched = [e for e in events if e is not None]
    if any(e.is_set() for e in watched):
        if asyncio.iscoroutine(coro):
            coro.close()
        return None
    task = asyncio.ensure_future(coro)
    stoppers = [asyncio.ensure_future(e.wait()) for e in watched]
    try:
        await asyncio.wait({task, *stoppers}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in stoppers:
            t.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, *stoppers, return_exceptions=True)
    if task.cancelled():
        return None
    result = task.result()
    return True if result is None else result
