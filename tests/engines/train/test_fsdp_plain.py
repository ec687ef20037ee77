"""FSDPEngine without a process group: a plain module at world size 1, same contract."""

from __future__ import annotations

from pathlib import Path

import torch

from asyncrl.config import load_config
from asyncrl.engines.train.fsdp import FSDPEngine
from tests.engines.train._ranks import TokenMeanLoss, make_batch


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
    engine.save(str(tmp_path / "ckpt"))
    engine.train_batch(batch2, TokenMeanLoss())
    expected = dict(engine.named_weights())
    resumed = FSDPEngine(str(tiny_model_dir), cfg)
    resumed.load(str(tmp_path / "ckpt"))
    assert resumed.step == 1
    resumed.train_batch(batch2, TokenMeanLoss())
    got = dict(resumed.named_weights())
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, atol=1e-6, rtol=1e-5)
