"""Advantage estimators (torch): GRPO group-relative advantages, GAE, whitening, diagnostics."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

__all__ = [
    "Scale",
    "discounted_returns",
    "explained_variance",
    "gae_advantages",
    "grpo_advantages",
    "masked_mean",
    "masked_whiten",
    "normalize_then_sum_advantages",
    "pad_rows",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "terminal_rewards",
]

Scale = Literal["group", "batch", "none"]


def _group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inverse, counts)``: each sample's group position and each group's size."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return inverse, counts


def _group_sum(x: torch.Tensor, inverse: torch.Tensor, n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.float32).index_add_(0, inverse, x)


def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    scale: Scale = "none",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-sequence advantage: reward minus its group's mean, over a std (``scale``).

    ``group``: the group's sample (Bessel) std, as verl's ``compute_grpo_outcome_advantage``
    and TRL's ``scale_rewards="group"``; ``batch``: the sample std of all ``rewards`` (TRL's
    ``"batch"``, Lite PPO); ``none``: no division (Dr.GRPO). ``eps`` is added to the std
    (verl 1e-6, TRL 1e-4). Groups of equal rewards get exactly zero advantage (never NaN);
    a group of one sample has zero advantage.
    """
    rewards = rewards.to(torch.float32)
    inverse, counts = _group_index(group_ids)
    means = _group_sum(rewards, inverse, len(counts)) / counts
    adv = rewards - means[inverse]
    # a group of one, or of equal rewards: exactly 0 (the float mean may miss by an ulp)
    lo = torch.full((len(counts),), float("inf")).scatter_reduce(0, inverse, rewards, "amin")
    hi = torch.full((len(counts),), float("-inf")).scatter_reduce(0, inverse, rewards, "amax")
    equal = (lo == hi) | (counts < 2)
    adv = torch.where(equal[inverse], torch.zeros_like(adv), adv)
    if scale == "group":
        sq = _group_sum(adv**2, inverse, len(counts))
        std = torch.sqrt(sq / (counts - 1).clamp(min=1))
        adv = adv / (std[inverse] + eps)
    elif scale == "batch":
        std = rewards.std(unbiased=True) if len(rewards) > 1 else torch.tensor(0.0)
        adv = adv / (std + eps)
    elif scale != "none":
        raise ValueError(f"unknown scale {scale!r} (allowed: 'group', 'batch', 'none')")
    return adv


def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): reward minus the mean of the *other* samples of its group,
    ``n/(n-1) * (r - mean)``, as verl's ``compute_rloo_outcome_advantage``; a group of one keeps
    its raw reward (no other sample to form a baseline from), as there."""
    rewards = rewards.to(torch.float32)
    inverse, counts = _group_index(group_ids)
    means = _group_sum(rewards, inverse, len(counts)) / counts
    n = counts[inverse].to(torch.float32)
    adv = (rewards - means[inverse]) * n / (n - 1).clamp(min=1)
    return torch.where(n > 1, adv, rewards)


def normalize_then_sum_advantages(
    components: torch.Tensor, weights: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-4
) -> torch.Tensor:
    """TRL 1.16's ``multi_objective_aggregation="normalize_then_sum"`` (GDPO, arXiv
    2601.05242), as ``trl/trainer/grpo_trainer.py:2790-2799`` computes it: each reward
    function's values (``components``, (B, K)) normalised within their group, ``(x - mean) /
    (std + eps)`` (sample std; a group of one: std 0), summed with ``weights`` (K,), then the
    sum normalised over the batch, ``(r - mean) / (std + eps)`` (sample std; one row: std 0).
    Groups are ``group_ids`` (any sizes; TRL's are ``num_generations`` consecutive rows)."""
    x = components.to(torch.float32)
    inverse, counts = _group_index(group_ids)
    n = len(counts)
    sums = torch.zeros((n, x.shape[1]), dtype=torch.float32).index_add_(0, inverse, x)
    means = sums / counts[:, None]
    dev = x - means[inverse]
    sq = torch.zeros((n, x.shape[1]), dtype=torch.float32).index_add_(0, inverse, dev**2)
    std = torch.sqrt(sq / (counts[:, None] - 1).clamp(min=1))
    std = torch.where(counts[:, None] > 1, std, torch.zeros_like(std))
    rewards = (dev / (std[inverse] + eps) * weights.to(torch.float32)[None, :]).sum(dim=1)
    batch_std = rewards.std() if rewards.numel() > 1 else torch.tensor(0.0)
    return (rewards - rewards.mean()) / (batch_std + eps)


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """(B, T) returns ``G_t = r_t + gamma * G_{t+1}`` over the trained tokens (``mask``); the
    recursion passes through masked tokens unchanged (they get 0), as verl's REINFORCE++."""
    out = torch.zeros_like(rewards, dtype=torch.float32)
    running = torch.zeros(rewards.shape[0], dtype=torch.float32)
    for t in reversed(range(rewards.shape[1])):
        on = mask[:, t] > 0
        new = rewards[:, t] + gamma * running
        out[:, t] = torch.where(on, new, torch.zeros_like(new))
        running = torch.where(on, new, running)
    return out


def reinforce_pp_advantages(
    rewards: torch.Tensor, mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): token returns (terminal rewards in ``rewards``, (B, T)) whitened
    over the batch's trained tokens (sample variance, as verl's ``masked_whiten``)."""
    return masked_whiten(discounted_returns(rewards, mask, gamma), mask, unbiased=True)


def reinforce_pp_baseline_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """REINFORCE++-baseline: reward minus its group's mean on every trained token, whitened over
    the batch's trained tokens (sample variance), as verl's
    ``compute_reinforce_plus_plus_baseline_outcome_advantage``. ``rewards`` (B,), ``mask``
    (B, T)."""
    rewards = rewards.to(torch.float32)
    inverse, counts = _group_index(group_ids)
    means = _group_sum(rewards, inverse, len(counts)) / counts
    # a group of one keeps its raw reward (verl: its mean is taken as 0)
    centred = torch.where(counts[inverse] > 1, rewards - means[inverse], rewards)
    tokens = centred[:, None] * (mask > 0)
    return masked_whiten(tokens, mask, unbiased=True)


def pad_rows(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """(B, T) float32, right-padded with zeros."""
    width = max((len(r) for r in rows), default=0)
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r.float().cpu()
    return out


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


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, unbiased: bool = False
) -> torch.Tensor:
    """Zero mean, unit std over the masked entries; masked-out entries become 0.

    Population variance, or the sample (Bessel) variance when ``unbiased`` (verl's
    ``masked_whiten``). All-equal entries give 0 (never NaN).
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = float((mask > 0).sum())
        var = var * (n / (n - 1) if n > 1 else 1.0)
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
