"""Run ``asyncrl bench weight-sync --engine E`` into a stand-in of E (vLLM 0.33 or SGLang)
holding a model of the bench's shapes: the command behind docs/results/weight-sync.md's
engine rows on a machine with neither server.

``python -m tests.bench.weight_sync_standin --engine vllm|sglang [--tp N] -- BENCH_ARGS...``
(``BENCH_ARGS``: ``asyncrl bench weight-sync`` arguments, ``--model`` and ``--dtype``
included). A Qwen2 model of ``--model``'s shapes is written to a temporary folder (random
weights, ``--dtype``), the stand-in started on it (vLLM's with ``--no-truth``: no ground
truth hashing beyond ``/weight_checker``), the bench run, every process ended by pid.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--engine", choices=["vllm", "sglang"], required=True)
    p.add_argument("--sglang-version", default="0.5.23")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("bench", nargs=argparse.REMAINDER)
    args = p.parse_args()
    bench = [a for a in args.bench if a != "--"]
    import tests.conftest  # noqa: F401  one run secret (a 0600 file) for the stand-in and bench

    known, _ = _bench_shape(bench)
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncrl.bench.weight_sync import MODELS

    folder = Path(tempfile.mkdtemp(prefix="asyncrl-ws-standin-"))
    model_dir = folder / known.model
    model = Qwen2ForCausalLM(Qwen2Config(**MODELS[known.model])).to(getattr(torch, known.dtype))
    model.save_pretrained(model_dir)
    del model
    if args.engine == "vllm":
        from tests.engines.rollout.vllm.server import start_vllm

        server: Any = start_vllm(model_dir, folder / "server", args.tp, flags=("--no-truth",))
    else:
        from tests.engines.rollout.sglang.server import start_standin

        server = start_standin(args.sglang_version, model_dir, folder / "server", args.tp)
    try:
        cmd = [sys.executable, "-m", "asyncrl.cli", "bench", "weight-sync"]
        cmd += [f"--engine={args.engine}", f"--urls={server.url}", *bench]
        sys.exit(subprocess.run(cmd, check=False).returncode)
    finally:
        server.stop()


def _bench_shape(bench: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model", default="qwen2-0.5b")
    p.add_argument("--dtype", default="bfloat16")
    return p.parse_known_args(bench)


if __name__ == "__main__":
    main()
