"""GRPO: group-relative advantages + the decoupled PPO token loss, over trajectories."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncrl.algorithms.advantages import grpo_advantages
from asyncrl.algorithms.losses import ppo_token_loss
from asyncrl.config import AlgoConfig
from asyncrl.engines.train.base import Seq
from asyncrl.transports.experience.types import Trajectory

__all__ = ["GRPOLoss", "build_seqs"]


def build_seqs(trajs: Sequence[Trajectory], cfg: AlgoConfig) -> list[Seq]:
    """Trainer sequences with per-token ``behav``, ``adv`` and ``mask`` fields."""
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    groups = torch.tensor([t.group_id for t in trajs], dtype=torch.long)
    adv = grpo_advantages(rewards, groups, cfg.norm_adv_by_std)
    seqs = []
    for t, a in zip(trajs, adv.tolist(), strict=True):
        ids = torch.from_numpy(t.prompt_ids.astype("int64"))
        resp = torch.from_numpy(t.response_ids.astype("int64"))
        n = len(resp)
        seqs.append(
            Seq(
                input_ids=torch.cat([ids, resp]),
                prompt_len=len(ids),
                fields={
                    "behav": torch.from_numpy(t.behav_logprobs.copy()),
                    "adv": torch.full((n,), a, dtype=torch.float32),
                    "mask": torch.from_numpy(t.loss_mask.astype("float32")),
                },
            )
        )
    return seqs


class GRPOLoss:
    """Token-mean decoupled PPO loss over the batch (see ``asyncrl.algorithms.losses``)."""

    def __init__(self, cfg: AlgoConfig, decoupled: bool = True):
        self.cfg = cfg
        self.decoupled = decoupled

    def token_weight(self, seq: Seq) -> torch.Tensor:
        return seq.fields["mask"]

    def __call__(
        self, logp: torch.Tensor, mb: Sequence[Seq]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        behav = torch.cat([s.fields["behav"] for s in mb]).to(logp.device)
        adv = torch.cat([s.fields["adv"] for s in mb]).to(logp.device)
        mask = torch.cat([s.fields["mask"] for s in mb]).to(logp.device)
        loss, info = ppo_token_loss(
            logp,
            behav,
            adv,
            clip_eps=self.cfg.clip_eps,
            cap=self.cfg.behav_imp_weight_cap,
            decoupled=self.decoupled,
        )
        stats = {
            "loss_sum": (loss * mask).sum().detach(),
            "tokens": mask.sum(),
            "clipped_sum": (info["clipped"] * mask).sum(),
            "behav_ratio_sum": (info["behav_ratio"] * mask).sum(),
            "approx_kl_sum": (info["approx_kl"] * mask).sum(),
            "entropy_proxy_sum": (-logp.detach() * mask).sum(),
        }
        return loss, stats
