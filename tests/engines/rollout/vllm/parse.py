"""vLLM 0.33's own ``vllm serve`` parser as a probe: ``python -m
tests.engines.rollout.vllm.parse ARGVS_JSON OUT`` parses each argv of the JSON list with
``app.parse_vllm_argv`` and writes to the file OUT one JSON list: per argv a few parsed
values, or the parser's error message (it exits 2, as ``vllm serve`` does). Run with
vLLM's server dependencies on its path (``code.vllm_env``; ``server.vllm_parse``)."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path
from typing import Any

from tests.engines.rollout.vllm.app import parse_vllm_argv
from tests.session_forks import as_imported

KEYS = ("model", "api_key", "middleware", "enable_scale_out", "tensor_parallel_size", "dtype",
        "port", "host")  # fmt: skip


def parsed(argv: list[str]) -> dict[str, Any] | str:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            a = parse_vllm_argv(argv)
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1]
    return {k: getattr(a, k) for k in KEYS}


def main() -> None:
    as_imported()
    argvs, out = json.loads(sys.argv[1]), Path(sys.argv[2])
    out.write_text(json.dumps([parsed(argv) for argv in argvs]))


if __name__ == "__main__":
    main()
