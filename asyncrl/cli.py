"""The ``asyncrl`` command: run | serve | bench | plot.

Parsing is done before any heavy import (torch, transformers), so ``--help``
answers at once and config errors show before anything starts.
"""

from __future__ import annotations

import signal
import sys


def _interrupted(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # before a job starts: exit quietly (130, 143)


# Started as the ``asyncrl`` command (not imported by a host program): quiet until a
# command installs its own handlers (asyncrl run: on its event loop).
if sys.argv and sys.argv[0].replace("\\", "/").endswith(("/asyncrl", "asyncrl/cli.py")):
    signal.signal(signal.SIGINT, _interrupted)
    signal.signal(signal.SIGTERM, _interrupted)

import argparse  # noqa: E402
from pathlib import Path  # noqa: E402

from asyncrl.bench import BENCHES  # noqa: E402

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="asyncrl", description="Fully-asynchronous RL for LMs.")
    sub = p.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser(
        "run",
        help="fully-async GRPO (no arguments: the embedded default job)",
        description="Run a training job. Any config key can be overridden as --section.key=value "
        "(e.g. --controller.max_staleness=2).",
    )
    run.add_argument("config", nargs="?", help="TOML config file (default: built-in defaults)")
    run.add_argument("--run-dir", default=None, help="output folder (default: a new runs/<time>)")
    run.add_argument(
        "--resume",
        metavar="RUN_DIR",
        default=None,
        help="continue a run from its newest complete checkpoint ('latest': the newest run "
        "under runs/); its recorded config is used, overrides only where safe",
    )
    run.add_argument("--quiet", action="store_true", help="no per-step progress lines")
    run.add_argument("--algo", choices=("grpo", "ppo"), help="shorthand of --algo.name=...")
    serve = sub.add_parser("serve", help="start the embedded engine (SGLang HTTP protocol)")
    serve.add_argument("args", nargs=argparse.REMAINDER, help="--model-path DIR --port N ...")
    bench = sub.add_parser(
        "bench",
        help="benchmarks shipped with the package (asyncrl bench NAME --help)",
        description="Each benchmark prints a table next to its baseline; --json PATH writes JSON.",
    )
    names = bench.add_subparsers(dest="bench", required=True, metavar="NAME")
    for name, (_, summary) in BENCHES.items():
        one = names.add_parser(name, help=summary, add_help=False)
        one.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the benchmark")
    plot = sub.add_parser(
        "plot",
        help="PNGs of runs (reward, staleness, throughput, time, timeline); several overlay",
        description="Pictures of one or more runs from metrics.jsonl and trace.json "
        "(matplotlib: the plot extra). Several run folders are overlaid, e.g. sync vs async.",
    )
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    plot.add_argument("--out", default=None, help="folder of the PNGs (default: RUN_DIR/plots)")
    plot.add_argument("--text", action="store_true", help="a terminal view instead of PNGs")
    plot.add_argument("--smooth", type=float, default=0.8, help="EMA weight in [0, 1)")
    plot.add_argument("--window", type=int, default=4, help="steps in the timeline strip")
    return p


def _load(ns: argparse.Namespace, overrides: list[str]):  # -> (RunConfig, Path | None)
    from asyncrl.config import load_config

    if ns.algo:
        overrides = [f"--algo.name={ns.algo}", *overrides]
    if ns.resume is None:
        return load_config(ns.config, overrides), None
    from asyncrl.controllers.checkpoints import find_run_dir, resume_config

    if ns.config or ns.run_dir:
        raise ValueError("--resume takes the run's own config and folder (no CONFIG/--run-dir)")
    run_dir = find_run_dir(ns.resume)
    return resume_config(run_dir, overrides), run_dir


def _run(ns: argparse.Namespace, overrides: list[str]) -> int:
    try:
        cfg, resume_dir = _load(ns, overrides)
        from asyncrl.preflight import preflight

        preflight(cfg)  # what this host lacks, before anything starts
    except ValueError as exc:
        print(f"asyncrl run: {exc}", file=sys.stderr)
        return 2
    import asyncio
    import logging

    from asyncrl import loops
    from asyncrl.runner import RunStopped, new_run_dir, run_job

    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    run_dir = resume_dir or Path(ns.run_dir or cfg.run_dir or new_run_dir())
    print(f"asyncrl run: {'resuming' if resume_dir else 'writing to'} {run_dir}", flush=True)
    got: list[int] = []

    async def _main() -> list[dict]:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        stop = asyncio.Event()

        def on_signal(sig: int) -> None:  # first: checkpoint and stop; second: stop now
            got.append(sig)
            if len(got) == 1 and cfg.checkpoint.on_signal:
                stop.set()
            else:
                task.cancel()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        return await run_job(
            cfg, run_dir, quiet=ns.quiet, resume=resume_dir is not None, stop_event=stop
        )

    try:
        rows = loops.run(_main())
    except RunStopped as exc:
        again = f"asyncrl run --resume {run_dir}" if exc.step is not None else "run it again"
        print(f"asyncrl run: {exc}; continue with: {again}", file=sys.stderr)
        return 128 + got[0]
    except asyncio.CancelledError:
        print("asyncrl run: stopped; every process of the run has ended", file=sys.stderr)
        return 128 + (got[0] if got else signal.SIGINT)
    except (RuntimeError, ValueError) as exc:
        print(f"asyncrl run: failed: {exc}", file=sys.stderr)
        return 1
    _summary(rows)
    return 0


def _summary(rows: list[dict]) -> None:
    if not rows:
        return
    k = min(10, len(rows))
    first = sum(r["reward_mean"] for r in rows[:k]) / k
    last = sum(r["reward_mean"] for r in rows[-k:]) / k
    worst = max(r["staleness_max"] for r in rows)
    print(
        f"done: {len(rows)} steps in {rows[-1]['wall_s']:.0f}s | reward first {k}: {first:.3f}"
        f" -> last {k}: {last:.3f} | max staleness {worst} | weight version "
        f"{rows[-1]['weight_version']}"
    )


_RUN_OPTIONS = ("--run-dir", "--resume", "--quiet", "--algo", "--help", "-h")


def _is_override(arg: str) -> bool:
    """A config override: ``--section.key=value``, or ``--key=value`` for a key that is not
    one of ``asyncrl run``'s own options (``--seed=1``)."""
    if not arg.startswith("--"):
        return False
    key = arg.split("=")[0]
    return "." in key or ("=" in arg and key not in _RUN_OPTIONS)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] != ["run"] and signal.getsignal(signal.SIGINT) is _interrupted:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # serve / bench / plot: Python's
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    parser = _parser()
    if argv[:1] == ["run"]:  # config overrides (--key=value, --section.key=value) go apart
        known = [a for a in argv if not _is_override(a)]
        overrides = [a for a in argv if a not in known]
        ns = parser.parse_args(known)
        sys.exit(_run(ns, overrides))
    if argv[:1] == ["serve"]:  # the engine's own parser takes the rest
        from asyncrl.engines.rollout.local.server import main as serve_main

        serve_main(argv[1:])
        return
    if argv[:1] == ["bench"] and argv[1:2] and argv[1] in BENCHES:  # its own parser takes the rest
        from asyncrl.bench import run_bench

        sys.exit(run_bench(argv[1], argv[2:]))
    ns = parser.parse_args(argv)
    if ns.cmd == "serve":
        from asyncrl.engines.rollout.local.server import main as serve_main

        serve_main(ns.args)
    elif ns.cmd == "plot":
        from asyncrl.plot import main_plot

        sys.exit(main_plot(ns.run_dirs, ns.out, ns.text, ns.smooth, ns.window))


if __name__ == "__main__":
    main()
