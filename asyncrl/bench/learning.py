"""Does asynchrony cost learning? Sync vs async (decoupled objective) vs async (naive PPO).

Runs the whole ``asyncrl run`` job (``asyncrl.runner.run_job``: engines, trainer,
controller, weight sync) on the default task with the same sample budget
(``--steps`` x ``controller.batch_size`` groups) and the same seeds for three arms:

- ``sync``: ``controller.max_staleness = 0`` (the plain on-policy objective);
- ``async_decoupled``: ``max_staleness = --staleness``, the decoupled objective;
- ``async_naive``: ``max_staleness = --staleness``, PPO clipped against the behaviour policy.

Final reward = mean ``reward_mean`` of the last 10 steps, averaged over the seeds;
wall time = the run's time to its last step (``wall_s``, start-up included) and
``steps_wall_s`` = from the first step's report to the last (steady state),
averaged over the seeds.
Target: decoupled >= 0.95 x sync, and decoupled faster than sync.

``asyncrl bench learning --json out.json``.
Arms run one after another (never in parallel), so wall times compare.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncrl.config import load_config
from asyncrl.runner import run_job

ARMS: dict[str, list[str]] = {
    "sync": ["--controller.max_staleness=0", "--algo.decoupled=true"],
    "async_decoupled": ["--controller.max_staleness={s}", "--algo.decoupled=true"],
    "async_naive": ["--controller.max_staleness={s}", "--algo.decoupled=false"],
}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def run_arm(arm: str, seed: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """One full job; returns its summary (first/last-10 reward, wall time, staleness)."""
    overrides = [o.format(s=args.staleness) for o in ARMS[arm]]
    overrides += [
        f"--seed={seed}",
        f"--task.seed={seed}",
        f"--controller.total_steps={args.steps}",
        *args.override,
    ]
    if args.batch_size:
        overrides.append(f"--controller.batch_size={args.batch_size}")
    if args.group_size:
        overrides.append(f"--algo.group_size={args.group_size}")
    cfg = load_config(None, overrides)
    run_dir = root / f"{arm}-seed{seed}"
    t0 = time.perf_counter()
    rows = asyncio.run(run_job(cfg, run_dir, quiet=True))
    total = time.perf_counter() - t0
    k = min(10, len(rows))
    rewards = [r["reward_mean"] for r in rows]
    return {
        "arm": arm,
        "seed": seed,
        "first_reward": _mean(rewards[:k]),
        "final_reward": _mean(rewards[-k:]),
        "wall_s": rows[-1]["wall_s"],
        "steps_wall_s": rows[-1]["wall_s"] - rows[0]["wall_s"],
        "total_s": total,
        "staleness_max": max(r["staleness_max"] for r in rows),
        "imp_weight_max": max(r.get("imp_weight_max", 1.0) for r in rows),
        "run_dir": str(run_dir),
    }


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for arm in ARMS:
        mine = [r for r in results if r["arm"] == arm]
        if not mine:
            continue
        for key in ("final_reward", "first_reward", "wall_s", "steps_wall_s"):
            out[f"{arm}_{key}"] = _mean([r[key] for r in mine])
    if "sync_final_reward" in out and "async_decoupled_final_reward" in out:
        sync, dec = out["sync_final_reward"], out["async_decoupled_final_reward"]
        out["decoupled_vs_sync_reward"] = dec / sync if sync > 0 else float("nan")
        out["decoupled_speedup"] = out["sync_wall_s"] / out["async_decoupled_wall_s"]
        out["decoupled_steps_speedup"] = (
            out["sync_steps_wall_s"] / out["async_decoupled_steps_wall_s"]
        )
        out["target_met"] = bool(dec >= 0.95 * sync and out["decoupled_speedup"] > 1.0)
    return out


def print_table(results: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    head = f"{'arm':<16} {'seed':>4} {'first10':>8} {'last10':>8} {'wall_s':>7} {'steps_s':>7}"
    print(head + f" {'stale':>5}")
    for r in results:
        print(
            f"{r['arm']:<16} {r['seed']:>4} {r['first_reward']:>8.3f} {r['final_reward']:>8.3f}"
            f" {r['wall_s']:>7.1f} {r['steps_wall_s']:>7.1f} {r['staleness_max']:>5}"
        )
    print("-" * 60)
    for arm in ARMS:
        if f"{arm}_final_reward" in summary:
            print(
                f"{arm:<16} {'mean':>4} {summary[f'{arm}_first_reward']:>8.3f}"
                f" {summary[f'{arm}_final_reward']:>8.3f} {summary[f'{arm}_wall_s']:>7.1f}"
                f" {summary[f'{arm}_steps_wall_s']:>7.1f}"
            )
    if "decoupled_vs_sync_reward" in summary:
        print(
            f"decoupled / sync reward: {summary['decoupled_vs_sync_reward']:.3f} (target >= 0.95)"
            f" | speedup vs sync: {summary['decoupled_speedup']:.2f}x (target > 1),"
            f" steps only {summary['decoupled_steps_speedup']:.2f}x"
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        prog="asyncrl bench learning",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--seeds", default="0,1", help="comma-separated seeds (>= 2 for the claim)")
    p.add_argument("--steps", type=int, default=30, help="train steps per run")
    p.add_argument("--batch-size", type=int, default=0, help="groups per step (0: run default)")
    p.add_argument("--group-size", type=int, default=0, help="samples per group (0: default)")
    p.add_argument("--staleness", type=int, default=4, help="max_staleness of the async arms")
    p.add_argument("--arms", default=",".join(ARMS), help="subset of: " + ", ".join(ARMS))
    p.add_argument("--override", action="append", default=[], help="extra --section.key=value")
    p.add_argument("--run-root", default=None, help="keep the runs here (default: a temp dir)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        p.error(f"unknown arms {unknown} (allowed: {', '.join(ARMS)})")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="asyncrl-learning-") as tmp:
        root = Path(args.run_root or tmp)
        results = []
        for seed in seeds:
            for arm in arms:
                r = run_arm(arm, seed, args, root)
                print(f"  {arm} seed {seed}: last10 {r['final_reward']:.3f} in {r['wall_s']:.1f}s")
                results.append(r)
    summary = summarize(results)
    print_table(results, summary)
    out = {
        **summary,
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "runs": results,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
