"""The SGLang stand-in's LoRA serving, written from SGLang's source.

0.5.10 lines unless noted (``tcm`` = ``srt/managers/tokenizer_communicator_mixin.py``,
0.5.23's ``tokenizer_control_mixin.py``; ``tm`` = ``srt/managers/tokenizer_manager.py``;
``lm`` = ``srt/lora/lora_manager.py``; ``hs`` = ``srt/entrypoints/http_server.py``;
``sa`` = ``srt/server_args.py``):

- Flags: ``--enable-lora``, ``--max-lora-rank``, ``--lora-target-modules`` (nargs ``*``),
  ``--max-loras-per-batch`` (default 8, base-only requests count), ``--max-loaded-loras``
  (sa:4578-4626). Without ``--lora-paths`` both the rank and the targets are required
  (sa:6326-6329); ``--max-loaded-loras >= --max-loras-per-batch`` (sa:6331-6336).
- The registry is SGLang's own ``LoRARegistry`` (``srt/lora/lora_registry.py``): imported
  (0.5.22+), or run from its source with SGLang's own ``ConcurrentCounter`` and ``RWLock``
  (0.5.10, whose ``srt.utils`` imports torchvision).
- ``/load_lora_adapter`` {lora_name, lora_path} (hs:1217-1232): LoRA off: 400 (tcm:646-650);
  under ``lora_update_lock`` (tcm:663): the folder read as ``LoRAConfig`` reads it
  (``adapter_config.json``'s ``r``, ``lora_alpha``, ``target_modules``, lora_config.py:26-45;
  ``adapter_model.safetensors``), checked (lm:180-218: a name already loaded, "already
  loaded"; a rank above ``--max-lora-rank`` or a target outside ``--lora-target-modules``,
  "incompatible", mem_pool.py:118-134), loaded, *then* registered and cached by name
  (tcm:671-675); then LRU eviction while more than ``--max-loaded-loras`` are registered
  (tcm:677-705). The answer is ``LoRAUpdateOutput`` {success, error_message,
  loaded_adapters}: 200, or 400 when not successful.
- ``/unload_lora_adapter`` {lora_name} (hs:1250-1265): under ``lora_update_lock``: unregister
  (an unknown name: 400 "does not exist", lora_registry.py:105-111; from here new requests
  naming it are refused), wait until no request uses it (``wait_for_unload``), then drop it
  (tcm:619-637, 787-813).
- 0.5.22+ (0.5.23 ``tokenizer_control_mixin.py``, ``tcm23``): an unload whose backend step
  failed stays *pending* (the name unregistered, its lora_id kept; 400 with the ranks'
  error); the next unload of that name skips the unregister and retries the backend step
  (tcm23:636-657). A load whose ranks failed while some rank loaded it leaves the name
  pending too (not registered, tcm23:697-706, ``_lora_load_needs_cleanup`` :171-177); a
  load of a pending name is refused: "LoRA adapter 'NAME' has an incomplete unload. Retry
  the unload before loading it again." (tcm23:681-686). 0.5.10 has none of this.
  Test-only faults (SGLang has no such switch): ``--lora-fail-load NAME`` (its first load
  fails on the last rank after the others loaded it), ``--lora-fail-unload NAME`` (its
  first unload's backend step fails).
- ``/generate`` ``lora_path`` (one name, or one per item; io_struct.py:181, 413-421): LoRA
  off: 400 (tm:2239-2250); a name not registered that was loaded before is *reloaded from
  its folder* (tm:2270-2299; a failed reload: 400 "Failed to implicitly load LoRA adapter
  NAME"); a name never loaded: 400 "has never been loaded"; then ``acquire`` (tm:2301), and
  ``release`` when the request finishes or is aborted (tm:1683-1684, 1229-1230). /generate
  errors are 400 ``{"error": {"message"}}`` (hs:689-691).
- A running batch holds at most ``--max-loras-per-batch`` distinct adapters, the base model
  included (``validate_lora_batch``, lm:245-274): the other requests wait.
- Each row adds ``B(A(x)) * lora_alpha / r`` of its own adapter on every target linear
  (srt/lora/lora.py:64).

Test-only ground truth (``lora`` in ``/standin/state``): the adapter that made each token
(per rid), the sha256 of every loaded adapter's tensors, loads and unloads in order, and
the most adapters held at once.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import hashlib
import json
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

PREFIX = "base_model.model."
OFF = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."  # tcm:646-650


def add_flags(p: argparse.ArgumentParser) -> None:
    """SGLang's LoRA flags (sa:4578-4626)."""
    p.add_argument("--enable-lora", action="store_true", default=None)
    p.add_argument("--max-lora-rank", type=int, default=None)
    p.add_argument("--lora-target-modules", nargs="*", default=None)
    p.add_argument("--max-loras-per-batch", type=int, default=8)
    p.add_argument("--max-loaded-loras", type=int, default=None)
    p.add_argument("--lora-fail-load", action="append", default=[], help="test-only fault")
    p.add_argument("--lora-fail-unload", action="append", default=[], help="test-only fault")


def load_registry() -> tuple[Any, Any, str]:
    """SGLang's ``LoRARegistry`` and ``LoRARef``, and how they loaded."""
    try:
        from sglang.srt.lora.lora_registry import LoRARef, LoRARegistry

        return LoRARegistry, LoRARef, "imported"
    except ImportError as exc:
        how = f"from source ({type(exc).__name__}: {exc})"
    import sglang

    srt = Path(sglang.__file__).parent / "srt"
    ns: dict[str, Any] = {}
    exec(compile((srt / "utils" / "aio_rwlock.py").read_text(), "aio_rwlock.py", "exec"), ns)
    common = ast.parse((srt / "utils" / "common.py").read_text())
    counter = [
        n for n in common.body if isinstance(n, ast.ClassDef) and n.name == "ConcurrentCounter"
    ]
    ns.update(asyncio=asyncio, Callable=Callable)
    exec(compile(ast.Module(counter, []), str(srt / "utils" / "common.py"), "exec"), ns)
    reg = ast.parse((srt / "lora" / "lora_registry.py").read_text())
    body = [  # its own imports of sglang.srt.utils are the namespace given
        n for n in reg.body if not (isinstance(n, ast.ImportFrom) and "sglang" in (n.module or ""))
    ]
    mod = types.ModuleType("_sglang_lora_registry")
    sys.modules[mod.__name__] = mod  # dataclasses resolve their module by name
    mod.__dict__.update(ConcurrentCounter=ns["ConcurrentCounter"], RWLock=ns["RWLock"])
    exec(
        compile(ast.Module(body, []), str(srt / "lora" / "lora_registry.py"), "exec"), mod.__dict__
    )
    return mod.LoRARegistry, mod.LoRARef, how


class Adapter:
    """One loaded adapter: per target layer ``(A, B)``, its scaling, its tensors' sha256."""

    def __init__(self, folder: str):
        from safetensors.torch import load_file

        cfg = json.loads((Path(folder) / "adapter_config.json").read_text())
        self.r, self.alpha = int(cfg["r"]), float(cfg["lora_alpha"])
        self.targets = set(cfg["target_modules"])
        self.scaling = self.alpha / self.r
        tensors = load_file(str(Path(folder) / "adapter_model.safetensors"))
        h = hashlib.sha256()
        for k in sorted(tensors):
            h.update(k.encode())
            h.update(tensors[k].contiguous().view(torch.uint8).numpy().tobytes())
        self.sha256 = h.hexdigest()
        self.layers: dict[str, dict[str, torch.Tensor]] = {}
        for k, t in tensors.items():
            layer, _, part = k.removeprefix(PREFIX).rpartition(".lora_")
            self.layers.setdefault(layer, {})[part[0]] = t.float()


def add_row_hooks(
    model: nn.Module, targets: set[str], rows: Callable[[], list[Adapter | None]]
) -> None:
    """On every target linear: each row of the forward adds its own adapter's
    ``B(A(x)) * scaling`` (``rows()``: the adapter of each row, None: the base model)."""

    def hook_of(layer: str) -> Any:
        def hook(mod: nn.Module, inp: tuple[torch.Tensor, ...], out: torch.Tensor) -> Any:
            adapters = rows()
            if not any(adapters):
                return out
            x, delta = inp[0], torch.zeros_like(out)
            for i, ad in enumerate(adapters):
                ab = ad.layers.get(layer) if ad is not None else None
                if ab is not None:
                    delta[i] = (x[i] @ ab["A"].T) @ ab["B"].T * ad.scaling
            return out + delta

        return hook

    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            mod.register_forward_hook(hook_of(name))


class LoraServing:
    def __init__(self, args: argparse.Namespace, model: nn.Module):
        self.enabled = bool(args.enable_lora)
        self.max_rank = args.max_lora_rank
        self.targets = set(args.lora_target_modules or [])
        self.per_batch = int(args.max_loras_per_batch)
        self.max_loaded = args.max_loaded_loras
        if self.enabled:
            assert self.max_rank and self.targets, "sa:6326-6329"
            assert self.max_loaded is None or self.max_loaded >= self.per_batch, "sa:6331-6336"
        Registry, self.Ref, self.loaded_how = load_registry()
        self.registry = Registry(None)
        self.ref_cache: dict[str, Any] = {}  # tm lora_ref_cache: name -> LoRARef
        self.adapters: dict[str, Adapter] = {}  # lora_id -> weights (the ranks' copy)
        self.names: dict[str, str] = {}  # lora_id -> name
        self.lock: asyncio.Lock | None = None
        self.rows: list[str | None] = []  # lora_id of each row of the forward under way
        self.events: list[dict[str, Any]] = []  # loads and unloads, in order
        self.sha: dict[str, str] = {}  # name -> sha256 of what was loaded under it
        self.most_held = 0
        version = tuple(int(x) for x in args.sglang_version.split("."))
        self.pending: dict[str, str] | None = {} if version >= (0, 5, 22) else None
        self.fail_load, self.fail_unload = set(args.lora_fail_load), set(args.lora_fail_unload)
        add_row_hooks(model, self.targets, self._row_adapters)

    def _row_adapters(self) -> list[Adapter | None]:
        return [None if lid is None else self.adapters[lid] for lid in self.rows]

    # -- routes ---------------------------------------------------------------------------
    def output(self, ok: bool, error: str = "") -> tuple[dict[str, Any], int]:
        loaded = {self.names[i]: "" for i in self.adapters}
        body = {"success": ok, "error_message": error, "loaded_adapters": loaded}
        return body, 200 if ok else 400

    async def load(self, name: str, path: str) -> tuple[dict[str, Any], int]:
        if not self.enabled:
            return self.output(False, OFF)
        assert self.lock is not None
        async with self.lock:
            if self.pending is not None and name in self.pending:  # tcm23:681-686
                return self.output(
                    False,
                    f"LoRA adapter '{name}' has an incomplete unload. "
                    "Retry the unload before loading it again.",
                )
            err = self._partial_load(name, path) if name in self.fail_load else ""
            err = err or self._load_locked(name, path)
            if err:
                return self.output(False, err)
            cap = self.max_loaded
            while cap is not None and self.registry.num_registered_loras > cap:
                lru = await self.registry.lru_lora_name(exclude_pinned=True)
                await self._unload_locked(lru, note="lru")
        return self.output(True)

    def _load_locked(self, name: str, path: str) -> str:
        ref = self.Ref(lora_name=name, lora_path=path, pinned=False)
        try:
            ad = Adapter(path)
        except (OSError, KeyError, ValueError) as exc:
            return str(exc)
        if name in self.names.values():
            return f"Failed to load LoRA adapter {name} because it is already loaded"
        if ad.r > self.max_rank or not ad.targets <= self.targets:
            return (
                f"LoRA adapter {name} with rank {ad.r} is incompatible with the current "
                "LoRA memory pool configuration."
            )
        self.adapters[ref.lora_id], self.names[ref.lora_id] = ad, name
        self.sha[name] = ad.sha256
        try:
            self.registry._register_adapter(ref)  # register() without its lock: same thing
        except ValueError as exc:
            del self.adapters[ref.lora_id], self.names[ref.lora_id]
            return str(exc)
        self.ref_cache[name] = ref
        self.events.append({"load": name})
        self.most_held = max(self.most_held, len(self.adapters))
        return ""

    def _partial_load(self, name: str, path: str) -> str:
        """The injected fault: the ranks but the last loaded ``name``; not registered, and on
        0.5.22+ pending (tcm23:697-706)."""
        self.fail_load.discard(name)
        ref = self.Ref(lora_name=name, lora_path=path, pinned=False)
        self.adapters[ref.lora_id], self.names[ref.lora_id] = Adapter(path), name
        if self.pending is not None:
            self.pending[name] = ref.lora_id
        self.events.append({"partial_load": name})
        return f"rank {len(self.names)}: injected load failure of {name}"

    async def unload(self, name: str) -> tuple[dict[str, Any], int]:
        if not self.enabled:
            return self.output(False, OFF)
        assert self.lock is not None
        async with self.lock:
            try:
                await self._unload_locked(name)
            except ValueError as exc:
                return self.output(False, str(exc))
        return self.output(True)

    async def _unload_locked(self, name: str, note: str = "") -> None:
        lid = None if self.pending is None else self.pending.get(name)  # tcm23:642-646
        if lid is None:
            lid = await self.registry.unregister(name)
            self.events.append({"unregister": name, "note": note})
            if self.pending is not None:
                self.pending[name] = lid
        await self.registry.wait_for_unload(lid)
        if name in self.fail_unload:  # the injected fault: the ranks' step fails
            self.fail_unload.discard(name)
            self.events.append({"failed_unload": name})
            raise ValueError(f"injected unload failure of {name}")
        del self.adapters[lid], self.names[lid]
        if self.pending is not None:
            self.pending.pop(name, None)  # tcm23:655-656
        self.events.append({"unload": name})

    async def resolve(self, paths: list[str | None]) -> list[str | None]:
        """tm:2233-2301: the lora_id of each item (acquired), or ValueError."""
        if not any(paths):
            return [None] * len(paths)
        if not self.enabled:
            first = next(p for p in paths if p)
            raise ValueError(
                f"LoRA adapter '{first}' was requested, but LoRA is not enabled. Please launch "
                "the server with --enable-lora flag and preload adapters using --lora-paths or "
                "/load_lora_adapter endpoint."
            )
        for name in await self.registry.get_unregistered_loras({p for p in paths if p}):
            if name not in self.ref_cache:
                raise ValueError(
                    f"Got LoRA adapter that has never been loaded: {name}\n"
                    f"All loaded adapters: {self.ref_cache.keys()}."
                )
            body, _ = await self.load(name, self.ref_cache[name].lora_path)
            if not body["success"] and "already loaded" not in body["error_message"]:
                raise ValueError(
                    f"Failed to implicitly load LoRA adapter {name}: {body['error_message']}"
                )
        return list(await self.registry.acquire(list(paths)))

    async def release(self, lora_id: str | None) -> None:
        if lora_id is not None:
            await self.registry.release(lora_id)

    def admit(self, batch: list[Any]) -> list[Any]:
        """The rows of the next step: at most ``per_batch`` distinct adapters (lm:245-274)."""
        seen: set[str | None] = set()
        out = []
        for r in batch:
            if r.lora_id in seen or len(seen) < self.per_batch:
                seen.add(r.lora_id)
                out.append(r)
        return out

    def state(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "loaded_how": self.loaded_how,
            "held": sorted(self.names.values()),
            "events": self.events,
            "sha256": self.sha,
            "most_held": self.most_held,
            "pending": sorted(self.pending or {}),
        }
