"""Adapter-only pushes to engines that load LoRA adapters from a folder (SGLang, vLLM): the
trainer side.

A :class:`~asyncrl.transports.weights.base.WeightTransport` for LoRA runs
(``lora.rank > 0``) whose engine family loads adapters by name from a folder
(:attr:`~asyncrl.transports.weights.seam.WeightAdapter.adapters`). Contract:

- ``push(named_weights, version)`` copies the adapter's tensors (PEFT's saved names, as
  the trainer's ``named_weights`` yields them under LoRA) to CPU in the caller's thread, so
  the snapshot is taken when it returns. One background thread then, push after push in
  order: writes PEFT's adapter folder ``{folder}/{name}-v{N}`` (``adapter_model.safetensors``
  + ``adapter_config.json``), and on every engine unloads the oldest versions it holds
  until fewer than ``capacity`` remain (SGLang answers an unload once no request uses the
  version), then loads ``{name}-v{N}``. So an engine never holds more than ``capacity``
  (``controller.max_staleness + 1``) versions, never drops one a request still runs on,
  and nothing pauses or aborts. ``handle.wait()`` returns once every engine serves
  ``v{N}`` (stats: ``bytes``, ``write_s``, ``unload_s``, ``load_s``), or raises
  :class:`WeightSyncError` naming the engine and its answer.
- Version 0 is the base model (PEFT's fresh adapter has ``B = 0``: its delta is exactly
  zero); it is never loaded, and a request at version 0 names no adapter.
- A version unloaded from every engine has its folder deleted: SGLang reloads a name it
  once loaded from that folder when a request names it again (0.5.10
  tokenizer_manager.py:2270-2299), which would break the ring; without the folder such a
  request is refused with an error that names the version. ``keep_folders`` (vLLM, whose
  unload forgets only the name and whose running requests may reload their adapter from
  its folder): deleted once ``2 * capacity`` newer versions exist.
- ``connect`` / ``engines_changed`` only record the engine set (there is no group to
  form); ``connect`` forgets which versions each engine holds: a version an engine then
  answers it holds already (the client's ``refusal`` says ``"held"``, in its family's
  words) counts as loaded (a re-sync pushes the same weights); an
  unload of a version the engine no longer knows counts as done.
- An engine whose versions are unknown (joining, restarted, or after ``connect``: the
  trainer's re-sync) gets the ring rebuilt before the push's version: the older versions a
  request may still name reloaded from their folders (kept while any engine holds them),
  the one no request may name any more unloaded. So a resubmission that keeps its version
  (``controllers/adapters.py``) finds it on a restarted engine too.
- Refusals SGLang expects to be retried are: a failed unload stays pending on SGLang
  0.5.22+ and is retried once; a load refused after a partial failure ("has an incomplete
  unload") gets the unload retried, then the load (0.5.23 tokenizer_control_mixin.py:
  642-656, 682-686, 700-706).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from asyncrl.transports.weights.base import PushHandle, WeightSyncError
from asyncrl.transports.weights.seam import AdapterControl, EngineError

__all__ = ["AdapterFolderSender", "AdapterSpec"]

log = logging.getLogger("asyncrl.weights")

PREFIX = "base_model.model."  # PEFT's prefix of saved adapter keys


@dataclass(frozen=True)
class AdapterSpec:
    """The run's adapters: ``rank``, ``alpha``, ``dropout`` (PEFT's ``LoraConfig``), served as
    ``{name}-v{N}``, at most ``capacity`` versions per engine, written under ``folder`` (which
    every engine must read at the same path), for the base model at ``base_path``."""

    name: str
    rank: int
    alpha: float
    dropout: float
    capacity: int
    folder: str
    base_path: str

    def label(self, version: int) -> str:
        return f"{self.name}-v{version}"


def adapter_config(spec: AdapterSpec, targets: Sequence[str]) -> dict[str, object]:
    """PEFT's ``adapter_config.json`` for ``spec`` on ``targets`` (the fields SGLang's
    ``LoRAConfig`` reads: ``r``, ``lora_alpha``, ``target_modules``; PEFT's loader needs
    ``peft_type`` and ``task_type``)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": sorted(targets),
        "bias": "none",
        "base_model_name_or_path": spec.base_path,
        "inference_mode": True,
    }


def write_adapter_folder(path: Path, spec: AdapterSpec, tensors: dict[str, torch.Tensor]) -> int:
    """PEFT's adapter folder at ``path`` (written beside, then renamed: a reader never sees
    half of it); returns the safetensors file's size in bytes."""
    from safetensors.torch import save_file

    targets = {k.removeprefix(PREFIX).rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for k in tensors}
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    (tmp / "adapter_config.json").write_text(json.dumps(adapter_config(spec, sorted(targets))))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return (path / "adapter_model.safetensors").stat().st_size


class AdapterFolderSender:
    """Pushes LoRA adapter versions to engines that load them from a folder (module
    docstring: the contract)."""

    def __init__(
        self,
        engine_urls: Sequence[str],
        spec: AdapterSpec,
        make: Callable[[str, float], AdapterControl],
        timeout_s: float = 300.0,
        keep_folders: bool = False,
    ):
        if spec.capacity < 1:
            raise ValueError(f"the adapter ring needs capacity >= 1, got {spec.capacity}")
        self.spec = spec
        self.timeout_s = timeout_s
        self.keep_folders = keep_folders
        self._make = make  # (url, timeout_s) -> AdapterControl
        self._urls = list(engine_urls)
        self._epoch = -1
        self._lock = threading.Lock()
        self._held: dict[str, list[int]] = {}  # engine -> versions it holds, oldest first
        self._folders: set[int] = set()  # versions whose folder is on disk
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="adapter-push")
        self._last: Future[dict[str, float]] | None = None
        self.unloads: list[tuple[str, int]] = []  # (engine, version), in order (tests, docs)
        Path(spec.folder).mkdir(parents=True, exist_ok=True)

    def connect(self, engine_urls: Sequence[str] | None = None) -> None:
        """Record the engine set; forget what each engine holds (see module docstring)."""
        with self._lock:
            if engine_urls is not None:
                self._urls = list(engine_urls)
            self._held = {}

    def engines_changed(self, engine_urls: Sequence[str], epoch: int) -> None:
        with self._lock:
            if epoch > self._epoch:
                self._epoch, self._urls = epoch, list(engine_urls)

    def push(self, named_weights: Iterable[tuple[str, torch.Tensor]], version: int) -> PushHandle:
        """Copy the adapter to CPU now; write, unload and load in the background."""
        tensors = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in named_weights}
        if not tensors:
            raise ValueError("push() got no tensors")
        bad = [n for n in tensors if ".lora_" not in n]
        if bad:
            raise ValueError(
                f"an adapter push takes LoRA factors only (PEFT's saved names), got {bad[:3]}"
            )
        snap = threading.Event()
        snap.set()
        fut = self._pool.submit(self._deliver, tensors, version)
        self._last = fut
        return PushHandle(version, fut, snap)

    def close(self) -> None:
        """Wait for the push in flight (up to ``timeout_s``), stop the thread."""
        if self._last is not None:
            try:
                self._last.result(self.timeout_s)
            except Exception as exc:  # reported through its handle already
                log.debug("last adapter push failed: %s", exc)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- the background thread ----------------------------------------------------------
    def _deliver(self, tensors: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        spec = self.spec
        t0 = time.perf_counter()
        path = Path(spec.folder) / spec.label(version)
        nbytes = write_adapter_folder(path, spec, tensors)
        self._folders.add(version)
        t1 = time.perf_counter()
        with self._lock:
            urls = list(self._urls)
        unload_s, load_s = asyncio.run(self._engines(urls, version, str(path)))
        self._drop_folders()
        return {
            "bytes": float(sum(t.nbytes for t in tensors.values())),
            "file_bytes": float(nbytes),
            "write_s": t1 - t0,
            "unload_s": unload_s,
            "load_s": load_s,
            "sync_s": time.perf_counter() - t0,
        }

    async def _engines(self, urls: list[str], version: int, path: str) -> tuple[float, float]:
        clients = [self._make(u, self.timeout_s) for u in urls]
        try:
            got = await asyncio.gather(
                *(self._one(c, version, path) for c in clients), return_exceptions=True
            )
        finally:
            await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
        errors = [(c.url, e) for c, e in zip(clients, got, strict=True) if isinstance(e, Exception)]
        if errors:
            url, exc = errors[0]
            raise WeightSyncError(
                f"adapter {self.spec.label(version)}: engine {url}: {exc}"
                + (f" (and {len(errors) - 1} more engine(s))" if len(errors) > 1 else "")
            )
        times = [t for t in got if isinstance(t, tuple)]
        return max(t[0] for t in times), max(t[1] for t in times)

    async def _one(self, client: AdapterControl, version: int, path: str) -> tuple[float, float]:
        """On one engine: unload the oldest until there is room, then load ``version``. An
        engine whose versions are unknown (new, restarted, or after ``connect``) first gets
        the ring rebuilt (:meth:`_rebuild`)."""
        with self._lock:
            known = client.url in self._held
            held = self._held.setdefault(client.url, [])
        t0 = time.perf_counter()
        if not known:
            await self._rebuild(client, version, held)
        if version in held:  # a re-sync of the version it holds: the same weights
            return 0.0, time.perf_counter() - t0
        while len(held) >= self.spec.capacity:
            old = held[0]
            await self._unload(client, old)
            held.pop(0)
            self.unloads.append((client.url, old))
        t1 = time.perf_counter()
        await self._load(client, version, path)
        held.append(version)
        return t1 - t0, time.perf_counter() - t1

    async def _rebuild(self, client: AdapterControl, version: int, held: list[int]) -> None:
        """The ring of an engine whose versions are unknown, as of ``version`` (the newest):
        the older versions a request may still name (``version - capacity + 2 ..``, the
        controller's rule for a resubmission, ``controllers/adapters.py``) loaded from their
        folders, oldest first (a restarted engine lost them: a resubmission naming one
        would be refused and fail its episode); the ring's oldest (``version - capacity +
        1``, which no request may name any more) unloaded if the engine still holds it, so
        an engine that kept its versions holds no more than ``capacity`` afterwards."""
        oldest = version - self.spec.capacity + 1
        if 1 <= oldest < version:
            await self._unload(client, oldest)
        for v in range(max(1, oldest + 1), version):
            folder = Path(self.spec.folder) / self.spec.label(v)
            if v in self._folders and folder.is_dir():
                await self._load(client, v, str(folder))
                held.append(v)
        if held:
            log.info("adapter ring of %s rebuilt at v%d: %s", client.url, version, held)

    async def _load(self, client: AdapterControl, version: int, path: str) -> None:
        """Load ``version``; a name it holds already counts as loaded. A refused load is
        tried twice more: SGLang 0.5.22+ answers a load after a partial failure (some ranks
        loaded it) with "has an incomplete unload. Retry the unload before loading it
        again" (0.5.23 tokenizer_control_mixin.py:682-686, 700-706): the unload is retried
        first (it completes the pending one, :642-656), then the load."""
        label = self.spec.label(version)
        for attempt in range(3):
            try:
                await client.load_lora_adapter(label, path)
                return
            except EngineError as exc:
                if client.refusal(exc) == "held":
                    return
                if attempt == 2:
                    raise
                log.warning("%s: loading %s failed, retrying: %s", client.url, label, exc)
                if client.refusal(exc) == "incomplete":
                    await self._unload(client, version)

    async def _unload(self, client: AdapterControl, version: int) -> None:
        """Unload ``version``; a name the engine does not hold counts as done. A refused
        unload is tried once more: SGLang 0.5.22+ keeps a failed unload pending (the name
        refused to new requests) and completes it when asked again (0.5.23
        tokenizer_control_mixin.py:642-656)."""
        label = self.spec.label(version)
        for attempt in range(2):
            try:
                await client.unload_lora_adapter(label)
                return
            except EngineError as exc:
                if client.refusal(exc) == "gone":  # not held (any more)
                    return
                if attempt == 1:
                    raise
                log.warning("%s: unloading %s failed, retrying: %s", client.url, label, exc)

    def _drop_folders(self) -> None:
        """Delete the folders of versions no engine holds (not the newest: a joining engine
        may still be given it); ``keep_folders``: only once ``capacity`` newer versions
        than the held ones loaded (vLLM may reload an unloaded version's folder for the
        requests still running on it)."""
        with self._lock:
            live = {v for vs in self._held.values() for v in vs}
        newest = max(self._folders, default=-1)
        drop = self._folders - live - {newest}
        if self.keep_folders:
            drop = {v for v in drop if v <= newest - 2 * self.spec.capacity}
        for v in sorted(drop):
            shutil.rmtree(Path(self.spec.folder) / self.spec.label(v), ignore_errors=True)
            self._folders.discard(v)
