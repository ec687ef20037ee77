"""vLLM 0.33's modules that the test server (``app.py``), its receiving ranks (``rank.py``)
and the parser probe (``parse.py``) import when they run, imported once by the session's
vLLM fork server (``forks.py``); what they set in the environment is set again in each
fork (``tests.session_forks.as_imported``)."""

from __future__ import annotations

from tests.session_forks import preload

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

preload(MODULES)
