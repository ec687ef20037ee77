"""Start, health-wait and stop rollout-engine server processes; or take engines by URL.

The part every engine family shares: :func:`launch` runs a :class:`LaunchSpec` (a
family's launcher builds it: ``sglang/launcher.py``, ``vllm/launcher.py``, the embedded
engine's below) in its own session (so stopping it by pid ends its whole process tree, TP workers
included) with output to a log file. :func:`wait_healthy` polls liveness
until it answers, failing early (with the log's tail) if the process exits,
or after a timeout. :func:`stop_servers` ends them by pid (SIGTERM, then
SIGKILL).

The server module is a field of :class:`LaunchSpec`: ``sglang.launch_server``
by default; ``asyncrl.entrypoints.engine`` (the embedded engine, which accepts SGLang's
flags) runs the very same code path — that is how the launcher is tested on machines
without SGLang, and how ``asyncrl run`` starts its embedded engines.

:func:`start_engines` is the one place a run turns ``RolloutConfig`` into
engine URLs: the configured ``urls`` as they are (servers running elsewhere),
or freshly launched servers of the configured family (:func:`engine_spec`).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from asyncrl.config import RolloutConfig, RunConfig
from asyncrl.engines.rollout.base import EngineUnavailable
from asyncrl.engines.rollout.factory import family, rollout_config
from asyncrl.engines.rollout.local.family import LOCAL_SERVER
from asyncrl.procs import Proc, Spawner, free_port, python_env, spawn, stop

__all__ = [
    "LOCAL_SERVER",
    "SGLANG_SERVER",
    "LaunchSpec",
    "LaunchedServer",
    "ServerSite",
    "engine_spec",
    "launch",
    "launch_command",
    "start_engines",
    "startup_timeout",
    "stop_servers",
    "stored_dtype",
    "wait_healthy",
]

SGLANG_SERVER = "sglang.launch_server"
"""SGLang's server module (``python -m``): :class:`LaunchSpec`'s default module."""


@dataclass(frozen=True)
class ServerSite:
    """Where and how one engine server of a run starts: what :func:`engine_spec` hands
    ``EngineFamily.spec``, which turns it into the family's :class:`LaunchSpec`."""

    model_path: str
    """Hugging Face model folder (or hub id, for SGLang)."""
    port: int
    """HTTP port of the server, on ``host``."""
    host: str
    """Address the server binds to."""
    gpu: int
    """The first GPU it uses (``EngineFamily.gpus`` of them from here)."""
    seed: int
    """The engine's sampling seed."""
    dtype: str
    """The trainer's weight dtype (the embedded engine's; SGLang's is its own)."""
    weight_master: str
    """Where the trainer's weight group is hosted."""
    lora: tuple[str, ...] = ()
    """The family's LoRA flags (``EngineFamily.lora_args``)."""


@dataclass(frozen=True)
class LaunchSpec:
    """One server process to start."""

    model_path: str
    """Hugging Face model folder (or hub id, for SGLang)."""
    port: int
    """HTTP port of the server."""
    host: str = "127.0.0.1"
    """Address the server binds to."""
    tp_size: int = 1
    """Tensor-parallel size (GPUs per server)."""
    mem_fraction_static: float | None = None
    """SGLang's static memory fraction (weights + KV cache); None keeps SGLang's default."""
    extra_args: tuple[str, ...] = ()
    """Further command-line arguments, passed through unchanged."""
    module: str = SGLANG_SERVER
    """The ``python -m`` module to run (the hook: any server taking SGLang's flags)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables (e.g. ``CUDA_VISIBLE_DEVICES``)."""
    entry_point: tuple[str, ...] = ()
    """``(module:function, *args)``: run this console-script entry point with ``args``
    before the flags (``sglang serve``: ``(SGLANG_CLI, "serve")``) instead of ``-m module``."""
    key_flag: str = ""
    """The server's flag for its API key (SGLang's and vLLM's ``--api-key``): the server is
    started through :mod:`asyncrl.entrypoints.keyed`, which gives it the run secret behind
    this flag in memory (never on the command line); "" for the embedded engine, which
    reads the run secret itself."""
    own_flags: bool = True
    """Pass SGLang-style ``--model-path/--tp-size/--host/--port`` before ``extra_args``;
    False: ``extra_args`` are the whole command line (``vllm serve MODEL ...``)."""
    backend: str = "sglang"
    """The rollout backend tag of the family that built it (``factory.FAMILIES``): its client
    probes the server's liveness (:func:`wait_healthy`). The embedded engine speaks SGLang's
    protocol, so a spec written by hand for it may keep the default."""

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"


@dataclass
class LaunchedServer:
    """A started server: its process (stop it by pid), URL and log file."""

    spec: LaunchSpec
    proc: Proc
    log_path: Path | None

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, chars: int = 2000) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return ""
        return self.log_path.read_bytes()[-chars:].decode(errors="replace")


KEYED = "asyncrl.entrypoints.keyed"


def launch_command(spec: LaunchSpec) -> list[str]:
    """The interpreter arguments (after ``python``) that start ``spec``'s server; with a
    ``key_flag``, behind ``-m asyncrl.entrypoints.keyed FLAG --`` (no key in them)."""
    args = _server_command(spec)
    return ["-m", KEYED, spec.key_flag, "--", *args] if spec.key_flag else args


def _server_command(spec: LaunchSpec) -> list[str]:
    if spec.tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {spec.tp_size}")
    if spec.mem_fraction_static is not None and not 0 < spec.mem_fraction_static < 1:
        raise ValueError(f"mem_fraction_static must be in (0, 1), got {spec.mem_fraction_static}")
    if not spec.own_flags:
        return [*_head(spec), *spec.extra_args]
    args = [*_head(spec), "--model-path", spec.model_path, "--tp-size", str(spec.tp_size)]
    args += ["--host", spec.host, "--port", str(spec.port)]
    if spec.mem_fraction_static is not None:
        args += ["--mem-fraction-static", str(spec.mem_fraction_static)]
    return [*args, *spec.extra_args]


def _head(spec: LaunchSpec) -> list[str]:
    """``-m module``, or ``-c`` code that calls the console-script entry point as the script
    the package installs would (same interpreter, no PATH lookup), then its arguments."""
    if not spec.entry_point:
        return ["-m", spec.module]
    target, *sub = spec.entry_point
    mod, _, fn = target.partition(":")
    if not re.fullmatch(r"[A-Za-z_][\w.]*", mod) or not re.fullmatch(r"[A-Za-z_]\w*", fn):
        raise ValueError(f"entry point must be 'module:function', got {target!r}")
    return ["-c", f"import sys; from {mod} import {fn}; sys.exit({fn}())", *sub]


def stored_dtype(model_path: str) -> str:
    """The dtype a Hugging Face checkpoint is stored in (``config.json``), or ""."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    got = cfg.get("torch_dtype") or cfg.get("dtype") or ""
    return got if isinstance(got, str) else ""


def startup_timeout(rc: RolloutConfig, model_path: str) -> float:
    """Seconds to wait for the engines to become healthy (see
    ``RolloutConfig.startup_timeout_s``): the configured value, or the family's (scaled to
    the model for GPU servers)."""
    if rc.startup_timeout_s is not None:
        return rc.startup_timeout_s
    return family(rc).startup_timeout(rc, model_path)


def launch(
    spec: LaunchSpec,
    log_path: Path | None = None,
    die_with_parent: bool = False,
    spawner: Spawner | None = None,
) -> LaunchedServer:
    """Start ``spec``'s server in a new session; returns at once (see :func:`wait_healthy`).
    ``die_with_parent``: as :func:`asyncrl.procs.spawn`'s; ``spawner``: what starts it
    (the run's fork server; default :func:`asyncrl.procs.spawn`)."""
    args, env = launch_command(spec), python_env(spec.env)
    if spawner is not None:
        return LaunchedServer(spec, spawner(args, log_path, env), log_path)
    proc = spawn(args, log_path, env=env, die_with_parent=die_with_parent)
    return LaunchedServer(spec, proc, log_path)


async def wait_healthy(
    servers: Sequence[LaunchedServer], timeout_s: float, interval_s: float = 0.25
) -> None:
    """Wait until every server answers (its family's client's ``wait_healthy``: SGLang's and
    the embedded engine's ``/model_info``, vLLM's ``/health``).

    Raises EngineUnavailable naming the server, with its log's tail, if its process exits
    first or ``timeout_s`` passes.
    """

    async def one(server: LaunchedServer) -> None:
        rc = rollout_config(server.spec.backend)  # the family's probe, short per request
        rc = msgspec.structs.replace(rc, request_timeout_s=max(1.0, interval_s * 8))
        client = family(rc).client(rc, server.url)

        def gone() -> str | None:
            code = server.proc.poll()
            return None if code is None else f"{server.spec.module} exited with {code}"

        try:
            await client.wait_healthy(timeout_s, interval_s, gone)
        except EngineUnavailable as exc:
            raise EngineUnavailable(
                f"{exc} (pid {server.pid}); log tail:\n{server.log_tail()}"
            ) from None
        finally:
            await client.close()

    await asyncio.gather(*(one(s) for s in servers))


def stop_servers(servers: Sequence[LaunchedServer], timeout_s: float = 10.0) -> None:
    """End every server's process group by pid: SIGTERM, wait, then SIGKILL."""
    stop([s.proc for s in servers], timeout_s)


def start_engines(
    rc: RolloutConfig,
    model_path: str,
    log_dir: Path,
    dtype: str = "float32",
    seed: int = 0,
    weight_master: str = "127.0.0.1",
    lora: Sequence[str] = (),
    spawner: Spawner | None = None,
) -> tuple[list[str], list[LaunchedServer]]:
    """Engine URLs for a run, and the servers started for it (empty when ``rc.urls`` is set).

    ``backend="local"`` launches ``rc.num_engines`` embedded engines; ``"sglang"``
    launches ``rc.num_engines`` SGLang servers (``rc.tp_size`` GPUs each, on
    consecutive GPUs via ``--base-gpu-id``). Embedded engines may join weight groups on
    loopback and at ``weight_master`` (the trainer's ``weights.master_address``). Callers
    wait with :func:`wait_healthy` and stop with :func:`stop_servers`. ``lora``: the
    embedded engines' LoRA flags (:func:`lora_engine_args`); ``spawner``: as :func:`launch`'s.
    """
    if rc.urls:
        return list(rc.urls), []
    servers: list[LaunchedServer] = []
    try:
        for i in range(rc.num_engines):
            spec = engine_spec(
                rc, model_path, i, dtype, seed, weight_master=weight_master, lora=lora
            )
            servers.append(launch(spec, log_dir / f"engine{i}.log", spawner=spawner))
    except BaseException:
        stop_servers(servers)
        raise
    return [s.url for s in servers], servers


def lora_engine_args(cfg: RunConfig) -> tuple[str, ...]:
    """The engines' flags for the run's ``lora`` section (none when LoRA is off): the
    adapters' shape and a ring of ``controller.max_staleness + 1`` versions, in the family's
    words (``EngineFamily.lora_args``)."""
    if not cfg.lora.enabled:
        return ()
    return family(cfg.rollout).lora_args(cfg.lora, cfg.controller.max_staleness + 1)


def engine_spec(
    rc: RolloutConfig,
    model_path: str,
    i: int,
    dtype: str = "float32",
    seed: int = 0,
    host: str | None = None,
    port: int | None = None,
    base_gpu: int | None = None,
    weight_master: str = "127.0.0.1",
    lora: Sequence[str] = (),
) -> LaunchSpec:
    """Engine ``i``'s server of a run: on ``host`` (default ``rc.host``) at ``port`` (default a
    free one there); a GPU server uses GPUs from ``base_gpu`` (default ``i * tp_size``, the
    engines of one host side by side; 0 where the launcher already narrowed the visible GPUs).
    ``dtype`` is the embedded engine's; SGLang's is ``sglang.launcher.sglang_dtype``'s. The
    flags are the family's (``EngineFamily.spec``)."""
    host = host or rc.host
    port = port or free_port(host)
    fam = family(rc)
    gpu = i * fam.gpus(rc) if base_gpu is None else base_gpu
    site = ServerSite(model_path, port, host, gpu, seed + 1000 + i, dtype, weight_master, (*lora,))
    return fam.spec(rc, site)
