"""The dispatcher and the reporter of ``asyncrl run``: batches and checkpoint requests to the
trainer, its reports back.

The dispatcher takes each step's batch from the controller, registers it in the ledger and
sends it; every ``checkpoint.every_steps`` steps (on a stop request, and at the end) it
snapshots the controller right after a step's batch is sent (a consistent cut: every step
before N is with the trainer) and sends ``Save(N)`` behind it. The reporter reads the
trainer's reports: ``StepDone`` -> the step's row, ``Saved`` -> the checkpoint's manifest
(commit) and prune, ``Synced`` -> the supervisor, a lost or stopped rank -> a trainer
failure. A failure interrupts the dispatcher, which runs the supervisor's recovery.

The run ends when the reporter finds the ledger finished: sealed by the dispatcher once
the last batch and the final checkpoint are registered, and everything registered
reported and committed. Both loops are coroutines of one :class:`Pipeline`, run side by
side (with the run's watchdog) by :func:`first`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec

from asyncrl import trace
from asyncrl.config import RunConfig
from asyncrl.controllers.state import ControllerState
from asyncrl.core import Batch
from asyncrl.run_ledger import CheckpointLedger, PendingSave
from asyncrl.run_steplog import StepLog
from asyncrl.run_supervisor import (
    CheckpointStore,
    TrainerChannel,
    TrainerSupervisor,
    is_set,
    unless,
)
from asyncrl.transports.experience.control import (
    ConsumerLost,
    EnginesSynced,
    Saved,
    Shutdown,
    StepDone,
    Synced,
)
from asyncrl.transports.experience.wire import Message

__all__ = ["BatchSource", "Pipeline", "RunStopped", "first"]

log = logging.getLogger("asyncrl.run")


class RunStopped(Exception):
    """The run stopped on request (a signal) after checkpointing step ``step`` (None: it
    stopped while starting, before any checkpoint of its own)."""

    def __init__(self, step: int | None):
        super().__init__(
            "stopped on request before the first step (nothing to checkpoint)"
            if step is None
            else f"stopped on request; checkpoint of step {step} written"
        )
        self.step = step


class BatchSource(Protocol):
    """What the dispatcher needs of the controller (:class:`Controller`)."""

    step: int
    """Batches formed so far (the next batch trains step ``step``)."""

    async def next_batch(self) -> Batch:
        """The next step's batch (``step`` counts it as soon as it is formed)."""
        ...

    def snapshot(self) -> ControllerState:
        """The controller's state now, in one instant."""
        ...

    async def interrupt(self, timeout_s: float) -> bool:
        """Bring the requests in flight into their journals (True: all answered in time)."""
        ...


class Pipeline:
    """The dispatcher and the reporter of one run (see the module doc). ``on_step`` gets
    each trained step's first report with its batch; ``on_engines`` each EnginesSynced."""

    def __init__(
        self,
        cfg: RunConfig,
        ctl: BatchSource,
        chan: TrainerChannel,
        store: CheckpointStore,
        sup: TrainerSupervisor,
        steplog: StepLog,
        on_step: Callable[[StepDone, Batch], Awaitable[None]],
        on_engines: Callable[[EnginesSynced], object] = lambda msg: None,
    ) -> None:
        self.cfg, self.ctl, self.chan, self.store = cfg, ctl, chan, store
        self.sup, self.steplog = sup, steplog
        self.ledger: CheckpointLedger = sup.ledger
        self.on_step, self.on_engines = on_step, on_engines
        self.save_futures: dict[int, asyncio.Future[dict[str, float]]] = {}
        self.saved_msgs: dict[int, Saved] = {}  # Saved reports not yet committed, by step

    # -- dispatcher ----------------------------------------------------------------------------
    async def dispatch(self, stop_event: asyncio.Event | None = None) -> None:
        """Send every step's batch and checkpoint; ends by raising :class:`RunStopped` (a stop
        request) or by being cancelled once the reporter is done."""
        # a stop aborts the requests in flight at once, not when this loop next looks
        stopper = asyncio.ensure_future(self._interrupt_on(stop_event))
        try:
            await self._dispatch(stop_event, stopper)
        finally:
            stopper.cancel()
            await asyncio.gather(stopper, return_exceptions=True)

    async def _interrupt_on(self, stop_event: asyncio.Event | None) -> bool:
        """When ``stop_event`` is set: :meth:`Controller.interrupt` (True: every request in
        flight answered the abort in time). Never returns without a stop event."""
        if stop_event is None:
            await asyncio.get_running_loop().create_future()
        assert stop_event is not None
        await stop_event.wait()
        return await self.ctl.interrupt(self.cfg.rollout.request_timeout_s)

    async def _dispatch(
        self, stop_event: asyncio.Event | None, stopper: asyncio.Future[bool]
    ) -> None:
        total, every = self.cfg.controller.total_steps, self.cfg.checkpoint.every_steps
        ctl, failed = self.ctl, self.sup.failed
        while ctl.step < total:
            batch = await unless(ctl.next_batch(), stop_event, failed)
            if batch is None and failed.is_set() and not is_set(stop_event):
                await self.sup.recover()
                continue
            if batch is None:  # stop requested: checkpoint what was handed out, then stop
                if failed.is_set():
                    raise RunStopped(self.ledger.committed)
                # tokens of requests in flight into their episodes' journals: kept on resume
                if not await stopper:
                    log.warning("stop: requests in flight did not answer the abort in time; "
                                "their tokens will be generated again on resume")  # fmt: skip
                await self.checkpoint(wait=True)
                raise RunStopped(ctl.step)
            await self._send(batch)
            if every and ctl.step % every == 0 and ctl.step < total:
                await self.checkpoint()
        while failed.is_set():
            await self.sup.recover()
        await self.checkpoint(final=True)  # seals the ledger before its first await
        # all sent: the run ends when the reporter has every step (a stop waits for the end)
        while await unless(asyncio.get_running_loop().create_future(), stop_event, failed) is None:
            if is_set(stop_event):
                break
            await self.sup.recover()
        await self._stop_save(total)  # a stop after the final checkpoint was asked for
        raise RunStopped(total)

    async def _send(self, batch: Batch) -> None:
        """Register and send one step's batch (a group never splits); a trainer failure
        meanwhile: the recovery sends it again."""
        self.ledger.add_batch(batch)
        with trace.get().span("send batch", "controller", {"step": batch.step}):
            async with self.sup.send_lock:  # no Engines message inside one step's
                sent = await unless(
                    self.chan.send_groups(batch.groups, step=batch.step), self.sup.failed
                )
        if not sent:
            await self.sup.recover()

    async def checkpoint(self, wait: bool = False, final: bool = False) -> None:
        """Checkpoint the run at ``ctl.step`` (every earlier step handed to the trainer).
        ``final``: the last one (the ledger is sealed before any await); ``wait``: until
        it is committed."""
        step = self.ctl.step
        if not self.ledger.needs_save(step):
            if final:
                self.ledger.seal()
            if wait and step in self.save_futures:  # a stop right after a periodic one
                await self._stop_save(step)
            return
        data = msgspec.msgpack.encode(self.ctl.snapshot())  # one instant: no await before this
        folder = self.store.folder(step)
        self.save_futures[step] = asyncio.get_running_loop().create_future()
        self.ledger.add_save(step, folder)
        if final:
            self.ledger.seal()
        await self.store.prepare(folder, data)
        export = ""
        if final:
            export = self.sup.final_export
        elif self.cfg.checkpoint.export_hf:
            export = str(folder / "hf")
        await self.sup.broadcast_save(step, folder, export)
        if wait:
            await self._stop_save(step)

    async def _stop_save(self, step: int) -> None:
        """Wait for a stop's checkpoint ``step`` to be committed. A trainer failure meanwhile
        ends the stop at the newest committed checkpoint instead (RunStopped: a resume redoes
        the steps after it; no restart just to save); TimeoutError naming the trainer after
        ``checkpoint.timeout_s``."""
        timeout = self.cfg.checkpoint.timeout_s
        saved = asyncio.wait_for(asyncio.shield(self.save_futures[step]), timeout)
        try:
            done = await unless(saved, self.sup.failed)
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"the trainer did not report the stop's checkpoint of step {step} within "
                f"checkpoint.timeout_s={timeout:g}s"
            ) from None
        if done is None:
            log.warning("stop: the trainer failed during the checkpoint of step %d; stopping "
                        "at the last committed one", step)  # fmt: skip
            raise RunStopped(self.ledger.committed)

    # -- reporter ------------------------------------------------------------------------------
    async def report(self) -> None:
        """Read reports until the ledger is finished (RuntimeError: a fatal report, a
        checkpoint not reported in ``checkpoint.timeout_s``, a failed save)."""
        while not self.ledger.finished:
            timeout = None
            if self.ledger.awaiting_saves_only and not self.sup.failed.is_set():
                timeout = self.cfg.checkpoint.timeout_s  # only checkpoints are awaited
            try:
                msg = await asyncio.wait_for(self.chan.recv_report(), timeout)
            except asyncio.TimeoutError:
                raise RuntimeError(
                    f"trainer did not report checkpoint(s) {sorted(self.ledger.pending)} "
                    f"within checkpoint.timeout_s={timeout}s"
                ) from None
            await self.handle(msg)

    async def handle(self, msg: Message) -> None:
        """One report of the trainer (or the channel's ConsumerLost)."""
        if isinstance(msg, Shutdown) and msg.fatal:  # no restart can repair it
            raise RuntimeError(f"trainer stopped the run: {msg.reason}")
        if isinstance(msg, Shutdown):
            self.sup.failure(f"trainer stopped the run: {msg.reason}")
        elif isinstance(msg, ConsumerLost):
            self.sup.failure(
                f"trainer rank {msg.rank} went silent with {len(msg.seqs)} batch(es) "
                f"unacknowledged (episodes {msg.episode_ids[:20]})"
            )
        elif isinstance(msg, Synced):
            self.sup.reported_synced(msg)
        elif isinstance(msg, Saved):
            await self.saved(msg)
        elif isinstance(msg, EnginesSynced):
            self.on_engines(msg)
        elif isinstance(msg, StepDone):
            batch = self.ledger.reported(msg.step)
            if batch is not None:  # (None: a step reported again after a recovery)
                trace.get().instant("step done", "controller", {"step": msg.step})
                await self.on_step(msg, batch)
            for save in self.ledger.ready_saves():  # held for this report
                await self.commit(save)

    async def saved(self, msg: Saved) -> None:
        """The trainer's part of checkpoint ``msg.step`` is written: commit and prune, once
        every step before it is reported (held until then: ``CheckpointLedger.take_save``)."""
        if msg.error and (save := self.ledger.pending.get(msg.step)) is not None:
            why = f"checkpoint {save.folder}: {msg.error}"
            self.save_futures[msg.step].set_exception(RuntimeError(f"trainer failed {why}"))
            raise RuntimeError(f"trainer failed to write {why}")
        self.saved_msgs[msg.step] = msg
        if (save := self.ledger.take_save(msg.step)) is not None:
            await self.commit(save)

    async def commit(self, save: PendingSave) -> None:
        """Commit checkpoint ``save.step`` (its ``Saved`` arrived, every step before it is
        reported), prune the old ones, log it."""
        msg = self.saved_msgs.pop(save.step)
        t0 = time.perf_counter()
        await self.store.commit(save.folder, msg.step)
        if self.ledger.commit(msg.step):  # not during a recovery: it may restore an older one
            await self.store.prune()
        stats = {"step": msg.step, "stall_s": msg.stall_s, "save_s": msg.save_s}
        stats["manifest_s"] = time.perf_counter() - t0
        self.steplog.checkpoint(stats, save.folder)
        self.save_futures[msg.step].set_result(stats)


async def first(*coros: Awaitable[Any]) -> None:
    """Run until the first coroutine (or future) finishes; re-raise its error; cancel the rest."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            t.result()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
