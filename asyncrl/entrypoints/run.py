"""The controller process: ``asyncrl run``.

Loads and checks the config (a mistake exits 2 before anything starts), then drives the
run (:func:`asyncrl.runner.run_job`: starts the engine and trainer processes, runs the
controller on uvloop). The first SIGTERM/SIGINT checkpoints and stops (exit 128 +
signal; ``asyncrl run --resume RUN_DIR`` continues), a second stops at once. Imports no
torch: the heavy work runs in the children.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

__all__ = ["main"]


def _load(ns: argparse.Namespace, overrides: list[str]):  # -> (RunConfig, Path | None)
    from asyncrl.config import load_config

    if ns.algo:  # a named recipe: its [algo] keys, before the user's own overrides
        from asyncrl.config.algo_recipes import recipe_overrides

        overrides = [*recipe_overrides(ns.algo), *overrides]
    if ns.resume is None:
        return load_config(ns.config, overrides), None
    from asyncrl.controllers.checkpoints import find_run_dir, resume_config

    if ns.config or ns.run_dir:
        raise ValueError("--resume takes the run's own config and folder (no CONFIG/--run-dir)")
    run_dir = find_run_dir(ns.resume)
    return resume_config(run_dir, overrides), run_dir


def main(ns: argparse.Namespace, overrides: list[str]) -> int:
    """``asyncrl run`` with its parsed options ``ns`` and config ``overrides``: the exit code
    (0 done, 1 failed, 2 bad config, 128 + signal when stopped by SIGINT/SIGTERM)."""
    try:
        cfg, resume_dir = _load(ns, overrides)
        from asyncrl.preflight import preflight

        preflight(cfg)  # what this host lacks, before anything starts
    except ValueError as exc:
        print(f"asyncrl run: {exc}", file=sys.stderr)
        return 2
    import asyncio

    from asyncrl import loops
    from asyncrl.runner import RunStopped, new_run_dir, run_job

    run_dir = resume_dir or Path(ns.run_dir or cfg.run_dir or new_run_dir())
    _console_logging(run_dir)
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


class _Console(logging.Formatter):
    """The console's log lines: asyncrl's records without their traceback, which is in
    ``RUN_DIR/controller.log`` (one per distinct error); other libraries' as they are."""

    def __init__(self, run_dir: Path):
        super().__init__("%(asctime)s %(name)s %(levelname)s %(message)s")
        self.where = run_dir / "controller.log"

    def format(self, record: logging.LogRecord) -> str:
        if not record.name.startswith("asyncrl"):  # not in controller.log: shown whole
            return super().format(record)
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        try:
            text = super().format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved
        return text + (f" (traceback in {self.where})" if saved[0] else "")


def _console_logging(run_dir: Path) -> None:
    """Warnings and errors on stderr, one line each: tracebacks go to the run's
    controller.log only, and a record logged with ``extra={"console": False}`` (one the
    run's last line reports, e.g. the error that stopped it) goes there only."""
    handler = logging.StreamHandler()
    handler.setFormatter(_Console(run_dir))
    handler.addFilter(lambda r: getattr(r, "console", True))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])


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
