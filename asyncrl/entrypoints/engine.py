"""The engine process: the embedded rollout engine behind SGLang's HTTP protocol.

``python -m asyncrl.entrypoints.engine --model-path DIR --port N`` (or ``asyncrl serve``;
``asyncrl run`` starts one per engine through :mod:`asyncrl.engines.rollout.launcher`,
which passes SGLang's launch flags, so the same launcher starts SGLang or this). Serves
until SIGTERM/SIGINT; binds ``--host`` only (loopback by default). The server itself is
:mod:`asyncrl.engines.rollout.local.server`; its flags are
:mod:`asyncrl.entrypoints.engine_args`'s; this module loads the model and runs the event
loop.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import torch
from aiohttp import web

from asyncrl import secret, trace
from asyncrl.engines.rollout.local.lora import LoraSpec
from asyncrl.engines.rollout.local.server import EngineServer, build_app, load_engine
from asyncrl.engines.rollout.local.weights import WeightReceiver
from asyncrl.entrypoints.engine_args import parser
from asyncrl.loops import new_event_loop
from asyncrl.procs import log_startup

__all__ = ["main", "serve"]


def _lora_spec(args: argparse.Namespace) -> LoraSpec | None:
    if not args.enable_lora:
        return None
    targets = tuple(t.strip() for t in args.lora_target_modules.split(",") if t.strip())
    return LoraSpec(
        args.max_lora_rank, args.lora_alpha, targets, args.max_loaded_loras, args.lora_name
    )


def _secret(args: argparse.Namespace) -> tuple[str, Path | None]:
    """The key every request must carry, and the file this process wrote it to (None when
    the key was given): a fresh one (nobody gave one) is written to a file only this user
    can read, whose path is logged (never the key); :func:`main` removes it at exit."""
    given = secret.held(args.secret_file)  # a run's (its pipe; a fork server's child holds
    if given is not None:  # it already), ASYNCRL_SECRET(_FILE) or --secret-file
        return given, None
    key = secret.load()  # nobody gave one: a fresh one, in a file only this user reads
    folder = Path(os.environ.get("XDG_RUNTIME_DIR") or Path.home() / ".cache" / "asyncrl")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"engine-{args.port}.secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    os.chmod(path, 0o600)
    logging.getLogger("asyncrl.engine").warning(
        "no run secret given: requests must carry the key in %s (Authorization: Bearer; "
        "removed when this engine exits)",
        path,
    )
    return key, path


_log = logging.getLogger("asyncrl.engine")


def main(argv: list[str] | None = None, receiver: type[WeightReceiver] = WeightReceiver) -> None:
    """Serve until SIGTERM/SIGINT (``receiver``: the receiving side of weight sync, see
    :class:`~asyncrl.engines.rollout.local.server.EngineServer`)."""
    serve(parser().parse_args(argv), receiver)


def serve(args: argparse.Namespace, receiver: type[WeightReceiver] = WeightReceiver) -> None:
    """:func:`main` with its flags parsed (``asyncrl serve`` parses them before it imports
    this module: ``asyncrl serve --help`` and a mistyped flag cost no torch import)."""
    if args.tp_size != 1:
        raise SystemExit("the embedded engine has no tensor parallelism: --tp-size must be 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    torch.set_num_threads(args.threads)
    if not args.model_path:  # the tiny default model, as `asyncrl run` makes it
        from asyncrl.tasks.tiny_model import default_model_dir, ensure_tiny_model

        args.model_path = str(ensure_tiny_model(default_model_dir()))
    trace.configure_from_env(f"engine-{args.port}")  # on when started by a traced run
    log_startup(_log, "asyncrl's modules imported (the model's classes load with the model)")
    engine = load_engine(
        args.model_path,
        args.device,
        args.dtype,
        args.max_batch_size,
        args.seed,
        args.max_prefill_tokens,
        args.kv_after_update,
        args.context_length,
        args.max_prompt_tokens,
        args.stall_timeout,
        _lora_spec(args),
    )
    log_startup(_log, f"model loaded on {args.device}")
    server = EngineServer(engine, args.model_path, args.host, args.weight_masters, receiver)
    key, key_file = _secret(args)
    app = build_app(server, key)
    loop = new_event_loop()  # uvloop when installed: lower latency of every control call
    try:
        web.run_app(  # handler_cancellation: a client that hangs up aborts its requests
            app,
            host=args.host,
            port=args.port,
            print=None,
            access_log=None,
            loop=loop,
            handler_cancellation=True,
        )
    finally:  # SIGTERM / SIGINT end run_app: the key made for this engine goes with it
        if key_file is not None:
            key_file.unlink(missing_ok=True)
    # Shutdown was orderly (engine stopped, sockets closed); skip the interpreter's slow
    # teardown of torch/transformers, which takes seconds on a loaded machine.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
