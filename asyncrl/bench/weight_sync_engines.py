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

``verified``: vLLM, every worker's ``/weight_checker`` sha256 of every parameter it holds
equals what it holds had it loaded the pushed tensors (fused, padded, sharded and cast as
vLLM's loader does: ``engines/rollout/vllm/layout.py``), every parameter compared, and
``/weight_info`` is the last version; SGLang: None (no route answers the loaded weights'
digests).

On this machine the servers are asyncrl's stand-ins of vLLM 0.33 and SGLang (tests/, written
from their source, Gloo in place of NCCL): their rows measure asyncrl's sender and control
calls against a CPU process that receives, unpacks and hashes, not a GPU engine.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["verified_by"]


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
    from asyncrl.engines.rollout.vllm.layout import VLLMDigests

    compare = VLLMDigests()
    for label, sums in asyncio.run(_vllm_state(urls)):
        try:
            got = compare(weights, sums, None, version)
        except ValueError:  # a layout it cannot compute: not verified
            return False
        if label != str(version) or got.wrong or got.compared != got.total:
            return False
    return True
