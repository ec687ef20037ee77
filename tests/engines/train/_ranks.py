"""Rank program of the multi-process train-engine tests (run by ``test_fsdp.py``, one per rank).

``python _ranks.py {world1|world2} --rank R --world W --port P --model DIR --out DIR``.
``world1`` runs at world size 1 and writes the reference results and a checkpoint;
``world2`` runs at world size 2 on the same batches and resumes that checkpoint.
Results are safetensors / JSON files under ``--out`` for the test to compare.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from asyncrl.config import RunConfig, load_config
from asyncrl.engines.train.base import Seq
from asyncrl.engines.train.fsdp import FSDPEngine, init_process_group

SMALL_BUDGET = 24  # several micro-batches per batch
BIG_BUDGET = 4096  # one micro-batch


def make_batch(seed: int, n: int = 8) -> list[Seq]:
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(n):
        p = 2 + int(torch.randint(0, 5, (1,), generator=g))
        r = 1 + int(torch.randint(0, 9, (1,), generator=g))
        ids = torch.randint(3, 15, (p + r,), generator=g)
        mask = (torch.rand(r, generator=g) > 0.2).float()
        mask[0] = 1.0
        fields = {
            "mask": mask,
            "adv": torch.randn(r, generator=g),
            "ret": torch.rand(r, generator=g),
        }
        fields["ret"] = fields["ret"] * 0 + (i % 4) / 4.0  # one return per sequence
        seqs.append(Seq(ids, p, fields))
    return seqs


class TokenMeanLoss:
    """-adv * logp + 0.1 * logp^2, token-mean over the batch."""

    def token_weight(self, seq: Seq) -> torch.Tensor:
        return seq.fields["mask"]

    def __call__(self, out: torch.Tensor, mb: Sequence[Seq]):
        adv = torch.cat([s.fields["adv"] for s in mb]).to(out.device)
        return -adv * out + 0.1 * out**2, {"tokens": torch.tensor(float(len(out)))}


class SeqMeanLoss(TokenMeanLoss):
    def token_weight(self, seq: Seq) -> torch.Tensor:
        m = seq.fields["mask"]
        return m / m.sum()


class EntropyBonusLoss(TokenMeanLoss):
    """Token-mean loss with an entropy bonus (the engine attaches ``fields["entropy"]``)."""

    needs_entropy = True

    def __call__(self, out: torch.Tensor, mb: Sequence[Seq]):
        loss, stats = super().__call__(out, mb)
        ent = torch.cat([s.fields["entropy"] for s in mb])
        assert ent.requires_grad and ent.shape == out.shape
        return loss - 0.5 * ent, stats


class ValueLoss:
    """Squared error of the values against the returns, token-mean."""

    def token_weight(self, seq: Seq) -> torch.Tensor:
        return seq.fields["mask"]

    def __call__(self, out: torch.Tensor, mb: Sequence[Seq]):
        ret = torch.cat([s.fields["ret"] for s in mb]).to(out.device)
        err = (out - ret) ** 2
        mask = torch.cat([s.fields["mask"] for s in mb]).to(out.device)
        return err, {"mse_sum": (err.detach() * mask).sum(), "tokens": mask.sum()}


def config(budget: int, *extra: str) -> RunConfig:
    base = [
        "--trainer.lr=0.01",
        "--trainer.grad_clip=1.0",
        f"--trainer.micro_batch_tokens={budget}",
    ]
    return load_config(None, [*base, *extra])


def grads(engine: FSDPEngine) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in engine.model.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return out


def assert_resumes_exactly(
    engine: FSDPEngine, fresh: Callable[[], FSDPEngine], ckpt: Path, batch: list[Seq]
) -> None:
    """Save ``engine`` (one step trained) to ``ckpt`` and train it on ``batch``; an engine from
    ``fresh()`` that loads ``ckpt`` is at step 1 and, trained on ``batch``, ends with the
    same weights."""
    engine.save(str(ckpt))
    engine.train_batch(batch, TokenMeanLoss())
    expected = dict(engine.named_weights())
    resumed = fresh()
    resumed.load(str(ckpt))
    assert resumed.step == 1
    resumed.train_batch(batch, TokenMeanLoss())
    got = dict(resumed.named_weights())
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, atol=1e-6, rtol=1e-5)


def shard(seqs: list[Seq], rank: int, world: int) -> list[Seq]:
    return seqs[rank::world]


def world1(model: str, out: Path) -> None:
    batch, batch2 = make_batch(1), make_batch(2)
    saved: dict[str, torch.Tensor] = {}
    losses = (("tok", TokenMeanLoss()), ("seq", SeqMeanLoss()), ("ent", EntropyBonusLoss()))
    for tag, loss in losses:
        for budget, name in ((BIG_BUDGET, "1mb"), (SMALL_BUDGET, "many")):
            eng = FSDPEngine(model, config(budget))
            eng.forward_backward_batch(batch, loss)
            saved.update({f"grads_{tag}_{name}/{k}": v for k, v in grads(eng).items()})
    # activation checkpointing: same gradients; bf16 compute: close log-probs
    eng = FSDPEngine(model, config(SMALL_BUDGET, "--trainer.activation_checkpointing=true"))
    eng.forward_backward_batch(batch, TokenMeanLoss())
    saved.update({f"grads_tok_ckpt/{k}": v for k, v in grads(eng).items()})
    eng = FSDPEngine(model, config(SMALL_BUDGET, "--trainer.mixed_precision=bf16"))
    saved["logp_bf16"] = torch.cat(eng.forward_batch(batch))
    # FSDP's mixed precision shards even one rank; forward-only passes leave it sharded
    assert eng.sharded and all(isinstance(p, DTensor) for p in eng.model.parameters())
    eng.offload()
    eng.onload()
    saved["bf16_step_grad_norm"] = torch.tensor(
        eng.train_batch(batch, TokenMeanLoss())["grad_norm"]
    )
    for packing in ("on", "off", "auto"):
        eng = FSDPEngine(model, config(SMALL_BUDGET, f"--trainer.packing={packing}"))
        assert eng.packed == (packing != "off")
        saved[f"logp_{packing}"] = torch.cat(eng.forward_batch(batch))
        saved[f"entropy_{packing}"] = torch.cat(eng.forward_batch(batch, output="entropy"))
        # one rank alone: a plain module, nothing sharded (no FSDP hooks on its hot path)
        assert not eng.sharded
        assert not any(isinstance(p, DTensor) for p in eng.model.parameters())
    # checkpoint at step 1, then the uninterrupted step 2
    sched = ["--trainer.lr_schedule=cosine", "--trainer.warmup_steps=1", "--trainer.decay_steps=4"]
    eng = FSDPEngine(model, config(SMALL_BUDGET, *sched))
    lr1 = eng.train_batch(batch, TokenMeanLoss())["lr"]
    eng.save(str(out / "ckpt"))
    lr2 = eng.train_batch(batch2, TokenMeanLoss())["lr"]
    saved.update({f"step2/{k}": v for k, v in eng.named_weights()})
    eng.export_hf(str(out / "hf"))
    # critic: values train toward the returns
    critic = FSDPEngine(model, config(SMALL_BUDGET, "--trainer.lr=0.003"), role="critic")
    saved["critic_values0"] = torch.cat(critic.forward_batch(batch))
    critic.export_hf(str(out / "critic_hf"))
    mse = []
    for _ in range(30):
        stats = critic.train_batch(batch, ValueLoss())
        mse.append(stats["mse_sum"] / stats["tokens"])
    save_file({k: v.contiguous() for k, v in saved.items()}, str(out / "world1.safetensors"))
    (out / "world1.json").write_text(json.dumps({"lr": [lr1, lr2], "critic_mse": mse}))


def world2(model: str, out: Path, rank: int) -> None:
    batch, batch2 = make_batch(1), make_batch(2)
    mine, mine2 = shard(batch, rank, 2), shard(batch2, rank, 2)
    saved: dict[str, torch.Tensor] = {}
    for tag, loss in (("tok", TokenMeanLoss()), ("seq", SeqMeanLoss())):
        eng = FSDPEngine(model, config(SMALL_BUDGET))
        eng.forward_backward_batch(mine, loss)
        saved.update({f"grads_{tag}/{k}": v for k, v in grads(eng).items()})
    saved["logp"] = torch.cat(eng.forward_batch(mine))
    # forward-only passes leave the parameters sharded (named_weights gathers fresh copies)
    assert eng.sharded and all(isinstance(p, DTensor) for p in eng.model.parameters())
    sched = ["--trainer.lr_schedule=cosine", "--trainer.warmup_steps=1", "--trainer.decay_steps=4"]
    eng = FSDPEngine(model, config(SMALL_BUDGET, *sched))
    eng.load(str(out / "ckpt"))
    lr2 = eng.train_batch(mine2, TokenMeanLoss())["lr"]
    saved.update({f"step2/{k}": v for k, v in eng.named_weights()})
    save_file(
        {k: v.contiguous() for k, v in saved.items()}, str(out / f"world2_rank{rank}.safetensors")
    )
    (out / f"world2_rank{rank}.json").write_text(json.dumps({"lr2": lr2}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=["world1", "world2"])
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(1234 + args.rank)  # rank-dependent on purpose: engines must not care
    init_process_group(args.rank, args.world, args.port)
    if args.scenario == "world1":
        world1(args.model, Path(args.out))
    else:
        world2(args.model, Path(args.out), args.rank)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
