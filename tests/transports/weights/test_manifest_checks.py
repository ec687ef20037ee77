"""The engine's request checks accept every manifest the real sender builds.

The sender (``transports.weights.sender.bucket_extra``) sends the checksum as a
signed int64 (``bucket._finish``); the engine's checks once accepted only
``[0, 2**64)``, refusing about half of all verified buckets with 400.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from asyncrl.engines.rollout.local.checks import BadRequest
from asyncrl.engines.rollout.local.weights import _manifest
from asyncrl.transports.weights.bucket import BucketManifest, checksum, plan_buckets, spec_of
from asyncrl.transports.weights.sender import bucket_extra


def _body(
    m: BucketManifest,
) -> dict:  # the body collective.py's _announce sends, minus the transport fields
    return {
        "names": [e.name for e in m.entries],
        "dtypes": [m.dtype] * len(m.entries),
        "shapes": [e.wire_shape for e in m.entries],
    }


def test_sender_manifests_with_negative_and_positive_checksums_pass_the_engine_checks() -> None:
    signs = set()
    for seed in range(16):
        g = torch.Generator().manual_seed(seed)
        tensors = {
            "a.weight": torch.randn(64, 16, generator=g),
            "b.bias": torch.randn(16, generator=g),
        }
        specs = [spec_of(n, t) for n, t in tensors.items()]
        (plan,) = plan_buckets(specs, 1 << 20)
        flat = torch.cat([t.reshape(-1) for t in tensors.values()])
        m = msgspec.structs.replace(plan, version=seed, checksum=checksum(flat))
        signs.add(m.checksum < 0)
        got = _manifest(_body(m), bucket_extra(m), limit=flat.numel())
        assert got.checksum == m.checksum and got.version == seed
    assert signs == {True, False}  # both signs were really exercised


@pytest.mark.parametrize("value", [-(1 << 63), (1 << 63) - 1])
def test_int64_bounds_accepted(value: int) -> None:
    t = torch.zeros(4)
    (m,) = plan_buckets([spec_of("w", t)], 1 << 20)
    m = msgspec.structs.replace(m, checksum=value)
    assert _manifest(_body(m), bucket_extra(m), limit=4).checksum == value


@pytest.mark.parametrize("value", [1 << 63, -(1 << 63) - 1, "abc", 1.5])
def test_out_of_int64_or_not_integer_refused(value: object) -> None:
    t = torch.zeros(4)
    (m,) = plan_buckets([spec_of("w", t)], 1 << 20)
    extra = bucket_extra(m) | {"checksum": value}
    with pytest.raises(BadRequest, match="checksum"):
        _manifest(_body(m), extra, limit=4)
