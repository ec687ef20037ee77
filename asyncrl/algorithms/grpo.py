"""GRPO: group-relative advantages, no critic; the (decoupled) PPO token loss on the actor.

Every response token of a sequence gets its sequence's advantage: reward minus
the mean reward of its group (same prompt), divided by the group's std when
``algo.norm_adv_by_std``. With std-normalisation off and ``loss_agg =
"token-sum-norm"`` this is Dr.GRPO's unbiased form.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncrl.algorithms.advantages import grpo_advantages
from asyncrl.algorithms.base import EngineFactory, PolicyUpdate, adv_stats, seqs_from_trajs
from asyncrl.config import AlgoConfig, RunConfig
from asyncrl.engines.train.base import Seq
from asyncrl.transports.experience.types import Trajectory

__all__ = ["GRPO", "build_seqs"]


def build_seqs(trajs: Sequence[Trajectory], cfg: AlgoConfig) -> list[Seq]:
    """Trainer sequences with per-token ``behav``, ``adv`` and ``mask`` fields."""
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    groups = torch.tensor([t.group_id for t in trajs], dtype=torch.long)
    adv = grpo_advantages(rewards, groups, cfg.norm_adv_by_std)
    seqs = seqs_from_trajs(trajs)
    if not seqs:
        return seqs
    lengths = [len(t.response_ids) for t in trajs]
    per_token = adv.repeat_interleave(torch.tensor(lengths, dtype=torch.long))
    for s, a in zip(seqs, per_token.split(lengths), strict=True):
        s.fields["adv"] = a
    return seqs


class GRPO:
    """GRPO on one actor engine (+ a frozen reference engine when ``algo.kl_coef > 0``)."""

    def __init__(self, cfg: RunConfig, build: EngineFactory):
        self.cfg = cfg
        self.actor = build("actor", cfg)
        ref = build("actor", cfg) if cfg.algo.kl_coef > 0 else None
        self.policy = PolicyUpdate(cfg, self.actor, ref, cfg.generation_budget())

    def train_step(self, step: int, trajs: Sequence[Trajectory]) -> dict[str, float]:
        seqs = build_seqs(trajs, self.cfg.algo)
        adv = torch.cat([s.fields["adv"] for s in seqs]) if seqs else torch.zeros(0)
        mask = torch.cat([s.fields["mask"] for s in seqs]) if seqs else torch.zeros(0)
        metrics = adv_stats(adv, mask)
        rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
        metrics["zero_adv_frac"] = _zero_adv_groups(trajs)
        metrics["reward_std"] = float(rewards.std(unbiased=False)) if len(trajs) else 0.0
        metrics.update(self.policy.run(step, seqs))
        return metrics


def _zero_adv_groups(trajs: Sequence[Trajectory]) -> float:
    """Fraction of groups whose rewards are all equal (they carry no GRPO signal)."""
    by_group: dict[int, set[float]] = {}
    for t in trajs:
        by_group.setdefault(t.group_id, set()).add(t.reward)
    if not by_group:
        return 0.0
    return sum(1 for r in by_group.values() if len(r) == 1) / len(by_group)
