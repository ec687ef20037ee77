"""Where SGLang's own source lives for the tests, per covered version.

``scripts/setup.sh`` unpacks each version's wheel (Python files only) under
``.cache/sglang/VERSION``; a test process that plays SGLang's side puts that
folder first on its path and imports SGLang's modules from it. One pytest
process never imports SGLang itself (three versions cannot share one process).
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.engines.rollout.vllm.code import missing

__all__ = ["ROOT", "VERSIONS", "sglang_env", "sglang_src"]

ROOT = Path(__file__).resolve().parents[4]
VERSIONS = ("0.5.10", "0.5.22", "0.5.23")


def sglang_src(version: str) -> Path:
    """The unpacked source of SGLang ``version``; skips the test (naming why) when absent,
    fails it under CI (``missing``)."""
    path = ROOT / ".cache" / "sglang" / version
    if not (path / "sglang" / "__init__.py").is_file():
        missing(
            f"SGLang {version}'s source is not at {path}: scripts/setup.sh downloads it "
            f"(pip download sglang=={version} --no-deps) and could not here"
        )
    try:
        import triton  # noqa: F401  (SGLang's srt/utils imports it; setup.sh installs it)
    except ImportError:
        missing("SGLang's srt.utils needs triton: install the 'sglang-wire' extra")
    return path


def sglang_env(version: str) -> dict[str, str]:
    """The environment of a process that imports SGLang ``version`` (and the tests)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(sglang_src(version)), str(ROOT)])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env
