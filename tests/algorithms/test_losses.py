"""Losses against hand-computed values on small inputs."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.algorithms.losses import (
    PolicyLoss,
    ValueLoss,
    aggregation_weight,
    entropy_surrogate,
    kl_k3,
    ppo_token_loss,
    value_token_loss,
)
from asyncrl.engines.train.base import Seq

L = math.log


def test_decoupled_loss_clip_weight_and_truncation() -> None:
    # token 0: ratio 0.5/0.4 = 1.25 -> clipped to 1.2 (A > 0); weight 0.4/0.2 = 2
    # token 1: ratio 0.3/0.4 = 0.75, A = -2 -> min(-1.5, -1.6) = -1.6 (clipped); weight 1
    # token 2: ratio 1, A = 0.5; weight 0.9/0.1 = 9 truncated to the cap 5
    logp = torch.tensor([L(0.5), L(0.3), L(0.9)], requires_grad=True)
    prox = torch.tensor([L(0.4), L(0.4), L(0.9)])
    behav = torch.tensor([L(0.2), L(0.4), L(0.1)])
    adv = torch.tensor([1.0, -2.0, 0.5])
    loss, info = ppo_token_loss(logp, behav, adv, prox, clip_eps=0.2, cap=5.0)
    torch.testing.assert_close(loss.detach(), torch.tensor([-2.4, 1.6, -2.5]))
    torch.testing.assert_close(info["clipped"], torch.tensor([1.0, 1.0, 0.0]))
    torch.testing.assert_close(info["imp_weight"], torch.tensor([2.0, 1.0, 9.0]))
    torch.testing.assert_close(info["truncated"], torch.tensor([0.0, 0.0, 1.0]))
    loss.sum().backward()
    # clipped tokens carry no gradient; token 2: d(-w * ratio * A)/dlogp = -5 * 1 * 0.5
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, 0.0, -2.5]))


def test_prox_defaults_to_current_logp_detached() -> None:
    logp = torch.tensor([L(0.5), L(0.25)], requires_grad=True)
    behav = torch.tensor([L(0.25), L(0.5)])
    adv = torch.tensor([1.0, 1.0])
    loss, info = ppo_token_loss(logp, behav, adv, cap=1.5)
    # ratio 1; weights 2 -> capped 1.5, and 0.5
    torch.testing.assert_close(loss.detach(), torch.tensor([-1.5, -0.5]))
    torch.testing.assert_close(info["ratio"], torch.ones(2))
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([-1.5, -0.5]))


def test_naive_objective_clips_against_behaviour() -> None:
    logp = torch.tensor([L(0.5), L(0.5)], requires_grad=True)
    behav = torch.tensor([L(0.25), L(0.5)])
    adv = torch.tensor([1.0, -1.0])
    loss, info = ppo_token_loss(logp, behav, adv, clip_eps=0.2, decoupled=False)
    # ratio 2 clipped to 1.2 (A>0); ratio 1 -> loss 1
    torch.testing.assert_close(loss.detach(), torch.tensor([-1.2, 1.0]))
    torch.testing.assert_close(info["clipped"], torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(info["truncated"], torch.zeros(2))


def test_kl_k3_and_entropy_surrogate() -> None:
    logp = torch.tensor([L(0.5), L(0.3)], requires_grad=True)
    ref = torch.tensor([L(0.25), L(0.3)])
    kl = kl_k3(logp, ref)
    # d = ref - logp = log 0.5: exp(d) - d - 1 = 0.5 + log 2 - 1
    torch.testing.assert_close(kl.detach(), torch.tensor([0.5 + math.log(2) - 1, 0.0]))
    assert bool((kl >= 0).all())
    h = entropy_surrogate(logp)
    torch.testing.assert_close(h.detach(), -logp.detach())
    h.sum().backward()
    torch.testing.assert_close(logp.grad, -logp.detach())


def test_value_loss_clipping() -> None:
    values = torch.tensor([1.0, 1.0, 0.1])
    old = torch.tensor([0.0, 0.0, 0.0])
    returns = torch.tensor([0.5, 2.0, 1.0])
    loss, clipped = value_token_loss(values, old, returns, clip=0.2)
    # 0: unclipped (0.5)^2 beats clipped (0.3)^2; 1: clipped (1.8)^2 beats (1.0)^2; 2: in range
    torch.testing.assert_close(loss, torch.tensor([0.125, 0.5 * 3.24, 0.5 * 0.81]))
    torch.testing.assert_close(clipped, torch.tensor([0.0, 1.0, 0.0]))
    loss_nc, _ = value_token_loss(values, old, returns, clip=0.0)
    torch.testing.assert_close(loss_nc, torch.tensor([0.125, 0.5, 0.405]))


def test_aggregation_weights() -> None:
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0])
    torch.testing.assert_close(aggregation_weight(mask, "token-mean"), mask)
    torch.testing.assert_close(aggregation_weight(mask, "seq-mean"), mask / 3)
    empty = torch.zeros(3)
    assert not torch.isnan(aggregation_weight(empty, "seq-mean")).any()


def _seq(n: int, **fields: list[float]) -> Seq:
    ids = torch.arange(2 + n)
    return Seq(ids, 2, {k: torch.tensor(v) for k, v in fields.items()})


def test_policy_loss_masks_stats_and_objectives() -> None:
    s = _seq(3, behav=[L(0.25), L(0.5), 0.0], adv=[1.0, 1.0, 5.0], mask=[1.0, 1.0, 0.0])
    logp = torch.tensor([L(0.5), L(0.5), L(0.01)])
    loss_fn = PolicyLoss("decoupled", clip_eps=0.2, cap=5.0)
    loss, stats = loss_fn(logp, [s])
    torch.testing.assert_close(loss[:2], torch.tensor([-2.0, -1.0]))
    # weights 2 and 1 (ratio 1): loss -2, -1; the masked token is excluded from the stats
    assert float(stats["tokens"]) == 2.0
    assert float(stats["pg_loss_sum"]) == pytest.approx(-3.0)
    assert float(stats["imp_weight_sum"]) == pytest.approx(3.0)
    assert loss_fn.extrema["imp_weight_max"] == pytest.approx(2.0)
    assert loss_fn.extrema["imp_weight_min"] == pytest.approx(1.0)
    # staleness 0: the correction weighs the engine/trainer mismatch the same way (TIS, cap 5)
    on, _ = PolicyLoss("on-policy", 0.2, 5.0)(logp, [s])
    torch.testing.assert_close(on[:2], torch.tensor([-2.0, -1.0]))
    naive, _ = PolicyLoss("naive", 0.2, 5.0)(logp, [s])  # ratio vs behaviour: 2 -> 1.2
    torch.testing.assert_close(naive[:2], torch.tensor([-1.2, -1.0]))


def test_policy_loss_uses_stored_prox_kl_and_entropy() -> None:
    s = _seq(
        2,
        behav=[L(0.5)] * 2,
        prox=[L(0.5)] * 2,
        ref=[L(0.25), L(0.5)],
        adv=[0.0, 0.0],
        mask=[1.0, 1.0],
    )
    logp = torch.tensor([L(0.5), L(0.5)], requires_grad=True)
    loss_fn = PolicyLoss("decoupled", 0.2, 5.0, kl_coef=0.1, entropy_coef=0.01)
    loss, stats = loss_fn(logp, [s])
    kl0 = 0.5 + math.log(2) - 1
    expect = torch.tensor([0.1 * kl0, 0.0]) - 0.01 * math.log(2)
    torch.testing.assert_close(loss.detach(), expect)
    assert float(stats["kl_ref_sum"]) == pytest.approx(kl0)


def test_value_loss_fn_stats() -> None:
    s = _seq(2, old_values=[0.0, 0.0], returns=[1.0, 1.0], mask=[1.0, 0.0])
    loss, stats = ValueLoss(clip=0.0, coef=0.5)(torch.tensor([0.0, 0.0]), [s])
    torch.testing.assert_close(loss, torch.tensor([0.25, 0.25]))
    assert float(stats["vf_loss_sum"]) == pytest.approx(0.5)
    assert float(stats["vf_tokens"]) == 1.0


def test_behaviour_trust_region_zeroes_tokens_moved_past_it() -> None:
    # ratio 1 (prox = logp); prox/behav per token: 2, 2, 0.5, 0.5, 1.1, 0.9
    # A > 0 and prox/behav 2 > 1.2 -> cut; A < 0 and 2 -> kept (weight capped 1)
    # A < 0 and 0.5 < 0.8 -> cut; A > 0 and 0.5 -> kept with weight 0.5
    # 1.1 and 0.9 lie inside [0.8, 1.2] -> kept whatever the sign
    logp = torch.tensor([L(0.4), L(0.4), L(0.2), L(0.2), L(0.44), L(0.36)], requires_grad=True)
    behav = torch.tensor([L(0.2), L(0.2), L(0.4), L(0.4), L(0.4), L(0.4)])
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, -1.0])
    loss, info = ppo_token_loss(logp, behav, adv, cap=1.0, behav_clip_eps=0.2)
    torch.testing.assert_close(info["behav_clipped"], torch.tensor([1.0, 0, 1, 0, 0, 0]))
    torch.testing.assert_close(loss.detach(), torch.tensor([0.0, 1.0, 0.0, -0.5, -1.0, 0.9]))
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, 1.0, 0.0, -0.5, -1.0, 0.9]))
    # eps_b = 0 disables it: token 0 gets its (capped) weight 1 back
    off, info = ppo_token_loss(logp.detach(), behav, adv, cap=1.0, behav_clip_eps=0.0)
    assert float(off[0]) == -1.0 and float(info["behav_clipped"].sum()) == 0.0


def test_behaviour_trust_region_only_in_decoupled_objective() -> None:
    logp = torch.tensor([L(0.4)], requires_grad=True)
    s = _seq(1, behav=[L(0.2)], adv=[1.0], mask=[1.0])
    dec, stats = PolicyLoss("decoupled", 0.2, 1.0, behav_clip_eps=0.2)(logp, [s])
    assert float(dec[0]) == 0.0 and float(stats["behav_clip_frac_sum"]) == 1.0
    naive, _ = PolicyLoss("naive", 0.2, 1.0, behav_clip_eps=0.2)(logp, [s])
    torch.testing.assert_close(naive.detach(), torch.tensor([-1.2]))  # its own clip: 2 -> 1.2
    on, _ = PolicyLoss("on-policy", 0.2, 1.0, behav_clip_eps=0.2)(logp, [s])
    torch.testing.assert_close(on.detach(), torch.tensor([-1.0]))


def test_behaviour_trust_region_config_is_validated() -> None:
    from asyncrl.config import load_config

    assert load_config(None, []).algo.behav_clip_eps == 0.2
    assert load_config(None, ["--algo.behav_clip_eps=0"]).algo.behav_clip_eps == 0.0
    with pytest.raises(ValueError, match="behav_clip_eps"):
        load_config(None, ["--algo.behav_clip_eps=-0.1"])
