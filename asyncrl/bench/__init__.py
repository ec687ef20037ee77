"""Benchmarks shipped with the package: ``asyncrl bench NAME [ARGS]``.

One module per benchmark; each has ``main(argv)`` with its own argparse parser
(``asyncrl bench NAME --help``), prints a table next to its baseline and
writes JSON with ``--json PATH``. ``BENCHES`` maps the command name to the
module; nothing here imports a benchmark (or torch) until one is run.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

__all__ = [
    "BENCHES",
    "HelpFormatter",
    "RawHelpFormatter",
    "bench_parser",
    "log_dir",
    "run_bench",
]

BENCHES: dict[str, tuple[str, str]] = {
    "weight-sync": ("asyncrl.bench.weight_sync", "weight-sync latency and bandwidth per backend"),
    "transport": ("asyncrl.bench.transport", "experience transport: msgspec+ZeroMQ vs pickle"),
    "pipeline": ("asyncrl.bench.pipeline", "pipeline speed-up: sync vs async on one workload"),
    "generation": ("asyncrl.bench.generation", "embedded engine vs HF generate throughput"),
    "controller": ("asyncrl.bench.controller", "controller episodes/s on one core"),
    "train": ("asyncrl.bench.train", "FSDP2 train_batch vs a plain PyTorch step"),
    "learning": ("asyncrl.bench.learning", "sync vs async learning: reward and time-to-reward"),
    "trace": ("asyncrl.bench.trace", "the timeline's cost: the default job traced vs not"),
    "faults": ("asyncrl.bench.faults", "killed trainer / engines / run: recovery, nothing lost"),
    "soak": ("asyncrl.bench.soak", "a long run under random kills and hangs: nothing lost"),
    "gateway": ("asyncrl.bench.gateway", "OpenAI gateway vs the engine's own /generate"),
    "peer": ("asyncrl.bench.peer", "TRL's GRPOTrainer beside asyncrl run on the default job"),
    "fuzz": ("asyncrl.bench.fuzz", "hostile HTTP and experience messages: all answered, none lost"),
}


class _Defaults(argparse.HelpFormatter):
    @staticmethod
    def _shows_default(action: argparse.Action) -> bool:
        default = action.default
        if not action.option_strings or default is None or default is False:  # 0 is shown
            return False
        if default == argparse.SUPPRESS or default == "":
            return False
        return default != [] and "%(default)" not in (action.help or "")

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and self._shows_default(action):  # no help text: its default
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if self._shows_default(action) and "(default: %(default)s)" not in text:
            text += " (default: %(default)s)"
        return text


class HelpFormatter(_Defaults, argparse.RawDescriptionHelpFormatter):
    """Every benchmark's ``--help``: each option's line ends with its default (options
    without a help text too), and the description keeps its own line breaks."""


class RawHelpFormatter(_Defaults, argparse.RawTextHelpFormatter):
    """:class:`HelpFormatter` for help texts laid out by hand (their line breaks kept)."""


def bench_parser(name: str, description: str) -> argparse.ArgumentParser:
    """The argument parser of ``asyncrl bench NAME``: its prog, ``description`` (as written)
    and the benchmarks' help format (defaults shown)."""
    return argparse.ArgumentParser(
        formatter_class=HelpFormatter, prog=f"asyncrl bench {name}", description=description
    )


def run_bench(name: str, argv: Sequence[str]) -> int:
    """Run benchmark ``name`` with its own arguments; 0 on success.

    Raises ``KeyError`` for an unknown name; argparse's ``SystemExit`` (bad
    arguments, ``--help``) passes through.
    """
    module = importlib.import_module(BENCHES[name][0])
    module.main(list(argv))
    return 0


@contextmanager
def log_dir(prefix: str) -> Iterator[Path]:
    """A fresh folder under the temporary directory for a benchmark's child processes'
    logs, as long as the run: removed when the block ends normally, kept (its path printed
    to stderr) when it ends with an exception, so a failed run's logs stay readable and a
    passing one leaves nothing behind."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    except BaseException:
        print(f"benchmark failed: its processes' logs are kept in {path}", file=sys.stderr)
        raise
    shutil.rmtree(path, ignore_errors=True)
