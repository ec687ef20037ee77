"""``asyncrl bench learning``'s time-to-reward: levels reached on the smoothed curve."""

from __future__ import annotations

import argparse

import pytest

from asyncrl.bench.learning import (
    WORKLOAD_DEFAULTS,
    WORKLOAD_NAMES,
    _knob,
    apply_workload_defaults,
    reach,
    summarize,
    trainer_idle,
)
from asyncrl.bench.learning_losses import LOSSES, first_window
from asyncrl.bench.learning_losses import summarize as summarize_losses
from asyncrl.plot import smooth


def _rows(rewards: list[float], dt: float = 2.0, n: int = 32) -> list[dict]:
    return [
        {"reward_mean": r, "wall_s": dt * (i + 1), "num_samples": n} for i, r in enumerate(rewards)
    ]


def test_reach_uses_the_smoothed_curve() -> None:
    rewards = [0.1, 0.2, 0.9, 0.1, 0.6, 0.7, 0.8, 0.95, 0.97]
    rows = _rows(rewards)
    time_to, samples_to = reach(rows, [0.5, 0.9], 1.0, 0.8)
    curve = smooth(rewards, 0.8)
    first = next(i for i, v in enumerate(curve) if v >= 0.5)
    assert rewards[2] >= 0.5 and first > 2  # one lucky step does not count
    assert time_to == {"0.5": rows[first]["wall_s"], "0.9": None}
    assert samples_to == {"0.5": 32 * (first + 1), "0.9": None}
    assert reach(rows, [0.4], 2.0, 0.0)[0] == {"0.4": rows[2]["wall_s"]}  # raw: 0.9 >= 0.4 * 2


def test_summary_is_null_unless_every_seed_reached() -> None:
    def run(arm: str, seed: int, rewards: list[float]) -> dict:
        t, s = reach(_rows(rewards), [0.5], 1.0, 0.0)
        return {"arm": arm, "seed": seed, "time_to": t, "samples_to": s, "final_reward": 0.0,
                "first_reward": 0.0, "wall_s": 1.0, "steps_wall_s": 1.0,
                "trainer_idle": 0.75 if arm == "sync" else 0.1, "staleness_mean": 0.0,
                "filtered_share": 0.0}  # fmt: skip

    runs = [run("sync", 0, [0.1, 0.6]), run("sync", 1, [0.6, 0.7])]
    runs += [run("async_decoupled", 0, [0.1, 0.2]), run("async_decoupled", 1, [0.9])]
    out = summarize(runs)
    assert out["sync_time_to"] == {"0.5": 3.0} and out["sync_samples_to"] == {"0.5": 48.0}
    assert out["async_decoupled_time_to"] == {"0.5": None}
    assert out["async_decoupled_time_ratio"] == {"0.5": None}
    assert out["overlap_ceiling"] == pytest.approx(4.0)  # 1 / (1 - 0.75)
    runs[2] = run("async_decoupled", 0, [0.9])
    assert summarize(runs)["async_decoupled_time_ratio"] == {"0.5": pytest.approx(2.0 / 3.0)}


def test_trainer_idle_and_workload_knobs() -> None:
    rows = [
        {"wall_s": 10.0, "train_s": 1.0},  # the first step: start-up, not counted
        {"wall_s": 14.0, "train_s": 1.0, "push_call_s": 0.5},
        {"wall_s": 18.0, "train_s": 2.0, "push_call_s": 0.5},
    ]
    assert trainer_idle(rows) == pytest.approx(1.0 - 4.0 / 8.0)
    assert _knob("max_len=64") == ("max_len", 64)
    assert _knob("latency_max_s=0.5") == ("latency_max_s", 0.5)
    with pytest.raises(ValueError, match="KEY=VALUE"):
        _knob("max_len")


def test_each_workload_brings_the_settings_its_results_used() -> None:
    def parsed(workload: str, **given: object) -> argparse.Namespace:
        base = {"steps": None, "staleness": None, "batch_size": None, "arms": None}
        args = argparse.Namespace(workload=workload, override=["--x.y=1"], **(base | given))
        apply_workload_defaults(args)
        return args

    longtail = parsed("longtail")
    assert (longtail.steps, longtail.staleness, longtail.batch_size) == (160, 3, 16)
    assert longtail.arms == "sync,async_decoupled"
    assert longtail.override == ["--x.y=1"]  # the run's own lr
    agentic = parsed("agentic")
    assert agentic.override == ["--trainer.lr=0.004", "--x.y=1"]  # the user's come after
    default = parsed("default")  # the default job: the bench's short run, the run's own lr
    assert (default.steps, default.staleness, default.batch_size) == (30, 4, 0)
    assert default.arms == "sync,async_decoupled,async_naive" and default.override == ["--x.y=1"]
    assert parsed("longtail", steps=7, arms="sync").steps == 7  # the command line wins
    assert set(WORKLOAD_DEFAULTS) == set(WORKLOAD_NAMES)


def test_losses_table_reaches_on_the_ten_step_mean() -> None:
    rewards = [0.0] * 5 + [0.95] * 9 + [0.0] + [0.95] * 10
    assert first_window(rewards, 0.9) == 24  # a 10-step mean, not one step's reward
    assert first_window([0.95] * 9, 0.9) is None  # fewer than 10 steps never count
    assert first_window([0.91] * 10, 0.9) == 9

    def run(loss: str, seed: int, steps_to: int | None, final: float) -> dict:
        time_to = None if steps_to is None else 2.0 * steps_to
        return {"loss": loss, "seed": seed, "steps_to": steps_to, "time_to": time_to,
                "final_reward": final, "wall_s": 10.0}  # fmt: skip

    out = summarize_losses([run("a", 0, 20, 0.9), run("a", 1, 40, 1.0), run("b", 0, None, 0.8)])
    assert out["a"] == {"reached": True, "steps_to": 30.0, "time_to": 60.0,
                        "final_reward": pytest.approx(0.95), "min_final_reward": 0.9,
                        "wall_s": 10.0}  # fmt: skip
    assert out["b"]["reached"] is False and out["b"]["steps_to"] is None
    assert all(k.startswith("--algo.") for keys in LOSSES.values() for k in keys)
