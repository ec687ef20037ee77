"""What the run's timeline costs: the default job with ``logging.trace`` on vs off.

Per repeat, the same job (the embedded default, ``asyncrl run`` with no
arguments, ``--steps`` steps) runs with tracing off (the baseline) and on,
one after the other (never in parallel). Reported per arm: ``wall_s``, the
run's time from the controller's start to its last step (``controller_s``,
process start-up excluded). For the traced arm also: the events each process
wrote, the trace's size, and ``est_cost_s`` = events x the measured cost of
recording one span in this process (``--calib`` spans, timed) — the tracer's
own CPU time, which, unlike the wall-time difference, noise on a shared
machine does not drown. ``cost_frac`` = ``est_cost_s / wall_s`` (target <= 0.02).

``asyncrl bench trace [--steps N] [--repeats R] [--json PATH]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncrl import trace
from asyncrl.bench import bench_parser
from asyncrl.bench.common import write_json


def span_cost_us(n: int, root: Path) -> float:
    """Microseconds per recorded span (``Tracer.span`` with args, written to a file)."""
    t = trace.Tracer(root / "calib.jsonl", "calib")
    try:
        t0 = time.perf_counter()
        for i in range(n):
            with t.span("generate", "lane #0", {"rid": f"{i}-0", "finish": "length"}):
                pass
        t.flush()
        return (time.perf_counter() - t0) / n * 1e6
    finally:
        t.close()


def run_once(traced: bool, args: argparse.Namespace, root: Path, i: int) -> dict[str, Any]:
    from asyncrl.config import load_config
    from asyncrl.runner import run_job

    overrides = [f"--logging.trace.enabled={'true' if traced else 'false'}", *args.override]
    if args.steps:
        overrides.append(f"--controller.total_steps={args.steps}")
    cfg = load_config(None, overrides)
    run_dir = root / f"{'on' if traced else 'off'}-{i}"
    rows = asyncio.run(run_job(cfg, run_dir, quiet=True))
    out: dict[str, Any] = {"traced": traced, "wall_s": rows[-1]["controller_s"]}
    if traced:
        events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
        names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
        per: dict[str, int] = {}
        for e in events:
            if e["ph"] != "M":
                per[names[e["pid"]]] = per.get(names[e["pid"]], 0) + 1
        out.update(events=per, trace_mb=(run_dir / "trace.json").stat().st_size / 2**20)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = bench_parser("trace", __doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="controller.total_steps (0: the default)")
    p.add_argument("--repeats", type=int, default=1, help="pairs of runs (off, on)")
    p.add_argument("--calib", type=int, default=20000, help="spans timed for the per-span cost")
    p.add_argument("--override", action="append", default=[], help="extra --section.key=value")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    runs = []
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-trace-") as tmp:
        root = Path(tmp)
        per_span = span_cost_us(args.calib, root)
        for i in range(args.repeats):
            for traced in (False, True):
                r = run_once(traced, args, root, i)
                print(f"  {'on ' if traced else 'off'} #{i}: {r['wall_s']:.1f}s", flush=True)
                runs.append(r)
    on = [r for r in runs if r["traced"]]
    off = [r for r in runs if not r["traced"]]
    events = statistics.mean(sum(r["events"].values()) for r in on)
    wall_on = statistics.median(r["wall_s"] for r in on)
    wall_off = statistics.median(r["wall_s"] for r in off)
    est = events * per_span / 1e6
    summary = {
        "wall_s_off": wall_off,
        "wall_s_on": wall_on,
        "wall_ratio": wall_on / wall_off,
        "events": events,
        "events_per_process": on[-1]["events"],
        "trace_mb": on[-1]["trace_mb"],
        "span_cost_us": per_span,
        "est_cost_s": est,
        "cost_frac": est / wall_on,
        "target_met": est / wall_on <= 0.02,
    }
    print(f"{'arm':<10} {'wall_s':>8} {'events':>8} {'trace MB':>9} {'est cost s':>11}")
    print(f"{'off':<10} {wall_off:>8.1f} {'-':>8} {'-':>9} {'-':>11}")
    print(f"{'on':<10} {wall_on:>8.1f} {events:>8.0f} {summary['trace_mb']:>9.2f} {est:>11.3f}")
    print(
        f"per span {per_span:.1f} us | estimated cost {100 * summary['cost_frac']:.2f}% of the"
        f" traced run's wall time (target <= 2%) | wall on/off {summary['wall_ratio']:.3f}"
        f" (median of {args.repeats}; noise on a shared machine is larger than the cost)"
    )
    out = {**summary, "runs": runs, "config": {k: v for k, v in vars(args).items()}}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
