"""CUDA IPC weight sync into colocated embedded engines (needs a GPU; CPU checks at the end)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from asyncrl.config import CudaIpcWeightsConfig, load_config
from asyncrl.engines.rollout.factory import make_weight_transport
from asyncrl.transports.weights.base import WeightSyncError
from asyncrl.transports.weights.bucket import checksum
from asyncrl.transports.weights.cuda_ipc_send import IpcExport
from tests.transports.weights.test_collective import engines, push_each, state


def gpu_engines(model_dir: Path, tmp: Path, faults: list[str]) -> contextlib.AbstractContextManager:
    """One engine process on the GPU per entry of ``faults`` ("" = healthy); stopped by pid."""
    return engines(model_dir, tmp, faults, device="cuda")


def weights_like(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    """Random weights of the model's shapes, one CUDA allocation each (like a trainer's)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = {
        n: torch.randn(p.shape, generator=gen, device="cuda") for n, p in model.named_parameters()
    }
    next(iter(out.values())).view(-1)[:3].view(torch.int32).fill_(0x7FA00001 + seed)  # NaN bits
    return out


def sums(weights: dict[str, torch.Tensor]) -> dict[str, int]:
    return {n: checksum(t.contiguous()) for n, t in weights.items()}


def push_all(
    urls: list[str], pushes: list[tuple[dict[str, torch.Tensor], int]], **cfg: object
) -> list[object]:
    """Push each (weights, version) through one sender; the stats or the error of each."""
    sender = make_weight_transport(CudaIpcWeightsConfig(**cfg), urls, "cuda")
    return push_each(sender, pushes, 120)


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["foreach", "graph"])
def test_cuda_ipc_delivers_bit_exact_and_remaps_a_new_layout(
    tiny_model_dir: Path, tmp_path: Path, how: str
) -> None:
    a, b = weights_like(tiny_model_dir, 1), weights_like(tiny_model_dir, 2)
    with gpu_engines(tiny_model_dir, tmp_path, [""]) as urls:
        out = push_all(urls, [(a, 1)], ipc_copy=how)
        assert isinstance(out[0], dict), out
        assert state(urls[0]) == ("1", sums(a))
        a2 = {n: t.mul_(-1) for n, t in a.items()}  # same storages: the layout is reused
        out = push_all(urls, [(a2, 2), (b, 3), (a2, 4)], ipc_copy=how)  # b: a new layout
        assert all(isinstance(o, dict) for o in out), out
        assert state(urls[0]) == ("4", sums(a2))


@pytest.mark.gpu
def test_cuda_ipc_failures_keep_the_old_version_on_every_engine(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    w = [weights_like(tiny_model_dir, s) for s in range(4)]
    with gpu_engines(tiny_model_dir, tmp_path, ["", "fail:0@2,corrupt:0@3"]) as urls:
        for pushes, error in (
            ([(w[0], 1), (w[1], 2)], "injected failure"),  # the second engine fails v2
            ([(w[2], 3)], "checksum mismatch"),  # ... and corrupts its copy of v3
        ):
            out = push_all(urls, pushes, ipc_verify=True)
            assert isinstance(out[0], dict) == (len(out) == 2), out
            assert isinstance(out[-1], WeightSyncError) and error in str(out[-1]), out
            for url in urls:  # neither engine switched
                assert state(url) == ("1", sums(w[0]))
        out = push_all(urls, [(w[3], 4)], ipc_verify=True)
        assert isinstance(out[0], dict), out
        for url in urls:
            assert state(url) == ("4", sums(w[3]))
        out = push_all(urls[1:], [(w[0], 5), (w[1], 2)])  # one engine: one call per sync
        assert isinstance(out[0], dict) and isinstance(out[1], WeightSyncError), out
        assert state(urls[1]) == ("5", sums(w[0]))


def test_ipc_config_and_cpu_tensors_are_refused_with_clear_errors() -> None:
    cfg = load_config(overrides=["--weights.backend=cuda-ipc", "--weights.ipc_verify=true"])
    assert cfg.weights.ipc_verify
    with pytest.raises(ValueError, match=r"cuda-ipc pushes CUDA tensors; w is on cpu"):
        IpcExport().update([("w", torch.zeros(2))])


def test_bitwise_views_copy_bits_as_wide_as_alignment_allows() -> None:
    from asyncrl.engines.rollout.local.cuda_ipc_recv import _bitwise

    src = torch.empty(4, 6, dtype=torch.bfloat16)
    src.view(torch.int16).copy_(torch.arange(0x7F81, 0x7F81 + 24, dtype=torch.int16).view(4, 6))
    dst = torch.zeros_like(src)  # NaN payloads that a float copy would canonicalize
    d, s = _bitwise(dst, src)
    assert d.dtype == s.dtype == torch.int64 and d.shape == (6,)
    torch._foreach_copy_([d], [s])
    assert torch.equal(dst.view(torch.int16), src.view(torch.int16))
    odd = torch.empty(3, dtype=torch.bfloat16)  # 6 bytes: 2-byte words
    assert _bitwise(odd, odd.clone())[0].dtype == torch.int16
    cast = _bitwise(torch.empty(2), torch.empty(2, dtype=torch.bfloat16))  # a cast stays
    assert (cast[0].dtype, cast[1].dtype) == (torch.float32, torch.bfloat16)
    strided = torch.empty(4, 4, dtype=torch.float16).t()  # not contiguous: same-size view
    assert _bitwise(strided, strided.clone())[0].shape == (4, 4)
