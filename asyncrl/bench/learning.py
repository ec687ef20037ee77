"""Does asynchrony cost learning, and how much time to reward does it save? Sync vs async.

Runs the whole ``asyncrl run`` job (``asyncrl.runner.run_job``: engines, trainer,
controller, weight sync) on a workload (``--workload``) with the same sample budget
(``--steps`` x ``controller.batch_size`` groups) and the same seeds for each arm:

- ``sync``: ``controller.max_staleness = 0`` (the on-policy objective; its correction sees only
  the engine/trainer mismatch);
- ``async_decoupled``: ``max_staleness = --staleness``, the decoupled objective (its
  off-policy correction ``algo.behav_correction``: the default, TIS);
- ``async_mis`` / ``async_icepop``: the same with ``behav_correction = mis`` / ``icepop``;
- ``async_naive``: ``max_staleness = --staleness``, PPO clipped against the behaviour policy;
- ``async_filtered``: ``async_decoupled`` with DAPO's dynamic sampling (``algo.filter_groups``:
  groups of equal rewards dropped, the batch refilled); its ``filtered`` share and its trainer
  idle against ``async_decoupled``'s are what it costs.

Workloads: ``default`` (the default job: the reverse task, short uniform generations);
``longtail`` and ``agentic`` (``task.name = "longtail" | "agentic"``, the episodes of
``asyncrl.tasks.workloads``: heavy-tailed generation lengths; multi-turn episodes waiting
on a tool with heavy-tailed latency), knobs via ``--workload-arg KEY=VALUE``
(``task.<workload>.KEY``). Each workload brings its own defaults of ``--steps``,
``--staleness``, ``--batch-size``, ``--arms`` and ``trainer.lr`` (``WORKLOAD_DEFAULTS``: the
settings docs/results/learning.md measured it with), so ``--workload W`` alone prints every
arm's time to 0.9; ``default`` keeps the bench's short run. The engine and the trainer are
pinned to their own cores (``--engine-core``, ``--trainer-core``; ``--no-pin`` to share), as
``bench pipeline`` does, so the comparison measures overlap, not two processes fighting over
one core.
Per run: ``trainer_idle`` = 1 - (train steps + weight-push calls) / time from the first
step's report to the last; ``staleness_mean``/``max`` of the trained samples. The
trainer-bound ceiling of any async speed-up is ``1 / (1 - sync trainer_idle)``.

Final reward = mean ``reward_mean`` of the last 10 steps, averaged over the seeds;
wall time = the run's time to its last step (``wall_s``, start-up included) and
``steps_wall_s`` = from the first step's report to the last (steady state),
averaged over the seeds.
Target: decoupled >= 0.95 x sync, and decoupled faster than sync.

Time to reward: a final reward hides how fast an arm got there, so per run and
per arm (mean over the seeds; null unless every seed got there) the bench also
reports ``time_to`` and ``samples_to``: for each level of ``--levels`` (fractions
of ``--max-reward``, the task's maximum), the wall time (``wall_s``) and the
samples trained until the smoothed reward curve (debiased EMA, ``--smooth``, as
``asyncrl plot`` draws it) first reaches it; null where it never does.

``asyncrl bench learning --json out.json``.
Arms run one after another (never in parallel), so wall times compare.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncrl.bench import RawHelpFormatter
from asyncrl.bench.common import write_json
from asyncrl.bench.learning_losses import LOSSES, run_losses
from asyncrl.config import load_config
from asyncrl.runner import run_job
from asyncrl.tasks.workloads import WORKLOADS

ARMS: dict[str, list[str]] = {
    "sync": ["--controller.max_staleness=0", "--algo.decoupled=true"],
    "async_decoupled": ["--controller.max_staleness={s}", "--algo.decoupled=true"],
    "async_mis": [
        "--controller.max_staleness={s}",
        "--algo.decoupled=true",
        "--algo.behav_correction=mis",
    ],
    "async_icepop": [
        "--controller.max_staleness={s}",
        "--algo.decoupled=true",
        "--algo.behav_correction=icepop",
    ],
    "async_naive": ["--controller.max_staleness={s}", "--algo.decoupled=false"],
    "async_filtered": [
        "--controller.max_staleness={s}",
        "--algo.decoupled=true",
        "--algo.filter_groups=true",
    ],
}
WORKLOAD_NAMES = ("default", *WORKLOADS)
DEFAULT_ARMS = "sync,async_decoupled,async_naive"
# Each workload's defaults of --steps/--staleness/--batch-size/--arms and its run overrides
# (before --override's, which win): the settings docs/results/learning.md measured it with,
# so `asyncrl bench learning --workload W` alone prints times to 0.9 for every arm.
WORKLOAD_DEFAULTS: dict[str, dict[str, Any]] = {
    "default": {"steps": 30, "staleness": 4, "batch_size": 0, "arms": DEFAULT_ARMS, "lr": None},
    "longtail": {  # lr 2e-3 (session 4's) collapsed the sync arm's entropy on 2026-11-29
        "steps": 160, "staleness": 3, "batch_size": 16, "arms": "sync,async_decoupled", "lr": None
    },
    "agentic": {
        "steps": 200, "staleness": 2, "batch_size": 16, "arms": "sync,async_decoupled", "lr": 4e-3
    },
}  # fmt: skip


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def run_arm(arm: str, seed: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """One full job; returns its summary (first/last-10 reward, wall time, staleness)."""
    overrides = workload_overrides(args.workload, args.workload_arg)
    overrides += [o.format(s=args.staleness) for o in ARMS[arm]]
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
    pin = {"engine": {args.engine_core}, "trainer": {args.trainer_core}} if args.pin else None
    job: dict[str, Any] = {"quiet": True, "pin": pin}
    t0 = time.perf_counter()
    rows = asyncio.run(run_job(cfg, run_dir, **job))
    total = time.perf_counter() - t0
    k = min(10, len(rows))
    rewards = [r["reward_mean"] for r in rows]
    time_to, samples_to = reach(rows, args.levels, args.max_reward, args.smooth)
    return {
        "arm": arm,
        "seed": seed,
        "first_reward": _mean(rewards[:k]),
        "final_reward": _mean(rewards[-k:]),
        "wall_s": rows[-1]["wall_s"],
        "steps_wall_s": rows[-1]["wall_s"] - rows[0]["wall_s"],
        "total_s": total,
        "staleness_max": max(r["staleness_max"] for r in rows),
        "staleness_mean": _mean([r.get("staleness_mean", 0.0) for r in rows]),
        "trainer_idle": trainer_idle(rows),
        "samples": sum(r["num_samples"] for r in rows),
        "filtered": sum(r.get("filtered_groups", 0) for r in rows),
        "filtered_share": filtered_share(rows),
        "imp_weight_max": max(r.get("imp_weight_max", 1.0) for r in rows),
        "time_to": time_to,
        "samples_to": samples_to,
        "run_dir": str(run_dir),
    }


def workload_overrides(workload: str, knobs: dict[str, Any]) -> list[str]:
    """The run-config overrides of ``--workload`` and its ``--workload-arg`` knobs: the task
    (``asyncrl run --task.name=longtail`` is the same run) and ``task.<workload>.<knob>``
    (``num_digits``: ``task.num_digits``)."""
    if workload == "default":
        return [f"--task.{k}={v}" for k, v in knobs.items()]
    out = [f"--task.name={workload}"]
    for key, value in knobs.items():
        dotted = "task.num_digits" if key == "num_digits" else f"task.{workload}.{key}"
        out.append(f"--{dotted}={value}")
    return out


def filtered_share(rows: list[dict[str, Any]]) -> float:
    """Mean over the steps of the share of finished groups dynamic sampling dropped
    (``filtered_share`` of each metrics row: dropped / (dropped + the batch's groups))."""
    return _mean([r.get("filtered_share", 0.0) for r in rows])


def trainer_idle(rows: list[dict[str, Any]]) -> float:
    """1 - (train steps + weight-push calls) / wall time, from the first step's report to the
    last (start-up and the first batch's generation excluded)."""
    if len(rows) < 2:
        return float("nan")
    span = rows[-1]["wall_s"] - rows[0]["wall_s"]
    busy = sum(r.get("train_s", 0.0) + r.get("push_call_s", 0.0) for r in rows[1:])
    return max(0.0, 1.0 - busy / span) if span > 0 else float("nan")


def reach(
    rows: list[dict[str, Any]], levels: list[float], max_reward: float, alpha: float
) -> tuple[dict[str, float | None], dict[str, int | None]]:
    """Wall time and samples until the smoothed reward first reaches ``level * max_reward``,
    per level (key: the level as text); None where it never does."""
    from asyncrl.plot import smooth

    curve = smooth([r["reward_mean"] for r in rows], alpha)
    time_to: dict[str, float | None] = {}
    samples_to: dict[str, int | None] = {}
    for level in levels:
        hit = next((i for i, v in enumerate(curve) if v >= level * max_reward), None)
        key = f"{level:g}"
        time_to[key] = None if hit is None else rows[hit]["wall_s"]
        samples_to[key] = None if hit is None else sum(r["num_samples"] for r in rows[: hit + 1])
    return time_to, samples_to


def _mean_or_none(xs: list[float | None]) -> float | None:
    return None if not xs or any(x is None for x in xs) else _mean([x for x in xs if x is not None])


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for arm in ARMS:
        mine = [r for r in results if r["arm"] == arm]
        if not mine:
            continue
        for key in (
            "final_reward",
            "first_reward",
            "wall_s",
            "steps_wall_s",
            "trainer_idle",
            "staleness_mean",
            "filtered_share",
        ):
            out[f"{arm}_{key}"] = _mean([r[key] for r in mine])
        for key in ("time_to", "samples_to"):
            out[f"{arm}_{key}"] = {
                lvl: _mean_or_none([r[key][lvl] for r in mine]) for lvl in mine[0][key]
            }
    if "sync_final_reward" in out and "async_decoupled_final_reward" in out:
        sync, dec = out["sync_final_reward"], out["async_decoupled_final_reward"]
        out["decoupled_vs_sync_reward"] = dec / sync if sync > 0 else float("nan")
        out["decoupled_speedup"] = out["sync_wall_s"] / out["async_decoupled_wall_s"]
        out["decoupled_steps_speedup"] = (
            out["sync_steps_wall_s"] / out["async_decoupled_steps_wall_s"]
        )
        out["target_met"] = bool(dec >= 0.95 * sync and out["decoupled_speedup"] > 1.0)
    if "sync_trainer_idle" in out:
        out["overlap_ceiling"] = 1.0 / max(1e-9, 1.0 - out["sync_trainer_idle"])
    for arm in ARMS:  # time and samples to each level relative to sync (None: not reached)
        if arm == "sync" or f"{arm}_time_to" not in out or "sync_time_to" not in out:
            continue
        out[f"{arm}_time_ratio"] = _ratios(out[f"{arm}_time_to"], out["sync_time_to"])
        out[f"{arm}_samples_ratio"] = _ratios(out[f"{arm}_samples_to"], out["sync_samples_to"])
    return out


def _ratios(mine: dict[str, Any], base: dict[str, Any]) -> dict[str, float | None]:
    return {k: None if v is None or not base.get(k) else v / base[k] for k, v in mine.items()}


def print_table(results: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    head = f"{'arm':<16} {'seed':>4} {'first10':>8} {'last10':>8} {'wall_s':>7} {'steps_s':>7}"
    print(head + f" {'stale':>5} {'stale_mean':>10} {'idle':>5} {'filtered':>8}")
    for r in results:
        print(
            f"{r['arm']:<16} {r['seed']:>4} {r['first_reward']:>8.3f} {r['final_reward']:>8.3f}"
            f" {r['wall_s']:>7.1f} {r['steps_wall_s']:>7.1f} {r['staleness_max']:>5}"
            f" {r['staleness_mean']:>10.2f} {r['trainer_idle']:>5.2f}"
            f" {r['filtered_share']:>8.2f}"
        )
    print("-" * 60)
    for arm in ARMS:
        if f"{arm}_final_reward" in summary:
            print(
                f"{arm:<16} {'mean':>4} {summary[f'{arm}_first_reward']:>8.3f}"
                f" {summary[f'{arm}_final_reward']:>8.3f} {summary[f'{arm}_wall_s']:>7.1f}"
                f" {summary[f'{arm}_steps_wall_s']:>7.1f}"
            )
    print_reach(summary)
    if "overlap_ceiling" in summary:
        print(
            f"sync trainer idle {summary['sync_trainer_idle']:.2f}: no async arm can beat sync"
            f" by more than {summary['overlap_ceiling']:.2f}x (1 / (1 - idle))"
        )
    if "decoupled_vs_sync_reward" in summary:
        print(
            f"decoupled / sync reward: {summary['decoupled_vs_sync_reward']:.3f} (target >= 0.95)"
            f" | speedup vs sync: {summary['decoupled_speedup']:.2f}x (target > 1),"
            f" steps only {summary['decoupled_steps_speedup']:.2f}x"
        )


def print_reach(summary: dict[str, Any]) -> None:
    """The time-to-reward table: per arm and level, seconds and samples (means over seeds)."""
    arms = [a for a in ARMS if f"{a}_time_to" in summary]
    if not arms:
        return
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    print(
        f"{'time to reward':<16} {'level':>6} {'wall_s':>8} {'samples':>8} {'speedup':>8}"
        f" {'samples/sync':>9}"
    )
    for arm in arms:
        for lvl, t in summary[f"{arm}_time_to"].items():
            sync_t = summary.get("sync_time_to", {}).get(lvl)
            ratio = sync_t / t if sync_t is not None and t else None
            n = summary[f"{arm}_samples_to"][lvl]
            sync_n = summary.get("sync_samples_to", {}).get(lvl)
            nr = n / sync_n if n is not None and sync_n else None
            print(
                f"{arm:<16} {lvl:>6} {fmt(t, '8.1f')} {fmt(n, '8.0f')} {fmt(ratio, '7.2f')}x"
                f" {fmt(nr, '8.2f')}x"
            )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = _parser()
    args = p.parse_args(argv)
    if args.losses is not None:
        return _losses_main(p, args)
    arms, seeds = _check(p, args)
    logging.basicConfig(level=logging.WARNING)
    results = _run_arms(arms, seeds, args)
    summary = summarize(results)
    print_table(results, summary)
    if args.run_root:
        root = Path(args.run_root)
        firsts = " ".join(str(root / f"{a}-seed{seeds[0]}") for a in arms)
        print(f"pictures: asyncrl plot {firsts} --out {root / 'plots'}")
    out = {
        **summary,
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "runs": results,
    }
    write_json(args.json, out)
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="asyncrl bench learning",
        description=__doc__,
        formatter_class=RawHelpFormatter,
    )
    p.add_argument("--workload", default="default", choices=WORKLOAD_NAMES, help="what to learn")
    p.add_argument(
        "--workload-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a knob of the workload: a key of task.longtail / task.agentic (e.g. max_len=256,"
        " latency_max_s=1.0) or num_digits",
    )
    p.add_argument("--engine-core", type=int, default=0, help="core of the engine process")
    p.add_argument("--trainer-core", type=int, default=1, help="core of the trainer process")
    p.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin processes")
    p.add_argument("--seeds", default="0,1", help="comma-separated seeds (>= 2 for the claim)")
    _add_run_options(p)
    p.add_argument("--levels", default="0.5,0.9", help="reward levels, fractions of the maximum")
    p.add_argument("--max-reward", type=float, default=1.0, help="the task's maximum reward")
    p.add_argument("--smooth", type=float, default=0.8, help="EMA weight of the reward curve")
    p.add_argument("--run-root", default=None, help="keep the runs here (default: a temp dir)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument(
        "--losses",
        default=None,
        metavar="all|NAME,...",
        help="instead of the arms: one run of the default job per policy loss / advantage"
        " estimator (" + ", ".join(LOSSES) + ") and seed, at"
        " the job's own step budget unless --steps",
    )
    p.add_argument("--target", type=float, default=0.9, help="--losses: the 10-step mean to reach")
    return p


def _add_run_options(p: argparse.ArgumentParser) -> None:
    """The options that size each arm's runs (steps, batch, staleness) and choose the arms."""
    p.add_argument("--steps", type=int, default=None, help="train steps per run" + _dflt("steps"))
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="groups per step (0: the run's default)" + _dflt("batch_size"),
    )
    p.add_argument("--group-size", type=int, default=0, help="samples per group (0: default)")
    p.add_argument(
        "--staleness",
        type=int,
        default=None,
        help="max_staleness of the async arms" + _dflt("staleness"),
    )
    p.add_argument("--arms", default=None, help="subset of: " + ", ".join(ARMS) + _dflt("arms"))
    p.add_argument(
        "--override",
        action="append",
        default=[],
        help="extra --section.key=value (after the workload's own: trainer.lr" + _dflt("lr") + ")",
    )


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[str], list[int]]:
    """Fills the workload's defaults into ``args`` and parses its lists (``p.error`` on a bad
    one); returns the arms and the seeds to run."""
    apply_workload_defaults(args)
    try:
        args.levels = [float(x) for x in args.levels.split(",") if x]
    except ValueError:
        p.error(f"--levels must be comma-separated numbers, got {args.levels!r}")
    try:
        args.workload_arg = dict(_knob(kv) for kv in args.workload_arg)
    except ValueError as exc:
        p.error(str(exc))
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        p.error(f"unknown arms {unknown} (allowed: {', '.join(ARMS)})")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    return arms, seeds


def _run_arms(arms: list[str], seeds: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every arm at every seed, in ``--run-root`` or a temporary folder, one line each."""
    with tempfile.TemporaryDirectory(prefix="asyncrl-learning-") as tmp:
        root = Path(args.run_root or tmp)
        results = []
        for seed in seeds:
            for arm in arms:
                r = run_arm(arm, seed, args, root)
                print(f"  {arm} seed {seed}: last10 {r['final_reward']:.3f} in {r['wall_s']:.1f}s")
                results.append(r)
    return results


def _losses_main(p: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """``--losses``: the per-loss table on the default job (learning_losses.py)."""
    unknown = [n for n in args.losses.split(",") if n and n not in LOSSES and n != "all"]
    if unknown:
        p.error(f"unknown losses {unknown} (allowed: all, {', '.join(LOSSES)})")
    if args.workload != "default":
        p.error("--losses runs the default job: leave --workload out")
    logging.basicConfig(level=logging.WARNING)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    with tempfile.TemporaryDirectory(prefix="asyncrl-learning-") as tmp:
        out = run_losses(args, seeds, Path(args.run_root or tmp))
    out["config"] = {k: v for k, v in vars(args).items() if k != "json"}
    write_json(args.json, out)
    return out


def _dflt(key: str) -> str:
    """The per-workload defaults of ``key`` for ``--help``."""
    own = {w: WORKLOAD_DEFAULTS[w][key] for w in WORKLOAD_NAMES}
    vals = ", ".join(f"{w} {'the run' + chr(39) + 's' if v is None else v}" for w, v in own.items())
    return f" (default per --workload: {vals})"


def apply_workload_defaults(args: argparse.Namespace) -> None:
    """Fill what the command line left unset from ``WORKLOAD_DEFAULTS[--workload]``; its
    learning rate goes first in ``--override`` (a later ``--override trainer.lr=...`` wins)."""
    own = WORKLOAD_DEFAULTS[args.workload]
    for key in ("steps", "staleness", "batch_size", "arms"):
        if getattr(args, key) is None:
            setattr(args, key, own[key])
    if own["lr"] is not None:
        args.override = [f"--trainer.lr={own['lr']:g}", *args.override]


def _knob(kv: str) -> tuple[str, float | int | str]:
    """``KEY=VALUE`` of ``--workload-arg``: the value as an int, else a float, else text."""
    key, sep, val = kv.partition("=")
    if not sep or not key:
        raise ValueError(f"--workload-arg must be KEY=VALUE, got {kv!r}")
    for conv in (int, float):
        try:
            return key, conv(val)
        except ValueError:
            pass
    return key, val


if __name__ == "__main__":
    main()
