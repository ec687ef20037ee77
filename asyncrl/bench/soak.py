"""A long run under random faults: the default job with two engines while engines and the
trainer are SIGKILLed, and engines hung (SIGSTOP, then SIGCONT), at random intervals.

``asyncrl bench soak --steps 900 --kill-every 15,40`` runs the real ``asyncrl run`` CLI
(a child process) and, until it ends, waits a random time in ``--kill-every`` (seconds)
and strikes: the faults of ``--faults`` (``engine``: SIGKILL an engine; ``trainer``:
SIGKILL trainer rank 0; ``hang``: SIGSTOP an engine for ``--hang-s``) come in shuffled
rounds, so every kind strikes once in each round of ``len(--faults)`` faults.

Restart budgets are rates (``trainer.max_restarts`` per ``trainer.restart_window_s``, the
same per engine): the soak sets each to the most faults of one kind its interval allows in
a window (``ceil(window / min interval) + 1``), the budget a run facing faults at that
rate needs, and shows that a run of any length then finishes. Extra ``--section.key=value``
arguments go to the run (after the soak's own).

Reported (and written with ``--json PATH``): faults by kind, steps, wall time, whether
every step was trained exactly once (``steps_exactly_once``) and every sample at most
once and none skipped (``samples_lost``, from every step's ``sample_ids``), restarts, the
run's memory (proportional set size of its processes, summed; the median of the first
and of the last fifth of the samples: ``rss_start_mb``, ``rss_end_mb``, ``rss_growth``)
and what was left after it ended (``left``: processes of the run and its shared-memory
rings: must be 0).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncrl.bench.common import write_json
from asyncrl.bench.faults import _cli, _config, _finish, _left, _lost, _pids, _rows

__all__ = ["main", "soak"]

FAULTS = ("engine", "trainer", "hang")
_WINDOW_S = 600.0


def _rss_mb(pids: list[int]) -> float:
    """The processes' memory, summed: proportional set sizes (``Pss`` of
    ``/proc/PID/smaps_rollup``), so pages a fork shares with its server count once."""
    total_kb = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total_kb += next(int(ln.split()[1]) for ln in f if ln.startswith("Pss:"))
        except (OSError, ValueError, IndexError, StopIteration):
            pass
    return total_kb / 1024


class _Striker:
    """Strikes the run's processes: shuffled rounds of the fault kinds."""

    def __init__(self, kinds: list[str], hang_s: float, rng: random.Random):
        self.kinds, self.hang_s, self.rng = kinds, hang_s, rng
        self.queue: list[str] = []
        self.done: dict[str, int] = dict.fromkeys(kinds, 0)

    def strike(self, pids: dict[str, int], alive: Any) -> str:
        """One fault on a live target (``alive()``: the run still runs); what was done."""
        if not self.queue:
            self.queue = self.rng.sample(self.kinds, len(self.kinds))
        kind = self.queue.pop()
        engines = sorted(n for n in pids if n.startswith("engine"))
        name = "trainer0" if kind == "trainer" else self.rng.choice(engines or ["engine0"])
        pid = pids.get(name)
        if pid is None:
            return f"skipped {kind} (no {name})"
        try:
            if kind == "hang":
                os.kill(pid, signal.SIGSTOP)
                end = time.monotonic() + self.hang_s
                while time.monotonic() < end and alive():
                    time.sleep(0.05)
                os.kill(pid, signal.SIGCONT)
            else:
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return f"skipped {kind} ({name} already gone)"
        self.done[kind] += 1
        return f"{kind} {name}"


def soak(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """The soak, start to finish; its row."""
    run_dir = root / "soak"
    budget = math.ceil(_WINDOW_S / args.kill_every[0]) + 1
    rng = random.Random(args.seed)
    striker = _Striker(args.faults, args.hang_s, rng)
    t0 = time.perf_counter()
    proc = _cli(run_dir, _overrides(args, budget))
    samples, log, seen = _strike_until_done(proc, run_dir, striker, rng, args, t0)
    wall = time.perf_counter() - t0
    _finish(proc, 60)
    end = time.monotonic() + 10
    while _left(seen, proc.pid) and time.monotonic() < end:
        time.sleep(0.05)
    rows = _rows(run_dir / "metrics.jsonl")
    recs = _rows(run_dir / "recoveries.jsonl")
    batch, stale = _config(run_dir)
    fifth = max(1, len(samples) // 5)
    start = statistics.median(m for _, m in samples[:fifth]) if samples else 0.0
    last = statistics.median(m for _, m in samples[-fifth:]) if samples else 0.0
    return {
        "steps": len(rows),
        "wall_s": wall,
        "faults": dict(striker.done),
        "fault_log": log,
        "budget_per_window": budget,
        "steps_exactly_once": [r["step"] for r in rows] == list(range(args.steps)),
        "samples_lost": _lost(rows, (stale + 3) * batch),
        "trainer_restarts": sum(1 for r in recs if "engine" not in r),
        "engine_restarts": sum(1 for r in recs if "engine" in r),
        "rss_start_mb": start,
        "rss_end_mb": last,
        "rss_growth": last / start if start else float("nan"),
        "left": _left(seen, proc.pid),
        "final_reward": sum(r["reward_mean"] for r in rows[-10:]) / max(1, len(rows[-10:])),
    }


def _overrides(args: argparse.Namespace, budget: int) -> list[str]:
    """The soak run's config: ``budget`` restarts per restart window for each side."""
    return [
        f"--controller.total_steps={args.steps}",
        f"--checkpoint.every_steps={args.every}",
        f"--rollout.num_engines={args.engines}",
        f"--trainer.max_restarts={budget}",
        f"--rollout.max_restarts={budget}",
        f"--trainer.restart_window_s={_WINDOW_S:g}",
        f"--rollout.restart_window_s={_WINDOW_S:g}",
        *args.override,
    ]


def _strike_until_done(
    proc: subprocess.Popen,
    run_dir: Path,
    striker: _Striker,
    rng: random.Random,
    args: argparse.Namespace,
    t0: float,
) -> tuple[list[tuple[float, float]], list[str], dict[str, int]]:
    """While the run lives: one fault every ``--kill-every`` seconds (uniform in the range)
    and its processes' RSS every 0.5 s, once it has logged a step. Returns the RSS samples
    (seconds since ``t0``, MB), the fault log and every process name -> pid seen; a run past
    ``--timeout`` is killed (TimeoutError)."""
    lo, hi = args.kill_every
    samples: list[tuple[float, float]] = []  # (seconds since start, RSS MB)
    log: list[str] = []
    seen: dict[str, int] = {}
    deadline = t0 + args.timeout
    next_strike = time.perf_counter() + rng.uniform(lo, hi)
    training = False  # a metrics row was seen: the run trains (checked until it is)
    while proc.poll() is None:
        now = time.perf_counter()
        if now > deadline:
            proc.kill()
            raise TimeoutError(f"the soak's run did not end within {args.timeout:g} s")
        pids = _pids(run_dir)
        seen.update(pids)
        training = training or bool(_rows(run_dir / "metrics.jsonl"))
        if pids and training:
            samples.append((now - t0, _rss_mb([proc.pid, *pids.values()])))
            if now >= next_strike:
                log.append(f"{now - t0:.1f}s {striker.strike(pids, lambda: proc.poll() is None)}")
                next_strike = time.perf_counter() + rng.uniform(lo, hi)
        time.sleep(0.5)
    return samples, log, seen


def _table(r: dict[str, Any]) -> str:
    faults = ", ".join(f"{k} {v}" for k, v in r["faults"].items())
    cells = [
        ("faults", faults),
        ("steps", str(r["steps"])),
        ("wall_s", f"{r['wall_s']:.1f}"),
        ("steps_exactly_once", str(r["steps_exactly_once"])),
        ("samples_lost", str(r["samples_lost"])),
        ("trainer_restarts", str(r["trainer_restarts"])),
        ("engine_restarts", str(r["engine_restarts"])),
        ("rss_start_mb", f"{r['rss_start_mb']:.0f}"),
        ("rss_end_mb", f"{r['rss_end_mb']:.0f}"),
        ("rss_growth", f"{r['rss_growth']:.3f}"),
        ("left", str(len(r["left"]))),
        ("final_reward", f"{r['final_reward']:.3f}"),
    ]
    head = " | ".join(c for c, _ in cells)
    return "\n".join([head, "-" * len(head), " | ".join(v for _, v in cells)])


def _interval(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"MIN,MAX seconds, got {text!r}") from None
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError(f"need 0 < MIN <= MAX, got {text!r}")
    return lo, hi


def _kinds(text: str) -> list[str]:
    kinds = [k for k in text.split(",") if k]
    bad = [k for k in kinds if k not in FAULTS]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(f"faults from {', '.join(FAULTS)}, got {text!r}")
    return kinds


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="asyncrl bench soak",
        description="the default job under random engine/trainer kills and engine hangs",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=900, help="controller.total_steps")
    p.add_argument("--every", type=int, default=20, help="checkpoint.every_steps")
    p.add_argument("--engines", type=int, default=2, help="rollout.num_engines")
    p.add_argument("--kill-every", type=_interval, default=(15.0, 40.0), help="MIN,MAX seconds")
    p.add_argument("--faults", type=_kinds, default=list(FAULTS), help="kinds, comma-separated")
    p.add_argument("--hang-s", type=float, default=8.0, help="how long a hung engine stays stopped")
    p.add_argument("--seed", type=int, default=0, help="of the intervals, kinds and targets")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole run")
    p.add_argument("--json", default="", help="write the result here")
    p.add_argument("--root", default="", help="the run folder's parent (default: temporary)")
    args, extra = p.parse_known_args(argv)
    args.override = extra
    with tempfile.TemporaryDirectory(prefix="asyncrl-soak-") as tmp:
        result = soak(args, Path(args.root or tmp))
    print(_table(result))
    for line in result["fault_log"]:
        print(f"  {line}")
    write_json(args.json, {"args": vars(args), "result": result})
    ok = result["steps_exactly_once"] and not result["samples_lost"] and not result["left"]
    if not ok:
        raise SystemExit("soak: a step or sample was lost or trained twice, or something was left")


if __name__ == "__main__":
    main()
