"""Delta buckets packed and compared chunk by chunk (``delta_pack``) against the bucket
packed whole and compared (``DeltaEncoder.take``): the same payloads and bases, bit for bit."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncrl.transports.weights import delta_native, delta_pack
from asyncrl.transports.weights.bucket import BucketManifest, TensorSpec, pack_into, plan_buckets
from asyncrl.transports.weights.delta import DeltaEncoder, apply_payload
from asyncrl.transports.weights.delta_pack import Segments, bf16_nan


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    """fp32 masters of odd sizes (entries straddle chunks and words), some not contiguous."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"emb": (301, 17), "a.bias": (7,), "b": (33, 5), "norm": (3,), "c": (129, 9)}
    out = {n: torch.randn(s, generator=g) * 0.02 for n, s in shapes.items()}
    out["t"] = torch.randn(11, 13, generator=g).t()  # packed through a reshape copy
    out["a.bias"][2] = float("inf")
    out["norm"][1] = -0.0
    out["c"][0, :4] = torch.tensor([1e-40, -1e-41, 3.0e38, -3.4e38])  # subnormals, rounding to inf
    out["c"][1, :3] = _floats([0x7FC00000, 0xFFA00001, 0x7F800001])  # NaNs: sign, payloads
    return out


def _floats(bits: list[int]) -> torch.Tensor:
    """fp32 values of the given bit patterns."""
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _step(w: dict[str, torch.Tensor], frac: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in w.items():
        moved = torch.rand(t.shape, generator=g) < frac
        out[n] = torch.where(moved, t + 0.01 * torch.randn(t.shape, generator=g), t)
    return out


def _plan(w: dict[str, torch.Tensor], bucket_bytes: int) -> list[BucketManifest]:
    specs = [TensorSpec(n, "bfloat16", tuple(t.shape)) for n, t in w.items()]
    return plan_buckets(specs, bucket_bytes, min_buckets=2)


def _packed(m: BucketManifest, w: dict[str, torch.Tensor]) -> torch.Tensor:
    flat = torch.empty(m.numel, dtype=torch.bfloat16)
    pack_into(flat, m, w)
    return flat.view(torch.uint8)


@pytest.mark.parametrize("frac", [0.0, 0.003, 0.05, 0.5, 1.0])
@pytest.mark.parametrize("mode", ["auto", "on"])
@pytest.mark.parametrize(
    ("chunk", "fused"), [(8, False), (40, False), (1024, False), (1 << 19, False), (8, True)]
)
@pytest.mark.parametrize("bucket_bytes", [2000, 1 << 20])
def test_chunked_payloads_and_bases_equal_the_packed_ones(
    monkeypatch: pytest.MonkeyPatch,
    frac: float,
    mode: str,
    chunk: int,
    fused: bool,
    bucket_bytes: int,
) -> None:
    """Packed chunk by chunk by torch (``fused`` false) or cast while compared (fp32 as
    bf16, one compiled pass): the payloads and bases of packing whole and comparing."""
    if fused:  # the torch-packed path must not be the one that passes
        monkeypatch.setattr(delta_pack, "_compare", _not_called)
    v1 = _tensors(0)
    v2 = _step(v1, frac, 1)
    _assert_takes_equal(v1, [v2, _step(v2, frac / 2, 2)], mode, chunk, fused, bucket_bytes)


def _not_called(*args: object) -> bool:
    raise AssertionError("packed by torch chunk by chunk, not cast while compared")


def _bits(seed: int, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
    """fp32 entries of random bit patterns: every class of value (NaNs of both signs and any
    payload, infinities, subnormals), a quarter of them exact ties of the bf16 rounding, and
    :data:`delta_pack._PROBE` in the first entry large enough."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, n in sizes.items():
        bits = torch.randint(0, 1 << 32, (n,), generator=g, dtype=torch.int64)
        tie = torch.rand(n, generator=g) < 0.25
        bits = torch.where(tie, bits & ~0xFFFF | 0x8000, bits)
        if n >= len(delta_pack._PROBE) and not out:
            bits[: len(delta_pack._PROBE)] = torch.tensor(delta_pack._PROBE)
        out[name] = bits.to(torch.int32).view(torch.float32)
    return out


def _redrawn(w: dict[str, torch.Tensor], frac: float, seed: int) -> dict[str, torch.Tensor]:
    """``w`` with a fraction of its elements given new random bit patterns."""
    new = _bits(seed, {n: t.numel() for n, t in w.items()})
    g = torch.Generator().manual_seed(seed)
    return {
        n: torch.where(torch.rand(t.shape, generator=g) < frac, new[n], t) for n, t in w.items()
    }


@pytest.mark.parametrize("frac", [0.01, 0.2])
@pytest.mark.parametrize("mode", ["auto", "on"])
@pytest.mark.parametrize("bucket_bytes", [64, 2000, 1 << 20])
def test_the_fused_cast_gives_torchs_bits_for_any_pattern(
    monkeypatch: pytest.MonkeyPatch, frac: float, mode: str, bucket_bytes: int
) -> None:
    """fp32 entries of any bit pattern, sized so that words straddle entries (some entries
    inside one word), cast while compared: the same payloads and bases as torch's cast of
    the bucket packed whole, the tie, NaN, infinity and subnormal bits included."""
    monkeypatch.setattr(delta_pack, "_compare", _not_called)
    sizes = {"probe": 4096 + 3, "one": 1, "two": 2, "five": 5, "odd": 7 * 61 * 8 + 1, "last": 6}
    v1 = _bits(0, sizes)
    v2 = _redrawn(v1, frac, 1)
    _assert_takes_equal(v1, [v2, _redrawn(v2, frac, 2)], mode, 8, True, bucket_bytes)


def _assert_takes_equal(
    v1: dict[str, torch.Tensor],
    steps: list[dict[str, torch.Tensor]],
    mode: str,
    chunk: int,
    fused: bool,
    bucket_bytes: int,
) -> None:
    """Pushes ``v1`` then each of ``steps``: ``take_chunked`` gives ``take``'s payloads and
    bases (of the buckets packed whole), and its payloads applied give the packed bytes."""
    native = delta_native.kernels()
    assert native is not None  # the compiled path is what is checked
    assert bf16_nan(native) is not None  # so is the fused cast, where asked for
    plan = _plan(v1, bucket_bytes)
    whole, chunked = DeltaEncoder(mode), DeltaEncoder(mode)
    chunked.chunk_bytes, chunked.fused = chunk, fused
    for m in plan:  # the first push: whole, the base of both
        whole.take(m.index, _packed(m, v1), True)
        chunked.take(m.index, _packed(m, v1), True)
    for w in steps:  # the second push guesses its payload's size from the first
        for m in plan:
            segs = Segments([(e.name, e.start, e.numel) for e in m.entries], w)
            before = chunked.bases[m.index].clone()
            got = chunked.take_chunked(m.index, segs, torch.bfloat16)
            want = whole.take(m.index, _packed(m, w), True)
            assert got is not None
            assert torch.equal(chunked.bases[m.index], whole.bases[m.index])
            assert torch.equal(chunked.bases[m.index], _packed(m, w))
            assert got[1] == want[1]
            if want[0] is None:
                assert got[0] is None and mode == "auto"
                continue
            assert got[0] is not None and torch.equal(got[0], want[0])
            assert apply_payload(before, got[0]) == got[1]
            assert torch.equal(before, _packed(m, w))


def test_entries_not_fp32_are_packed_by_torch() -> None:
    """bf16 masters (nothing to cast) and an fp64 entry: the fused cast does not apply, the
    bucket is packed by torch chunk by chunk, with the same payloads and bases."""
    v1 = {n: t.bfloat16() for n, t in _tensors(5).items()}
    v1["c"] = v1["c"].double()
    v2 = _step(v1, 0.05, 1)
    _assert_takes_equal(v1, [v2, _step(v2, 0.05, 2)], "on", 40, True, 2000)


def test_portable_loops_give_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiler that refuses ``-march=native``: the loops are built portable (no AVX-512:
    the collect that stores every word and counts the changed ones) into a cache of their
    own, and give the same payloads and bases, fused or packed by torch."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    calls = tmp_path / "calls"
    wrapper = tmp_path / "cc"
    wrapper.write_text(
        f'#!/bin/sh\necho "$@" >> {calls}\n'
        'for a in "$@"; do [ "$a" = -march=native ] && exit 1; done\n'
        f'exec {cc} "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    delta_native._loaded.clear()
    try:
        assert delta_native.kernels() is not None
        built = [c for c in calls.read_text().splitlines() if "-shared" in c]
        assert len(built) == 1 and "-march=native" not in built[0]
        v1 = _bits(0, {"probe": 4096 + 3, "one": 1, "five": 5, "odd": 7 * 61 * 8 + 1})
        for fused, chunk in ((True, 8), (False, 40)):
            _assert_takes_equal(v1, [_redrawn(v1, 0.05, 1)], "on", chunk, fused, 2000)
    finally:
        delta_native._loaded.clear()


_SCALAR_RUN = """
import sys
import torch
sys.path.insert(0, sys.argv[1])
import test_delta_pack as t
assert torch.backends.cpu.get_cpu_capability() == "DEFAULT"
t.delta_pack._compare = t._not_called
v1 = t._bits(0, {"probe": 4096 + 3, "one": 1, "five": 5, "odd": 7 * 61 * 8 + 1})
t._assert_takes_equal(v1, [t._redrawn(v1, 0.2, 1)], "on", 8, True, 2000)
print(hex(t.bf16_nan(t.delta_native.kernels())))
"""


def test_the_fused_cast_follows_torchs_scalar_cast_too() -> None:
    """Without its vectorised kernels (``ATEN_CPU_CAPABILITY=default``) torch casts a NaN
    to 0x7fc0 (c10's ``round_to_nearest_even``), not the vectorised 0xffff: the probe finds
    that word and the fused payloads are still torch's, bit for bit."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    here = str(Path(__file__).parent)
    done = subprocess.run(
        [sys.executable, "-c", _SCALAR_RUN, here], env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "0x7fc0"


def test_segments_pack_any_range_as_the_whole_bucket_is_packed() -> None:
    w = _tensors(3)
    m = _plan(w, 1 << 20)[0]
    want = _packed(m, w).view(torch.bfloat16)
    segs = Segments([(e.name, e.start, e.numel) for e in m.entries], w)
    assert segs.numel == m.numel
    for lo, hi in ((0, m.numel), (5, 6), (100, 5200), (m.numel - 3, m.numel), (17, 17)):
        dst = torch.empty(hi - lo, dtype=torch.bfloat16)
        segs.pack(dst, lo, hi)
        assert torch.equal(dst.view(torch.int16), want[lo:hi].view(torch.int16))


def test_without_compiled_loops_the_bucket_is_packed_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCRL_DELTA_NATIVE", "0")
    delta_native._loaded.clear()
    try:
        w = _tensors(4)
        m = _plan(w, 1 << 20)[0]
        enc = DeltaEncoder("on")
        enc.take(0, _packed(m, w), True)
        segs = Segments([(e.name, e.start, e.numel) for e in m.entries], w)
        assert enc.take_chunked(0, segs, torch.bfloat16) is None
    finally:
        delta_native._loaded.clear()
