"""The engine's request checks accept every manifest the real sender builds (each
``weights.verify`` mode, delta buckets) and refuse malformed ones with 400.

The sender (``transports.weights.collective_wire.bucket_extra``) sends the checksum as a
signed int64 (``bucket._finish``); the engine's checks once accepted only
``[0, 2**64)``, refusing about half of all verified buckets with 400.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from asyncrl.engines.rollout.checks import BadRequest
from asyncrl.engines.rollout.local.collective_recv import bucket_manifest
from asyncrl.transports.weights.bucket import BucketManifest, checksum, plan_buckets, spec_of
from asyncrl.transports.weights.collective_wire import bucket_extra
from asyncrl.transports.weights.delta import DeltaEncoder, DeltaInfo
from asyncrl.transports.weights.integrity import bucket_checksum


def _body(
    m: BucketManifest,
) -> dict:  # the body collective_send.py's _announce sends, minus the transport fields
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
        got = bucket_manifest(_body(m), bucket_extra(m), limit=flat.numel())
        assert got.checksum == m.checksum and got.version == seed
    assert signs == {True, False}  # both signs were really exercised


@pytest.mark.parametrize("value", [-(1 << 63), (1 << 63) - 1])
def test_int64_bounds_accepted(value: int) -> None:
    t = torch.zeros(4)
    (m,) = plan_buckets([spec_of("w", t)], 1 << 20)
    m = msgspec.structs.replace(m, checksum=value)
    assert bucket_manifest(_body(m), bucket_extra(m), limit=4).checksum == value


@pytest.mark.parametrize("value", [1 << 63, -(1 << 63) - 1, "abc", 1.5])
def test_out_of_int64_or_not_integer_refused(value: object) -> None:
    t = torch.zeros(4)
    (m,) = plan_buckets([spec_of("w", t)], 1 << 20)
    extra = bucket_extra(m) | {"checksum": value}
    with pytest.raises(BadRequest, match="checksum"):
        bucket_manifest(_body(m), extra, limit=4)


def _model_bucket(seed: int) -> tuple[BucketManifest, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "a.weight": torch.randn(256, 64, generator=g),
        "b.bias": torch.randn(61, generator=g),
    }
    (plan,) = plan_buckets([spec_of(n, t) for n, t in tensors.items()], 1 << 20)
    return plan, torch.cat([t.reshape(-1) for t in tensors.values()])


@pytest.mark.parametrize("mode", ["full", "sampled", "off"])
def test_every_verify_mode_and_delta_manifest_passes_the_engine_checks(mode: str) -> None:
    """The checksum of each weights.verify mode and a delta bucket's [base, nbytes, checksum],
    as the sender builds them, come back unchanged through the engine's checks."""
    signs = set()
    for seed in range(8):
        plan, flat = _model_bucket(seed)
        m = msgspec.structs.replace(plan, version=seed + 1, verify=mode)
        m = msgspec.structs.replace(m, checksum=bucket_checksum(flat, m, mode))
        new = flat.clone()
        new[seed::97] += 1.0  # a few changed words: a real payload
        enc = DeltaEncoder("on")
        enc.take(0, flat.view(torch.uint8).clone(), False)
        payload, changed = enc.take(0, new.view(torch.uint8).clone(), True)
        assert payload is not None and changed > 0
        info = DeltaInfo(seed, payload.numel(), None if mode == "off" else checksum(payload))
        for sent in (m, msgspec.structs.replace(m, delta=info)):
            got = bucket_manifest(_body(sent), bucket_extra(sent), limit=flat.numel())
            assert (got.checksum, got.verify, got.delta) == (sent.checksum, mode, sent.delta)
            if sent.checksum is not None:
                signs.add(sent.checksum < 0)
    assert mode == "off" or signs == {True, False}


@pytest.mark.parametrize(
    ("delta", "match"),
    [
        ({"base": 1}, "delta must be"),
        ([1], "delta must be"),
        ([1, 2, 3, 4], "delta must be"),
        (["1", 16, None], "base"),
        ([1, 13, None], "not 12 \\* words"),
        ([1, -12, None], "nbytes"),
        ([1, 10**12, None], "nbytes"),
        ([1, 16, 1 << 63], "checksum"),  # 16 = 12 * 1 word + 65780 % 8
        ([True, 16, None], "base"),
    ],
)
def test_malformed_delta_refused_before_allocation(delta: object, match: str) -> None:
    plan, flat = _model_bucket(0)
    extra = bucket_extra(msgspec.structs.replace(plan, version=1)) | {"delta": delta}
    with pytest.raises(BadRequest, match=match):
        bucket_manifest(_body(plan), extra, limit=flat.numel())


def test_unknown_verify_mode_refused() -> None:
    plan, flat = _model_bucket(0)
    extra = bucket_extra(plan) | {"verify": "most"}
    with pytest.raises(BadRequest, match="verify must be one of"):
        bucket_manifest(_body(plan), extra, limit=flat.numel())
