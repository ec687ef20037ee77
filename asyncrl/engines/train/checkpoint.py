"""Checkpoints of an FSDPEngine: torch distributed checkpoint (DCP) and Hugging Face export.

A checkpoint folder holds the DCP shards of model + optimizer state (resharded on
load, so it resumes at any world size), ``trainer_state.json`` (step, LR
schedule, role, world size at save time) and ``rng/rank{r}.safetensors`` (each
rank's RNG states; a rank with no saved state of its own keeps its seed).
With LoRA (``engine.lora``) a checkpoint holds the adapter and its optimizer state only
(the frozen base comes from the model folder again), and :func:`export_hf` writes the
adapter in PEFT's folder format to ``<dir>/adapter`` (plus the merged model in ``<dir>``
when ``lora.export_merged``).
Every function here is collective: call it on every rank.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from asyncrl.engines.train import lora

if TYPE_CHECKING:
    from asyncrl.engines.train.fsdp import FSDPEngine

__all__ = ["export_hf", "load", "save"]

_STATE = "trainer_state.json"
_WEIGHT_FILES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".safetensors.index.json",
    ".bin.index.json",
)
_SHARD_BYTES = 4 << 30


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _options(engine: FSDPEngine) -> StateDictOptions:
    """State-dict options: a LoRA engine's frozen base is left out (adapter + optimizer; on
    load the base keys are absent, not missing)."""
    return StateDictOptions(ignore_frozen_params=engine.lora, strict=not engine.lora)


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def save(
    engine: FSDPEngine, path: str | Path, async_group: dist.ProcessGroup | None = None
) -> Future | None:
    """Write model, optimizer, schedule, step and RNG of every rank to ``path``.

    With ``async_group`` (a Gloo group of every trainer rank, kept for checkpoints only,
    so the background writes never share a communicator with training) the shards are
    staged into CPU memory here and written by a background thread
    (``dcp.async_save``); the returned future completes when they are on disk on every
    rank. The RNG and ``trainer_state.json`` are written before returning either way.
    """
    from safetensors.torch import save_file

    path = Path(path)
    model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer, options=_options(engine))
    sd = {"model": model_sd, "optim": optim_sd}
    future: Future | None = None
    if async_group is not None and dist.is_initialized():
        got = dcp.async_save(sd, checkpoint_id=str(path), process_group=async_group)
        future = got if isinstance(got, Future) else got.upload_completion
    else:
        dcp.save(sd, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    rank = _rank()
    (path / "rng").mkdir(parents=True, exist_ok=True)
    save_file(_rng_state(), str(path / "rng" / f"rank{rank}.safetensors"))
    if rank == 0:
        tc = engine.config.trainer
        state = {
            "step": engine.step,
            "role": engine.role,
            "world_size": engine.world,
            "lora": engine.lora,
            "schedule": {
                "lr": tc.lr,
                "lr_schedule": tc.lr_schedule,
                "warmup_steps": tc.warmup_steps,
                "decay_steps": tc.decay_steps,
                "min_lr_ratio": tc.min_lr_ratio,
            },
        }
        (path / _STATE).write_text(json.dumps(state, indent=1))
    _barrier()
    return future


def load(engine: FSDPEngine, path: str | Path) -> None:
    """Restore a checkpoint written by :func:`save` at any world size."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / _STATE).is_file():
        raise ValueError(f"{path} is not an asyncrl checkpoint (no {_STATE})")
    state = json.loads((path / _STATE).read_text())
    if state["role"] != engine.role:
        raise ValueError(
            f"{path} holds a {state['role']} checkpoint, this engine is a {engine.role}"
        )
    if bool(state.get("lora", False)) != engine.lora:
        kinds = ("a full-model", "a LoRA-adapter")
        raise ValueError(
            f"{path} holds {kinds[bool(state.get('lora'))]} checkpoint, this engine trains "
            f"{kinds[engine.lora].split(' ', 1)[1]} (lora.rank must match the checkpoint's run)"
        )
    options = _options(engine)
    model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer, options=options)
    sd: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    set_state_dict(
        engine.model,
        engine.optimizer,
        model_state_dict=sd["model"],
        optim_state_dict=sd["optim"],
        options=options,
    )
    engine.step = int(state["step"])
    rng = path / "rng" / f"rank{_rank()}.safetensors"
    if rng.is_file():
        saved = load_file(str(rng))
        torch.set_rng_state(saved["cpu"])
        if "cuda" in saved and torch.cuda.is_available():
            torch.cuda.set_rng_state(saved["cuda"])
    _barrier()


def export_hf(engine: FSDPEngine, path: str | Path) -> None:
    """Write a Hugging Face folder (config, safetensors shards, tokenizer files) on rank 0.

    Weights stream through ``engine.named_weights()`` and are written shard by shard,
    so rank 0 never holds more than one shard (at most 4 GiB) of them.
    """
    if engine.lora:
        _export_lora(engine, Path(path))
        return
    _export_tensors(engine, Path(path), engine.named_weights())


def _export_lora(engine: FSDPEngine, path: Path) -> None:
    """The adapter in PEFT's format in ``path/adapter``; the merged model in ``path`` when
    ``lora.export_merged`` (collective)."""
    lc = engine.config.lora
    adapter = {n: t.to("cpu") for n, t in engine.named_weights()}
    if _rank() == 0:
        lora.write_adapter(path / lora.ADAPTER_DIR, lc, engine.model_path, adapter)
    if lc.export_merged:
        _export_tensors(engine, path, lora.merged(engine.named_parameters_full(), lc.scaling))
    _barrier()


def _export_tensors(
    engine: FSDPEngine, path: Path, named: Iterator[tuple[str, torch.Tensor]]
) -> None:
    """``named`` (full tensors under HF names) as a sharded HF folder at ``path`` on rank 0."""
    from safetensors.torch import save_file

    rank0 = _rank() == 0
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    index: dict[str, str] = {}
    if rank0:
        path.mkdir(parents=True, exist_ok=True)

    def flush(final: bool) -> None:
        name = f"model-{len(shards):05d}.safetensors"
        if final and len(shards) == 1:
            name = "model.safetensors"
        save_file(shards[-1], str(path / name), metadata={"format": "pt"})
        index.update(dict.fromkeys(shards[-1], name))
        shards[-1] = {}

    for name, tensor in named:
        if not rank0:
            continue
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > _SHARD_BYTES:
            flush(final=False)
            shards.append({})
            size = 0
        shards[-1][name] = tensor.to("cpu").contiguous()
        size += nbytes
    if rank0:
        flush(final=True)
        if len(shards) > 1:
            idx = {"metadata": {}, "weight_map": index}
            (path / "model.safetensors.index.json").write_bytes(msgspec.json.encode(idx))
        _write_config(engine, path)
    _barrier()


def _write_config(engine: FSDPEngine, path: Path) -> None:
    """config.json naming the HF class (not FSDP's wrapper), plus tokenizer/generation files."""
    import copy

    cfg = copy.deepcopy(engine.model.config)
    cfg.architectures = [engine.hf_class]
    cfg.use_cache = True
    cfg.save_pretrained(str(path))
    src = Path(engine.model_path)
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith(_WEIGHT_FILES):
            shutil.copy2(f, path / f.name)
