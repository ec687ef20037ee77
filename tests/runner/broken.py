"""The two ledger rules that broke in loaded CI, re-created for the property tests to find
(test code only: the product's ledger keeps the fixed rules)."""

from __future__ import annotations

from collections.abc import Callable

from asyncrl.run_ledger import CheckpointLedger


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
