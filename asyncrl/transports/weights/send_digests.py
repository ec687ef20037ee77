"""Checking what engines that report per-tensor digests loaded (trainer process).

Some engines (vLLM 0.33's ``POST /weight_checker``) answer the sha256 of every tensor they
hold, on every worker; what they hold is not the tensors pushed (vLLM fuses, pads, shards
and casts them), so the engine family says how its answer follows from the pushed tensors
(``WeightAdapter.compare_digests``: :class:`~asyncrl.transports.weights.seam.DigestReport`).
Such an engine cannot be asked for a subset: each call hashes the whole model on every
worker. So for such families ``weights.verify`` means, after each push's finish and before
generation resumes:

- ``full``: every engine answers; every tensor it holds is compared.
- ``sampled``: the first check of the sender compares every tensor of one engine (as
  ``full``); later pushes one engine each, in turn (``version mod engines``), and
  :data:`SAMPLE` of its tensors chosen by the push's version.
- ``off``: nothing.

The trainer's side is computed from the staged copy of the push (the bytes sent). A tensor
that differs fails the attempt (:class:`~asyncrl.transports.weights.base.WeightSyncError`
naming the engine and tensors): the push is re-sent as a whole new round, as for any failed
update of an engine that loads live. When the family cannot compute what the engine holds
(another layout than it knows, named), nothing can be checked: the push fails with
:class:`~asyncrl.transports.weights.base.WeightsUnverified` at once (fatal, not re-sent),
naming why and ``weights.verify = "off"``. A check never passes having compared nothing.
``compared`` / ``total``: the last check's counts (tensors per worker rank, over the engines
asked), reported with the push's stats.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import torch

from asyncrl.transports.weights.base import WeightsUnverified, WeightSyncError
from asyncrl.transports.weights.bucket import BucketManifest
from asyncrl.transports.weights.seam import DigestCompare, DigestReport, WeightEngine

__all__ = ["SAMPLE", "DigestCheck", "pushed_tensors"]

log = logging.getLogger("asyncrl.weights")

SAMPLE = 8
"""Tensors compared per push under ``weights.verify = "sampled"`` (after the first check)."""

Checksums = Callable[[WeightEngine], Awaitable[dict[str, str]]]


def pushed_tensors(packed: list[tuple[BucketManifest, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The whole tensors of staged buckets (manifest, flat bytes) as views, by name."""
    out: dict[str, torch.Tensor] = {}
    for m, flat in packed:
        values = flat.view(-1).view(m.torch_dtype)
        offset = 0
        for e in m.entries:
            if e.whole:
                out[e.name] = values[offset : offset + e.size].view(e.shape)
            offset += e.size
    return out


class DigestCheck:
    """The check of one sender (module docstring)."""

    def __init__(self, mode: str, checksums: Checksums, compare: DigestCompare):
        self.mode = mode
        self.checksums = checksums
        self.compare = compare
        self.full_done = False  # a check compared every tensor of an engine
        self.compared = 0  # the last check's counts
        self.total = 0

    def engines(self, version: int, clients: list[WeightEngine]) -> list[WeightEngine]:
        if self.mode == "off" or not clients:
            return []
        return list(clients) if self.mode == "full" else [clients[version % len(clients)]]

    async def check(
        self, version: int, clients: list[WeightEngine], pushed: dict[str, torch.Tensor]
    ) -> None:
        """Ask the engines of push ``version`` for their digests and compare (module
        docstring); WeightSyncError on a difference or an engine that fails to answer,
        WeightsUnverified when nothing can be compared."""
        chosen = self.engines(version, clients)
        if not chosen:
            return
        sample = None if self.mode == "full" or not self.full_done else SAMPLE
        answers = await asyncio.gather(*(self.checksums(c) for c in chosen), return_exceptions=True)
        loop = asyncio.get_running_loop()
        compared = total = 0
        bad: list[str] = []
        for c, answer in zip(chosen, answers, strict=True):
            if isinstance(answer, BaseException):
                raise WeightSyncError(f"v{version}: {c.url}/weight_checker: {answer}")
            try:
                got: DigestReport = await loop.run_in_executor(
                    None, self.compare, pushed, answer, sample, version
                )
            except ValueError as exc:
                raise WeightsUnverified(
                    f"v{version}: weights.verify={self.mode} cannot check {c.url}: {exc}; "
                    "nothing was compared (weights.verify=off runs without the check)"
                ) from exc
            if got.compared == 0:
                raise WeightsUnverified(
                    f"v{version}: weights.verify={self.mode}: {c.url} reported "
                    f"{got.total} tensors, none comparable with the pushed ones"
                )
            compared, total = compared + got.compared, total + got.total
            if got.wrong:
                names = ", ".join(got.wrong[:4])
                n = len(got.wrong)
                bad.append(f"{c.url}: {n} of {got.compared} tensor(s) differ ({names})")
        self.compared, self.total = compared, total
        if bad:
            raise WeightSyncError(
                f"v{version}: the engines' weights differ from the trainer's "
                f"(weights undefined): {'; '.join(bad)}"
            )
        if sample is None and not self.full_done:
            self.full_done = True
            log.info(
                "weights.verify=%s: v%d: %d of %d tensors compared, all equal",
                self.mode, version, compared, total,
            )  # fmt: skip
