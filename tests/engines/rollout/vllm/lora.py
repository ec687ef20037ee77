"""The vLLM stand-in's LoRA serving, written from vLLM 0.33.0's source (``ms`` =
``vllm/entrypoints/openai/models/serving.py``, ``ar`` = ``vllm/entrypoints/serve/lora/
api_router.py``, ``es`` = ``vllm/entrypoints/serve/engine/serving.py``):

- Flags: ``--enable-lora``, ``--max-loras`` (adapters in one batch), ``--max-lora-rank``
  (1, 8, 16, 32, 64, ..., config/lora.py:27-36), ``--max-cpu-loras``.
- The routes exist only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` (ar:30-32; else 404).
- ``POST /v1/load_lora_adapter`` {lora_name, lora_path} (ar:63-74): both needed, 400
  (ms:254-260); a name loaded already: 400 "has already been loaded" (ms:270-278); a folder
  without an adapter: 404 "No adapter found for PATH" (ms:196-205, exceptions.py:84-93); a
  rank above ``--max-lora-rank``: 500 "LoRA rank R is greater than max_lora_rank M"
  (peft_helper.py:194-197, ms:206-213); else 200 with the text "Success: LoRA adapter
  'NAME' added successfully." (ms:227-232).
- ``POST /v1/unload_lora_adapter`` {lora_name} (ar:81-96): an unknown name: 404 "cannot be
  found" (ms:293-300); else the name is forgotten at once (ms:234-248): requests already
  running keep their adapter (their ``LoRARequest``), new ones naming it get 404.
- ``/inference/v1/generate`` ``model``: a loaded adapter's name runs on it (es:199-200);
  no model or the base model's name: the base model; any other: 404 "The model `NAME` does
  not exist." (es:209-213).
- Each row adds its adapter's ``B(A(x)) * alpha / r`` on every target linear
  (``tests/engines/rollout/sglang/lora.py``'s hooks).

Ground truth (``lora`` in ``/standin/state``): per loaded name the sha256 of its tensors,
loads and unloads in order, the most names held at once.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from torch import nn

from tests.engines.rollout.sglang.lora import Adapter, add_row_hooks

RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # config/lora.py:27


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-loras", type=int, default=1)
    p.add_argument("--max-lora-rank", type=int, default=16, choices=RANKS)
    p.add_argument("--max-cpu-loras", type=int, default=None)
    p.add_argument("--lora-target-modules", nargs="*", default=None)  # the stand-in's hooks


class VLLMLora:
    def __init__(self, args: argparse.Namespace, model: nn.Module, base_name: str):
        self.enabled = bool(args.enable_lora)
        self.routes = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0") in ("1", "true")
        self.max_rank = args.max_lora_rank
        self.base_name = base_name
        self.names: dict[str, Adapter] = {}  # ms lora_requests
        self.rows: list[Adapter | None] = []
        self.events: list[dict[str, str]] = []
        self.sha: dict[str, str] = {}
        self.most_held = 0
        targets = set(args.lora_target_modules or ())
        add_row_hooks(model, targets, lambda: self.rows)

    def load(self, body: dict[str, Any]) -> tuple[Any, int]:
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return "Both 'lora_name' and 'lora_path' must be provided.", 400
        if name in self.names:
            return (
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
                400,
            )
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            return f"Loading lora {name} failed: No adapter found for {path}", 404
        ad = Adapter(path)
        if ad.r > self.max_rank:
            return f"LoRA rank {ad.r} is greater than max_lora_rank {self.max_rank}.", 500
        self.names[name] = ad
        self.sha[name] = ad.sha256
        self.events.append({"load": name})
        self.most_held = max(self.most_held, len(self.names))
        return f"Success: LoRA adapter '{name}' added successfully.", 200

    def unload(self, body: dict[str, Any]) -> tuple[Any, int]:
        name = body.get("lora_name")
        if not name:
            return "'lora_name' needs to be provided to unload a LoRA adapter.", 400
        if name not in self.names:
            return f"The lora adapter '{name}' cannot be found.", 404
        del self.names[name]
        self.events.append({"unload": name})
        return f"Success: LoRA adapter '{name}' removed successfully.", 200

    def resolve(self, model: str | None) -> tuple[Adapter | None, str | None]:
        """The adapter a request's ``model`` names (None: the base model), or the 404
        message."""
        if model in self.names:
            return self.names[model], None
        if not model or model == self.base_name:
            return None, None
        return None, f"The model `{model}` does not exist."

    def state(self) -> dict[str, Any]:
        return {
            "held": sorted(self.names),
            "events": self.events,
            "sha256": self.sha,
            "most_held": self.most_held,
        }
