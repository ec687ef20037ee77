"""The Algorithm seam: one train step of the trainer over a batch of trajectories.

An algorithm owns the step between "a batch arrived" and "new actor weights":
advantages, the proximal/reference/critic forward passes, and the optimizer
updates of the actor (and critic). The trainer process then pushes
``algorithm.actor``'s weights to the engines (the actor's only).

Step structure shared by GRPO and PPO (:class:`PolicyUpdate`)::

    seqs   <- trajectories (behaviour log-probs, loss mask) + advantages
    ref    <- reference model forward            (only if algo.kl_coef > 0)
    prox   <- actor forward, no grad             (only if epochs x minibatches > 1, or
                                                  behav_reject_norm = "kept" with mis/icepop)
    for epoch in epochs: for minibatch in shuffled split: actor.train_batch(mb, PolicyLoss)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch

from asyncrl.algorithms.losses import Objective, PolicyLoss
from asyncrl.config import AlgoConfig, RunConfig
from asyncrl.core import Trajectory
from asyncrl.engines.train.base import (
    LossFn,
    Role,
    Seq,
    TrainEngine,
    TrainerEngine,
    all_reduce_floats,
)

__all__ = [
    "CRITIC_FREE",
    "Algorithm",
    "EngineFactory",
    "PolicyUpdate",
    "correction_band",
    "make_algorithm",
    "objective_for",
    "seqs_from_trajs",
]

CRITIC_FREE = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
"""``algo.name`` values trained by :class:`~asyncrl.algorithms.grpo.GRPO` (no critic)."""

EngineFactory = Callable[[Role, RunConfig], TrainerEngine]
"""``build(role, config)`` -> a train engine; role ``"actor"`` (also the reference) or
``"critic"`` (per-token outputs are values instead of log-probs)."""


class Algorithm(Protocol):
    """One RL algorithm on the trainer side. ``actor`` is the engine whose weights are synced."""

    actor: TrainerEngine

    def train_step(self, step: int, trajs: Sequence[Trajectory]) -> dict[str, float]:
        """Train on one batch (this rank's shard, whole groups); returns the step's metrics.

        Collective under data parallelism: every rank calls it once per step.
        """
        ...


def make_algorithm(cfg: RunConfig, build: EngineFactory) -> Algorithm:
    """The one factory of algorithms: chooses from ``cfg.algo.name``; builds the engines."""
    if cfg.algo.name in CRITIC_FREE:
        from asyncrl.algorithms.grpo import GRPO

        return GRPO(cfg, build)
    if cfg.algo.name == "ppo":
        from asyncrl.algorithms.ppo import PPO

        return PPO(cfg, build)
    allowed = ", ".join(repr(n) for n in (*CRITIC_FREE, "ppo"))
    raise ValueError(f"unknown algo.name {cfg.algo.name!r} (allowed: {allowed})")


def correction_band(algo: AlgoConfig) -> tuple[float, float]:
    """The accepted ratio band of ``algo.behav_correction``: ``behav_mis_low/high`` for
    ``mis``, ``behav_icepop_low/high`` for ``icepop`` (``tis`` has none: the icepop band)."""
    if algo.behav_correction == "mis":
        return (algo.behav_mis_low, algo.behav_mis_high)
    return (algo.behav_icepop_low, algo.behav_icepop_high)


def objective_for(cfg: RunConfig) -> Objective:
    """``naive`` if ``algo.decoupled`` is off; else ``decoupled`` when samples may be stale
    (``controller.max_staleness > 0``) and the plain ``on-policy`` objective at 0."""
    if not cfg.algo.decoupled:
        return "naive"
    return "decoupled" if cfg.controller.max_staleness > 0 else "on-policy"


def overlong_penalty(
    lengths: torch.Tensor, budget: int, buffer: int, factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13; verl 0.9.1
    ``verl/workers/reward_manager/dapo.py:121-127``): ``min(-(L - (budget - buffer)) / buffer
    * factor, 0)`` for responses of ``lengths`` tokens; 0 when ``buffer`` is 0."""
    if buffer <= 0:
        return torch.zeros(len(lengths))
    if buffer > budget:
        raise ValueError(
            f"algo.overlong_buffer_len ({buffer}) exceeds the generation budget ({budget} "
            "tokens: rollout.max_new_tokens or the task's)"
        )
    exceed = lengths.to(torch.float32) - (budget - buffer)
    return torch.clamp(-exceed / buffer * factor, max=0.0)


def shaped_rewards(trajs: Sequence[Trajectory], algo: AlgoConfig, budget: int) -> torch.Tensor:
    """The rewards the advantages are computed from: each trajectory's ``reward`` plus
    :func:`overlong_penalty` of its response length (``algo.overlong_buffer_len``)."""
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    lengths = torch.tensor([len(t.response_ids) for t in trajs])
    return rewards + overlong_penalty(
        lengths, budget, algo.overlong_buffer_len, algo.overlong_penalty_factor
    )


def truncated(traj: Trajectory) -> bool:
    """Whether ``traj``'s response hit its token budget (its last generation's finish reason
    was ``length``: ``metadata["truncated"]``, set by ``ctx.trajectory``)."""
    return bool(traj.metadata.get("truncated", False))


def seqs_from_trajs(trajs: Sequence[Trajectory], mask_truncated: bool = False) -> list[Seq]:
    """Trainer sequences with per-token ``behav`` and ``mask`` fields (advantages added later).
    ``mask_truncated``: a truncated response's mask is all zeros (out of loss and normaliser).

    Each field of the batch is one copy of the trajectories' arrays (never their buffers,
    which a shared-memory ring reuses), split into per-sequence views.
    """
    if not trajs:
        return []
    prompt = [len(t.prompt_ids) for t in trajs]
    resp = [len(t.response_ids) for t in trajs]
    parts = [a for t in trajs for a in (t.prompt_ids, t.response_ids)]
    ids = torch.from_numpy(np.concatenate(parts).astype(np.int64, copy=False))
    behav = torch.from_numpy(np.concatenate([t.behav_logprobs for t in trajs]))
    mask = np.concatenate([t.loss_mask for t in trajs]).astype(np.float32, copy=False)
    if mask_truncated:  # the concatenation is this batch's own copy: zeroed in place
        off = 0
        for t, r in zip(trajs, resp, strict=True):
            if truncated(t):
                mask[off : off + r] = 0.0
            off += r
    rows = zip(
        ids.split([p + r for p, r in zip(prompt, resp, strict=True)]),
        prompt,
        behav.split(resp),
        torch.from_numpy(mask).split(resp),
        strict=True,
    )
    return [Seq(i, p, {"behav": b, "mask": m}) for i, p, b, m in rows]


def minibatches(seqs: Sequence[Seq], n: int, gen: torch.Generator) -> list[list[Seq]]:
    """A shuffled split of ``seqs`` into ``n`` non-empty, near-equal minibatches."""
    if len(seqs) < n:
        raise ValueError(
            f"algo.num_minibatches={n} exceeds the {len(seqs)} sequences of a rank's batch"
        )
    if n == 1:
        return [list(seqs)]
    order = torch.randperm(len(seqs), generator=gen).tolist()
    return [[seqs[i] for i in order[k::n]] for k in range(n)]


def merge_stats(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """Sums of the token sums (``*_sum``, ``*tokens``) and means of the rest over updates."""
    out: dict[str, float] = {}
    for p in parts:
        for k, v in p.items():
            out[k] = out.get(k, 0.0) + v
    for k in out:
        if not (k.endswith("_sum") or k.endswith("tokens")):
            out[k] /= len(parts)
    return out


def per_token(stats: dict[str, float], tokens_key: str, prefix: str = "") -> dict[str, float]:
    """``*_sum`` stats divided by ``stats[tokens_key]``; other keys copied, names prefixed."""
    denom = max(stats.get(tokens_key, 0.0), 1.0)
    out = {}
    for k, v in stats.items():
        if k == tokens_key:
            continue
        out[prefix + k.removesuffix("_sum")] = v / denom if k.endswith("_sum") else v
    return out


def run_updates(
    engine: TrainEngine,
    seqs: Sequence[Seq],
    loss: LossFn,
    algo: AlgoConfig,
    gen: torch.Generator,
    before: Callable[[list[Seq]], None] | None = None,
) -> dict[str, float]:
    """``epochs`` passes of ``num_minibatches`` optimizer steps; merged stats."""
    parts = []
    for _ in range(algo.epochs):
        for mb in minibatches(seqs, algo.num_minibatches, gen):
            if before is not None:
                before(mb)
            parts.append(engine.train_batch(mb, loss))
    return merge_stats(parts)


class PolicyUpdate:
    """The actor side of a step: reference and proximal passes, then the policy updates."""

    def __init__(self, cfg: RunConfig, actor: TrainEngine, ref: TrainEngine | None, budget: int):
        a = cfg.algo
        self.cfg = cfg
        self.actor = actor
        self.ref = ref
        self.budget = budget  # max response tokens, the constant of token-sum-norm
        self.loss = PolicyLoss(
            objective_for(cfg),
            a.clip_range()[0],
            a.behav_imp_weight_cap,
            a.loss_agg,
            a.kl_coef,
            a.entropy_coef,
            a.behav_clip_eps,
            a.behav_correction,
            correction_band(a),
            a.behav_reject_norm,
            policy=a.policy_loss,
            clip_high=a.clip_range()[1],
            clip_ratio_c=a.clip_ratio_c,
            tau=(a.sapo_tau_pos, a.sapo_tau_neg),
        )

    def run(self, step: int, seqs: list[Seq]) -> dict[str, float]:
        a = self.cfg.algo
        if self.ref is not None:
            for s, lp in zip(seqs, self.ref.forward_batch(seqs), strict=True):
                s.fields["ref"] = lp.float().cpu()
        if a.top_entropy_quantile < 1:
            keep_top_entropy(seqs, self.actor.forward_batch(seqs, output="entropy"), a)
        several = a.epochs * a.num_minibatches > 1
        if (several or self.loss.needs_prox) and self.loss.objective != "naive":
            for s, lp in zip(seqs, self.actor.forward_batch(seqs), strict=True):
                s.fields["prox"] = lp.float().cpu()
        self.loss.extrema = {}
        gen = torch.Generator().manual_seed(self.cfg.seed * 100_003 + step)
        stats = run_updates(self.actor, seqs, self.loss, a, gen, self._set_scale)
        out = per_token(stats, "tokens")
        out.update(self.loss.extrema)
        out["train_tokens"] = stats.get("tokens", 0.0) / a.epochs
        out["updates"] = float(a.epochs * a.num_minibatches)
        return out

    def _set_scale(self, mb: list[Seq]) -> None:
        agg = self.cfg.algo.loss_agg
        if agg not in ("token-sum-norm", "seq-mean-token-sum"):
            return
        masks = [self.loss.trained_mask(s) for s in mb]
        if agg == "token-sum-norm":
            tokens, n = all_reduce_floats(sum(float(m.sum()) for m in masks), float(len(mb)))
            self.loss.scale = tokens / max(n * self.budget, 1.0)
        else:  # token sum over the sequences that have trained tokens (verl's seq_mask)
            tokens, n = all_reduce_floats(
                sum(float(m.sum()) for m in masks), float(sum(bool(m.any()) for m in masks))
            )
            self.loss.scale = tokens / max(n, 1.0)


def keep_top_entropy(
    seqs: Sequence[Seq], entropies: Sequence[torch.Tensor], algo: AlgoConfig
) -> None:
    """Set each sequence's ``entropy_keep`` field: 1.0 on the trained tokens whose entropy is
    at least the ``1 - algo.top_entropy_quantile`` quantile of the trained tokens of ``seqs``
    (this rank's batch; TRL's ``get_high_entropy_mask``), 0.0 elsewhere."""
    masks = [s.fields["mask"] > 0 for s in seqs]
    trained = torch.cat([e.float().cpu()[m] for e, m in zip(entropies, masks, strict=True)])
    if trained.numel() == 0:
        for s in seqs:
            s.fields["entropy_keep"] = torch.zeros(s.response_len)
        return
    threshold = torch.quantile(trained, 1 - algo.top_entropy_quantile)
    for s, e, m in zip(seqs, entropies, masks, strict=True):
        s.fields["entropy_keep"] = ((e.float().cpu() >= threshold) & m).float()


def adv_stats(adv: torch.Tensor, mask: torch.Tensor, prefix: str = "adv") -> dict[str, float]:
    """Mean, std, min and max of the masked entries of ``adv``."""
    vals = adv[mask > 0]
    if vals.numel() == 0:
        return {}
    return {
        f"{prefix}_mean": float(vals.mean()),
        f"{prefix}_std": float(vals.std(unbiased=False)),
        f"{prefix}_min": float(vals.min()),
        f"{prefix}_max": float(vals.max()),
    }
