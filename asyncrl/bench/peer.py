"""What a user would pick instead: TRL's ``GRPOTrainer`` beside ``asyncrl run`` on one job.

``asyncrl bench peer [--seeds 0 1] [--steps 120] [--trl-threads 2 1] [--json PATH]``

The job is asyncrl's default job (``asyncrl run`` with no config): the tiny Qwen2 model
built locally, the reverse task's prompts and reward, 32 prompts x 8 samples per step,
AdamW at a constant lr, no KL and no reference model, float32 on the CPU. Per seed:

- **asyncrl**: ``asyncrl run --quiet --run-dir DIR --seed=S --task.seed=S
  --controller.total_steps=N``, as a user runs it (engine and trainer in their own processes,
  one torch thread each); read back from its ``metrics.jsonl``;
- **TRL**: TRL's ``GRPOTrainer`` (``asyncrl.bench.peer_trl``, a process of its own per
  ``--trl-threads`` entry, that many torch threads) with every setting taken from the same
  asyncrl config, on the same prompt stream in the same order and the same reward; it stops
  once its 10-step mean reward reaches the highest target (or after ``--trl-max-steps``).

The settings table prints both sides' values (read back from asyncrl's config and from TRL's
own ``GRPOConfig``/optimizer) and names every difference that remains. Reported per side:
wall time and samples until the 10-step mean reward first reaches each ``--targets`` level
(asyncrl: its ``wall_s``, from the run's start, engine and trainer start-up included; TRL:
from ``trainer.train()``, its imports and model load excluded; so also TRL's time from its
process's start, ``process_to_train_s`` added, and that ratio: asyncrl's ``wall_s`` starts
0.3-0.4 s after its exec, in ``run_job``, after the CLI's imports and preflight), seconds per
step (median
over the steps after the first 10), the trainer step (asyncrl's ``train_s``; TRL's step
minus its generation and scoring), TRL's generation, the CPU seconds per step of all of a
side's processes (asyncrl: controller, engine, trainer; on a 2-core machine a pipeline cannot
step faster than half of that), and the final 10-step mean; then the ratios asyncrl / TRL.
Runs one after another (never in parallel), so the times compare.
Needs TRL (``pip install 'asyncrl[peer]'``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from asyncrl.bench import HelpFormatter, log_dir
from asyncrl.bench.common import start, write_json
from asyncrl.procs import python_env, stop

__all__ = ["main", "reach"]

WINDOW = 10  # the targets are on the mean reward of the last WINDOW steps


def reach(rows: list[dict[str, Any]], level: float) -> dict[str, float] | None:
    """The first step whose ``WINDOW``-step mean reward (that step and the ``WINDOW - 1``
    before it) is >= ``level``: its ``wall_s``, step index and samples trained up to it;
    None if none is (or there are fewer than ``WINDOW`` steps)."""
    samples = 0.0
    for i, row in enumerate(rows):
        samples += row["num_samples"]
        if i + 1 >= WINDOW:
            mean = sum(r["reward_mean"] for r in rows[i + 1 - WINDOW : i + 1]) / WINDOW
            if mean >= level:
                return {"wall_s": row["wall_s"], "step": float(i), "samples": samples}
    return None


def summarize(rows: list[dict[str, Any]], targets: list[float]) -> dict[str, Any]:
    """Per-run numbers from per-step rows (``reward_mean``, ``wall_s``, ``num_samples``,
    ``train_s``, optionally ``gen_s`` and ``step_s``)."""
    steady = rows[WINDOW:] if len(rows) > WINDOW + 1 else rows
    if "step_s" in rows[0]:
        per_step = [r["step_s"] for r in steady]
    else:
        walls = [r["wall_s"] for r in rows]
        per_step = [b - a for a, b in itertools.pairwise(walls)][-len(steady) :] or [walls[0]]
    out: dict[str, Any] = {
        "steps": len(rows),
        "samples": sum(r["num_samples"] for r in rows),
        "final_reward": statistics.fmean(r["reward_mean"] for r in rows[-WINDOW:]),
        "wall_s": rows[-1]["wall_s"],
        "s_per_step": statistics.median(per_step),
        "train_s": statistics.median(r["train_s"] for r in steady),
        "gen_s": statistics.median(r["gen_s"] for r in steady) if "gen_s" in rows[0] else None,
        "reach": {str(t): reach(rows, t) for t in targets},
        "cpu_s_per_step": cpu_per_step(rows),
    }
    return out


def cpu_per_step(rows: list[dict[str, Any]]) -> float | None:
    """CPU seconds per step of every process of a side (the rows' cumulative ``cpu_*_s``:
    asyncrl's controller, engine, trainer, fork server; TRL's one process), over the steps
    after the first ``WINDOW``; None with too few steps."""
    if len(rows) < WINDOW + 2:
        return None
    a, b = rows[WINDOW], rows[-1]
    keys = [k for k in b if k.startswith("cpu_") and k.endswith("_s") and k in a]
    if not keys:
        return None
    return sum(b[k] - a[k] for k in keys) / (len(rows) - WINDOW - 1)


def run_asyncrl(args: argparse.Namespace, seed: int, root: Path, logs: Path) -> dict[str, Any]:
    run_dir = root / f"asyncrl-seed{seed}"
    cmd = [
        "-m",
        "asyncrl.cli",
        "run",
        "--quiet",
        "--run-dir",
        str(run_dir),
        *asyncrl_overrides(args, seed),
    ]
    t0 = time.perf_counter()
    _run("asyncrl run", cmd, logs / f"asyncrl-seed{seed}.log", args.timeout_s)
    command_s = time.perf_counter() - t0
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rows = [r for r in map(json.loads, filter(None, lines)) if "reward_mean" in r]
    return {
        "side": "asyncrl",
        "seed": seed,
        "threads": "1+1",
        "command_s": command_s,
        **summarize(rows, args.targets),
    }


def run_trl(args: argparse.Namespace, seed: int, threads: int, root: Path, logs: Path) -> dict:
    from asyncrl.bench.peer_settings import trl_args

    out = root / f"trl-t{threads}-seed{seed}.json"
    cmd = [
        "-m",
        "asyncrl.bench.peer_trl",
        "--out",
        str(out),
        "--workdir",
        str(root / f"trl-t{threads}-seed{seed}"),
        "--threads",
        str(threads),
        "--seed",
        str(seed),
        "--steps",
        str(args.trl_max_steps),
        "--stop-at",
        str(max(args.targets)),
        *trl_args(args.cfg, args.model_dir),
    ]
    t0 = time.perf_counter()
    env = {k: str(threads) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    _run("TRL GRPOTrainer", cmd, logs / out.with_suffix(".log").name, args.timeout_s, env)
    command_s = time.perf_counter() - t0
    got = json.loads(out.read_text())
    rows = [
        dict(r, num_samples=float(args.cfg.controller.batch_size * args.cfg.algo.group_size))
        for r in got.pop("steps")
    ]
    return {
        "side": "trl",
        "seed": seed,
        "threads": str(threads),
        "command_s": command_s,
        **summarize(rows, args.targets),
        **got,
    }


def _run(name: str, cmd: list[str], log: Path, timeout_s: float, env: dict | None = None) -> None:
    """``python CMD...`` to its end (output to ``log``); RuntimeError with the log's tail when
    it fails or outlives ``timeout_s`` (its process group is ended either way)."""
    proc = start(cmd, log, python_env(env))
    try:
        rc = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{name} did not finish within {timeout_s:g} s; log: {log}") from None
    finally:
        stop([proc])  # whatever it left in its process group
    if rc != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{name} exited with {rc}:\n{tail}")


def asyncrl_overrides(args: argparse.Namespace, seed: int) -> list[str]:
    return [f"--seed={seed}", f"--task.seed={seed}", f"--controller.total_steps={args.steps}"]


def _mean(runs: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.fmean(vals) if vals and len(vals) == len(runs) else None


def _reach_mean(runs: list[dict[str, Any]], level: str, key: str) -> float | None:
    got = [r["reach"][level] for r in runs]
    return None if any(g is None for g in got) else statistics.fmean(g[key] for g in got)


def aggregate(runs: list[dict[str, Any]], targets: list[float]) -> dict[str, Any]:
    """Per side (``asyncrl``, ``trl-tN``): the means over the seeds; then the ratios."""
    sides: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        sides.setdefault(
            r["side"] if r["side"] == "asyncrl" else f"trl-t{r['threads']}", []
        ).append(r)
    summary: dict[str, Any] = {}
    for side, rs in sides.items():
        summary[side] = {
            "seeds": [r["seed"] for r in rs],
            **{
                k: _mean(rs, k)
                for k in (
                    "s_per_step",
                    "train_s",
                    "gen_s",
                    "cpu_s_per_step",
                    "final_reward",
                    "samples",
                    "steps",
                )
            },
            "time_to": {str(t): _reach_mean(rs, str(t), "wall_s") for t in targets},
            "samples_to": {str(t): _reach_mean(rs, str(t), "samples") for t in targets},
        }
        start = 0.0 if side == "asyncrl" else _mean(rs, "process_to_train_s")
        summary[side]["time_from_start_to"] = {
            t: None if v is None or start is None else v + start
            for t, v in summary[side]["time_to"].items()
        }
    ours = summary.get("asyncrl")
    ratios: dict[str, Any] = {}
    for side, s in summary.items():
        if side == "asyncrl" or ours is None:
            continue
        ratios[side] = {
            "time_to": {t: _div(ours["time_to"][t], s["time_to"][t]) for t in s["time_to"]},
            "time_from_start_to": {
                t: _div(ours["time_from_start_to"][t], s["time_from_start_to"][t])
                for t in s["time_from_start_to"]
            },
            "samples_to": {
                t: _div(ours["samples_to"][t], s["samples_to"][t]) for t in s["samples_to"]
            },
            "s_per_step": _div(ours["s_per_step"], s["s_per_step"]),
            "train_s": _div(ours["train_s"], s["train_s"]),
        }
    return {"sides": summary, "ratio_asyncrl_over": ratios}


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    from asyncrl.bench.peer_settings import check_trl, settings_table
    from asyncrl.config import load_config
    from asyncrl.tasks.tiny_model import ensure_tiny_model

    check_trl()
    args.cfg = load_config(None, asyncrl_overrides(args, args.seeds[0]))
    args.model_dir = str(ensure_tiny_model())
    runs = _run_all(args)
    trl_view = next(r["config"] for r in runs if r["side"] == "trl")
    table, differences = settings_table(args.cfg, trl_view, args.trl_threads)
    print("\nsettings (asyncrl run | TRL GRPOTrainer)\n" + table)
    print("differences that remain:\n" + "\n".join(f"  - {d}" for d in differences))
    result = aggregate(runs, args.targets)
    print("\n" + _summary_text(result, args.targets))
    if args.json:
        payload = {
            "config": {
                "seeds": args.seeds,
                "steps": args.steps,
                "targets": args.targets,
                "trl_threads": args.trl_threads,
                "trl_max_steps": args.trl_max_steps,
            },
            "settings": table,
            "differences": differences,
            "runs": runs,
            **result,
        }
        write_json(args.json, payload)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="asyncrl bench peer", description=__doc__, formatter_class=HelpFormatter
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=120, help="asyncrl's controller.total_steps")
    p.add_argument(
        "--trl-max-steps",
        type=int,
        default=300,
        help="TRL's max_steps (it stops earlier at the highest target)",
    )
    p.add_argument(
        "--trl-threads",
        type=int,
        nargs="+",
        default=[2, 1],
        help="one TRL run per entry, with that many torch threads",
    )
    p.add_argument(
        "--targets",
        type=float,
        nargs="+",
        default=[0.5, 0.9],
        help="levels of the 10-step mean reward",
    )
    p.add_argument("--timeout-s", type=float, default=900.0, help="longest wait for one run")
    p.add_argument("--json", "--out", dest="json", default=None, help="write the results here")
    return p


def _run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per seed: the asyncrl run, then one TRL run per ``--trl-threads`` entry; a row each."""
    runs: list[dict[str, Any]] = []
    with log_dir("asyncrl-bench-peer-") as root:
        for seed in args.seeds:
            runs.append(run_asyncrl(args, seed, root, root))
            print(_row(runs[-1], args.targets), flush=True)
            for threads in args.trl_threads:
                runs.append(run_trl(args, seed, threads, root, root))
                print(_row(runs[-1], args.targets), flush=True)
    return runs


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _row(r: dict[str, Any], targets: list[float]) -> str:
    reach = "  ".join(
        f"{t}: {_fmt((r['reach'][str(t)] or {}).get('wall_s'), '.1f')} s" for t in targets
    )
    return (
        f"{r['side']:<8} threads {r['threads']:<4} seed {r['seed']}  steps {r['steps']:>4}  "
        f"{reach}  s/step {r['s_per_step']:.3f}  train {r['train_s']:.3f}  "
        f"final {r['final_reward']:.3f}"
    )


def _summary_text(result: dict[str, Any], targets: list[float]) -> str:
    head = f"{'side':<10} {'s/step':>7} {'train s':>8} {'gen s':>7} {'cpu s':>6} {'final':>6}  "
    head += "  ".join(f"{'to ' + str(t) + ' s (samples)':>22}" for t in targets)
    lines = [head]
    for side, s in result["sides"].items():
        to = "  ".join(
            f"{_fmt(s['time_to'][str(t)], '.1f'):>10} "
            f"({_fmt(s['samples_to'][str(t)], '.0f'):>7})   "
            for t in targets
        )
        lines.append(
            f"{side:<10} {_fmt(s['s_per_step'], '.3f'):>7} {_fmt(s['train_s'], '.3f'):>8} "
            f"{_fmt(s['gen_s'], '.3f'):>7} {_fmt(s['cpu_s_per_step'], '.3f'):>6} "
            f"{_fmt(s['final_reward'], '.3f'):>6}  {to}"
        )
    for side, r in result["ratio_asyncrl_over"].items():
        to = ", ".join(f"time to {t} {_fmt(r['time_to'][str(t)])}x" for t in targets)
        lines.append(
            f"asyncrl / {side}: {to}; s/step {_fmt(r['s_per_step'])}x; "
            f"trainer step {_fmt(r['train_s'])}x"
        )
        start = ", ".join(f"time to {t} {_fmt(r['time_from_start_to'][str(t)])}x" for t in targets)
        lines.append(f"  from each side's process start (TRL's imports and load counted): {start}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
