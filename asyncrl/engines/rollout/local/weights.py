"""Receiving side of weight sync in the embedded engine (the server's handlers stay thin).

Protocol (SGLang's endpoints and field names, plus an ``asyncrl_bucket`` field):

- ``/init_weights_update_group``: join the sender's dedicated group as rank
  ``rank_offset``; ``/destroy_weights_update_group`` leaves it.
- ``/update_weights_from_distributed`` with ``asyncrl_bucket`` (index, count,
  version, checksum, chunks): receive bucket ``index`` of a push (one
  broadcast), verify its checksum, stage it. The last bucket also checks that
  every staged bucket verified and that names and shapes fit the model. The
  answer is ``success: false`` with the reason on any failure; the engine keeps
  receiving the buckets still announced so the group stays in step.
  Without ``asyncrl_bucket`` (a plain SGLang sender): receive and load at
  once (``flattened_bucket`` or one broadcast per tensor), SGLang's semantics.
- ``/update_weights_from_tensor`` (``load_format="asyncrl_ipc"``, a JSON
  descriptor in ``asyncrl_ipc``, see ``transports.weights.cuda_ipc_send``): copy the
  sender's CUDA tensors, mapped through CUDA IPC once per layout, into the
  standby parameter set on a side stream (a CUDA graph of per-tensor copies or
  one multi-tensor copy); with ``commit`` switch to it at once (one call per
  sync), else stage it for ``/update_weight_version``. ``{"release": true}``
  unmaps the sender's tensors (it closes). An engine serving LoRA takes adapters this way
  too: the mapped adapter tensors are copied aside and loaded into the ring beside the
  served versions (``_ipc_adapter``), nothing pauses.
- ``/update_weight_version`` {new_version}: the commit. When a verified update
  of that version is staged, the model switches to it between two decoding
  steps and only then reports the new version; otherwise only the label
  changes (SGLang's meaning). A failed or partial update is never served.

Received buckets live in receive buffers, two per bucket slot: the committed
model's parameters become views into one set (no copy when dtypes match) while
the next update arrives into the other. A bucket whose parameters are copies of
its bytes (a tensor split across buckets, joined at commit; a dtype conversion)
has one buffer, holding only the last push's bytes. A receive buffer never aliases a served
parameter: a parameter of another dtype than its bucket gets a converted copy
of its own, and a buffer any parameter still points into is never received
into. A staged push must hold every parameter, each in the parameter's dtype
or, between float32/bfloat16/float16, one it converts from (never integers or
float64); otherwise it fails and nothing changes. A plain SGLang push (no
``asyncrl_bucket``) loads what it names, SGLang's semantics.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from asyncrl.engines.rollout import checks
from asyncrl.engines.rollout.checks import BadRequest
from asyncrl.engines.rollout.local.collective_recv import (
    bucket_manifest,
    post_receive,
    receive_plain,
    tensor_specs,
)
from asyncrl.transports.weights.bucket import BucketManifest, assemble, checksum
from asyncrl.transports.weights.collective_wire import destroy_weight_group, new_weight_group
from asyncrl.transports.weights.delta_apply import DeltaApplier
from asyncrl.transports.weights.integrity import bucket_checksum

if TYPE_CHECKING:
    from asyncrl.engines.rollout.local.engine import LocalEngine

__all__ = ["WeightReceiver", "WeightRequestError"]

log = logging.getLogger("asyncrl.engine.weights")


_LORA_STAGED = (
    "this engine serves LoRA adapters: push them staged (update_weights_from_distributed with "
    "asyncrl_bucket, then update_weight_version) or over CUDA IPC (update_weights_from_tensor), "
    "which load each version beside the others"
)


class WeightRequestError(BadRequest):
    """A malformed weight-sync request (answered with HTTP 400)."""


@dataclass
class _Update:
    version: int
    count: int
    next_index: int = 0
    buckets: dict[int, tuple[BucketManifest, torch.Tensor]] = field(default_factory=dict)
    verified: dict[int, asyncio.Future[None]] = field(default_factory=dict)
    error: str | None = None
    ready: list[tuple[str, torch.Tensor]] | None = None
    ipc: bool = False


class WeightReceiver:
    """Owns the engine's weight groups, the staged update and the receive buffers."""

    def __init__(self, engine: LocalEngine, host: str = "", masters: str = "loopback"):
        self.engine = engine
        self.host = host  # the address this engine advertises: its weight-group ranks bind there
        self.groups: dict[str, Any] = {}
        self.masters = checks.allowed_networks(masters)  # where a weight group may be joined
        self._model_numel = sum(p.numel() for p in engine.model.parameters())
        self._io = ThreadPoolExecutor(1, thread_name_prefix="weights-io")  # receives, in order
        self._poster = ThreadPoolExecutor(1, thread_name_prefix="weights-post")
        self._catchup = ThreadPoolExecutor(1, thread_name_prefix="weights-catchup")
        self._update: _Update | None = None
        self._pool: dict[tuple[int, str, int], list[torch.Tensor]] = {}
        self._live: set[int] = set()
        self._turn = asyncio.Condition()
        self.turn_timeout_s = 120.0  # longest wait for the previous bucket to start arriving
        self._ipc: Any = None  # cuda-ipc: IpcReceiver (mapped sender tensors, standby set)
        self._deltas = DeltaApplier()  # which version each receive buffer holds (delta pushes)
        self.adapter_slot_timeout_s = 300.0  # LoRA: longest wait for a free version slot

    # -- group -------------------------------------------------------------------------
    async def init_group(self, body: dict[str, Any]) -> dict[str, Any]:
        world = checks.integer(body, "world_size", 2, 1 << 16)
        args = (
            checks.text(body, "backend", "gloo", ("gloo", "nccl", "hccl")),
            checks.text(body, "master_address"),
            checks.integer(body, "master_port", 1, 65535),
            checks.integer(body, "rank_offset", 1, world - 1),
            world,
            checks.text(body, "group_name", "weight_update_group"),
            checks.number(body, "timeout_s", 0, 86400, 300.0),
            self.host,
        )
        await asyncio.to_thread(checks.check_master, args[1], self.masters)
        destroy_weight_group(self.groups.pop(args[5], None))
        self._update = None
        self._deltas.clear()  # a new group: the sender starts with a full push
        for pool in (self._io, self._poster):  # a receive stuck on a dead sender times out alone
            pool.shutdown(wait=False)
        self._io = ThreadPoolExecutor(1, thread_name_prefix="weights-io")
        self._poster = ThreadPoolExecutor(1, thread_name_prefix="weights-post")
        loop = asyncio.get_running_loop()
        try:
            group = await loop.run_in_executor(self._io, lambda: new_weight_group(*args))
        except (RuntimeError, ValueError, OSError) as exc:  # rendezvous failures go to the caller
            return {"success": False, "message": f"{type(exc).__name__}: {exc}"}
        self.groups[args[5]] = group
        return {"success": True, "message": "weight update group ready"}

    async def destroy_group(self, body: dict[str, Any]) -> dict[str, Any]:
        found = self.groups.pop(checks.text(body, "group_name", "weight_update_group"), None)
        self._update = None
        await asyncio.to_thread(destroy_weight_group, found)
        return {"success": found is not None, "message": "destroyed" if found else "no such group"}

    # -- buckets -----------------------------------------------------------------------
    async def update_from_distributed(self, body: dict[str, Any]) -> dict[str, Any]:
        fmt = body.get("load_format")
        if fmt not in (None, "flattened_bucket", "direct"):
            raise WeightRequestError(f"load_format {fmt!r} unsupported (flattened_bucket or none)")
        extra = body.get("asyncrl_bucket")
        m = None if extra is None else bucket_manifest(body, extra, self._model_numel)
        group = self.groups.get(checks.text(body, "group_name", "weight_update_group"))
        if group is None:
            raise WeightRequestError(
                "no weight update group: call /init_weights_update_group first"
            )
        if m is None:
            return await self._load_plain(body, group, fmt == "flattened_bucket")
        return await self._stage(m, functools.partial(post_receive, group))

    async def update_from_tensor(self, body: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        desc = body.get("asyncrl_ipc")
        if body.get("load_format") != "asyncrl_ipc" or not isinstance(desc, dict):
            raise WeightRequestError(
                "update_weights_from_tensor needs load_format='asyncrl_ipc' and an asyncrl_ipc "
                "descriptor (asyncrl's JSON CUDA IPC layout; pickled tensors are not accepted)"
            )
        if self.engine.device.type != "cuda":
            raise WeightRequestError("update_weights_from_tensor (CUDA IPC) needs a CUDA engine")
        if desc.get("release"):  # the sender closes: unmap its tensors
            if self._ipc is not None:
                self._ipc.release()
            return {"success": True, "message": "released"}
        if self.engine.lora is not None:
            return await self._ipc_adapter(desc)
        try:
            version, commit = int(desc["version"]), bool(desc.get("commit", False))
            pause = desc.get("pause")
            mode = None if not pause else str(pause["mode"])
            scope = None if not pause else str(pause.get("scope", "commit"))
        except (KeyError, TypeError, ValueError) as exc:
            raise WeightRequestError(f"bad asyncrl_ipc descriptor: {exc!r}") from None
        self._update = None  # a new push drops whatever was staged
        self._deltas.clear()  # the model switches to the IPC standby set, not the buffers
        try:
            if scope == "transfer" and mode is not None:  # a scope implies a mode
                await asyncio.to_thread(self.engine.pause, mode)
            try:
                switch_pause = mode if scope == "commit" else None
                ready, timing = await self._ipc_update(desc, version, commit, switch_pause)
            finally:
                if scope == "transfer":
                    self.engine.resume()
        except (ValueError, RuntimeError, KeyError, TypeError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            log.error(
                "weight update v%d failed, keeping v%s: %s",
                version,
                self.engine.weight_version,
                error,
            )
            return {"success": False, "message": error}
        timing["handler_s"] = time.perf_counter() - t0
        if not commit:
            self._update = _Update(version, 1, ready=ready, ipc=True)
            return {"success": True, "message": f"v{version} staged", "timing": timing}
        return {"success": True, "message": f"switched to v{version}", "timing": timing}

    async def _ipc_update(
        self, desc: dict[str, Any], version: int, commit: bool, pause_mode: str | None
    ) -> tuple[list[tuple[str, torch.Tensor]], dict[str, float]]:
        """Copy the sender's tensors into the standby set (and switch to it when ``commit``).

        A new layout is mapped in a worker thread (opening IPC handles is slow); the copy
        is enqueued from the event loop (it only launches GPU work); the switch, which
        waits for the model lock, and the wait for the copy run in a worker thread.
        """
        t0 = time.perf_counter()
        if self._ipc is None or self._ipc.layout_id != str(desc.get("layout")):
            await asyncio.to_thread(self._ipc_map, desc)
        t1 = time.perf_counter()
        verify = desc.get("verify")
        ready = self._ipc.launch(desc.get("event"), str(desc.get("copy", "graph")))
        t2 = time.perf_counter()
        timing = {"map_s": t1 - t0, "launch_s": t2 - t1}
        if commit and verify is None:
            # switch while the GPU copies: the model's next kernels wait for the copy
            timing |= await asyncio.to_thread(
                self._ipc_switch_during_copy, ready, version, pause_mode
            )
            return ready, timing
        await asyncio.to_thread(self._ipc.wait)
        t3 = time.perf_counter()
        if verify is not None:
            await asyncio.to_thread(self._ipc_verify, ready, list(verify))
        t4 = time.perf_counter()
        if commit:
            await asyncio.to_thread(self._ipc_switch, ready, str(version), pause_mode)
        timing |= {"gpu_wait_s": t3 - t2, "verify_s": t4 - t3, "switch_s": time.perf_counter() - t4}
        return ready, timing

    async def _ipc_adapter(self, desc: dict[str, Any]) -> dict[str, Any]:
        """A LoRA engine's CUDA IPC push: the sender's adapter tensors (PEFT's names), checked
        against the base model once per layout, copied aside after the sender's event (the
        answer comes once they are read), then loaded into the ring beside the served
        versions (``commit``), or at ``/update_weight_version`` (several engines), exactly as
        the collective path's staged buckets are. Nothing pauses."""
        try:
            version, commit = int(desc["version"]), bool(desc.get("commit", False))
        except (KeyError, TypeError, ValueError) as exc:
            raise WeightRequestError(f"bad asyncrl_ipc descriptor: {exc!r}") from None
        self._update = None
        try:
            staged = await asyncio.to_thread(self._ipc_adapter_copy, desc)
        except (ValueError, RuntimeError, KeyError, TypeError) as exc:
            return {"success": False, "message": f"adapter v{version}: {type(exc).__name__}: {exc}"}
        if not commit:
            self._update = _Update(version, 1, ready=staged)
            return {"success": True, "message": f"adapter v{version} staged"}
        return await self.commit({"new_version": str(version)}, staged)

    def _ipc_adapter_copy(self, desc: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
        from asyncrl.engines.rollout.local.cuda_ipc_recv import IpcReceiver

        ring = self.engine.lora
        assert ring is not None
        if self._ipc is None:
            self._ipc = IpcReceiver(self.engine.device, {})  # mapping only: no standby sets
        if self._ipc.map(desc):  # a new layout: checked against the base model once
            try:
                ring.check(list(zip(self._ipc.names, self._ipc.sources, strict=True)))
            except ValueError:
                self._ipc.layout_id = None
                raise
        stream = torch.cuda.current_stream(self.engine.device)
        sender = self._ipc.event(desc.get("event"))
        if sender is not None:
            stream.wait_event(sender)  # the trainer's writes of this adapter are done
        pairs = zip(self._ipc.names, self._ipc.sources, strict=True)
        with torch.no_grad():
            staged = [(n, t.clone()) for n, t in pairs]
        stream.synchronize()  # read: the trainer may write its tensors again
        if desc.get("verify") is not None:
            self._ipc_verify([(n, t.contiguous()) for n, t in staged], list(desc["verify"]))
        return staged

    def _ipc_map(self, desc: dict[str, Any]) -> None:
        from asyncrl.engines.rollout.local.cuda_ipc_recv import IpcReceiver

        if self._ipc is None:
            params = dict(self.engine.model.named_parameters())
            self._ipc = IpcReceiver(self.engine.device, params)
        if self._ipc.map(desc):  # a new layout: check it against the model once
            try:
                self.engine.check_weights(
                    list(zip(self._ipc.names, self._ipc.sources, strict=True))
                )
            except (KeyError, ValueError):
                self._ipc.layout_id = None
                raise

    def _ipc_switch_during_copy(
        self, ready: list[tuple[str, torch.Tensor]], version: int, pause_mode: str | None
    ) -> dict[str, float]:
        t0 = time.perf_counter()
        self._ipc_switch(ready, str(version), pause_mode, self._ipc.order_after_copy)
        t1 = time.perf_counter()
        self._ipc.wait()  # answer once the trainer's tensors are read
        return {"switch_s": t1 - t0, "gpu_wait_s": time.perf_counter() - t1}

    def _ipc_verify(self, ready: list[tuple[str, torch.Tensor]], want: list[int]) -> None:
        if len(want) != len(ready):
            raise ValueError(f"{len(want)} checksums for {len(ready)} tensors")
        for (n, t), w in zip(ready, want, strict=True):
            got = checksum(t)
            if got != int(w):
                raise ValueError(f"checksum mismatch on {n}: got {got}, sender sent {w}")

    def _ipc_switch(
        self,
        ready: list[tuple[str, torch.Tensor]],
        version: str,
        pause_mode: str | None,
        before: Any = None,
    ) -> None:
        """Make the standby set the model's parameters; the old ones become the standby set.
        ``before()`` runs just before the switch (with the engine paused, when it pauses)."""
        if pause_mode is not None:
            self.engine.pause(pause_mode)
        try:
            if before is not None:
                before()
            self.engine.load_weights(ready, version, True)
        finally:
            if pause_mode is not None:
                self.engine.resume()
        self._ipc.switched()

    async def _turn_of(self, m: BucketManifest) -> _Update:
        """Wait until bucket ``m.index`` is next (buckets may be announced before their turn)."""
        if m.index == 0:
            self._update = _Update(m.version, m.count)  # a new push drops whatever was staged
            return self._update

        def ready() -> bool:  # an older push's state: wait for this push's bucket 0
            up = self._update
            if up is None or up.version < m.version:
                return False
            return up.version > m.version or up.next_index >= m.index

        async with self._turn:  # give up only when no bucket moved for turn_timeout_s
            while not ready():
                try:
                    await asyncio.wait_for(self._turn.wait(), self.turn_timeout_s)
                except asyncio.TimeoutError:
                    break
        up = self._update
        if up is None or up.version != m.version or up.next_index != m.index:
            expected = "none" if up is None else f"v{up.version} bucket {up.next_index}"
            raise WeightRequestError(f"bucket {m.index} of v{m.version} out of turn ({expected})")
        return up

    def _buffer(self, m: BucketManifest) -> torch.Tensor:
        key = (m.index, m.dtype, m.numel)
        pair = self._pool.setdefault(key, [])
        for buf in pair:
            if buf.data_ptr() not in self._live:
                return buf
        buf = torch.empty(m.numel, dtype=m.torch_dtype, device=self.engine.device)
        pair.append(buf)
        assert len(pair) <= 2, "receive buffers: at most one live and one arriving set"
        return buf

    async def _stage(
        self, m: BucketManifest, receive: Callable[[torch.Tensor], Callable[[], None]]
    ) -> dict[str, Any]:
        """Receive bucket ``m`` in its turn, verify it, keep it for the commit.

        ``receive(flat)`` posts the bucket's receive (called in bucket order, on the
        poster thread: NCCL/HCCL set up their communicator on the first collective,
        which blocks until every rank joins) and returns the blocking wait for it
        (run on the io thread), so the next bucket's receive is posted while this
        one still arrives.
        """
        loop = asyncio.get_running_loop()
        up = await self._turn_of(m)
        if m.index == 0:
            self._deltas.push_started()  # a catch-up still running stops (see delta_apply)
        flat = self._buffer(m)
        done: asyncio.Future[None] = loop.create_future()
        up.verified[m.index] = done
        if m.delta is None:
            self._deltas.received(flat, None)  # overwritten below
            target = flat
        else:  # the changed words travel; applied into flat once verified
            size, device = m.delta.nbytes, self.engine.device
            target = self._deltas.payload_buffer(m.index, size, m.nbytes, device)
        try:
            try:
                wait = await loop.run_in_executor(self._poster, receive, target)  # drain it all
            finally:
                up.next_index += 1
                async with self._turn:
                    self._turn.notify_all()  # the next bucket may post its receive now
            await loop.run_in_executor(self._io, wait)
            await asyncio.to_thread(self._verify, m, flat, target)
            up.buckets[m.index] = (m, flat)
            done.set_result(None)
        except (ValueError, RuntimeError, KeyError, OSError) as exc:
            up.error = up.error or f"bucket {m.index}: {type(exc).__name__}: {exc}"
            done.set_result(None)
        if m.index == m.count - 1 and up.error is None:
            await asyncio.gather(*up.verified.values())
            if up.error is None:
                try:
                    up.ready = await asyncio.to_thread(self._prepare, up)
                except (ValueError, KeyError) as exc:
                    up.error = f"{type(exc).__name__}: {exc}"
        if up.error is not None:
            log.error(
                "weight update v%d failed, keeping v%s: %s",
                m.version,
                self.engine.weight_version,
                up.error,
            )
            return {"success": False, "message": up.error}
        return {"success": True, "message": f"bucket {m.index + 1}/{m.count} staged"}

    def _verify(self, m: BucketManifest, flat: torch.Tensor, received: torch.Tensor) -> None:
        """Check what arrived (``received``: the bucket, or a delta payload applied into
        ``flat`` here) against the sender's checksums; ``flat`` then holds ``m.version``."""
        raw = flat.view(-1).view(torch.uint8)
        if m.delta is not None:
            if m.delta.checksum is not None and checksum(received) != m.delta.checksum:
                raise ValueError(f"checksum mismatch on bucket {m.index}'s delta payload")
            live = self._live_buffer(m)
            self._deltas.apply(m.index, raw, live, received, m.delta.base, m.version)
        if m.checksum is not None:  # None: the sender runs with weights.verify = off
            got = bucket_checksum(flat, m, "sampled" if m.verify == "sampled" else "full")
            if got != m.checksum:
                self._deltas.received(flat, None)
                raise ValueError(
                    f"checksum mismatch on bucket {m.index} ({m.verify}): got {got}, "
                    f"sender sent {m.checksum}"
                )
        self._deltas.received(flat, m.version)

    def _live_buffer(self, m: BucketManifest) -> torch.Tensor | None:
        """Bucket ``m``'s receive buffer that the model serves from (None: none yet)."""
        for buf in self._pool.get((m.index, m.dtype, m.numel), []):
            if buf.data_ptr() in self._live:
                return buf.view(-1).view(torch.uint8)
        return None

    def _prepare(self, up: _Update) -> list[tuple[str, torch.Tensor]]:
        if len(up.buckets) != up.count:
            raise ValueError(f"{len(up.buckets)} of {up.count} buckets arrived")
        named = assemble([up.buckets[i] for i in range(up.count)])
        if self.engine.lora is not None:  # an adapter push: checked against the base model
            self.engine.lora.check(named)
        else:
            self.engine.check_weights(named, complete=True)
        return named

    async def _load_plain(
        self, body: dict[str, Any], group: Any, flattened: bool
    ) -> dict[str, Any]:
        if self.engine.lora is not None:
            raise WeightRequestError(_LORA_STAGED)
        names, raw_dtypes, shapes = tensor_specs(body)
        dtypes = [getattr(torch, d) for d in raw_dtypes]
        if sum(math.prod(s) for s in shapes) > self._model_numel:
            raise BadRequest(f"an update larger than the model ({self._model_numel} elements)")
        device = self.engine.device

        def receive() -> list[tuple[str, torch.Tensor]]:
            return receive_plain(group, names, dtypes, shapes, flattened, device)

        loop = asyncio.get_running_loop()
        version = body.get("weight_version")
        self._deltas.clear()  # loaded around the receive buffers: no delta applies any more
        try:
            named = await loop.run_in_executor(self._io, receive)
            await asyncio.to_thread(
                self.engine.load_weights, named, None if version is None else str(version)
            )
        except (ValueError, RuntimeError, KeyError) as exc:
            return {"success": False, "message": f"{type(exc).__name__}: {exc}"}
        return {"success": True, "message": "updated"}

    # -- commit ------------------------------------------------------------------------
    async def commit(
        self, body: dict[str, Any], adapter: list[tuple[str, torch.Tensor]] | None = None
    ) -> dict[str, Any]:
        """``/update_weight_version``: switch to the staged update (``adapter``: a LoRA
        engine's IPC push, loaded at once, not staged)."""
        version = body.get("new_version")
        if isinstance(version, bool) or not isinstance(version, str | int):
            raise WeightRequestError(f"new_version must be a string or an integer, got {version!r}")
        version = str(version)
        up = self._update if adapter is None else _Update(int(version), 1, ready=adapter)
        if up is None:  # no staged update: SGLang's meaning, relabel only
            self.engine.weight_version = version
            return {"success": True, "message": "version label updated"}
        if str(up.version) != version or up.ready is None or up.error is not None:
            self._update = None
            reason = up.error or f"staged v{up.version} is incomplete"
            return {"success": False, "message": f"cannot commit v{version}: {reason}"}
        self._update = None
        if self.engine.lora is not None:  # beside the served versions: nothing pauses
            timeout = self.adapter_slot_timeout_s
            try:
                await asyncio.to_thread(self.engine.load_adapter, version, up.ready, timeout)
            except (TimeoutError, ValueError) as exc:
                return {"success": False, "message": f"cannot load adapter v{version}: {exc}"}
            return {"success": True, "message": f"adapter v{version} loaded"}
        if up.ipc:
            await asyncio.to_thread(self._ipc_switch, up.ready, version, None)
            return {"success": True, "message": f"switched to v{version}"}
        await asyncio.to_thread(self.engine.load_weights, up.ready, version, True)
        # the buffers served parameters are views of now; converted ones own their memory
        self._live = {p.untyped_storage().data_ptr() for p in self.engine.model.parameters()}
        self._catch_up_after(up)
        return {"success": True, "message": f"switched to v{version}"}

    def _catch_up_after(self, up: _Update) -> None:
        """Bring each bucket's standby buffer to the version just committed, in the background
        (``delta_apply``): the next delta push then applies only its own payload. Buckets
        whose parameters are converted copies have no live buffer: nothing to do."""
        pairs = []
        for m, flat in up.buckets.values():
            live = flat.view(-1).view(torch.uint8)
            for buf in self._pool.get((m.index, m.dtype, m.numel), []):
                if buf.data_ptr() != flat.data_ptr() and flat.data_ptr() in self._live:
                    pairs.append((m.index, buf.view(-1).view(torch.uint8), live))
        if pairs:
            self._catchup.submit(self._catch_up, pairs, self._deltas.generation())

    def _catch_up(self, pairs: list[tuple[int, torch.Tensor, torch.Tensor]], gen: int) -> None:
        for index, standby, live in pairs:
            if not self._deltas.catch_up(index, standby, live, gen):
                return  # a push started: it catches up the rest as it applies

    def weights_checksum(self) -> dict[str, Any]:
        """Per-parameter checksums of the served model (for tests and benchmarks)."""
        params = dict(self.engine.model.named_parameters())
        out: dict[str, Any] = {
            "weight_version": self.engine.weight_version,
            "checksums": {n: checksum(p.detach().contiguous()) for n, p in params.items()},
        }
        ring = self.engine.lora
        if ring is not None:  # every held adapter version, per tensor (PEFT's saved names)
            out["adapters"] = {
                v: {n: checksum(t.contiguous()) for n, t in ring.factors(v).items()}
                for v in ring.held()
            }
        return out

    def close(self) -> None:
        self.groups.clear()
        self._deltas.clear()  # a catch-up still running stops after its bucket
        for pool in (self._io, self._poster, self._catchup):
            pool.shutdown(wait=False)
