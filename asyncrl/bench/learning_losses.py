"""``asyncrl bench learning --losses``: does each policy loss and advantage estimator learn the
default job? One ``asyncrl run`` per option and seed (the job's own defaults: its step budget,
staleness, batch, lr; only the option's keys changed), one table: steps and seconds until the
10-step mean reward first reaches ``--target`` (0.9), the last 10 steps' mean, the run's wall
time. The options are the config values of docs/algorithms.md ("Policy losses and advantage
estimators"); ``--losses a,b`` picks some, ``--losses all`` every one.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from asyncrl.config import load_config
from asyncrl.runner import run_job

# option name -> the run-config keys that select it (docs/algorithms.md's names)
LOSSES: dict[str, list[str]] = {
    "grpo": [],  # the default: ppo loss, grpo advantages, group std
    "gspo": ["--algo.policy_loss=gspo"],
    "gspo_length_unbiased": ["--algo.policy_loss=gspo", "--algo.loss_agg=seq-mean-token-sum"],
    "cispo": ["--algo.policy_loss=cispo"],
    "sapo": ["--algo.policy_loss=sapo", "--algo.loss_agg=seq-mean"],
    "clip_higher": ["--algo.clip_eps_high=0.28"],
    "dual_clip": ["--algo.clip_ratio_c=3"],
    "rloo": ["--algo.name=rloo"],
    "reinforce_plus_plus": ["--algo.name=reinforce_plus_plus"],
    "rpp_baseline": ["--algo.name=reinforce_plus_plus_baseline"],
    "grpo_scale_batch": ["--algo.scale_rewards=batch"],
    "grpo_scale_none": ["--algo.scale_rewards=none"],
    "mask_truncated": ["--algo.mask_truncated=true"],
    "top_entropy": ["--algo.top_entropy_quantile=0.2"],
}
WINDOW = 10  # steps of the mean reward the target is judged on


def first_window(rewards: list[float], target: float, window: int = WINDOW) -> int | None:
    """Index of the last step of the first ``window`` steps whose mean reward is >= ``target``
    (None: never; fewer than ``window`` steps never count)."""
    for end in range(window, len(rewards) + 1):
        if sum(rewards[end - window : end]) / window >= target:
            return end - 1
    return None


def run_loss(name: str, seed: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """One ``asyncrl run`` of the default job with ``name``'s keys; its row of the table."""
    overrides = [*LOSSES[name], f"--seed={seed}", f"--task.seed={seed}", *args.override]
    if args.steps:
        overrides.append(f"--controller.total_steps={args.steps}")
    cfg = load_config(None, overrides)
    pin = {"engine": {args.engine_core}, "trainer": {args.trainer_core}} if args.pin else None
    rows = asyncio.run(run_job(cfg, root / f"{name}-seed{seed}", quiet=True, pin=pin))
    rewards = [r["reward_mean"] for r in rows]
    hit = first_window(rewards, args.target)
    k = min(WINDOW, len(rewards))
    return {
        "loss": name,
        "seed": seed,
        "keys": LOSSES[name],
        "steps": len(rows),
        "steps_to": None if hit is None else hit + 1,
        "time_to": None if hit is None else rows[hit]["wall_s"],
        "best_window": max(
            (sum(rewards[i : i + k]) / k for i in range(len(rewards) - k + 1)), default=0.0
        ),
        "final_reward": sum(rewards[-k:]) / k if k else float("nan"),
        "wall_s": rows[-1]["wall_s"],
    }


def summarize(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per option, over its seeds: mean steps/time to the target (None unless every seed got
    there), mean final 10-step reward, and whether every seed reached the target."""
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r["loss"] for r in results):
        mine = [r for r in results if r["loss"] == name]
        reached = all(r["steps_to"] is not None for r in mine)
        out[name] = {
            "reached": reached,
            "steps_to": _mean(mine, "steps_to") if reached else None,
            "time_to": _mean(mine, "time_to") if reached else None,
            "final_reward": _mean(mine, "final_reward"),
            "min_final_reward": min(r["final_reward"] for r in mine),
            "wall_s": _mean(mine, "wall_s"),
        }
    return out


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def print_table(results: list[dict[str, Any]], summary: dict[str, Any], target: float) -> None:
    fmt = lambda v, f: "never" if v is None else format(v, f)  # noqa: E731
    print(f"{'loss':<22} {'seed':>4} {'steps to':>8} {'s to':>6} {'last10':>6} {'wall_s':>6}"
          f"   (target: a {WINDOW}-step mean reward >= {target:g})")  # fmt: skip
    for r in results:
        t = fmt(r["time_to"], "6.1f")
        print(f"{r['loss']:<22} {r['seed']:>4} {fmt(r['steps_to'], '8d')} {t}"
              f" {r['final_reward']:>6.3f} {r['wall_s']:>6.1f}")  # fmt: skip
    print("-" * 60)
    for name, s in summary.items():
        print(f"{name:<22} {'mean':>4} {fmt(s['steps_to'], '8.1f')} {fmt(s['time_to'], '6.1f')}"
              f" {s['final_reward']:>6.3f} {s['wall_s']:>6.1f}"
              f"  {'reached' if s['reached'] else 'NOT reached'}")  # fmt: skip


def run_losses(args: argparse.Namespace, seeds: list[int], root: Path) -> dict[str, Any]:
    """Every option of ``args.losses`` for every seed, one after another; prints the table."""
    names = list(LOSSES) if args.losses == "all" else [n for n in args.losses.split(",") if n]
    results = []
    for seed in seeds:
        for name in names:
            r = run_loss(name, seed, args, root)
            print(f"  {name} seed {seed}: last10 {r['final_reward']:.3f}, "
                  f"steps to {args.target:g}: {r['steps_to']}", flush=True)  # fmt: skip
            results.append(r)
    summary = summarize(results)
    print_table(results, summary, args.target)
    return {"losses": summary, "target": args.target, "runs": results}
