"""The checkpoint ledger on its own (pure: no loop, no processes): the two orderings that
broke in loaded CI, written out step by step."""

from __future__ import annotations

from pathlib import Path

from asyncrl.core import Batch
from asyncrl.run_ledger import CheckpointLedger


def _sent(ledger: CheckpointLedger, *steps: int) -> None:
    for s in steps:
        ledger.add_batch(Batch(step=s, groups=[[]]))


def test_not_finished_until_sealed_whatever_was_reported() -> None:
    """58c6393: every registered step reported, the last batch formed but not yet
    registered: the run goes on until dispatch seals the ledger."""
    ledger = CheckpointLedger(total_steps=3)
    _sent(ledger, 0, 1)
    assert ledger.reported(0) is not None and ledger.reported(1) is not None
    assert not ledger.finished and not ledger.awaiting_saves_only
    _sent(ledger, 2)
    ledger.add_save(3, Path("step-3"))
    ledger.seal()
    assert ledger.reported(2) is not None
    assert ledger.awaiting_saves_only and not ledger.finished
    assert ledger.take_save(3) is not None and ledger.commit(3)
    assert ledger.finished


def test_a_commit_during_a_recovery_keeps_what_the_recovery_sends_again() -> None:
    """cde797b: the dead trainer's queued Saved(4) is committed after the recovery chose
    checkpoint 2: steps 2 and 3 are still sent again, and nothing is pruned meanwhile."""
    ledger = CheckpointLedger(total_steps=6)
    _sent(ledger, 0, 1)
    ledger.add_save(2, Path("step-2"))
    _sent(ledger, 2, 3)
    ledger.add_save(4, Path("step-4"))
    _sent(ledger, 4)
    assert ledger.reported(0) is not None and ledger.reported(1) is not None
    assert ledger.take_save(2) is not None and ledger.commit(2)
    assert sorted(ledger.kept) == [2, 3, 4]
    ledger.begin_recovery()  # chooses checkpoint 2: StepDone(2, 3), Saved(4) not handled yet
    assert ledger.reported(2) is not None and ledger.reported(3) is not None
    assert ledger.take_save(4) is not None
    assert not ledger.commit(4)  # no prune: checkpoint 2 is being restored
    assert sorted(ledger.kept) == [2, 3, 4]
    assert ledger.restore(2) == [2, 3, 4]
    ledger.end_recovery()
    _sent(ledger, 5)
    ledger.add_save(6, Path("step-6"))
    assert all(ledger.reported(s) is not None for s in (2, 3, 4, 5))
    assert ledger.take_save(6) is not None and ledger.commit(6)
    assert not ledger.kept


def test_a_second_recovery_from_a_newer_checkpoint_leaves_nothing_outstanding_before_it() -> None:
    """Recovery 1 restores 0 and sends 0..3 again; checkpoint 3 commits meanwhile; the trainer
    dies having reported 0 and 1; recovery 2 restores 3: step 2 is no longer awaited."""
    ledger = CheckpointLedger(total_steps=4)
    _sent(ledger, 0, 1, 2)
    ledger.add_save(3, Path("step-3"))
    _sent(ledger, 3)
    assert all(ledger.reported(s) is not None for s in (0, 1, 2))
    ledger.begin_recovery()
    assert ledger.take_save(3) is not None and not ledger.commit(3)
    assert ledger.restore(0) == [0, 1, 2, 3]
    assert ledger.reported(0) is not None and ledger.reported(1) is not None
    ledger.begin_recovery()
    assert ledger.restore(3) == [3]
    assert sorted(ledger.outstanding) == [3]


def test_a_resumed_run_never_asks_for_its_own_checkpoint_again() -> None:
    ledger = CheckpointLedger(total_steps=8, resumed_step=4)
    assert ledger.committed == 4 and not ledger.needs_save(4) and ledger.needs_save(5)
    ledger.add_save(5, Path("step-5"))
    assert not ledger.needs_save(5)
    assert ledger.take_save(5) is not None and ledger.take_save(5) is None


def test_a_checkpoint_saved_before_its_last_step_is_reported_waits_for_that_report() -> None:
    """The trainer reports StepDone(s) once step s's weights are live, in the background:
    Saved(2) may come first. Checkpoint 2 commits only after StepDone(1) (a trainer dying in
    between left a committed checkpoint whose step 1 no one ever reported: no metrics row)."""
    ledger = CheckpointLedger(total_steps=4)
    _sent(ledger, 0, 1)
    ledger.add_save(2, Path("step-2"))
    _sent(ledger, 2)
    assert ledger.reported(0) is not None
    assert ledger.take_save(2) is None and ledger.ready_saves() == []  # held: step 1 unreported
    assert not ledger.finished and 2 in ledger.pending
    assert ledger.reported(2) is not None and ledger.ready_saves() == []  # still step 1
    assert ledger.reported(1) is not None
    assert [s.step for s in ledger.ready_saves()] == [2] and ledger.ready_saves() == []
    assert ledger.commit(2) and 2 not in ledger.pending


def test_a_recovery_drops_held_checkpoints_and_asks_for_them_again() -> None:
    """The trainer died between Saved(2) and StepDone(1): checkpoint 2 is not committed; the
    recovery restores 0, sends 0 and 1 again and asks for checkpoint 2 again."""
    ledger = CheckpointLedger(total_steps=2)
    _sent(ledger, 0, 1)
    ledger.add_save(2, Path("step-2"))
    ledger.seal()
    assert ledger.reported(0) is not None and ledger.take_save(2) is None
    ledger.begin_recovery()
    assert ledger.reported(1) is not None  # the dead trainer's last report, queued
    assert ledger.ready_saves() == []  # dropped: its folder is about to be written again
    assert ledger.restore(0) == [0, 1]
    assert ledger.ask_again(1) is None
    again = ledger.ask_again(2)
    assert again is not None and again.step == 2
    ledger.end_recovery()
    assert ledger.reported(0) is not None and ledger.take_save(2) is None  # held again
    assert ledger.reported(1) is not None and [s.step for s in ledger.ready_saves()] == [2]
    assert ledger.commit(2) and ledger.finished
