"""``asyncrl bench peer``'s arithmetic and its settings table (the whole bench, both sides
training: ``test_smoke.py``'s ``peer`` entry)."""

from __future__ import annotations

from typing import Any

from asyncrl.bench.peer import aggregate, reach, summarize
from asyncrl.bench.peer_settings import settings_table, trl_args
from asyncrl.config import load_config


def _rows(rewards: list[float], dt: float = 0.5, samples: float = 256.0) -> list[dict[str, Any]]:
    return [
        {"reward_mean": r, "wall_s": 1.0 + dt * i, "num_samples": samples, "train_s": dt / 2}
        for i, r in enumerate(rewards)
    ]


def test_reach_is_the_first_step_whose_ten_step_mean_is_at_the_level() -> None:
    rows = _rows([0.0] * 5 + [1.0] * 20)
    # the mean of steps i-9..i is (i - 4) / 10 from step 9 on: 0.5 first at step 9, 0.9 at 13
    assert reach(rows, 0.5) == {"wall_s": 1.0 + 0.5 * 9, "step": 9.0, "samples": 10 * 256.0}
    assert reach(rows, 0.9) == {"wall_s": 1.0 + 0.5 * 13, "step": 13.0, "samples": 14 * 256.0}
    assert reach(rows[:9], 0.0) is None  # fewer than ten steps: no ten-step mean
    assert reach(rows, 1.01) is None


def test_summary_and_ratios_over_seeds() -> None:
    ours = [
        {"side": "asyncrl", "seed": s, "threads": "1+1", **summarize(_rows([1.0] * 20), [0.5])}
        for s in (0, 1)
    ]
    theirs = [
        {
            "side": "trl",
            "seed": s,
            "threads": "2",
            "process_to_train_s": 4.0 + s,  # TRL's imports and model load, before its clock
            **summarize([dict(r, step_s=1.0, gen_s=0.4) for r in _rows([1.0] * 20, dt=1.0)], [0.5]),
        }
        for s in (0, 1)
    ]
    assert ours[0]["s_per_step"] == 0.5 and ours[0]["gen_s"] is None
    assert ours[0]["cpu_s_per_step"] is None  # no cpu_*_s columns
    cpu = [dict(r, cpu_a_s=0.1 * i, cpu_b_s=0.3 * i) for i, r in enumerate(_rows([1.0] * 20))]
    assert abs(summarize(cpu, [0.5])["cpu_s_per_step"] - 0.4) < 1e-9
    assert theirs[0]["s_per_step"] == 1.0 and theirs[0]["gen_s"] == 0.4
    got = aggregate(ours + theirs, [0.5])
    assert got["sides"]["asyncrl"]["time_to"]["0.5"] == 1.0 + 0.5 * 9
    assert got["sides"]["trl-t2"]["time_to"]["0.5"] == 1.0 + 1.0 * 9
    ratio = got["ratio_asyncrl_over"]["trl-t2"]
    assert ratio["time_to"]["0.5"] == (1.0 + 4.5) / 10.0
    assert ratio["s_per_step"] == 0.5 and ratio["train_s"] == 0.5
    assert ratio["samples_to"]["0.5"] == 1.0
    # from each side's process start: TRL's mean start-up (4.5 s) added to its clock only
    assert got["sides"]["trl-t2"]["time_from_start_to"]["0.5"] == 10.0 + 4.5
    assert ratio["time_from_start_to"]["0.5"] == (1.0 + 4.5) / (10.0 + 4.5)
    # a seed that never reaches a level: no mean time for that side
    late = dict(ours[1], reach={"0.5": None})
    assert aggregate([ours[0], late], [0.5])["sides"]["asyncrl"]["time_to"]["0.5"] is None


def _trl_view(**change: Any) -> dict[str, Any]:
    """What peer_trl reads back from TRL for the default job's arguments."""
    view = {
        "generation_batch_size": 256,
        "num_generations": 8,
        "steps_per_generation": 1,
        "num_iterations": 1,
        "max_completion_length": 3,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "learning_rate": 0.0015,
        "lr_scheduler_type": "constant",
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "beta": 0.0,
        "epsilon": 0.2,
        "loss_type": "dapo",
        "scale_rewards": "group",
        "gradient_checkpointing": False,
        "optim": "adamw_torch_fused",
        "optimizer": "AdamW",
        "optimizer_betas": [0.9, 0.99],
        "optimizer_eps": 1e-8,
        "ref_model": False,
        "dtype": "float32",
    }
    return view | change


def test_the_table_names_only_the_differences_that_remain() -> None:
    cfg = load_config(None, [])
    args = trl_args(cfg, "/m")
    assert "--prompts=32" in args and "--group-size=8" in args and "--max-new-tokens=3" in args
    assert "--lr=0.0015" in args and args[args.index("--betas") + 1 :][:2] == ["0.9", "0.99"]
    table, diffs = settings_table(cfg, _trl_view(), [2, 1])
    differs = [ln.split("  ")[0] for ln in table.splitlines() if ln.endswith("<- differs")]
    assert differs == [
        "max staleness (steps)",
        "off-policy correction",
        "generation",
        "torch threads",
    ]
    assert not any(d.startswith("learning rate") for d in diffs)
    assert any(d.startswith("asynchrony:") for d in diffs)
    # a value TRL ran with that is not asyncrl's is marked and named
    table, diffs = settings_table(cfg, _trl_view(learning_rate=1e-6, dtype="bfloat16"), [2])
    assert "learning rate: asyncrl 0.0015, TRL 1e-06" in diffs
    assert "dtype: asyncrl float32, TRL bfloat16" in diffs
