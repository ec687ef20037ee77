"""Advantage estimators (torch): GRPO group-relative advantages, GAE, whitening, diagnostics."""

from __future__ import annotations

import torch

__all__ = [
    "explained_variance",
    "gae_advantages",
    "grpo_advantages",
    "masked_mean",
    "masked_whiten",
    "terminal_rewards",
]


def grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, norm_by_std: bool = False, eps: float = 1e-6
) -> torch.Tensor:
    """Per-sequence advantage: reward minus its group's mean (optionally over the group's std).

    Groups of equal rewards get exactly zero advantage (never NaN); a group of one
    sample has zero advantage. The std is the population std of the group.
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


def terminal_rewards(reward: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) token rewards: each row's scalar reward on its last trained token, 0 elsewhere."""
    b, t = mask.shape
    out = torch.zeros((b, t), dtype=torch.float32)
    pos = torch.arange(t).expand(b, t)
    last = torch.where(mask > 0, pos, torch.full_like(pos, -1)).max(dim=1).values
    rows = torch.nonzero(last >= 0).squeeze(1)
    out[rows, last[rows]] = reward.to(torch.float32)[rows]
    return out


def gae_advantages(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over (B, T) padded rows; returns (advantages, returns).

    Tokens with ``mask == 0`` (environment tokens, padding) are skipped: the recursion
    passes through them, so the trained tokens form the episode's time axis. The value
    after the last trained token is 0 (the episode ends). Masked positions get 0.
    """
    b, t = mask.shape
    adv = torch.zeros((b, t), dtype=torch.float32)
    next_value = torch.zeros(b, dtype=torch.float32)
    last_gae = torch.zeros(b, dtype=torch.float32)
    for i in reversed(range(t)):
        on = mask[:, i] > 0
        delta = rewards[:, i] + gamma * next_value - values[:, i]
        gae = delta + gamma * lam * last_gae
        adv[:, i] = torch.where(on, gae, torch.zeros_like(gae))
        last_gae = torch.where(on, gae, last_gae)
        next_value = torch.where(on, values[:, i], next_value)
    returns = (adv + values) * (mask > 0)
    return adv, returns


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Zero mean, unit (population) std over the masked entries; masked-out entries become 0.

    All-equal entries give 0 (never NaN).
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var + eps) * (mask > 0)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(returns - values) / Var(returns)`` over masked entries (0 if Var is 0)."""
    ret_mean = masked_mean(returns, mask)
    var_ret = masked_mean((returns - ret_mean) ** 2, mask)
    diff = returns - values
    var_diff = masked_mean((diff - masked_mean(diff, mask)) ** 2, mask)
    if float(var_ret) <= 0:
        return 0.0
    return float(1.0 - var_diff / var_ret)
