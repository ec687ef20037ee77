"""Benchmarks shipped with the package: ``asyncrl bench NAME [ARGS]``.

One module per benchmark; each has ``main(argv)`` with its own argparse parser
(``asyncrl bench NAME --help``), prints a table next to its baseline and
writes JSON with ``--json PATH``. ``BENCHES`` maps the command name to the
module; nothing here imports a benchmark (or torch) until one is run.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

__all__ = ["BENCHES", "run_bench"]

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
    "gateway": ("asyncrl.bench.gateway", "OpenAI gateway vs the engine's own /generate"),
    "fuzz": ("asyncrl.bench.fuzz", "hostile HTTP and experience messages: all answered, none lost"),
}


def run_bench(name: str, argv: Sequence[str]) -> int:
    """Run benchmark ``name`` with its own arguments; 0 on success.

    Raises ``KeyError`` for an unknown name; argparse's ``SystemExit`` (bad
    arguments, ``--help``) passes through.
    """
    module = importlib.import_module(BENCHES[name][0])
    module.main(list(argv))
    return 0
