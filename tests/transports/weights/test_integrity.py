"""What each weights.verify mode catches: buckets corrupted in each way, detections counted."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import torch

from asyncrl.transports.weights.bucket import (
    BucketManifest,
    TensorSpec,
    pack_into,
    plan_buckets,
)
from asyncrl.transports.weights.integrity import bucket_checksum

SPECS = [TensorSpec(f"layer{i}.w", "bfloat16", (96 + 8 * i, 130)) for i in range(24)]
PLAN = plan_buckets(SPECS, 1 << 20, 4)  # 4 buckets of ~150-200 KiB, 6 tensors each


def _pushes() -> list[list[torch.Tensor]]:
    """Two versions' packed buckets: v2 differs from v1 in a few elements per tensor, as a
    small optimizer step changes bf16 weights."""
    g = torch.Generator().manual_seed(0)
    v1 = {s.name: torch.randn(s.shape, generator=g).bfloat16() for s in SPECS}
    v2 = {}
    for n, t in v1.items():
        t2 = t.clone().reshape(-1)
        t2[torch.randint(0, t2.numel(), (t2.numel() // 50,), generator=g)] += 0.5
        v2[n] = t2.view(t.shape)
    out = []
    for w in (v1, v2):
        bufs = []
        for m in PLAN:
            flat = torch.empty(m.numel, dtype=torch.bfloat16)
            pack_into(flat, m, w)
            bufs.append(flat)
        out.append(bufs)
    return out


Corruption = Callable[[int, list[torch.Tensor], list[torch.Tensor]], torch.Tensor]


def _misordered(k: int, new: list[torch.Tensor], _: list[torch.Tensor]) -> torch.Tensor:
    other = new[(k + 1) % len(new)]  # the next bucket's bytes where bucket k belongs
    out = new[k].clone()
    n = min(out.numel(), other.numel())
    out[:n] = other[:n]
    return out


def _shifted(k: int, new: list[torch.Tensor], _: list[torch.Tensor]) -> torch.Tensor:
    return torch.roll(new[k].view(torch.uint8), 8).view(torch.bfloat16)  # 8 bytes late


def _truncated(k: int, new: list[torch.Tensor], old: list[torch.Tensor]) -> torch.Tensor:
    out = new[k].clone()
    cut = out.numel() * 7 // 8
    out[cut:] = old[k][cut:]  # the tail never arrived: the buffer kept the last push
    return out


def _torn(k: int, new: list[torch.Tensor], old: list[torch.Tensor]) -> torch.Tensor:
    out = new[k].clone()
    a = out.numel() // 3
    out[a : a + out.numel() // 8] = old[k][a : a + out.numel() // 8]  # an eighth from v1
    return out


def _bit_flip(k: int, new: list[torch.Tensor], _: list[torch.Tensor]) -> torch.Tensor:
    out = new[k].clone()
    out.view(torch.uint8)[out.numel() // 3 + 11] ^= 0x04
    return out


def test_each_mode_catches_what_it_promises() -> None:
    v1, v2 = _pushes()
    kinds = {
        "misordered": _misordered,
        "shifted": _shifted,
        "truncated": _truncated,
        "torn": _torn,
        "bit_flip": _bit_flip,
    }
    caught = {mode: dict.fromkeys(kinds, 0) for mode in ("full", "sampled", "off")}
    trials = 0
    for version in range(2, 12):  # the sampled blocks move with the version
        for k, base in enumerate(PLAN):
            m: BucketManifest = msgspec.structs.replace(base, version=version)
            trials += 1
            for mode in caught:
                want = bucket_checksum(v2[k], m, mode)  # type: ignore[arg-type]
                assert bucket_checksum(v2[k].clone(), m, mode) == want  # intact: no alarm
                for kind, corrupt in kinds.items():
                    bad = corrupt(k, v2, v1)
                    assert not torch.equal(bad, v2[k])
                    if want is not None and bucket_checksum(bad, m, mode) != want:
                        caught[mode][kind] += 1
    print(f"detections out of {trials} per kind: {caught}")
    assert caught["full"] == dict.fromkeys(kinds, trials)
    structural = ("misordered", "shifted", "truncated", "torn")
    assert all(caught["sampled"][k] == trials for k in structural), caught["sampled"]
    assert caught["sampled"]["bit_flip"] < trials  # a lone bit outside the subset: not promised
    assert caught["off"] == dict.fromkeys(kinds, 0)
