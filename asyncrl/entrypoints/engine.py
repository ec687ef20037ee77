"""The engine process: the embedded rollout engine behind SGLang's HTTP protocol.

``python -m asyncrl.entrypoints.engine --model-path DIR --port N`` (or ``asyncrl serve``;
``asyncrl run`` starts one per engine through :mod:`asyncrl.engines.rollout.launcher`,
which passes SGLang's launch flags, so the same launcher starts SGLang or this). Serves
until SIGTERM/SIGINT; binds ``--host`` only (loopback by default). The server itself is
:mod:`asyncrl.engines.rollout.local.server`; this module parses flags, loads the model
and runs the event loop.
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
from asyncrl.loops import new_event_loop

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="asyncrl serve",
        description="The embedded rollout engine: an HTTP server speaking SGLang's protocol "
        "(/generate, /pause_generation, /update_weights_from_distributed, ...), continuous "
        "batching on a CPU or a CUDA device. Serves until SIGTERM/SIGINT.",
    )
    p.add_argument(
        "--model-path",
        default="",
        help="local Hugging Face model folder (default: the tiny default model, built once)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--port", type=int, default=30000, help="port to bind")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="parameter dtype the model is served in",
    )
    p.add_argument(
        "--max-batch-size", type=int, default=256, help="most sequences decoded together"
    )
    p.add_argument(
        "--max-prefill-tokens", type=int, default=8192, help="token budget of one prefill step"
    )
    p.add_argument(
        "--kv-after-update",
        default="recompute",
        choices=["recompute", "keep"],
        help="KV cache of requests in flight across a weight update (see LocalEngine)",
    )
    p.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="most prompt + new tokens of a request (default: the model's max_position_embeddings)",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="longest prompt admitted (default: the context length); longer ones get HTTP 400",
    )
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=60.0,
        help="/health answers 503 while one scheduler step has run longer than this (seconds)",
    )
    p.add_argument(
        "--weight-masters",
        default="loopback",
        help="addresses or CIDRs (comma-separated; 'loopback' = 127.0.0.0/8 and ::1) where "
        "/init_weights_update_group may make this engine join a weight group",
    )
    p.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters: an in-memory ring of adapter versions (see local/lora.py)",
    )
    p.add_argument("--max-lora-rank", type=int, default=8, help="the adapters' rank")
    p.add_argument("--lora-alpha", type=float, default=16.0, help="adapters scale by alpha/rank")
    p.add_argument(
        "--lora-target-modules",
        default="q_proj,k_proj,v_proj,o_proj",
        help="comma-separated names of the linear layers with an adapter",
    )
    p.add_argument(
        "--max-loaded-loras",
        type=int,
        default=2,
        help="adapter versions held at once (the run's max_staleness + 1)",
    )
    p.add_argument("--lora-name", default="policy", help="versions are served as NAME-vN")
    p.add_argument(
        "--secret-file",
        default="",
        help="file (mode 0600) holding the key every request must carry as 'Authorization: "
        "Bearer KEY' (default: the run's, handed over by asyncrl; else ASYNCRL_SECRET or "
        "ASYNCRL_SECRET_FILE; else a fresh key, written to a 0600 file named in the log)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of sampling")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    # SGLang launch_server flags, so the SGLang launcher can start this server too.
    p.add_argument("--tp-size", "--tp", type=int, default=1, help="must be 1 (no tensor parallel)")
    p.add_argument("--mem-fraction-static", type=float, default=None, help="accepted, unused")
    return p


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


def main(argv: list[str] | None = None, receiver: type[WeightReceiver] = WeightReceiver) -> None:
    """Serve until SIGTERM/SIGINT (``receiver``: the receiving side of weight sync, see
    :class:`~asyncrl.engines.rollout.local.server.EngineServer`)."""
    args = _parser().parse_args(argv)
    if args.tp_size != 1:
        raise SystemExit("the embedded engine has no tensor parallelism: --tp-size must be 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    torch.set_num_threads(args.threads)
    if not args.model_path:  # the tiny default model, as `asyncrl run` makes it
        from asyncrl.tasks.tiny_model import default_model_dir, ensure_tiny_model

        args.model_path = str(ensure_tiny_model(default_model_dir()))
    trace.configure_from_env(f"engine-{args.port}")  # on when started by a traced run
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
