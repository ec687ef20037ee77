"""FSDP2 training engine: a Hugging Face causal LM sharded with ``fully_shard``.

Runs one process per rank over the default process group (Gloo on CPU, NCCL on
CUDA). Every rank runs the same number of micro-batches (padded with empty ones
when its shard is smaller) so the collectives inside FSDP always line up.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from asyncrl.config import RunConfig
from asyncrl.engines.train.base import LossFn, Seq
from asyncrl.engines.train.micro_batch import pad_inputs, split_by_tokens

__all__ = ["FSDPEngine"]


def _all_reduce(value: float, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> float:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return float(t.item())


class FSDPEngine:
    """TrainEngine over FSDP2 (see ``asyncrl.engines.train.base`` for the contract)."""

    def __init__(self, model_path: str, config: RunConfig, role: str = "actor"):
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

        if role not in ("actor", "critic"):
            raise ValueError(f"FSDPEngine role must be 'actor' or 'critic', got {role!r}")
        self.role = role
        self.config = config
        tc = config.trainer
        self.device = torch.device(tc.device)
        dtype = getattr(torch, config.model.dtype)
        if role == "critic":  # value head (num_labels=1) on the same backbone
            hf_config = AutoConfig.from_pretrained(model_path, num_labels=1)
            hf_config.classifier_dropout = 0.0
            model = AutoModelForTokenClassification.from_pretrained(
                model_path, config=hf_config, dtype=dtype
            ).to(self.device)
        else:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(self.device)
        self.pad_id = model.config.pad_token_id or 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        if dist.is_initialized():
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
        self.model = model
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay, betas=(0.9, 0.99)
        )

    # -- one execution path ------------------------------------------------------------
    def forward_backward_batch(
        self, seqs: Sequence[Seq], loss_fn: LossFn | None, forward_only: bool = False
    ) -> tuple[list[torch.Tensor], dict[str, float]]:
        budget = self.config.trainer.micro_batch_tokens
        lengths = [len(s.input_ids) for s in seqs]
        local_count = len(split_by_tokens(lengths, budget))
        count = int(_all_reduce(local_count, dist.ReduceOp.MAX))
        groups = split_by_tokens(lengths, budget, min_count=count)
        denom = 1.0
        if loss_fn is not None and not forward_only:
            denom = _all_reduce(sum(float(loss_fn.token_weight(s).sum()) for s in seqs))
        outputs: list[torch.Tensor | None] = [None] * len(seqs)
        stats: dict[str, float] = {}
        self.model.train(not forward_only)
        for idx in groups:
            mb = [seqs[i] for i in idx]
            with torch.set_grad_enabled(not forward_only):
                logps = self._forward(mb)
                if not forward_only and loss_fn is not None:
                    flat = torch.cat(logps) if logps else torch.zeros(0)
                    loss, info = loss_fn(flat, mb)
                    weight = torch.cat([loss_fn.token_weight(s) for s in mb]).to(loss.device)
                    # FSDP averages gradients over ranks; undo that so the sum is global.
                    scaled = (loss * weight).sum() * (self.world / max(denom, 1e-12))
                    scaled.backward()
                    for k, v in info.items():
                        stats[k] = stats.get(k, 0.0) + float(v)
            for i, lp in zip(idx, logps, strict=True):
                outputs[i] = lp.detach()
        assert all(o is not None for o in outputs)
        return outputs, stats  # type: ignore[return-value]

    def _forward(self, mb: Sequence[Seq]) -> list[torch.Tensor]:
        """Input preparation -> model -> output preparation for one micro-batch."""
        if not mb:  # an empty micro-batch still joins the collectives
            ids = torch.full((1, 1), self.pad_id, dtype=torch.long, device=self.device)
            out = self.model(input_ids=ids).logits
            (out.sum() * 0.0).backward() if torch.is_grad_enabled() else None
            return []
        ids, mask = pad_inputs(mb, self.pad_id)
        ids, mask = ids.to(self.device), mask.to(self.device)
        logits = self.model(input_ids=ids, attention_mask=mask).logits.float()
        if self.role == "critic":  # value of the state before each response token
            values = logits[..., 0]
            return [values[i, s.prompt_len - 1 : len(s.input_ids) - 1] for i, s in enumerate(mb)]
        logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return [logp[i, s.prompt_len - 1 : len(s.input_ids) - 1] for i, s in enumerate(mb)]

    def train_batch(self, seqs: Sequence[Seq], loss_fn: LossFn) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        _, stats = self.forward_backward_batch(seqs, loss_fn)
        stats.update(self.optimizer_step())
        return stats

    def forward_batch(self, seqs: Sequence[Seq]) -> list[torch.Tensor]:
        outputs, _ = self.forward_backward_batch(seqs, None, forward_only=True)
        return outputs

    def optimizer_step(self) -> dict[str, float]:
        clip = self.config.trainer.grad_clip
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        grad_norm = float(norm)
        lr = self.optimizer.param_groups[0]["lr"]
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            return {"grad_norm": grad_norm, "lr": lr, "skipped": 1.0}
        self.optimizer.step()
        return {"grad_norm": grad_norm, "lr": lr, "skipped": 0.0}

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in self.model.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            yield name, full.detach()
