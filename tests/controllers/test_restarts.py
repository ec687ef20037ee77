"""Restart budgets as rates (asyncrl/controllers/restarts.py), under a virtual clock."""

from __future__ import annotations

import random

import pytest

from asyncrl.controllers.restarts import RestartBudget


def test_a_rate_budget_survives_faults_that_come_no_faster_than_it_allows() -> None:
    budget = RestartBudget(2, 600.0)
    # one fault every 301 s for a simulated week: never more than 2 in any 600 s
    assert all(budget.take(301.0 * k) for k in range(2000))
    assert budget.total == 2000


def test_a_burst_beyond_the_rate_is_refused_and_not_recorded() -> None:
    budget = RestartBudget(2, 600.0)
    assert budget.take(0.0) and budget.take(10.0)
    assert not budget.take(20.0)  # a third within 600 s
    assert budget.in_window(20.0) == 2 and budget.total == 2
    assert not budget.take(599.9)
    assert budget.take(600.0)  # the restart at 0 s has left the window (0, 600]
    assert not budget.take(609.9) and budget.take(610.0)


def test_window_zero_is_a_lifetime_count() -> None:
    budget = RestartBudget(3, 0.0)
    assert all(budget.take(1e6 * k) for k in range(3))
    assert not budget.take(1e9)
    assert budget.describe() == "3 restart(s) per run"
    assert RestartBudget(0, 60).take(0.0) is False


def test_the_rule_matches_a_brute_force_count_over_random_fault_times() -> None:
    rng = random.Random(7)
    for _ in range(200):
        limit, window = rng.randint(0, 4), rng.choice([0.0, 5.0, 30.0])
        budget, granted = RestartBudget(limit, window), []
        now = 0.0
        for _ in range(50):
            now += rng.expovariate(0.2)
            inside = [t for t in granted if window == 0 or t > now - window]
            expect = len(inside) < limit
            assert budget.take(now) is expect
            if expect:
                granted.append(now)


def test_bad_budgets_are_refused() -> None:
    with pytest.raises(ValueError, match="limit, window_s >= 0"):
        RestartBudget(-1, 10)
