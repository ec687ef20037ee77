"""vLLM 0.33's modules that the test server (``app.py``), its receiving ranks (``rank.py``)
and the parser probe (``parse.py``) import when they run, imported here once by the vLLM
fork server (``forks.py``).

``IMPORT_ENV``: the environment variables these imports set (vLLM's ``env_override`` and
friends set them at import time: ``TORCHINDUCTOR_COMPILE_THREADS``, ...). A process forked
from the server has them imported already, with the environment it was given: it sets them
again (:func:`as_imported`), as the imports would have in a fresh interpreter.
"""

from __future__ import annotations

import importlib
import os

MODULES = (
    "fastapi",
    "uvloop",
    "vllm.entrypoints.common.cli_args",  # the parser: ~4.5 CPU-s of the ~5.5
    "vllm.utils.argparse_utils",
    "vllm.entrypoints.launchers.app",
    "vllm.entrypoints.launchers.launcher",
    "vllm.v1.engine.async_llm",
    "vllm.entrypoints.scale_out.token_in_token_out.protocol",
    "vllm.entrypoints.serve.exception_handling.error_response",
    "vllm.exceptions",
    "vllm.distributed.utils",  # the receiving ranks' StatelessProcessGroup (rank.py)
)


def _import_all() -> dict[str, str]:
    before = dict(os.environ)
    for name in MODULES:
        importlib.import_module(name)
    return {k: v for k, v in os.environ.items() if before.get(k) != v}


IMPORT_ENV = _import_all()


def as_imported() -> None:
    """Set what vLLM's imports set in the environment, where it is not set (module doc)."""
    for key, value in IMPORT_ENV.items():
        os.environ.setdefault(key, value)
