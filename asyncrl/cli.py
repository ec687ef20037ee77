"""The ``asyncrl`` command: run | serve | bench | plot | config.

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

from asyncrl.bench import BENCHES  # noqa: E402
from asyncrl.config.algo_recipes import RECIPES  # noqa: E402

__all__ = ["main"]

_Commands = argparse._SubParsersAction  # what add_subparsers returns: one add_parser per command


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="asyncrl", description="Fully-asynchronous RL for LMs.")
    sub = p.add_subparsers(dest="cmd", required=True)
    _add_run(sub)
    serve = sub.add_parser("serve", help="start the embedded engine (SGLang HTTP protocol)")
    serve.add_argument(
        "args", nargs=argparse.REMAINDER, help="[--model-path DIR] [--port N] ... (see -h)"
    )
    _add_bench(sub)
    _add_config(sub)
    _add_plot(sub)
    return p


def _add_run(sub: _Commands) -> None:
    """``asyncrl run [CONFIG] [options] [--section.key=value ...]``: the overrides are not
    argparse's (:func:`_split_run_args` sets them apart first)."""
    run = sub.add_parser(
        "run",
        help="fully-async GRPO (no arguments: the embedded default job)",
        description="Run a training job. Any config key can be overridden as --section.key=value "
        "or --section.key value (e.g. --controller.max_staleness=2); every key, its default and "
        "meaning: asyncrl config.",
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
    run.add_argument(
        "--algo",
        metavar="RECIPE",
        choices=tuple(RECIPES),
        help="a named algorithm recipe: sets its [algo] keys (docs/algorithms.md, 'Recipes'; "
        "a key given on the command line wins): "
        + "; ".join(f"{name}: {doc}" for name, (doc, _) in RECIPES.items()),
    )


def _add_bench(sub: _Commands) -> None:
    """``asyncrl bench NAME ...``: each benchmark parses its own arguments."""
    bench = sub.add_parser(
        "bench",
        help="benchmarks shipped with the package (asyncrl bench NAME --help)",
        description="Each benchmark prints a table next to its baseline; --json PATH writes JSON.",
    )
    names = bench.add_subparsers(dest="bench", required=True, metavar="NAME")
    for name, (_, summary) in BENCHES.items():
        one = names.add_parser(name, help=summary, add_help=False)
        one.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the benchmark")


def _add_config(sub: _Commands) -> None:
    """``asyncrl config [SECTION]``: the configuration reference."""
    config = sub.add_parser(
        "config",
        help="the configuration reference: every key, its type, default and meaning",
        description="Print the configuration reference (Markdown, as docs/config.md): every key "
        "of asyncrl run's config with its type and limits, default and meaning, from the config "
        "structs' docstrings. Set keys in a TOML file or as --section.key=value.",
    )
    config.add_argument(
        "section", nargs="?", default="", help="only this section (e.g. rollout, logging.trace)"
    )


def _add_plot(sub: _Commands) -> None:
    """``asyncrl plot RUN_DIR ...``: pictures of runs."""
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


_RUN_OPTIONS = ("--run-dir", "--resume", "--quiet", "--algo", "--help", "-h")


def _is_override(arg: str) -> bool:
    """A config override: ``--section.key=value``, or ``--key=value`` for a key that is not
    one of ``asyncrl run``'s own options (``--seed=1``)."""
    if not arg.startswith("--"):
        return False
    key = arg.split("=")[0]
    return "." in key or ("=" in arg and key not in _RUN_OPTIONS)


def _takes_next(arg: str) -> bool:
    """``--section.key`` (or a top-level value key, ``--seed``) with no ``=``: its value is the
    next argument (``--controller.total_steps 5``)."""
    if not arg.startswith("--") or "=" in arg or arg in _RUN_OPTIONS:
        return False
    key = arg[2:]
    if "." in key:
        return True
    from asyncrl.config import RunConfig

    return key in RunConfig.__struct_fields__


def _split_run_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """``asyncrl run``'s own arguments and its config overrides (``--key=value``, or
    ``--key value``: the next argument is the value); SystemExit(2) naming a key that has no
    value."""
    known: list[str] = []
    overrides: list[str] = []
    args = iter(argv)
    for arg in args:
        if _takes_next(arg):
            value = next(args, None)
            if value is None or value.startswith("--"):
                print(
                    f"asyncrl run: {arg} needs a value: {arg}=VALUE or {arg} VALUE",
                    file=sys.stderr,
                )
                sys.exit(2)
            overrides.append(f"{arg}={value}")
        elif _is_override(arg):
            overrides.append(arg)
        else:
            known.append(arg)
    return known, overrides


def _serve(argv: list[str]) -> None:
    """``asyncrl serve ARGS``: flags parsed before the engine (torch) is imported."""
    from asyncrl.entrypoints.engine_args import parser

    args = parser().parse_args(argv)
    from asyncrl.entrypoints.engine import serve

    serve(args)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] != ["run"] and signal.getsignal(signal.SIGINT) is _interrupted:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # serve / bench / plot: Python's
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    parser = _parser()
    if argv[:1] == ["run"]:  # config overrides (--key=value, --section.key=value) go apart
        known, overrides = _split_run_args(argv)
        ns = parser.parse_args(known)
        from asyncrl.entrypoints.run import main as run_main

        sys.exit(run_main(ns, overrides))
    if argv[:1] == ["serve"]:  # the engine's own parser takes the rest
        _serve(argv[1:])
        return
    if argv[:1] == ["bench"] and argv[1:2] and argv[1] in BENCHES:  # its own parser takes the rest
        from asyncrl.bench import run_bench

        sys.exit(run_bench(argv[1], argv[2:]))
    ns = parser.parse_args(argv)
    if ns.cmd == "serve":
        _serve(ns.args)
    elif ns.cmd == "config":
        from asyncrl.config.reference import render, sections

        keys = [k for k, _ in sections()]
        if ns.section and not any(k == ns.section or k.startswith(ns.section + ".") for k in keys):
            print(f"asyncrl config: no section {ns.section!r} (sections: {', '.join(keys)})",
                  file=sys.stderr)  # fmt: skip
            sys.exit(2)
        print(render(ns.section), end="")
    elif ns.cmd == "plot":
        from asyncrl.plot import main_plot

        sys.exit(main_plot(ns.run_dirs, ns.out, ns.text, ns.smooth, ns.window))


if __name__ == "__main__":
    main()
