"""The weight group, formed identically by both sides of the collective transport.

Trainer rank 0 (``collective_send``) and every engine rank (the embedded engine's
``collective_recv``, or SGLang's own ``init_custom_process_group``) join one dedicated
process group the same way, and move each bucket as one broadcast posted in the same
order on every rank; each bucket is announced by an HTTP call whose ``asyncrl_bucket``
field :func:`bucket_extra` writes (``collective_recv.bucket_manifest`` reads it back).
Everything here runs in both processes; nothing here knows which
side it is on beyond the rank it is given.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
from collections.abc import Iterator
from typing import Any, cast

import msgspec
import torch
import torch.distributed as dist

from asyncrl.net import gloo_options, tcp_store
from asyncrl.transports.weights.bucket import BucketManifest

__all__ = [
    "TorchLink",
    "broadcast",
    "bucket_extra",
    "destroy_weight_group",
    "finish_broadcast",
    "group_on_store",
    "new_weight_group",
    "post_broadcast",
]

log = logging.getLogger("asyncrl.weights")


def new_weight_group(
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float = 300.0,
    bind_address: str = "",
) -> dist.ProcessGroup:
    """Join the dedicated weight-sync group (blocks until every rank joined).

    Formed exactly as SGLang's receiving ranks form it (``init_custom_process_group``,
    sglang 0.5.23 ``srt/utils/common.py:2859-2927``, the same since 0.5.10
    ``common.py:1698``): a ``tcp://`` rendezvous (rank 0 hosts the store), wrapped in
    ``PrefixStore(group_name)``, then torch's ``_new_process_group_helper`` with
    ``group_name``, which adds its own key prefixes. A group built any other way waits on
    other store keys: Gloo times out, NCCL hangs on the first broadcast. The group is
    registered under ``group_name`` in this process: :func:`destroy_weight_group` releases
    the name (a group of the same name cannot be formed again before). The trainer's
    default group is never touched.

    ``bind_address``: the address this rank advertises to its peers (Gloo binds there,
    unless ``GLOO_SOCKET_IFNAME`` says otherwise); empty: Gloo's default (the hostname's).
    Only the Gloo device changes (see :func:`_gloo_bound`; SGLang's ranks bind per
    ``GLOO_SOCKET_IFNAME``); the store keys stay the same.
    """
    from torch.distributed import distributed_c10d as c10d

    if backend not in ("gloo", "nccl", "hccl"):
        raise ValueError(f"unknown weight-sync backend {backend!r} (allowed: gloo, nccl, hccl)")
    if backend == "hccl":
        import torch_npu  # noqa: F401  (registers the hccl backend with torch.distributed)
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:  # the store's server listens on master_address only (rendezvous': on all)
        store = tcp_store(master_address, master_port, world_size, True, timeout_s)
    else:
        url = f"tcp://{_host(master_address)}:{int(master_port)}"
        store, rank, world_size = next(c10d.rendezvous(url, rank, world_size, timeout=timeout))
    return group_on_store(backend, store, rank, world_size, group_name, timeout_s, bind_address)


def group_on_store(
    backend: str,
    store: Any,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float = 300.0,
    bind_address: str = "",
) -> dist.ProcessGroup:
    """The second half of :func:`new_weight_group`: the group on a rendezvous ``store`` a
    rank already holds (e.g. the one vLLM's ``StatelessProcessGroup`` made; the tests' vLLM
    stand-in ranks join so). Same keys, same group, as :func:`new_weight_group`'s."""
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    stale = [pg for pg, name in c10d._world.pg_names.items() if name == group_name]
    for pg in stale:  # a group of ours left behind by a failed form or push
        destroy_weight_group(pg)
    with _gloo_bound(c10d, bind_address if backend == "gloo" else "", timeout_s):
        pg, _ = c10d._new_process_group_helper(
            world_size,
            rank,
            [],
            c10d.Backend(backend),
            store,
            group_name=cast("c10d.GroupName", group_name),  # a NewType of str
            timeout=timeout,
        )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


_BIND = threading.local()  # .address: where Gloo backends made by this thread bind


@contextlib.contextmanager
def _gloo_bound(c10d: Any, address: str, timeout_s: float) -> Iterator[None]:
    """Gloo backends this thread makes inside bind their device to ``address`` exactly.

    torch's ``_new_process_group_helper`` builds each Gloo backend as
    ``ProcessGroupGloo(store, rank, size, timeout=...)`` and ignores backend options
    (torch 2.13 ``distributed_c10d.py:2163-2175``: "GLOO options not supported"), so the
    device comes from the hostname or ``GLOO_SOCKET_IFNAME``; an interface name cannot
    tell loopback aliases apart, and a hostname mapped to 127.0.1.1 advertises loopback
    to other hosts. So the class the helper calls becomes (once per process) a subclass
    that passes explicit options when the calling thread asked for an address, and is
    the plain constructor otherwise (same store keys either way; a subclass because the
    helper checks ``isinstance(.., ProcessGroupGloo)``; per thread because constructing
    blocks until every rank joined, and ranks of one group may share a process).
    """
    if not address:
        yield
        return
    if not getattr(c10d.ProcessGroupGloo, "_asyncrl_bound", False):
        real: Any = c10d.ProcessGroupGloo

        class Bound(real):
            _asyncrl_bound = True

            def __init__(self, store: Any, rank: int, size: int, timeout: Any = None) -> None:
                addr, secs = getattr(_BIND, "target", ("", 0.0))
                if addr:
                    super().__init__(store, rank, size, gloo_options(addr, secs))
                elif timeout is None:
                    super().__init__(store, rank, size)
                else:
                    super().__init__(store, rank, size, timeout)

        c10d.ProcessGroupGloo = Bound
    _BIND.target = (address, timeout_s)
    try:
        yield
    finally:
        _BIND.target = ("", 0.0)


def destroy_weight_group(group: dist.ProcessGroup | None) -> None:
    """Leave a group made by :func:`new_weight_group` and release its name (best effort)."""
    if group is None:
        return
    try:
        dist.destroy_process_group(group)
    except (RuntimeError, ValueError, KeyError) as exc:
        log.warning("destroying the weight group: %s", exc)


def _host(address: str) -> str:
    """An address as a ``tcp://`` URL's host (IPv6 in brackets)."""
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


def post_broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, src: int = 0) -> dist.Work:
    """Start one broadcast on ``group`` and return at once (see :func:`finish_broadcast`).

    Every rank must post the group's broadcasts in the same order. Posting the next
    one before the last finished keeps the link busy across buckets: the backend
    moves them back to back, with no round trip or thread wake-up in between.
    """
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    return group.broadcast([tensor], opts)


def finish_broadcast(work: dist.Work, tensor: torch.Tensor) -> None:
    """Block until a posted broadcast is done and ``tensor`` may be reused (device synced)."""
    work.wait()
    if tensor.device.type == "cuda":
        torch.cuda.current_stream(tensor.device).synchronize()


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, src: int = 0) -> None:
    """One broadcast on ``group``; returns once ``tensor`` may be reused (device synced)."""
    finish_broadcast(post_broadcast(group, tensor, src), tensor)


class TorchLink:
    """Trainer rank 0's :class:`~asyncrl.transports.weights.seam.TrainerLink` over a torch
    process group made by :func:`new_weight_group` (Gloo, NCCL, HCCL)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def post(self, tensor: torch.Tensor) -> dist.Work:
        return post_broadcast(self.group, tensor)

    def finish(self, work: dist.Work, tensor: torch.Tensor) -> None:
        finish_broadcast(work, tensor)

    def close(self) -> None:
        destroy_weight_group(self.group)


def bucket_extra(m: BucketManifest) -> dict[str, Any]:
    """The ``asyncrl_bucket`` field of a bucket's control call (SGLang ignores it)."""
    chunks = None if all(e.whole for e in m.entries) else [[e.start, e.numel] for e in m.entries]
    full = None if chunks is None else [list(e.shape) for e in m.entries]
    return {
        "index": m.index,
        "count": m.count,
        "version": m.version,
        "checksum": m.checksum,
        "verify": m.verify,
        "chunks": chunks,
        "full_shapes": full,
        "delta": None if m.delta is None else msgspec.to_builtins(m.delta),
    }
