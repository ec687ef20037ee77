"""The embedded engine with weight-sync faults injected: a test-only engine process.

``python -m tests.transports.weights.faulty_engine --faults SPEC [engine flags...]`` runs
the real engine server (every flag of ``asyncrl.entrypoints.engine``) with
:class:`FaultyReceiver` as its weight receiver. The product has no failure switch: the
faults exist only in this module, which only tests start.

``SPEC``, comma-separated, each ``KIND:K@V`` (bucket ``K`` of version ``V``; CUDA IPC
syncs are bucket 0):

- ``corrupt``: flip a byte of what arrived, before it is verified (collective: the
  bucket's middle byte; CUDA IPC: the first byte of the first tensor, when the push
  verifies with ``weights.ipc_verify``);
- ``fail``: fail receiving it (RuntimeError "injected failure ...");
- ``stop``: SIGSTOP this engine when the bucket is announced (a hung engine).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

import torch

from asyncrl.engines.rollout.local.weights import WeightReceiver
from asyncrl.entrypoints.engine import main
from asyncrl.transports.weights.bucket import BucketManifest


def parse_faults(spec: str) -> dict[tuple[int, int], str]:
    """``"corrupt:1@11,fail:1@21"`` -> ``{(1, 11): "corrupt", (1, 21): "fail"}``."""
    faults = {}
    for item in filter(None, spec.split(",")):
        kind, _, at = item.partition(":")
        k, _, v = at.partition("@")
        if kind not in ("corrupt", "fail", "stop") or not k or not v:
            raise ValueError(f"bad fault {item!r}: KIND:BUCKET@VERSION, KIND corrupt|fail|stop")
        faults[(int(k), int(v))] = kind
    return faults


class FaultyReceiver(WeightReceiver):
    """The engine's receiver, failing as ``faults`` says (see module docstring)."""

    faults: dict[tuple[int, int], str] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._corrupt_ipc = False

    async def update_from_distributed(self, body: dict[str, Any]) -> dict[str, Any]:
        extra = body.get("asyncrl_bucket")
        if isinstance(extra, dict):
            at = (extra.get("index"), extra.get("version"))
            if self.faults.get(at) == "stop":  # hang mid-push
                os.kill(os.getpid(), signal.SIGSTOP)
        return await super().update_from_distributed(body)

    def _verify(self, m: BucketManifest, flat: torch.Tensor, received: torch.Tensor) -> None:
        fault = self.faults.get((m.index, m.version))
        if fault == "corrupt":
            raw = received.view(-1).view(torch.uint8)
            raw[raw.numel() // 2] ^= 0xFF
        elif fault == "fail":
            raise RuntimeError(f"injected failure loading bucket {m.index}")
        super()._verify(m, flat, received)

    async def _ipc_update(
        self, desc: dict[str, Any], version: int, commit: bool, pause_mode: str | None
    ) -> tuple[list[tuple[str, torch.Tensor]], dict[str, float]]:
        fault = self.faults.get((0, version))
        if fault == "fail":
            raise RuntimeError(f"injected failure copying v{version}")
        self._corrupt_ipc = fault == "corrupt"
        return await super()._ipc_update(desc, version, commit, pause_mode)

    def _ipc_verify(self, ready: list[tuple[str, torch.Tensor]], want: list[int]) -> None:
        if self._corrupt_ipc:
            ready[0][1].view(-1).view(torch.uint8)[0] ^= 0xFF
        super()._ipc_verify(ready, want)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--faults", default="")
    ours, rest = parser.parse_known_args(sys.argv[1:])
    FaultyReceiver.faults = parse_faults(ours.faults)
    main(rest, receiver=FaultyReceiver)
