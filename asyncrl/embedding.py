"""What an embedding program needs beside the :class:`~asyncrl.Controller`: an engine to
generate with, and the wait until engines answer (README, "Embedding the controller").

- :class:`EngineProcess`: an embedded engine (``asyncrl serve``) started as a child
  process of your program on a free loopback port; ``with EngineProcess.start(...) as
  engine:`` stops it (by pid, its whole process group) when the block ends.
- :func:`wait_healthy`: wait until engines (yours, or ones started by hand) answer, with
  this process's run secret; an engine that refuses the secret fails at once, naming where
  the secret came from (:func:`asyncrl.secret.source`).

The run secret: every request carries this process's (``cluster.secret_file`` of the
config a :class:`~asyncrl.Controller` is given, else ``ASYNCRL_SECRET_FILE`` /
``ASYNCRL_SECRET``, else a fresh one made at first use; docs/embedding.md). An engine
:class:`EngineProcess` starts is handed this process's secret through a pipe (never a
command line), or reads ``secret_file`` when one is given: then give the same file to the
config (``--cluster.secret_file=F``).

Nothing here imports torch; the engine process does.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from asyncrl.tasks.tiny_model import TINY_VOCAB, ensure_tiny_model

if TYPE_CHECKING:
    from asyncrl.config import RunConfig
    from asyncrl.engines.rollout.launcher import LaunchedServer

__all__ = ["TINY_VOCAB", "EngineProcess", "ensure_tiny_model", "wait_healthy"]


class EngineProcess:
    """An embedded engine (``asyncrl serve``, the SGLang HTTP protocol) running as a child
    process; make one with :meth:`start`.

    ``url`` is where it listens (``http://127.0.0.1:PORT``), ``pid`` its process, ``log_path``
    its output. It answers only holders of the secret it was started with (module
    docstring). :meth:`stop` (or the end of a ``with`` block) ends it by pid: SIGTERM, then
    SIGKILL after ``timeout_s``. A child started with ``die_with_parent`` (the default) is
    also killed when your program dies, however it dies (Linux).
    """

    def __init__(self, server: LaunchedServer, log_path: Path):
        self._server = server
        self.url: str = server.url
        self.log_path = log_path

    @classmethod
    def start(
        cls,
        model_path: str | os.PathLike[str] | None = None,
        *,
        port: int = 0,
        host: str = "127.0.0.1",
        log_path: str | os.PathLike[str] | None = None,
        secret_file: str | os.PathLike[str] | None = None,
        args: Sequence[str] = (),
        die_with_parent: bool = True,
    ) -> EngineProcess:
        """Start ``asyncrl serve`` and return at once (:meth:`wait_healthy` waits for it).

        ``model_path``: a Hugging Face model folder (default: the tiny model,
        :func:`ensure_tiny_model`); ``port``: 0 picks a free one; ``log_path``: its output
        (default: ``engine.log`` in a new temporary folder); ``secret_file``: a file (mode
        0600) with the key it requires (default: this process's run secret, handed over by
        a pipe); ``args``: more ``asyncrl serve`` flags (``asyncrl serve --help``), e.g.
        ``("--max-batch-size", "64")``."""
        from asyncrl.engines.rollout.launcher import LOCAL_SERVER, LaunchSpec, launch
        from asyncrl.procs import free_port

        model = str(model_path) if model_path is not None else str(ensure_tiny_model())
        extra = tuple(args)
        if secret_file is not None:
            extra = ("--secret-file", str(secret_file), *extra)
        spec = LaunchSpec(model, port or free_port(host), host, module=LOCAL_SERVER,
                          extra_args=extra)  # fmt: skip
        if log_path is None:
            log = Path(tempfile.mkdtemp(prefix="asyncrl-engine-")) / "engine.log"
        else:
            log = Path(log_path)
        return cls(launch(spec, log, die_with_parent=die_with_parent), log)

    @property
    def pid(self) -> int:
        """The engine's process id."""
        return self._server.pid

    async def wait_healthy(self, timeout_s: float = 300.0) -> None:
        """Return once the engine answers; :class:`~asyncrl.EngineUnavailable` (with its log's
        tail) when its process exits first, it refuses this process's secret, or
        ``timeout_s`` passes."""
        from asyncrl.engines.rollout.launcher import wait_healthy as wait_servers

        await wait_servers([self._server], timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        """End the engine by pid (its whole process group); idempotent."""
        from asyncrl.engines.rollout.launcher import stop_servers

        stop_servers([self._server], timeout_s)

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EngineProcess(url={self.url!r}, pid={self.pid})"


async def wait_healthy(engines: RunConfig | str | Sequence[str], timeout_s: float = 300.0) -> None:
    """Return once every engine answers its liveness probe, asked with this process's run
    secret. ``engines``: the config a :class:`~asyncrl.Controller` will run (its
    ``rollout.urls``, asked by the client of its ``rollout.backend``; its
    ``cluster.secret_file`` becomes this process's secret first, as the Controller does), or
    engine URLs (asked as the embedded engine and SGLang answer). Raises
    :class:`~asyncrl.EngineUnavailable` naming the URL when ``timeout_s`` passes, and at once
    when an engine refuses the secret (saying where this process's secret came from and how
    to give it the engine's)."""
    from asyncrl import secret
    from asyncrl.config import LocalRolloutConfig, RunConfig
    from asyncrl.engines.rollout.factory import make_engine

    if isinstance(engines, RunConfig):
        secret.adopt(engines.cluster.secret_file)
        rollout, urls = engines.rollout, list(engines.rollout.urls)
        if not urls:
            raise ValueError("wait_healthy: the config's rollout.urls is empty")
    else:
        rollout = LocalRolloutConfig()
        urls = [engines] if isinstance(engines, str) else list(engines)

    async def one(url: str) -> None:
        engine = make_engine(rollout, url)
        try:
            await engine.wait_healthy(timeout_s)
        finally:
            await engine.close()

    await asyncio.gather(*(one(u) for u in urls))
