"""``asyncrl bench weight-sync --engine sglang|vllm --urls URL[,URL]``: the same pushes into
running SGLang or vLLM servers, rows beside the embedded engine's (same run, same shapes,
same columns; ``weight_sync`` measures both).

The servers must serve a model with ``--model``'s shapes and names (e.g. Qwen2-0.5B for
``qwen2-0.5b``; for vLLM started with ``VLLM_SERVER_DEV_MODE=1`` and ``--weight-transfer-config
'{"backend": "nccl"}'``, so ``--backend nccl``); the run's secret is their key. Pushes go
through the family's engine control as in a run (SGLang: whole tensors, paused transfer;
vLLM: ``keep`` pause, start/update/finish sessions, packed chunks, ``weights.verify``
through ``/weight_checker``). The naive per-tensor baseline is the embedded engine's only
(both families need their sessions). ``cpu_s`` counts this process only (the servers are
not its children).

``verified``: vLLM, every worker's ``/weight_checker`` sha256 of every tensor the sender
pushed equals the sender's, and ``/weight_info`` is the last version (a tensor that vLLM
fuses or shards is not in its answer under the sender's name: such a tensor counts as
unverified, so ``verified`` is False unless every pushed name is there); SGLang: None (no
route answers the loaded weights' digests).

On this machine the servers are asyncrl's stand-ins of vLLM 0.33 and SGLang (tests/, written
from their source, Gloo in place of NCCL): their rows measure asyncrl's sender and control
calls against a CPU process that receives, unpacks and hashes, not a GPU engine.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

__all__ = ["verified_by"]


def _sha256(t: Any) -> str:
    import torch

    raw = t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy()
    return hashlib.sha256(raw.data).hexdigest()


async def _vllm_state(urls: list[str]) -> list[tuple[str, dict[str, str]]]:
    from asyncrl.engines.rollout.vllm.control import VLLMControl

    clients = [VLLMControl(u, timeout_s=600) for u in urls]
    try:
        return [(await c.get_weight_version(), await c.weight_checksums()) for c in clients]
    finally:
        await asyncio.gather(*(c.close() for c in clients))


def verified_by(
    engine: str, urls: list[str], weights: dict[str, Any], version: int, embedded: bool | None
) -> bool | None:
    """Whether the engines at ``urls`` hold ``weights`` as ``version`` (module docstring);
    ``embedded``: the embedded engine's own check, passed through for that family."""
    if engine == "embedded":
        return embedded
    if engine != "vllm":
        return None
    want = {n: _sha256(t) for n, t in weights.items()}
    for label, sums in asyncio.run(_vllm_state(urls)):
        held: dict[str, set[str]] = {}
        for key, digest in sums.items():
            held.setdefault(key.split(":", 4)[-1], set()).add(digest)
        if label != str(version) or any(held.get(n) != {d} for n, d in want.items()):
            return False
    return True
