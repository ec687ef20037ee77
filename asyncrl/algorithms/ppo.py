"""PPO: an actor and a critic (a value model from the same checkpoint), GAE advantages.

Per step: the critic's values at every response token (``critic.forward_batch``)
-> token rewards (the scalar reward on the last trained token) -> GAE(gamma, lambda)
advantages and returns -> optional whitening over the batch's trained tokens ->
critic updates (clipped value loss) and actor updates (the same decoupled PPO
token loss as GRPO). Only the actor's weights go to the rollout engines.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import torch

from asyncrl.algorithms.advantages import (
    explained_variance,
    gae_advantages,
    masked_whiten,
    pad_rows,
    terminal_rewards,
)
from asyncrl.algorithms.base import (
    EngineFactory,
    PolicyUpdate,
    adv_stats,
    per_token,
    run_updates,
    seqs_from_trajs,
    shaped_rewards,
)
from asyncrl.algorithms.losses import ValueLoss
from asyncrl.config import RunConfig
from asyncrl.core import Trajectory
from asyncrl.engines.train.base import Seq

__all__ = ["PPO", "critic_config", "pad_rows"]


def critic_config(cfg: RunConfig) -> RunConfig:
    """The run config the critic engine is built with (``algo.critic_lr`` as its lr)."""
    if cfg.algo.critic_lr <= 0:
        return cfg
    trainer = msgspec.structs.replace(cfg.trainer, lr=cfg.algo.critic_lr)
    return msgspec.structs.replace(cfg, trainer=trainer)


class PPO:
    """PPO with a critic engine (role ``"critic"``) and the actor engine."""

    def __init__(self, cfg: RunConfig, build: EngineFactory):
        self.cfg = cfg
        self.actor = build("actor", cfg)
        self.critic = build("critic", critic_config(cfg))
        ref = build("actor", cfg) if cfg.algo.kl_coef > 0 else None
        self.policy = PolicyUpdate(cfg, self.actor, ref, cfg.generation_budget())
        self.value_loss = ValueLoss(cfg.algo.value_clip, cfg.algo.value_coef)

    def advantages(self, seqs: list[Seq], rewards: torch.Tensor) -> dict[str, float]:
        """Fill ``old_values``, ``returns`` and ``adv`` fields; returns their diagnostics."""
        a = self.cfg.algo
        values = pad_rows(self.critic.forward_batch(seqs))
        mask = pad_rows([s.fields["mask"] for s in seqs])
        token_rewards = terminal_rewards(rewards, mask)
        adv, returns = gae_advantages(token_rewards, values, mask, a.gamma, a.lam)
        metrics = adv_stats(adv, mask, "adv_raw")
        if a.whiten_adv:
            adv = masked_whiten(adv, mask)
        metrics.update(adv_stats(adv, mask))
        metrics.update(adv_stats(returns, mask, "return"))
        metrics.update(adv_stats(values, mask, "value"))
        metrics["explained_var"] = explained_variance(values, returns, mask)
        for i, s in enumerate(seqs):
            n = s.response_len
            s.fields["old_values"] = values[i, :n].clone()
            s.fields["returns"] = returns[i, :n].clone()
            s.fields["adv"] = adv[i, :n].clone()
        return metrics

    def train_step(self, step: int, trajs: Sequence[Trajectory]) -> dict[str, float]:
        seqs = seqs_from_trajs(trajs, self.cfg.algo.mask_truncated)
        rewards = shaped_rewards(trajs, self.cfg.algo, self.policy.budget)
        metrics = self.advantages(seqs, rewards)
        gen = torch.Generator().manual_seed(self.cfg.seed * 100_003 + step + 7)
        vstats = run_updates(self.critic, seqs, self.value_loss, self.cfg.algo, gen)
        metrics.update(per_token(vstats, "vf_tokens", prefix="critic_"))
        if step >= self.cfg.algo.critic_warmup_steps:
            metrics.update(self.policy.run(step, seqs))
        return metrics
