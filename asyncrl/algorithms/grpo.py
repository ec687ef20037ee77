"""Critic-free algorithms: GRPO, RLOO, REINFORCE++ and REINFORCE++-baseline (``algo.name``),
then the policy loss (``algo.policy_loss``) on the actor.

GRPO: every response token of a sequence gets its sequence's advantage: reward minus
the mean reward of its group (same prompt), divided by a std (``algo.scale_rewards``:
the group's, the batch's, none). With no scaling and ``loss_agg = "token-sum-norm"``
this is Dr.GRPO's unbiased form. RLOO: reward minus the mean of the group's other
samples. REINFORCE++: the discounted return of each trained token, whitened over the
batch; -baseline: reward minus its group's mean, whitened over the batch's trained tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncrl.algorithms.advantages import (
    grpo_advantages,
    normalize_then_sum_advantages,
    pad_rows,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    terminal_rewards,
)
from asyncrl.algorithms.base import (
    EngineFactory,
    PolicyUpdate,
    adv_stats,
    overlong_penalty,
    seqs_from_trajs,
    shaped_rewards,
)
from asyncrl.config import AlgoConfig, RunConfig
from asyncrl.core import Trajectory
from asyncrl.engines.train.base import Seq

__all__ = ["GRPO", "aggregation_of", "build_seqs", "reward_components"]


def build_seqs(
    trajs: Sequence[Trajectory],
    cfg: AlgoConfig,
    budget: int = 0,
    normalize_then_sum: Sequence[tuple[str, float]] = (),
) -> list[Seq]:
    """Trainer sequences with per-token ``behav``, ``adv`` and ``mask`` fields (``adv`` from
    ``cfg.name``'s estimator over the batch's trained tokens, after ``mask_truncated``, on the
    rewards shaped by the overlong penalty over a budget of ``budget`` tokens).
    ``normalize_then_sum`` (``task.reward_aggregation``: (name, weight) per reward function,
    ``algo.name = "grpo"``): the advantage is TRL's of the trajectories' ``rewards``
    components (:func:`normalize_then_sum_advantages`) instead."""
    groups = torch.tensor([t.group_id for t in trajs], dtype=torch.long)
    seqs = seqs_from_trajs(trajs, cfg.mask_truncated)
    if not seqs:
        return seqs
    if cfg.name in ("grpo", "rloo"):
        if normalize_then_sum:
            parts, weights = reward_components(trajs, normalize_then_sum)
            adv = normalize_then_sum_advantages(parts, weights, groups)
        elif cfg.name == "grpo":
            adv = grpo_advantages(shaped_rewards(trajs, cfg, budget), groups, cfg.grpo_scale())
        else:
            adv = rloo_advantages(shaped_rewards(trajs, cfg, budget), groups)
        lengths = [s.response_len for s in seqs]
        per_token = adv.to(torch.float32).repeat_interleave(torch.tensor(lengths, dtype=torch.long))
        for s, a in zip(seqs, per_token.split(lengths), strict=True):
            s.fields["adv"] = a
        return seqs
    mask = pad_rows([s.fields["mask"] for s in seqs])
    rewards = shaped_rewards(trajs, cfg, budget)
    if cfg.name == "reinforce_plus_plus":
        token_adv = reinforce_pp_advantages(terminal_rewards(rewards, mask), mask, cfg.gamma)
    elif cfg.name == "reinforce_plus_plus_baseline":
        token_adv = reinforce_pp_baseline_advantages(rewards, groups, mask)
    else:
        raise ValueError(f"algo.name {cfg.name!r} is not a critic-free estimator")
    for i, s in enumerate(seqs):
        s.fields["adv"] = token_adv[i, : s.response_len].clone()
    return seqs


def reward_components(
    trajs: Sequence[Trajectory], specs: Sequence[tuple[str, float]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """((B, K) each trajectory's ``rewards[name]`` per (name, weight) of ``specs``, (K,) the
    weights); ValueError naming the trajectory and the name when one lacks a component."""
    rows = []
    for t in trajs:
        missing = [n for n, _ in specs if n not in t.rewards]
        if missing:
            raise ValueError(
                f"task.reward_aggregation='normalize_then_sum': episode {t.episode_id} has no "
                f"reward component(s) {missing} (its rewards: {sorted(t.rewards)}); each "
                "trajectory needs every task.rewards function's value"
            )
        rows.append([float(t.rewards[n]) for n, _ in specs])
    weights = torch.tensor([w for _, w in specs], dtype=torch.float32)
    return torch.tensor(rows, dtype=torch.float32), weights


def aggregation_of(cfg: RunConfig) -> tuple[tuple[str, float], ...]:
    """(name, weight) per ``task.rewards`` function when ``task.reward_aggregation`` is
    ``normalize_then_sum``; else empty (the summed reward is the reward)."""
    t = cfg.task
    if getattr(t, "reward_aggregation", "sum") != "normalize_then_sum":
        return ()
    return tuple((r.label, r.weight) for r in getattr(t, "rewards", []))


class GRPO:
    """A critic-free algorithm (``algo.name`` in ``CRITIC_FREE``) on one actor engine (+ a
    frozen reference engine when ``algo.kl_coef > 0``)."""

    def __init__(self, cfg: RunConfig, build: EngineFactory):
        self.cfg = cfg
        self.actor = build("actor", cfg)
        ref = build("actor", cfg) if cfg.algo.kl_coef > 0 else None
        self.policy = PolicyUpdate(cfg, self.actor, ref, cfg.generation_budget())
        self.aggregation = aggregation_of(cfg)

    def train_step(self, step: int, trajs: Sequence[Trajectory]) -> dict[str, float]:
        a = self.cfg.algo
        seqs = build_seqs(trajs, a, self.policy.budget, self.aggregation)
        adv = torch.cat([s.fields["adv"] for s in seqs]) if seqs else torch.zeros(0)
        mask = torch.cat([s.fields["mask"] for s in seqs]) if seqs else torch.zeros(0)
        metrics = adv_stats(adv, mask)
        rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
        metrics["zero_adv_frac"] = _zero_adv_groups(trajs)
        metrics["reward_std"] = float(rewards.std(unbiased=False)) if len(trajs) else 0.0
        if a.overlong_buffer_len and trajs:
            lengths = torch.tensor([len(t.response_ids) for t in trajs])
            pen = overlong_penalty(
                lengths, self.policy.budget, a.overlong_buffer_len, a.overlong_penalty_factor
            )
            metrics["overlong_penalty_mean"] = float(pen.mean())
            metrics["overlong_frac"] = float((pen < 0).float().mean())
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
