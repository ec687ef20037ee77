"""The three ledger rules that broke in loaded CI, and the stop rule that lost a stop's
checkpoint, re-created for the property tests to find (test code only: the product keeps
the fixed rules)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from asyncrl.run_ledger import CheckpointLedger, PendingSave
from asyncrl.run_loops import Pipeline


class EndsOnFormedCount(CheckpointLedger):
    """Before 58c6393: the reporter ended once the controller had formed ``total_steps``
    batches (``ctl.step``) and nothing registered was outstanding; the controller counts a
    batch one scheduling turn before dispatch registers it."""

    def __init__(self, total_steps: int, formed: Callable[[], int]) -> None:
        super().__init__(total_steps)
        self.formed = formed

    @property
    def finished(self) -> bool:
        return self.formed() >= self.total_steps and not self.outstanding and not self.pending

    @property
    def awaiting_saves_only(self) -> bool:
        return self.formed() >= self.total_steps and not self.outstanding


class PrunesDuringRecovery(CheckpointLedger):
    """Before cde797b: a commit dropped the kept batches before it and allowed a prune even
    while a recovery was choosing (or restoring) an older checkpoint."""

    def commit(self, step: int) -> bool:
        self.committed = max(self.committed, step)
        for s in [s for s in self.kept if s < self.committed]:
            del self.kept[s]
        return True


class CommitsBeforeItsStepsReported(CheckpointLedger):
    """Before the ledger held checkpoints: ``Saved(k)`` committed at once, even with
    ``StepDone(k - 1)`` (sent once that step's push is done) still to come; the trainer
    died in between, the recovery restored ``k`` and no one reported step ``k - 1``."""

    def take_save(self, step: int) -> PendingSave | None:
        return self.pending.pop(step, None)

    def ready_saves(self) -> list[PendingSave]:
        return []


class StopSaveIgnoresFailures(Pipeline):
    """Before ``Pipeline._stop_save``: a stop waited for its checkpoint whatever happened to
    the trainer meanwhile; a trainer death under it ended the run with a bare TimeoutError
    after ``checkpoint.timeout_s``."""

    async def _stop_save(self, step: int) -> None:
        timeout = self.cfg.checkpoint.timeout_s
        await asyncio.wait_for(asyncio.shield(self.save_futures[step]), timeout)
