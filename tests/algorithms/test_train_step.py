"""GRPO and PPO train steps on the real (single-process) training engine and the tiny model."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncrl.algorithms.base import EngineFactory, make_algorithm, objective_for, seqs_from_trajs
from asyncrl.config import RunConfig, load_config
from asyncrl.core import Trajectory
from asyncrl.engines.train.fsdp import FSDPEngine


def _trajs(engine: FSDPEngine, shift: float = 0.0, n_groups: int = 2, size: int = 4) -> list:
    """Episodes whose behaviour log-probs are the engine's own (minus ``shift``: staleness)."""
    gen = torch.Generator().manual_seed(0)
    trajs = []
    for g in range(n_groups):
        prompt = np.array([1, 3 + g, 4, 5, 13], np.int32)
        for i in range(size):
            resp = torch.randint(3, 13, (4,), generator=gen).numpy().astype(np.int32)
            mask = np.array([1, 1, 1, 0 if i == 0 else 1], np.uint8)
            trajs.append(
                Trajectory(
                    prompt_ids=prompt,
                    response_ids=resp,
                    behav_logprobs=np.zeros(4, np.float32),
                    versions=np.zeros(4, np.int32),
                    loss_mask=mask,
                    reward=float(i % 2) if g == 0 else 0.5,  # group 1: equal rewards
                    group_id=g,
                    episode_id=g * size + i,
                )
            )
    seqs = seqs_from_trajs(trajs)
    for t, lp in zip(trajs, engine.forward_batch(seqs), strict=True):
        t.behav_logprobs = (lp.numpy() - shift).astype(np.float32)
    return trajs


def _build(model_dir: Path) -> EngineFactory:
    return lambda role, cfg: FSDPEngine(str(model_dir), cfg, role=role)


def _finite(metrics: dict[str, float]) -> None:
    bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
    assert not bad, bad


def test_objective_choice() -> None:
    assert objective_for(RunConfig()) == "decoupled"
    assert objective_for(load_config(None, ["--controller.max_staleness=0"])) == "on-policy"
    assert objective_for(load_config(None, ["--algo.decoupled=false"])) == "naive"


def test_grpo_step_with_minibatches_kl_entropy(tiny_model_dir: Path) -> None:
    torch.manual_seed(0)
    cfg = load_config(
        None,
        [
            "--algo.epochs=2",
            "--algo.num_minibatches=2",
            "--algo.kl_coef=0.1",
            "--algo.entropy_coef=0.01",
            "--algo.loss_agg=token-sum-norm",
            "--algo.norm_adv_by_std=true",
        ],
    )
    algo = make_algorithm(cfg, _build(tiny_model_dir))
    before = [p.detach().clone() for p in algo.actor.model.parameters()]
    m = algo.train_step(0, _trajs(algo.actor, shift=0.3))
    _finite(m)
    assert m["updates"] == 4.0
    assert m["zero_adv_frac"] == 0.5  # group 1 has equal rewards
    assert m["imp_weight"] == pytest.approx(math.exp(0.3), rel=1e-3)  # prox/behav
    assert m["kl_ref"] >= 0.0 and m["train_tokens"] == 30.0
    assert m["ratio_max"] > 1.0 or m["ratio_min"] < 1.0  # later updates move off prox
    after = list(algo.actor.model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_grpo_step_on_policy_single_update(tiny_model_dir: Path) -> None:
    cfg = load_config(None, ["--controller.max_staleness=0"])
    algo = make_algorithm(cfg, _build(tiny_model_dir))
    m = algo.train_step(0, _trajs(algo.actor))
    _finite(m)
    assert m["ratio_max"] == pytest.approx(1.0) and m["clip_frac"] == 0.0
    assert m["imp_weight_max"] == pytest.approx(1.0, abs=1e-4)


def test_ppo_step_trains_actor_and_critic(tiny_model_dir: Path) -> None:
    torch.manual_seed(0)
    cfg = load_config(
        None, ["--algo.name=ppo", "--algo.num_minibatches=2", "--algo.critic_lr=0.01"]
    )
    algo = make_algorithm(cfg, _build(tiny_model_dir))
    critic = algo.critic  # type: ignore[attr-defined]
    trajs = _trajs(algo.actor, shift=0.1)
    v0 = critic.forward_batch(seqs_from_trajs(trajs))
    assert [len(v) for v in v0] == [4] * len(trajs)
    m = algo.train_step(0, trajs)
    _finite(m)
    for key in ("explained_var", "critic_vf_loss", "adv_mean", "return_mean", "value_mean"):
        assert key in m
    assert abs(m["adv_mean"]) < 1e-5 and m["adv_std"] == pytest.approx(1.0, abs=1e-3)
    assert m["critic_lr"] == 0.01 and m["lr"] == cfg.trainer.lr
    v1 = critic.forward_batch(seqs_from_trajs(trajs))
    assert not torch.allclose(torch.cat(v0), torch.cat(v1))
    names = [n for n, _ in algo.actor.named_weights()]
    assert "lm_head.weight" in names and not any(n.startswith("score") for n in names)


def test_ppo_critic_warmup_holds_actor(tiny_model_dir: Path) -> None:
    cfg = load_config(None, ["--algo.name=ppo", "--algo.critic_warmup_steps=1"])
    algo = make_algorithm(cfg, _build(tiny_model_dir))
    before = [p.detach().clone() for p in algo.actor.model.parameters()]
    m = algo.train_step(0, _trajs(algo.actor))
    assert "pg_loss" not in m and "critic_vf_loss" in m
    after = list(algo.actor.model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize(
    "options",
    [
        ["--algo.name=rloo", "--algo.policy_loss=gspo", "--algo.loss_agg=seq-mean-token-sum"],
        ["--algo.name=reinforce_plus_plus", "--algo.policy_loss=cispo", "--algo.epochs=2"],
        [
            "--algo.name=reinforce_plus_plus_baseline",
            "--algo.policy_loss=sapo",
            "--algo.loss_agg=seq-mean",
        ],
        ["--algo.scale_rewards=batch", "--algo.clip_eps_high=0.28", "--algo.clip_ratio_c=3"],
        ["--algo.top_entropy_quantile=0.5", "--algo.mask_truncated=true"],
    ],
)
def test_new_losses_and_estimators_train_on_the_engine(
    tiny_model_dir: Path, options: list[str]
) -> None:
    """Each new option through make_algorithm and the real engine: finite metrics, moved
    weights; top-entropy selection keeps about its quantile of the trained tokens."""
    torch.manual_seed(0)
    algo = make_algorithm(load_config(None, options), _build(tiny_model_dir))
    before = [p.detach().clone() for p in algo.actor.model.parameters()]
    trajs = _trajs(algo.actor, shift=0.2)
    trajs[0].metadata = {"truncated": True}
    m = algo.train_step(0, trajs)
    _finite(m)
    if "--algo.mask_truncated=true" in options:
        assert m["train_tokens"] == 30.0 - 3.0  # trajs[0]: 3 trained tokens, truncated
        assert 0.4 <= m["entropy_kept_frac"] <= 0.65
    after = list(algo.actor.model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
