"""Checking what engines that report per-tensor digests loaded (trainer process).

vLLM 0.33's ``POST /weight_checker {"action": "checksum"}`` answers the sha256 of every
parameter of the loaded model, on every worker, keyed ``dp{i}:pp{i}:pcp{i}:tp{i}:NAME``
(vllm/entrypoints/rl/online/api_router.py:232-266; vllm/v1/worker/gpu_worker.py:380-391;
vllm/model_executor/model_loader/weight_checksum.py:32-38: ``sha256`` of the tensor's bytes
after ``.cpu().contiguous()``). It cannot be asked for a subset: each call hashes the whole
model on every worker (a device-to-host copy and a sha256 of every weight, inside the
engine's busy loop). So for such families (``WeightFamily.digests``) ``weights.verify``
means, after each push's finish and before generation resumes:

- ``full``: every engine answers; every pushed tensor is hashed on the trainer (sha256
  of the bytes pushed, in the sync dtype) and compared.
- ``sampled``: one engine per push, in turn (``version mod engines``), and a seeded
  sample of :data:`SAMPLE` tensors (of those known comparable, below).
- ``off``: nothing.

vLLM's parameters are not always the tensors the trainer sends: it fuses some
(``qkv_proj``, ``gate_up_proj``: their names never appear), shards others over TP
(``o_proj``, ``down_proj``: one digest per rank, none the whole tensor's), pads vocab
tables, may hold another dtype. So a name is *comparable* once, on some checked push,
every worker's digest of it equalled the trainer's; the first checked push hashes every
tensor to find them (the names that never match are logged once). A mismatch is:

- a comparable name whose digest on any worker is not the trainer's, or
- any name the trainer's digest matches on some worker but not on another (a replicated
  tensor that one rank got wrong), comparable or not yet.

A mismatch fails the attempt (:class:`~asyncrl.transports.weights.base.WeightSyncError`
naming the engine and tensors): the push is re-sent as a whole new round, as for any
failed update of an engine that loads live. Limit: a tensor that is wrong on every
worker at the first checked push never becomes comparable (it is named in the log line).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
from collections.abc import Awaitable, Callable, Iterable

import torch

from asyncrl.engines.rollout.base import ControlledEngine
from asyncrl.transports.weights.base import WeightSyncError
from asyncrl.transports.weights.bucket import BucketManifest

__all__ = ["SAMPLE", "DigestCheck", "bucket_digests"]

log = logging.getLogger("asyncrl.weights")

SAMPLE = 8
"""Tensors compared per push under ``weights.verify = "sampled"``."""

Checksums = Callable[[ControlledEngine], Awaitable[dict[str, str]]]


def bucket_digests(m: BucketManifest, flat: torch.Tensor, names: set[str]) -> dict[str, str]:
    """sha256 of the bytes of each whole entry of bucket ``m`` (packed in ``flat``) named in
    ``names``: what an engine holding exactly those bytes reports."""
    out: dict[str, str] = {}
    raw = flat.view(-1).view(torch.uint8)
    item, offset = m.torch_dtype.itemsize, 0
    for e in m.entries:
        size = e.size * item
        if e.whole and e.name in names:
            out[e.name] = hashlib.sha256(raw[offset : offset + size].cpu().numpy().data).hexdigest()
        offset += size
    return out


def _by_name(answer: dict[str, str]) -> dict[str, set[str]]:
    """vLLM's ``dp:pp:pcp:tp:NAME`` keys as NAME -> the digests its workers hold."""
    out: dict[str, set[str]] = {}
    for key, digest in answer.items():
        name = key.split(":", 4)[-1]
        out.setdefault(name, set()).add(digest)
    return out


class DigestCheck:
    """The check of one sender (module docstring); ``comparable`` persists across pushes."""

    def __init__(self, mode: str, checksums: Checksums):
        self.mode = mode
        self.checksums = checksums
        self.comparable: set[str] | None = None  # None: no push checked yet
        self.checked = 0  # (engine, tensor) pairs compared, over the sender's life

    def names(self, version: int, all_names: Iterable[str]) -> set[str]:
        """The tensors the trainer hashes for push ``version`` (every one until the first
        check has found the comparable ones)."""
        if self.mode == "off":
            return set()
        names = sorted(all_names)
        if self.mode == "full" or self.comparable is None:
            return set(names)
        pool = sorted(self.comparable)
        return set(random.Random(version).sample(pool, min(SAMPLE, len(pool))))

    def engines(self, version: int, clients: list[ControlledEngine]) -> list[ControlledEngine]:
        if self.mode == "off" or not clients:
            return []
        return list(clients) if self.mode == "full" else [clients[version % len(clients)]]

    async def check(
        self, version: int, clients: list[ControlledEngine], expected: dict[str, str]
    ) -> None:
        """Ask the engines of push ``version`` for their digests and compare (module
        docstring); raises WeightSyncError on a mismatch, or when an engine fails to answer."""
        chosen = self.engines(version, clients)
        if not chosen or not expected:
            return
        answers = await asyncio.gather(*(self.checksums(c) for c in chosen), return_exceptions=True)
        matched: set[str] = set()
        bad: list[str] = []
        for c, answer in zip(chosen, answers, strict=True):
            if isinstance(answer, BaseException):
                raise WeightSyncError(f"v{version}: {c.url}/weight_checker: {answer}")
            held = _by_name(answer)
            wrong = []
            for name, want in sorted(expected.items()):
                got = held.get(name)
                if got is None:
                    continue  # fused away: not in the engine's parameters
                if got == {want}:
                    matched.add(name)
                    self.checked += 1
                elif want in got or (self.comparable is not None and name in self.comparable):
                    wrong.append(name)
            if wrong:
                bad.append(f"{c.url}: {len(wrong)} tensor(s) differ ({', '.join(wrong[:4])})")
        if self.comparable is None and not bad:
            self.comparable = matched
            never = sorted(set(expected) - matched)
            log.info(
                "weights.verify=%s: %d of %d tensors comparable with the engines' "
                "/weight_checker; not comparable (fused, sharded, padded or another dtype "
                "there): %s",
                self.mode, len(matched), len(expected), ", ".join(never[:8]) or "none",
            )  # fmt: skip
        if bad:
            raise WeightSyncError(
                f"v{version}: the engines' weights differ from the trainer's "
                f"(weights undefined): {'; '.join(bad)}"
            )
