"""The session's fork server with vLLM 0.33's server code imported (``tests/session_forks.py``),
for the vLLM test servers (``app.py``), their receiving ranks (``rank.py``) and vLLM's parser
probe (``parse.py``): importing vLLM's CLI, app and ``AsyncLLM`` modules costs ~5.5 CPU-s
(``vllm.config`` pulls in torch's inductor, transformers and openai's types); a fork of
this server has them imported. Its environment is ``code.vllm_env`` (vLLM's source and its
pinned server dependencies first on the path, as a fresh ``app.py`` process has them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.engines.rollout.vllm.code import vllm_env
from tests.session_forks import SessionForkServer

__all__ = ["PRELOAD", "SERVER", "spawn_vllm"]

PRELOAD = (
    "tests.engines.rollout.vllm.app",
    "tests.engines.rollout.vllm.preload",
    "transformers.models.qwen2.modeling_qwen2",  # the stand-in's model class
)
"""What the server imports before it forks (``preload.py`` lists vLLM's own modules)."""

SERVER = SessionForkServer("vllm-0.33.0", vllm_env, PRELOAD)


def spawn_vllm(args: list[str], log: Path | None, env: dict[str, str]) -> Any:
    """Start ``python ARGS`` (``-m MODULE ...``) with ``env`` (``code.vllm_env``'s path),
    forked from the session's vLLM fork server where there is one."""
    return SERVER.spawn(args, log, env)
