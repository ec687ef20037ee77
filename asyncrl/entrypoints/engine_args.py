"""The flags of the embedded engine (``asyncrl serve``, ``python -m asyncrl.entrypoints.engine``),
apart from :mod:`asyncrl.entrypoints.engine` so that parsing them imports no torch:
``asyncrl serve --help`` and a mistyped flag answer in the time of an interpreter start."""

from __future__ import annotations

import argparse

__all__ = ["parser"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="asyncrl serve",
        description="The embedded rollout engine: an HTTP server speaking SGLang's protocol "
        "(/generate, /pause_generation, /update_weights_from_distributed, ...), continuous "
        "batching on a CPU or a CUDA device. Serves until SIGTERM/SIGINT.",
    )
    _add_model(p)
    _add_limits(p)
    p.add_argument(
        "--weight-masters",
        default="loopback",
        help="addresses or CIDRs (comma-separated; 'loopback' = 127.0.0.0/8 and ::1) where "
        "/init_weights_update_group may make this engine join a weight group",
    )
    _add_lora(p)
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


def _add_model(p: argparse.ArgumentParser) -> None:
    """What is served, where, and on which device."""
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


def _add_limits(p: argparse.ArgumentParser) -> None:
    """Batching, request-length and stall limits, and the KV cache across a weight update."""
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


def _add_lora(p: argparse.ArgumentParser) -> None:
    """Serving LoRA adapters (``--enable-lora``) and their shape."""
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
