"""The compiled delta loops (``delta_native``) against the torch/numpy path: the same
payloads, the same bases, bit for bit, and the same refusals."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from asyncrl.transports.weights import delta_native
from asyncrl.transports.weights.delta import DeltaEncoder, apply_payload


@pytest.fixture
def path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test chooses the path with ``_use``; the loaded kernels are forgotten after it."""
    yield
    delta_native._loaded.clear()


def _use(monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    monkeypatch.setenv("ASYNCRL_DELTA_NATIVE", "1" if native else "0")
    delta_native._loaded.clear()
    assert (delta_native.kernels() is not None) == native


def _encode(old: torch.Tensor, new: torch.Tensor, mode: str) -> tuple[object, int, torch.Tensor]:
    enc = DeltaEncoder(mode)
    enc.take(0, old.clone(), True)
    payload, changed = enc.take(0, new.clone(), True)
    return payload, changed, enc.bases[0]


def _changed(old: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """``old`` with one bit flipped in each of the 8-byte words ``words``."""
    new = old.clone()
    new[words * 8 + 3] ^= 0x10
    return new


@pytest.mark.parametrize("nbytes", [13, 4096 + 5, 8 * 64 * 61 + 7, 8 * 200_003 + 3])
@pytest.mark.parametrize("frac", [0.0, 0.02, 0.3, 1.0])
@pytest.mark.parametrize("mode", ["auto", "on"])
def test_native_payloads_equal_the_torch_ones(
    path: None, monkeypatch: pytest.MonkeyPatch, nbytes: int, frac: float, mode: str
) -> None:
    g = torch.Generator().manual_seed(nbytes)
    old = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    words = torch.nonzero(torch.rand(nbytes // 8, generator=g) < frac).squeeze(1)
    new = _changed(old, words)
    if nbytes % 8:
        new[-1] ^= 0x01  # the tail travels too
    out = {}
    for native in (False, True):
        _use(monkeypatch, native)
        out[native] = _encode(old, new, mode)
    (p0, c0, b0), (p1, c1, b1) = out[False], out[True]
    assert torch.equal(b0, new) and torch.equal(b1, new)
    if p0 is None:  # auto, not smaller: both send the bucket whole
        assert p1 is None and mode == "auto"
        return
    assert isinstance(p0, torch.Tensor) and isinstance(p1, torch.Tensor)
    assert c0 == c1 == words.numel() and torch.equal(p0, p1)
    for native in (False, True):
        _use(monkeypatch, native)
        dst = old.clone()
        assert apply_payload(dst, p1) == c1
        assert torch.equal(dst, new)


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_a_short_estimate_grows_the_payload(
    path: None, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Every word changes but those the estimate samples (each 61st): the payload sized from
    the estimate is grown until everything fits (``on``), or the bucket goes whole once the
    payload would not be smaller (``auto``)."""
    _use(monkeypatch, True)
    n = 64 * 61 * 10
    old = torch.randint(0, 256, (8 * n,), dtype=torch.uint8)
    every = torch.arange(n)
    sparse = every[every % 61 != 0][::4]  # 1/4 of the unsampled words: a delta is smaller
    for words, whole in ((sparse, False), (every[every % 61 != 0], mode == "auto")):
        new = _changed(old, words)
        payload, changed, base = _encode(old, new, mode)
        assert torch.equal(base, new)
        if whole:
            assert payload is None
            continue
        assert isinstance(payload, torch.Tensor) and changed == words.numel()
        dst = old.clone()
        apply_payload(dst, payload)
        assert torch.equal(dst, new)


@pytest.mark.parametrize("native", [False, True])
def test_a_payload_indexing_outside_the_bucket_is_refused(
    path: None, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    _use(monkeypatch, native)
    payload = torch.zeros(12 * 2, dtype=torch.uint8)
    payload[8 * 2 : 12 * 2].view(torch.int32).copy_(torch.tensor([1, 40]))  # 40 >= 10 words
    with pytest.raises(ValueError, match="outside"):
        apply_payload(torch.zeros(80, dtype=torch.uint8), payload)
    payload[8 * 2 : 12 * 2].view(torch.int32).copy_(torch.tensor([1, -1]))
    with pytest.raises(ValueError, match="outside"):
        apply_payload(torch.zeros(80, dtype=torch.uint8), payload)


def test_no_compiler_means_the_torch_path(path: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    delta_native._loaded.clear()
    assert delta_native.kernels() is None  # logged, not raised: deltas still work
    old = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    new = _changed(old, torch.tensor([3, 100]))
    _, changed, base = _encode(old, new, "on")
    assert changed == 2 and torch.equal(base, new)
