"""Advantage estimators (torch): GRPO group-relative advantages."""

from __future__ import annotations

import torch

__all__ = ["grpo_advantages"]


def grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, norm_by_std: bool = False, eps: float = 1e-6
) -> torch.Tensor:
    """Per-sequence advantage: reward minus its group's mean (optionally over the group's std).

    Groups of equal rewards get exactly zero advantage (never NaN); a group of one
    sample has zero advantage.
    """
    rewards = rewards.to(torch.float32)
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=torch.float32).index_add_(0, inverse, rewards)
    means = sums / counts
    adv = rewards - means[inverse]
    if norm_by_std:
        sq = torch.zeros(len(counts), dtype=torch.float32).index_add_(0, inverse, adv**2)
        std = torch.sqrt(sq / counts.clamp(min=1))
        adv = adv / (std[inverse] + eps)
    return adv
