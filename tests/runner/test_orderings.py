"""The runner's dispatcher, reporter, ledger and trainer supervisor under hundreds of
orderings of reports, saves, commits, trainer kills, recoveries and stop requests (seeded,
on a virtual clock: ``tests/runner/sim.py``), and proof that the checker finds the three
races that loaded CI runs once hit (58c6393, cde797b, a checkpoint committed before its last
step's report) and a stop that waited on a dead
trainer's checkpoint, when their old rules come back."""

from __future__ import annotations

import logging
from collections.abc import Callable
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


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> list[Sim]:
    """Every seed's run of the product's runner, once for the tests below."""
    logging.getLogger("asyncrl").setLevel(logging.ERROR)  # recoveries' warnings, hundreds
    try:
        return [Sim(seed, tmp_path_factory.mktemp("sims")).run() for seed in SEEDS]
    finally:
        logging.getLogger("asyncrl").setLevel(logging.NOTSET)


def test_every_ordering_trains_each_step_once_and_ends_after_the_final_save(
    sims: list[Sim],
) -> None:
    found = {sim.seed: bad for sim in sims if (bad := check(sim))}
    assert not found, f"{len(found)} of {len(SEEDS)} orderings broke the contract: {found}"


def test_the_orderings_cover_kills_recoveries_stops_and_commits_during_a_recovery(
    sims: list[Sim],
) -> None:
    """The draw reaches what the invariants are about (else a pass would say little)."""
    seen = {"recovered": 0, "committed_in_recovery": 0, "stopped": 0, "budget_used_up": 0}
    seen["saved_before_its_last_step_reported"] = 0
    for sim in sims:
        seen["recovered"] += bool(sim.sup.recoveries)
        seen["committed_in_recovery"] += bool(sim.commits_in_recovery)
        seen["stopped"] += sim.outcome == "stopped"
        seen["budget_used_up"] += "used up" in sim.outcome
        seen["saved_before_its_last_step_reported"] += bool(sim.saved_first)
    assert all(n >= 5 for n in seen.values()), seen


def _shows(what: str) -> Callable[[list[str]], bool]:
    """Whether a seed's broken invariants include ``what``."""
    return lambda bad: any(what in b for b in bad)


def test_the_checker_finds_a_run_ending_one_step_short() -> None:
    """58c6393: the reporter ended on the controller's count of formed batches."""
    shows = _shows("rc 0 with metrics rows")
    found = explore(
        SEEDS, lambda sim: EndsOnFormedCount(sim.plan.total, lambda: sim.ctl.step), until=shows
    )
    assert any(shows(bad) for bad in found.values()), f"the old end rule went unnoticed: {found}"


def test_the_checker_finds_a_recovery_losing_steps_committed_meanwhile() -> None:
    """cde797b: a commit during a recovery dropped the batches it had to send again."""
    shows = _shows("trained on the state")
    found = explore(SEEDS, lambda sim: PrunesDuringRecovery(sim.plan.total), until=shows)
    assert any(shows(bad) for bad in found.values()), f"the old commit rule went unnoticed: {found}"


def test_the_checker_finds_a_checkpoint_committed_before_its_last_steps_report() -> None:
    """A loaded CI run (session 10): Saved(8) before StepDone(7), the trainer SIGKILLed in
    between, the recovery restored checkpoint 8 and step 7 never got its metrics row."""
    shows = _shows("rc 0 with metrics rows")
    found = explore(SEEDS, lambda sim: CommitsBeforeItsStepsReported(sim.plan.total), until=shows)
    assert any(shows(bad) for bad in found.values()), f"went unnoticed: {found}"


def test_the_checker_finds_a_stop_waiting_on_a_dead_trainers_checkpoint() -> None:
    shows = _shows("TimeoutError")
    found = explore(SEEDS, pipeline=StopSaveIgnoresFailures, until=shows)
    assert any(shows(bad) for bad in found.values()), f"a hanging stop went unnoticed: {found}"


def test_a_seed_replays_the_same_run(tmp_path: Path) -> None:
    a, b = (Sim(7, tmp_path).run() for _ in range(2))
    assert (a.outcome, a.end_time, a.steplog.rows) == (b.outcome, b.end_time, b.steplog.rows)
    assert check(a) == check(b)
