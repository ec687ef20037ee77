"""The runner's dispatcher, reporter, ledger and trainer supervisor under hundreds of
orderings of reports, saves, commits, trainer kills, recoveries and stop requests (seeded,
on a virtual clock: ``tests/runner/sim.py``), and proof that the checker finds the three
races that loaded CI runs once hit (58c6393, cde797b, a checkpoint committed before its last
step's report) and a stop that waited on a dead
trainer's checkpoint, when their old rules come back."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.runner.broken import (
    CommitsBeforeItsStepsReported,
    EndsOnFormedCount,
    PrunesDuringRecovery,
    StopSaveIgnoresFailures,
)
from tests.runner.sim import Sim, check, explore

SEEDS = range(400)


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, "asyncrl")  # a recovery's warnings, hundreds of times


def test_every_ordering_trains_each_step_once_and_ends_after_the_final_save() -> None:
    found = explore(SEEDS)
    assert not found, f"{len(found)} of {len(SEEDS)} orderings broke the contract: {found}"


def test_the_orderings_cover_kills_recoveries_stops_and_commits_during_a_recovery(
    tmp_path: Path,
) -> None:
    """The draw reaches what the invariants are about (else a pass would say little)."""
    seen = {"recovered": 0, "committed_in_recovery": 0, "stopped": 0, "budget_used_up": 0}
    seen["saved_before_its_last_step_reported"] = 0
    for seed in SEEDS:
        sim = Sim(seed, tmp_path).run()
        seen["recovered"] += bool(sim.sup.recoveries)
        seen["committed_in_recovery"] += bool(sim.commits_in_recovery)
        seen["stopped"] += sim.outcome == "stopped"
        seen["budget_used_up"] += "used up" in sim.outcome
        seen["saved_before_its_last_step_reported"] += bool(sim.saved_first)
    assert all(n >= 5 for n in seen.values()), seen


def test_the_checker_finds_a_run_ending_one_step_short() -> None:
    """58c6393: the reporter ended on the controller's count of formed batches."""
    found = explore(SEEDS, lambda sim: EndsOnFormedCount(sim.plan.total, lambda: sim.ctl.step))
    assert found, "the old end rule went unnoticed"
    assert any("rc 0 with metrics rows" in b for bad in found.values() for b in bad)


def test_the_checker_finds_a_recovery_losing_steps_committed_meanwhile() -> None:
    """cde797b: a commit during a recovery dropped the batches it had to send again."""
    found = explore(SEEDS, lambda sim: PrunesDuringRecovery(sim.plan.total))
    assert found, "the old commit rule went unnoticed"
    assert any("trained on the state" in b for bad in found.values() for b in bad)


def test_the_checker_finds_a_checkpoint_committed_before_its_last_steps_report() -> None:
    """A loaded CI run (session 10): Saved(8) before StepDone(7), the trainer SIGKILLed in
    between, the recovery restored checkpoint 8 and step 7 never got its metrics row."""
    found = explore(SEEDS, lambda sim: CommitsBeforeItsStepsReported(sim.plan.total))
    assert found, "a checkpoint committed before its last step's report went unnoticed"
    assert any("rc 0 with metrics rows" in b for bad in found.values() for b in bad)


def test_the_checker_finds_a_stop_waiting_on_a_dead_trainers_checkpoint() -> None:
    found = explore(SEEDS, pipeline=StopSaveIgnoresFailures)
    assert found, "a stop hanging on a dead trainer's checkpoint went unnoticed"
    assert any("TimeoutError" in b for bad in found.values() for b in bad)


def test_a_seed_replays_the_same_run(tmp_path: Path) -> None:
    a, b = (Sim(7, tmp_path).run() for _ in range(2))
    assert (a.outcome, a.end_time, a.steplog.rows) == (b.outcome, b.end_time, b.steplog.rows)
    assert check(a) == check(b)
