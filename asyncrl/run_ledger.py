"""The run's checkpoint ledger: which batches and checkpoints are still outstanding, and what a
trainer recovery must send again. Pure bookkeeping: no asyncio, no processes, no disk.

A run hands step ``s``'s batch to the trainer (:meth:`add_batch`), asks for checkpoint ``k``
behind the batch of step ``k - 1`` (:meth:`add_save`), and hears back ``StepDone(s)``
(:meth:`reported`) and ``Saved(k)`` (:meth:`take_save`, then :meth:`commit` once its
manifest is on disk). The trainer reports ``StepDone(s)`` only once step ``s``'s weights
are live, in the background, so ``Saved(k)`` may come before ``StepDone(k - 1)``; such a
checkpoint is *held* (:meth:`take_save` returns None) until every step before it is
reported (:meth:`ready_saves`). A batch is

- *outstanding* from :meth:`add_batch` until its first report, and
- *kept* until a committed checkpoint at a later step holds its training: a recovery
  restores the newest complete checkpoint ``n`` and sends every kept batch from ``n`` on
  again (:meth:`restore`).

Contract (what the property tests in ``tests/runner/`` check under every ordering):

- The run is :attr:`finished` only once :meth:`seal` said every step's batch and the final
  checkpoint are registered, and none of them is outstanding. Not a count of batches the
  controller formed: the controller counts a batch one scheduling turn before dispatch
  registers it (a run once ended one step short in that turn, rc 0).
- Between :meth:`begin_recovery` and :meth:`end_recovery` a commit (the dead trainer's last
  ``Saved``, still queued) drops no kept batch and allows no prune: the recovery may have
  chosen an older checkpoint and must still send every batch from it on (a recovery once
  lost the steps between its checkpoint and one committed meanwhile).
- A checkpoint commits only once every step before it is reported: a trainer that dies
  between ``Saved(k)`` and ``StepDone(k - 1)`` must not leave a committed checkpoint
  whose steps no one reported (a recovery from it would never log them; a loaded CI run
  once lost a step's metrics row that way). A recovery drops the holds: it asks for those
  checkpoints again.
- After :meth:`restore` nothing before the restored checkpoint is outstanding: a second
  recovery may restore a newer checkpoint than the first (one committed during the first)
  while steps before it, sent again by the first, were never reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from asyncrl.core import Batch

__all__ = ["CheckpointLedger", "PendingSave"]


@dataclass(frozen=True)
class PendingSave:
    """Checkpoint ``step`` asked for in ``folder``, its ``Saved`` not yet received."""

    step: int
    folder: Path


class CheckpointLedger:
    """Batches and checkpoints of one run, from dispatch to commit (see the module doc)."""

    def __init__(self, total_steps: int, resumed_step: int = -1) -> None:
        self.total_steps = total_steps
        self.resumed_step = resumed_step
        """The checkpoint a resumed run started from (-1: none); never asked for again."""
        self.outstanding: dict[int, Batch] = {}
        """Batches sent and not yet reported (StepDone), by step."""
        self.kept: dict[int, Batch] = {}
        """Batches sent since the newest committed checkpoint: a recovery sends them again."""
        self.pending: dict[int, PendingSave] = {}
        """Checkpoints asked for whose ``Saved`` has not arrived."""
        self.held: set[int] = set()
        """Pending checkpoints whose ``Saved`` came before a report of a step before them."""
        self.asked: set[int] = set()
        """Every checkpoint step asked for in this run (committed or not)."""
        self.committed = max(resumed_step, 0)
        """Step of the newest complete checkpoint."""
        self.sealed = False
        self.recovering = False

    # -- dispatch ----------------------------------------------------------------------------
    def add_batch(self, batch: Batch) -> None:
        """Step ``batch.step``'s batch is handed to the trainer."""
        self.outstanding[batch.step] = self.kept[batch.step] = batch

    def needs_save(self, step: int) -> bool:
        """Whether checkpoint ``step`` is still to be asked for (not asked in this run, not
        the checkpoint it resumed from)."""
        return step not in self.asked and step != self.resumed_step

    def add_save(self, step: int, folder: Path) -> None:
        """Checkpoint ``step`` is asked for, in ``folder`` (every step before it sent)."""
        assert self.needs_save(step), f"checkpoint {step} asked for twice"
        self.asked.add(step)
        self.pending[step] = PendingSave(step, folder)

    def seal(self) -> None:
        """Every step's batch and the final checkpoint are registered: nothing more comes."""
        self.sealed = True

    # -- reports -----------------------------------------------------------------------------
    def reported(self, step: int) -> Batch | None:
        """``StepDone(step)``: its batch, the first time (None: not outstanding, e.g. a step
        of a dead trainer reported again after its recovery sent it once more)."""
        return self.outstanding.pop(step, None)

    def take_save(self, step: int) -> PendingSave | None:
        """``Saved(step)`` arrived: the pending checkpoint to commit now (None: already taken,
        or held until every step before it is reported: :meth:`ready_saves`)."""
        if step not in self.pending:
            return None
        if any(s < step for s in self.outstanding):
            self.held.add(step)
            return None
        self.held.discard(step)
        return self.pending.pop(step)

    def ready_saves(self) -> list[PendingSave]:
        """Held checkpoints with every step before them now reported, in step order (taken:
        commit each)."""
        first = min(self.outstanding, default=self.total_steps)
        ready = sorted(s for s in self.held if s <= first)
        self.held.difference_update(ready)
        return [self.pending.pop(s) for s in ready]

    def commit(self, step: int) -> bool:
        """Checkpoint ``step`` is complete on disk. Returns whether older checkpoints may be
        pruned now (not during a recovery: it may restore one of them)."""
        self.committed = max(self.committed, step)
        if self.recovering:
            return False
        for s in [s for s in self.kept if s < self.committed]:
            del self.kept[s]  # never sent again: the checkpoint holds their training
        return True

    @property
    def finished(self) -> bool:
        """Every step reported and every checkpoint committed: the run may end."""
        return self.sealed and not self.outstanding and not self.pending

    @property
    def awaiting_saves_only(self) -> bool:
        """Sealed with every step reported: only checkpoints are still awaited."""
        return self.sealed and not self.outstanding

    # -- recovery ----------------------------------------------------------------------------
    def begin_recovery(self) -> None:
        """A trainer recovery is choosing its checkpoint: commits keep every batch; held
        checkpoints are dropped (still pending: the recovery asks for them again)."""
        self.recovering = True
        self.held.clear()

    def restore(self, step: int) -> list[int]:
        """The restarted trainer restored checkpoint ``step`` (0: the model): the steps to
        send again, in order; each is outstanding again. A step before ``step`` still
        outstanding (sent again by an earlier recovery from an older checkpoint, its trainer
        lost before reporting it) is not: the checkpoint holds its training."""
        self.committed = step
        for s in [s for s in self.outstanding if s < step]:
            del self.outstanding[s]
        redo = sorted(s for s in self.kept if s >= step)
        for s in redo:
            self.outstanding[s] = self.kept[s]
        return redo

    def ask_again(self, step: int) -> PendingSave | None:
        """The recovery sent step ``step - 1`` again: checkpoint ``step`` if still pending (its
        old attempt died; no longer held: it is asked for again), else None."""
        self.held.discard(step)
        return self.pending.get(step)

    def batch(self, step: int) -> Batch:
        """The kept batch of ``step`` (to send again)."""
        return self.kept[step]

    def end_recovery(self) -> None:
        """Every batch from the restored checkpoint on is sent again."""
        self.recovering = False
