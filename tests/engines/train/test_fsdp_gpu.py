"""FSDP2 on a CUDA device (NCCL, world size 1): same numbers as the CPU engine, trains, offloads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from asyncrl.config import load_config
from asyncrl.engines.train.fsdp import FSDPEngine, init_process_group
from tests.engines.train._ranks import TokenMeanLoss, make_batch

ARGS = ["--trainer.micro_batch_tokens=24", "--trainer.lr=0.01"]


@pytest.mark.gpu
def test_fsdp_on_cuda_matches_cpu_engine(tiny_model_dir: Path, free_port: int) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    batch, batch2 = make_batch(1), make_batch(2)
    cpu = FSDPEngine(str(tiny_model_dir), load_config(None, ARGS))  # no process group: plain
    ref_before = torch.cat(cpu.forward_batch(batch))
    cpu.train_batch(batch, TokenMeanLoss())
    ref_after = torch.cat(cpu.forward_batch(batch2))
    ref_weights = {n: t.clone() for n, t in cpu.named_weights()}

    init_process_group(0, 1, free_port, "cuda")
    try:
        gpu = FSDPEngine(str(tiny_model_dir), load_config(None, [*ARGS, "--trainer.device=cuda"]))
        assert not gpu.sharded and gpu.device.type == "cuda"  # one rank: a plain module
        before = torch.cat(gpu.forward_batch(batch)).cpu()
        torch.testing.assert_close(before, ref_before, atol=1e-4, rtol=1e-4)
        stats = gpu.train_batch(batch, TokenMeanLoss())
        assert stats["skipped"] == 0.0 and stats["grad_norm"] > 0
        after = torch.cat(gpu.forward_batch(batch2)).cpu()
        torch.testing.assert_close(after, ref_after, atol=1e-3, rtol=1e-3)
        weights = dict(gpu.named_weights())
        assert weights.keys() == ref_weights.keys()
        for name, t in weights.items():
            assert t.device.type == "cuda"
            # one AdamW step of lr 0.01: a near-zero gradient's update is ~sign(g) * lr, so
            # float rounding between devices may move such an element by a fraction of lr
            torch.testing.assert_close(t.cpu(), ref_weights[name], atol=1e-3, rtol=1e-3)
        held = torch.cuda.memory_allocated()
        gpu.offload()
        assert torch.cuda.memory_allocated() < held  # parameters and optimizer state left
        gpu.onload()
        torch.testing.assert_close(
            torch.cat(gpu.forward_batch(batch2)).cpu(), after, atol=0.0, rtol=0.0
        )
    finally:
        dist.destroy_process_group()
