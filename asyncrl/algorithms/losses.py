"""Policy losses (torch). The decoupled off-policy PPO objective used for async training.

Per response token with mask m, advantage A, current log-prob logp, proximal
log-prob prox (the policy at the start of the step) and behaviour log-prob
behav (the engine's, possibly several versions old)::

    ratio = exp(logp - prox)
    w     = min(exp(prox - behav), cap)                       # truncated importance weight
    loss  = -w * min(ratio * A, clip(ratio, 1-eps, 1+eps) * A)

With one optimizer step per batch, prox equals logp's value (detached), so the
proximal policy costs no extra forward pass. ``decoupled=False`` is the plain
PPO objective against the behaviour policy (ratio = exp(logp - behav), w = 1).
"""

from __future__ import annotations

import torch

__all__ = ["ppo_token_loss"]


def ppo_token_loss(
    logp: torch.Tensor,
    behav: torch.Tensor,
    adv: torch.Tensor,
    prox: torch.Tensor | None = None,
    clip_eps: float = 0.2,
    cap: float = 5.0,
    decoupled: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss (same shape as ``logp``) and per-token diagnostics (detached)."""
    if prox is None:
        prox = logp.detach()
    if decoupled:
        ratio = torch.exp(logp - prox)
        weight = torch.exp(prox - behav).clamp(max=cap)
    else:
        ratio = torch.exp(logp - behav)
        weight = torch.ones_like(logp)
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    loss = -weight.detach() * surrogate
    info = {
        "clipped": ((ratio - clipped).abs() > 1e-8).float().detach(),
        "behav_ratio": torch.exp(prox - behav).detach(),
        "approx_kl": (behav - logp).detach(),
    }
    return loss, info
