"""SGLang server processes: the flags of ``sglang serve`` (or ``python -m
sglang.launch_server``) for one engine of a run. Starting, health-waiting and stopping
are the generic launcher's (:mod:`asyncrl.engines.rollout.launcher`)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from asyncrl.config import LoraConfig, SGLangRolloutConfig
from asyncrl.engines.rollout.launcher import SGLANG_SERVER, LaunchSpec, ServerSite, stored_dtype

__all__ = [
    "SGLANG_CLI",
    "SGLANG_SERVER",
    "sglang_dtype",
    "sglang_entry_point",
    "sglang_lora_args",
    "sglang_spec",
]

SGLANG_CLI = "sglang.cli.main:main"
"""SGLang's ``sglang`` console script (its wheels' entry_points.txt, 0.5.10 to 0.5.23)."""


def sglang_entry_point(choice: str = "auto") -> tuple[str, ...]:
    """How to start SGLang: ``(entry point, "serve")`` for ``sglang serve``, ``()`` for
    ``python -m sglang.launch_server``.

    ``auto``: ``serve`` when the installed SGLang distribution declares the ``sglang``
    console script and ships ``sglang/cli/serve.py`` (0.5.10 to 0.5.23 do: cli/main.py
    dispatches ``serve`` to cli/serve.py, which parses the flags with the same
    ``prepare_server_args``; launch_server.py warns that ``sglang serve`` is the
    recommended entrypoint), read from its metadata without importing it. No SGLang here
    (e.g. it lives only on the engine's node): ``launch_server``, which every version has.
    """
    if choice == "launch_server":
        return ()
    try:
        dist = importlib.metadata.distribution("sglang")
    except importlib.metadata.PackageNotFoundError:
        return (SGLANG_CLI, "serve") if choice == "serve" else ()
    for ep in dist.entry_points:
        if ep.group == "console_scripts" and ep.name == "sglang":
            if choice == "serve" or Path(str(dist.locate_file("sglang/cli/serve.py"))).is_file():
                return (ep.value, "serve")
    return (SGLANG_CLI, "serve") if choice == "serve" else ()


def sglang_dtype(rc: SGLangRolloutConfig, model_path: str) -> str:
    """``--dtype`` of a launched SGLang server (see ``RolloutConfig.dtype``): SGLang's
    ``auto`` serves a float32 checkpoint in float16 (srt/configs/model_config.py:2303-2319
    in 0.5.23), which overflows where the trainer's bfloat16 does not; so ``auto`` here is
    SGLang's ``auto`` only for checkpoints stored in bfloat16 or float16."""
    if rc.dtype != "auto":
        return rc.dtype
    return "auto" if stored_dtype(model_path) in ("bfloat16", "float16") else "bfloat16"


def sglang_lora_args(lc: LoraConfig, capacity: int) -> tuple[str, ...]:
    """SGLang's LoRA flags for a run's adapters (0.5.10 server_args.py:4578-4626): LoRA on
    with no adapter at start (``--max-lora-rank`` and ``--lora-target-modules`` are then
    required, :6326-6329), and room for ``capacity`` versions plus the base model (version
    0's requests) in one running batch (``--max-loras-per-batch``, which counts base-only
    requests, :4616-4619). No ``--max-loaded-loras``: its LRU eviction runs *after* a load
    (tokenizer_communicator_mixin.py:679-705) and may pick a version other than the oldest;
    asyncrl's sender unloads the oldest itself before each load."""
    return (
        "--enable-lora",
        "--max-lora-rank", str(lc.rank),
        "--lora-target-modules", *lc.target_modules,
        "--max-loras-per-batch", str(capacity + 1),
    )  # fmt: skip


def sglang_spec(rc: SGLangRolloutConfig, at: ServerSite) -> LaunchSpec:
    """One SGLang server of a run at ``at``: ``rc.tp_size`` GPUs from ``at.gpu``
    (``--base-gpu-id``), :func:`sglang_dtype`, sampling seed ``at.seed``, the run's LoRA flags
    ``at.lora`` (:func:`sglang_lora_args`), ``rc.extra_args`` last."""
    extra = ["--dtype", sglang_dtype(rc, at.model_path), "--random-seed", str(at.seed)]
    extra += ["--base-gpu-id", str(at.gpu), *at.lora]
    return LaunchSpec(
        at.model_path,
        at.port,
        at.host,
        rc.tp_size,
        rc.mem_fraction_static or None,
        (*extra, *rc.extra_args),
        SGLANG_SERVER,
        entry_point=sglang_entry_point(rc.sglang_entrypoint),
        key_flag="--api-key",  # the run secret (asyncrl.entrypoints.keyed)
    )
