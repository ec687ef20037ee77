"""FSDPEngine without a process group: a plain module at world size 1, same contract."""

from __future__ import annotations

from pathlib import Path

import torch

from asyncrl.config import load_config
from asyncrl.engines.train.fsdp import FSDPEngine
from tests.engines.train._ranks import TokenMeanLoss, assert_resumes_exactly, make_batch


def test_engine_without_process_group_trains_saves_and_loads(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    torch.set_num_threads(1)
    cfg = load_config(None, ["--trainer.micro_batch_tokens=24", "--trainer.lr=0.01"])
    engine = FSDPEngine(str(tiny_model_dir), cfg)
    assert not engine.sharded
    batch, batch2 = make_batch(1), make_batch(2)
    before = torch.cat(engine.forward_batch(batch))
    stats = engine.train_batch(batch, TokenMeanLoss())
    assert stats["skipped"] == 0.0 and stats["grad_norm"] > 0
    assert not torch.allclose(before, torch.cat(engine.forward_batch(batch)))
    assert_resumes_exactly(
        engine, lambda: FSDPEngine(str(tiny_model_dir), cfg), tmp_path / "ckpt", batch2
    )
