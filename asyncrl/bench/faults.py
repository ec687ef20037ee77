"""Faults survived: the default job with processes killed, next to the same job undisturbed.

Each scenario runs the real ``asyncrl run`` CLI (a child process; checkpoints every
``--every`` steps) and SIGKILLs something when the run's ``metrics.jsonl`` reaches a
step:

- ``baseline``: nothing killed;
- ``trainer``: trainer rank 0 at ``--kill-at`` (the run restarts every rank from the
  last checkpoint by itself);
- ``engines``: two engines; engine 0 SIGKILLed at ``--kill-at``, engine 1 halfway from
  there to the end (or at the steps of ``--engine-kills A,B``). The run restarts each,
  holds it out of rotation, re-forms the weight group from the running trainer with
  the current weights and puts it back (``membership.EngineSet``): no trainer
  restart, no step redone;
- ``run``: the ``asyncrl run`` process itself at ``--kill-at``; then ``asyncrl run
  --resume RUN_DIR`` finishes the run. Also checked: 10 s after the kill, no process
  of the run and no shared-memory ring of it is left.

Reported per scenario (and written with ``--json PATH``): wall time, final reward
(mean of the last 10 steps), ``recovery_s`` (trainer: from the death's detection to
the lost steps sent again; engines: from the SIGKILL to the engine back in rotation
with the current weights, the mean of both; run: from the kill to the resumed run's
first new step), ``steps_redone`` (steps trained before the failure that were trained
again from a checkpoint), ``samples_lost`` (samples trained twice plus samples
skipped, from every step's ``sample_ids``: must be 0), ``groups_failed`` (groups whose
episodes gave up: must be 0),
``staleness_violations`` (steps whose oldest token is older than
``controller.max_staleness``: must be 0), ``resumed_kept_tokens`` (run: in-flight
tokens the checkpoint kept), ``left_after_kill`` (run: processes and rings found 10 s
after the kill: must be 0) and the trainer's mean stall per checkpoint.

``asyncrl bench faults --steps 80 --every 20 --kill-at 50 --engine-kills 30,60`` (the
issue's layout: checkpoints every 20 steps, trainer and run killed at step 50, the
engines at steps 30 and 60).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncrl.bench import bench_parser
from asyncrl.bench.common import write_json
from asyncrl.procs import die_with_parent_fn, finish, pid_alive, python_env

__all__ = ["main", "run_scenario"]

SCENARIOS = ("baseline", "trainer", "engines", "run")


def _cli(run_dir: Path, args: list[str], resume: bool = False) -> subprocess.Popen:
    where = ["--resume", str(run_dir)] if resume else ["--run-dir", str(run_dir)]
    cmd = [sys.executable, "-m", "asyncrl.cli", "run", "--quiet", *where, *args]
    return subprocess.Popen(
        cmd,
        env=python_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=die_with_parent_fn(),  # the run's guardian then ends its children
    )


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def _wait_step(run_dir: Path, proc: subprocess.Popen[str], step: int, timeout_s: float) -> None:
    assert proc.stdout is not None  # _cli pipes it
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = _rows(run_dir / "metrics.jsonl")
        if rows and rows[-1]["step"] >= step:
            return
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended before step {step}: {proc.stdout.read()[-2000:]}")
        time.sleep(0.05)
    raise TimeoutError(f"no step {step} within {timeout_s}s")


def _wait_checkpoint(run_dir: Path, proc: subprocess.Popen, timeout_s: float) -> None:
    """Until the run has one complete checkpoint (written by the trainer after its step: on a
    loaded machine the run may be steps ahead of it)."""
    from asyncrl.controllers import checkpoints

    deadline = time.monotonic() + timeout_s
    while checkpoints.latest_checkpoint(run_dir) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"no complete checkpoint in {run_dir} within {timeout_s:g} s")
        time.sleep(0.05)


def _finish(proc: subprocess.Popen, timeout_s: float) -> None:
    rc, out = finish(proc, timeout_s)
    if rc != 0:
        raise RuntimeError(f"asyncrl run exited with {rc}:\n{out[-3000:]}")


def _left(pids: dict[str, int], run_pid: int) -> list[str]:
    left = [name for name, pid in pids.items() if pid_alive(pid)]
    return left + [p.name for p in Path("/dev/shm").glob(f"asyncrl-xp-{run_pid}-*")]


def _lost(rows: list[dict[str, Any]], window: int) -> int:
    """Samples trained twice + samples skipped (not trained although later ones were, beyond
    the ``window`` of groups that may still be in flight at the end)."""
    ids = [i for r in rows for i in r.get("sample_ids", []) if i is not None]
    if not ids:
        return 0
    twice = len(ids) - len(set(ids))
    skipped = len(set(range(max(ids) + 1 - window)) - set(ids))
    return twice + skipped


def run_scenario(name: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """One scenario, start to finish; returns its row of the table."""
    run_dir = root / name
    cfg = [
        f"--controller.total_steps={args.steps}",
        f"--checkpoint.every_steps={args.every}",
        *args.override,
    ]
    if name == "engines":
        cfg.append("--rollout.num_engines=2")
    t0 = time.perf_counter()
    proc = _cli(run_dir, cfg)
    out: dict[str, Any] = {"scenario": name, "recovery_s": 0.0, "steps_redone": 0}
    if name == "trainer":
        _wait_step(run_dir, proc, args.kill_at, args.timeout)
        _kill(run_dir, "trainer0")
    kills: dict[str, float] = {}  # engine -> wall time of its SIGKILL
    if name == "engines":  # two engines: engine 0 killed at the first step, engine 1 later
        for engine, at in zip(("engine0", "engine1"), _engine_kills(args), strict=True):
            _wait_step(run_dir, proc, at, args.timeout)
            _kill(run_dir, engine)
            kills[engine] = time.time()
    before = 0
    if name == "run":
        proc, before = _kill_and_resume(run_dir, proc, args, out)
    _finish(proc, args.timeout)
    total = time.perf_counter() - t0
    _recoveries(name, run_dir, out, kills, before)
    _outcome(run_dir, out, total)
    return out


def _pids(run_dir: Path) -> dict[str, int]:
    """The run's ``processes.json`` (name -> pid); empty before the run wrote it."""
    try:
        return {k: int(v) for k, v in json.loads((run_dir / "processes.json").read_text()).items()}
    except (OSError, ValueError):
        return {}


def _kill(run_dir: Path, process: str) -> None:
    """SIGKILL the run's ``process`` (a key of its ``processes.json``: ``trainer0``, ...)."""
    os.kill(_pids(run_dir)[process], signal.SIGKILL)


def _kill_and_resume(
    run_dir: Path, proc: subprocess.Popen, args: argparse.Namespace, out: dict[str, Any]
) -> tuple[subprocess.Popen, int]:
    """The ``run`` scenario's fault: SIGKILL the whole run after a complete checkpoint, time
    its processes' exit (``left_after_kill``, ``cleanup_s``) and its resume (``recovery_s``)
    into ``out``; returns the resumed run and the last step logged before the kill."""
    _wait_step(run_dir, proc, args.kill_at, args.timeout)
    _wait_checkpoint(run_dir, proc, args.timeout)  # a resume needs one complete checkpoint
    pids = _pids(run_dir)
    before = _rows(run_dir / "metrics.jsonl")[-1]["step"]
    proc.send_signal(signal.SIGKILL)
    killed = time.perf_counter()
    proc.wait()
    while time.perf_counter() - killed < 10 and _left(pids, proc.pid):
        time.sleep(0.05)
    out["left_after_kill"] = len(_left(pids, proc.pid))
    out["cleanup_s"] = time.perf_counter() - killed
    proc = _cli(run_dir, [], resume=True)
    out["recovery_s"] = _wait_resumed(run_dir, proc, killed, args.timeout)
    return proc, before


def _recoveries(
    name: str, run_dir: Path, out: dict[str, Any], kills: dict[str, float], before: int
) -> None:
    """The scenario's recovery columns into ``out``, from the run's ``recoveries.jsonl``
    (``kills``: each killed engine's wall time; ``before``: ``run``'s last step pre-kill)."""
    recs = _rows(run_dir / "recoveries.jsonl")
    trainer_recs = [r for r in recs if "engine" not in r]
    engine_recs = [r for r in recs if "engine" in r]
    if name in ("trainer", "engines"):
        out["steps_redone"] = sum(r.get("steps_redone", 0) for r in trainer_recs)
        out["trainer_restarts"] = len(trainer_recs)
    if name == "trainer" and trainer_recs:
        out["recovery_s"] = sum(r.get("detect_to_sent_s", 0.0) for r in trainer_recs)
    if name == "engines":
        back = [r["admitted_at"] - kills[r["engine"]] for r in engine_recs if r["engine"] in kills]
        out["engine_restarts"] = len(engine_recs)
        out["recovery_s"] = sum(back) / len(back) if back else float("nan")
        out["recovery_max_s"] = max(back, default=float("nan"))
    if name == "run":
        out["steps_redone"] = max(0, before + 1 - _resumed_from(run_dir))


def _outcome(run_dir: Path, out: dict[str, Any], total: float) -> None:
    """The finished run's columns into ``out``: its steps, reward, losses and checkpoints."""
    rows = _rows(run_dir / "metrics.jsonl")
    saves = _rows(run_dir / "checkpoints.jsonl")
    batch, stale = _config(run_dir)
    failed = int(rows[-1].get("ctl_failed", 0)) if rows else 0
    k = min(10, len(rows))
    out.update(
        steps=len(rows),
        wall_s=total,
        final_reward=sum(r["reward_mean"] for r in rows[-k:]) / max(1, k),
        samples_lost=_lost(rows, (stale + 3) * batch),
        groups_failed=failed,
        staleness_violations=sum(1 for r in rows if r["staleness_max"] > stale),
        stall_per_checkpoint_s=sum(s["stall_s"] for s in saves) / max(1, len(saves)),
        checkpoints=len(saves),
        resumed_kept_tokens=_kept_tokens(run_dir),
    )


def _engine_kills(args: argparse.Namespace) -> tuple[int, int]:
    """The steps at which engine 0 and engine 1 are killed (``--engine-kills A,B``; default:
    ``--kill-at`` and halfway from there to the end)."""
    if not args.engine_kills:
        return args.kill_at, (args.kill_at + args.steps) // 2
    a, b = (int(x) for x in args.engine_kills.split(","))
    return a, b


def _config(run_dir: Path) -> tuple[int, int]:
    cfg = json.loads((run_dir / "config.json").read_text())
    return cfg["controller"]["batch_size"], cfg["controller"]["max_staleness"]


def _resumed_from(run_dir: Path) -> int:
    """The checkpoint step the resumed run started from (its resume.json)."""
    try:
        got = json.loads((run_dir / "resume.json").read_text()).get("trainer", "")
    except (OSError, ValueError):
        return -1
    m = re.search(r"step-(\d+)", got)
    return int(m.group(1)) if m else 0


def _wait_resumed(run_dir: Path, proc: subprocess.Popen, killed: float, timeout_s: float) -> float:
    """Seconds from the kill until the resumed run logged its first step."""
    resume = run_dir / "resume.json"
    wall_killed = time.time() - (time.perf_counter() - killed)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if resume.is_file() and resume.stat().st_mtime > wall_killed:
            n = _resumed_from(run_dir)
            if n >= 0 and len(_rows(run_dir / "metrics.jsonl")) > n:
                return time.perf_counter() - killed
        time.sleep(0.05)
    return float("nan")


def _kept_tokens(run_dir: Path) -> int:
    path = run_dir / "resumed.json"
    return int(json.loads(path.read_text()).get("kept_tokens", 0)) if path.is_file() else 0


def _table(rows: list[dict[str, Any]]) -> str:
    cols = [
        ("scenario", "{}"),
        ("steps", "{}"),
        ("wall_s", "{:.1f}"),
        ("final_reward", "{:.3f}"),
        ("recovery_s", "{:.2f}"),
        ("steps_redone", "{}"),
        ("engine_restarts", "{}"),
        ("trainer_restarts", "{}"),
        ("samples_lost", "{}"),
        ("groups_failed", "{}"),
        ("staleness_violations", "{}"),
        ("stall_per_checkpoint_s", "{:.3f}"),
        ("resumed_kept_tokens", "{}"),
        ("left_after_kill", "{}"),
    ]
    head = " | ".join(c for c, _ in cols)
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = [fmt.format(r[c]) if c in r else "-" for c, fmt in cols]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = bench_parser("faults", __doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--every", type=int, default=20, help="checkpoint.every_steps")
    p.add_argument("--kill-at", type=int, default=50, help="the step the kill waits for")
    p.add_argument(
        "--engine-kills",
        default="",
        help="A,B: steps at which engine 0 and engine 1 are killed (default: --kill-at and "
        "halfway from there to the end)",
    )
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--timeout", type=float, default=600.0, help="per run, seconds")
    p.add_argument("--json", default="", help="write the results here")
    p.add_argument("--root", default="", help="run folders here (default: a temporary one)")
    p.add_argument("override", nargs="*", help="extra --section.key=value of every run")
    args, extra = p.parse_known_args(argv)
    args.override = [*args.override, *extra]
    if args.engine_kills and not re.fullmatch(r"\d+,\d+", args.engine_kills):
        p.error(f"--engine-kills must be two steps A,B, got {args.engine_kills!r}")
    names = [s for s in args.scenarios.split(",") if s]
    for s in names:
        if s not in SCENARIOS:
            p.error(f"unknown scenario {s!r} (allowed: {', '.join(SCENARIOS)})")
    with tempfile.TemporaryDirectory(prefix="asyncrl-faults-") as tmp:
        root = Path(args.root or tmp)
        results = [run_scenario(s, args, root) for s in names]
    print(_table(results))
    write_json(args.json, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
