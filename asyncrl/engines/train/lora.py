"""LoRA on the trainer's actor (PEFT): wrap, name the adapter's tensors, export.

Contract:

- :func:`wrap` puts a PEFT LoRA adapter (``lora`` config section) on a Hugging Face causal
  LM and freezes everything else: only the adapter trains. PEFT is imported here only, and
  only when LoRA is on (the ``lora`` extra).
- Adapter tensors travel and are exported under PEFT's saved names
  (``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``, the adapter's own name
  left out), the names ``PeftModel.from_pretrained`` loads and engines match against their
  base model (:func:`split_name`).
- :func:`write_adapter` writes PEFT's folder (``adapter_config.json`` +
  ``adapter_model.safetensors``); :func:`merged` turns full base + adapter tensors into the
  merged model's (``W + scaling * B @ A``), for a plain Hugging Face export.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from asyncrl.config import LoraConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "ADAPTER_DIR",
    "PREFIX",
    "is_adapter_param",
    "merged",
    "saved_name",
    "split_name",
    "wrap",
    "write_adapter",
]

ADAPTER = "default"  # PEFT's adapter name inside the wrapped model
PREFIX = "base_model.model."
"""PEFT's prefix of every module name of the wrapped model (and of its saved keys)."""
ADAPTER_DIR = "adapter"
"""Where the adapter goes inside an export folder (``RUN_DIR/final/adapter``)."""


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise ValueError(
            "lora.rank > 0 needs PEFT: pip install 'asyncrl[lora]' (or lora.rank=0)"
        ) from None
    return peft


def wrap(model: PreTrainedModel, cfg: LoraConfig) -> torch.nn.Module:
    """``model`` with a fresh LoRA adapter (B = 0: the wrapped model computes exactly what
    ``model`` did); every base parameter frozen."""
    peft = _peft()
    pc = peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
    )
    wrapped = peft.get_peft_model(model, pc, adapter_name=ADAPTER)
    if not any(is_adapter_param(n) for n, _ in wrapped.named_parameters()):
        raise ValueError(f"lora.target_modules {list(cfg.target_modules)} matched no layer")
    return wrapped


def is_adapter_param(name: str) -> bool:
    """Whether the wrapped model's parameter ``name`` belongs to the adapter."""
    return f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name


def saved_name(name: str) -> str:
    """PEFT's saved key of adapter parameter ``name`` (the adapter's name dropped)."""
    return name.replace(f".lora_A.{ADAPTER}.", ".lora_A.").replace(
        f".lora_B.{ADAPTER}.", ".lora_B."
    )


def split_name(key: str) -> tuple[str, str]:
    """``(module, "A" | "B")`` of a saved adapter key: the base model's module name (e.g.
    ``model.layers.0.self_attn.q_proj``) and which factor; ValueError for any other key."""
    body = key.removeprefix(PREFIX)
    for part in ("A", "B"):
        tail = f".lora_{part}.weight"
        if body.endswith(tail) and body != key:
            return body[: -len(tail)], part
    raise ValueError(f"{key!r} is not a LoRA adapter tensor ({PREFIX}<module>.lora_A|B.weight)")


def write_adapter(
    path: str | Path, cfg: LoraConfig, base_path: str, tensors: dict[str, torch.Tensor]
) -> None:
    """PEFT's adapter folder at ``path`` from saved-name ``tensors`` (loads with
    ``PeftModel.from_pretrained(base, path)``)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    peft = _peft()
    pc = peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=sorted({split_name(k)[0].rsplit(".", 1)[-1] for k in tensors}),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=str(base_path),
    )
    pc.save_pretrained(str(path))
    cpu = {k: t.detach().to("cpu").contiguous() for k, t in tensors.items()}
    save_file(cpu, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    json.loads((path / "adapter_config.json").read_text())  # written and readable


def merged(
    named: Iterable[tuple[str, torch.Tensor]], scaling: float
) -> Iterator[tuple[str, torch.Tensor]]:
    """The merged model's tensors under the base model's names, from the wrapped model's full
    tensors (``named``: base weights and adapter factors, in any order). A target layer's
    weight (PEFT's ``<module>.base_layer.weight``) is held until both its factors arrived and
    then yielded as ``W + scaling * B @ A`` (computed in float32); every other tensor at once."""
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in named:
        if is_adapter_param(name):
            module, part = split_name(saved_name(name))
        elif name.endswith(".base_layer.weight"):
            module, part = name.removeprefix(PREFIX)[: -len(".base_layer.weight")], "W"
        else:
            yield name.removeprefix(PREFIX).replace(".base_layer.", "."), t
            continue
        got = held.setdefault(module, {})
        got[part] = t
        if len(got) == 3:
            del held[module]
            delta = (got["B"].float() @ got["A"].float()) * scaling
            yield f"{module}.weight", (got["W"].float() + delta).to(got["W"].dtype)
    if held:
        raise ValueError(f"incomplete adapter layers (weight, lora_A, lora_B): {sorted(held)[:3]}")
