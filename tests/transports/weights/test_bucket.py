"""Flat buckets: planning (one dtype, bounded, chunked), packing, checksum, reassembly."""

from __future__ import annotations

import torch

from asyncrl.transports.weights.bucket import (
    assemble,
    checksum,
    pack_into,
    plan_buckets,
    span_of,
    spec_of,
)

MIB = 1 << 20


def _roundtrip(tensors: dict[str, torch.Tensor], bucket_bytes: int, min_buckets: int = 1):
    plan = plan_buckets([spec_of(n, t) for n, t in tensors.items()], bucket_bytes, min_buckets)
    bufs = []
    for m in plan:
        flat = torch.empty(m.numel, dtype=m.torch_dtype)
        pack_into(flat, m, tensors)
        bufs.append((m, flat))
    return plan, dict(assemble(bufs))


def test_buckets_hold_one_dtype_bounded_and_chunk_oversized_tensors() -> None:
    torch.manual_seed(0)
    tensors = {
        "small": torch.randn(10, 10),
        "half": torch.randn(3000).to(torch.bfloat16),
        "huge": torch.randn(700, 1000),  # 2.8 MB > 1 MiB bucket
        "tail": torch.randn(5),
        "int": torch.arange(7),
    }
    plan, out = _roundtrip(tensors, MIB)
    for m in plan:
        assert m.nbytes <= MIB
        assert len({m.dtype}) == 1
        assert m.count == len(plan)
    chunks = [e for m in plan for e in m.entries if e.name == "huge"]
    assert len(chunks) >= 3 and not any(e.whole for e in chunks)
    assert {m.dtype for m in plan} == {"float32", "bfloat16", "int64"}
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype and torch.equal(out[name], t), name


def test_min_buckets_splits_a_sync_for_pipelining() -> None:
    tensors = {f"w{i}": torch.zeros(256, 1024) for i in range(8)}  # 8 MiB
    plan, out = _roundtrip(tensors, 512 * MIB, min_buckets=4)
    assert len(plan) == 4 and all(m.nbytes == 2 * MIB for m in plan)
    assert all(torch.equal(out[n], t) for n, t in tensors.items())


def test_checksum_detects_a_flipped_bit_and_block_swaps() -> None:
    flat = torch.randn(1 << 20).to(torch.bfloat16)  # 4 checksum blocks
    c = checksum(flat)
    assert c == checksum(flat.clone())
    bad = flat.clone()
    bad.view(torch.uint8)[12345] ^= 4
    assert checksum(bad) != c
    words = flat.view(torch.int64).clone()
    swapped = torch.cat([words[1 << 16 :], words[: 1 << 16]])
    assert checksum(swapped) != checksum(words)
    odd = torch.arange(13, dtype=torch.uint8)  # byte tail not a multiple of 8
    assert checksum(odd) != checksum(torch.arange(1, 14, dtype=torch.uint8))


def test_cpu_checksum_equals_the_device_formula_and_fused_packing() -> None:
    from asyncrl.transports.weights.bucket import _checksum_torch, pack_checksum

    for n in (0, 1, 7, 8, 13, (1 << 19) + 5, 3 * (1 << 19) + 11):
        raw = torch.randint(0, 256, (n,), dtype=torch.uint8)
        assert checksum(raw) == _checksum_torch(raw), n
    specs = [spec_of(f"t{i}", torch.empty(301 * i + 3, 7, dtype=torch.bfloat16)) for i in range(40)]
    tensors = {s.name: torch.randn(s.shape).to(torch.bfloat16) for s in specs}
    for m in plan_buckets(specs, MIB // 4):
        fused, plain = torch.empty(m.numel, dtype=torch.bfloat16), torch.empty(m.numel)
        plain = plain.to(torch.bfloat16)
        value = pack_checksum(fused, m, tensors)
        pack_into(plain, m, tensors)
        assert torch.equal(fused.view(torch.int16), plain.view(torch.int16))
        assert value == checksum(plain) == _checksum_torch(plain)


def test_span_of_sends_back_to_back_tensors_in_place_and_nothing_else() -> None:
    flat = torch.randn(6000)
    shapes = {"a": (10, 100), "b": (3000,), "c": (2000,)}
    views, off = {}, 0
    for n, shape in shapes.items():
        views[n] = flat[off : off + torch.Size(shape).numel()].view(shape)
        off += torch.Size(shape).numel()
    plan = plan_buckets([spec_of(n, t) for n, t in views.items()], 8000, 1)
    assert [[(e.name, e.whole) for e in m.entries] for m in plan] == [
        [("a", True), ("b", False)],  # b is chunked over two buckets
        [("b", False)],
        [("c", True)],
    ]
    for m in plan:
        span = span_of(m, views, torch.device("cpu"))
        packed = torch.empty(m.numel)
        pack_into(packed, m, views)
        assert span is not None and torch.equal(span, packed)
        assert span.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    copies = {n: t.clone() for n, t in views.items()}  # separate allocations: only buckets
    spans = [span_of(m, copies, torch.device("cpu")) for m in plan]  # of one tensor are spans
    assert [s is None for s in spans] == [True, False, False]
    assert spans[1] is not None and torch.equal(spans[1], views["b"][1000:])
    swapped = {"a": views["b"], "b": views["a"], "c": views["c"]}  # wrong order in memory
    assert span_of(plan[0], dict(swapped), torch.device("cpu")) is None
    halves = {n: t.half() for n, t in views.items()}
    assert span_of(plan[0], halves, torch.device("cpu")) is None  # not the bucket's dtype
