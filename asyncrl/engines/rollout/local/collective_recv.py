"""Collective weight transport, engine side: what an engine reads off the wire and receives.

Runs in the engine process (the embedded engine's ``WeightReceiver``; SGLang engines run
SGLang's own code). The trainer's side is ``collective_send``; the group both join is
``collective_wire``. Requests are checked here before anything is allocated for them:
a malformed one raises :class:`~asyncrl.engines.rollout.checks.BadRequest`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from asyncrl.engines.rollout import checks
from asyncrl.engines.rollout.checks import BadRequest
from asyncrl.transports.weights.bucket import BucketEntry, BucketManifest
from asyncrl.transports.weights.collective_wire import broadcast, finish_broadcast, post_broadcast
from asyncrl.transports.weights.delta import DeltaInfo

__all__ = ["bucket_manifest", "post_receive", "receive_plain", "tensor_specs"]


def tensor_specs(body: dict[str, Any]) -> tuple[list[str], list[str], list[tuple[int, ...]]]:
    """Names, dtypes (torch names) and shapes of an update request, checked (BadRequest)."""
    names = checks.strings(body.get("names"), "names")
    dtypes = [str(d).removeprefix("torch.") for d in checks.strings(body.get("dtypes"), "dtypes")]
    raw = body.get("shapes")
    if not isinstance(raw, list):
        raise BadRequest(f"shapes must be a list of shapes, got {raw!r}"[:300])
    shapes = [checks.shape(s, "shapes") for s in raw]
    if not len(names) == len(dtypes) == len(shapes):
        raise BadRequest("names, dtypes and shapes must be of equal length")
    for d in set(dtypes):
        if not isinstance(getattr(torch, d, None), torch.dtype):
            raise BadRequest(f"dtypes: {d!r} is not a torch dtype"[:300])
    return names, dtypes, shapes


def bucket_manifest(body: dict[str, Any], extra: Any, limit: int) -> BucketManifest:
    """The bucket announced by ``body`` (``extra``: its ``asyncrl_bucket`` field, as the
    sender's ``bucket_extra`` writes it); at most ``limit`` elements (the model's size)
    before anything is allocated for it."""
    if not isinstance(extra, dict):
        raise BadRequest(f"asyncrl_bucket must be an object, got {extra!r}"[:300])
    names, dtypes, shapes = tensor_specs(body)
    if len(set(dtypes)) != 1:
        raise BadRequest(f"a flattened bucket holds one torch dtype, got {sorted(set(dtypes))}")
    chunks: Any = extra.get("chunks")  # JSON, checked here and per entry below
    full: Any = extra.get("full_shapes")
    if chunks is not None and not (
        isinstance(chunks, list)
        and isinstance(full, list)
        and len(chunks) == len(full) == len(names)
    ):
        raise BadRequest("chunks and full_shapes must be lists with one entry per name")
    entries = []
    for i, (n, s) in enumerate(zip(names, shapes, strict=True)):
        if chunks is None or chunks[i] is None:
            entries.append(BucketEntry(n, s))
            continue
        whole, c = checks.shape(full[i], "full_shapes"), chunks[i]
        if not (isinstance(c, list) and len(c) == 2 and all(type(x) is int for x in c)):
            raise BadRequest(f"chunks[{i}] must be [start, numel], got {c!r}"[:300])
        whole_tensor = c == [0, -1]  # a whole tensor inside a chunked bucket
        if not whole_tensor and not (0 <= c[0] and 0 <= c[1] and c[0] + c[1] <= math.prod(whole)):
            raise BadRequest(f"chunks[{i}] = {c} lies outside {n} of shape {list(whole)}"[:300])
        entries.append(BucketEntry(n, whole, c[0], c[1]))
    count = checks.integer(extra, "count", 1, 1 << 20)
    m = BucketManifest(
        dtypes[0],
        tuple(entries),
        checks.integer(extra, "index", 0, count - 1),
        count,
        checks.integer(extra, "version", -(1 << 62), 1 << 62),
        checks.integer(extra, "checksum", -(1 << 63), (1 << 63) - 1, None)  # signed int64
        if extra.get("checksum") is not None
        else None,
        checks.text(extra, "verify", "full", ("full", "sampled", "off")),
    )
    if m.numel > limit:
        raise BadRequest(f"a bucket of {m.numel} elements is larger than the model ({limit})")
    delta = checks.delta(extra.get("delta"), m.nbytes)  # bounded by the bucket: checked above
    if delta is not None:
        m = msgspec.structs.replace(m, delta=DeltaInfo(*delta))
    return m


def post_receive(group: dist.ProcessGroup, flat: torch.Tensor) -> Callable[[], None]:
    """Post the receive of one bucket into ``flat`` (as bytes, as SGLang receives them) and
    return the blocking wait for it. Call in bucket order: each is the group's next
    broadcast from rank 0."""
    work = post_broadcast(group, flat.view(torch.uint8), src=0)
    return lambda: finish_broadcast(work, flat)


def receive_plain(
    group: dist.ProcessGroup,
    names: list[str],
    dtypes: list[torch.dtype],
    shapes: list[tuple[int, ...]],
    flattened: bool,
    device: torch.device,
) -> list[tuple[str, torch.Tensor]]:
    """Receive a plain SGLang push (no ``asyncrl_bucket``), blocking: one uint8 broadcast of
    the tensors back to back (``flattened``, SGLang's FlattenedTensorBucket), else one
    broadcast per tensor. Returns the named tensors (views of the flat buffer)."""
    if flattened:
        sizes = [torch.Size(s).numel() * d.itemsize for s, d in zip(shapes, dtypes, strict=True)]
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        broadcast(group, flat)
        views, off = [], 0
        for n, d, s, size in zip(names, dtypes, shapes, sizes, strict=True):
            views.append((n, flat[off : off + size].view(d).reshape(s)))
            off += size
        return views
    out = []
    for n, d, s in zip(names, dtypes, shapes, strict=True):
        t = torch.empty(s, dtype=d, device=device)
        broadcast(group, t)
        out.append((n, t))
    return out
