"""Advantage estimators against hand-computed values."""

from __future__ import annotations

import math

import torch

from asyncrl.algorithms.advantages import (
    explained_variance,
    gae_advantages,
    grpo_advantages,
    masked_whiten,
    terminal_rewards,
)


def test_grpo_group_mean_and_std() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.3])
    groups = torch.tensor([0, 0, 1, 1, 2])
    adv = grpo_advantages(rewards, groups)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.0, 0.0, 0.0]))
    adv_std = grpo_advantages(rewards, groups, "group")
    # group 0: sample std sqrt(0.5) -> +-sqrt(0.5); equal-reward and single-sample groups:
    # exactly 0, no NaN
    h = math.sqrt(0.5)
    torch.testing.assert_close(adv_std, torch.tensor([h, -h, 0.0, 0.0, 0.0]), atol=1e-5, rtol=0)
    assert not torch.isnan(adv_std).any()
    assert float(adv_std[2]) == 0.0 and float(adv_std[4]) == 0.0


def test_grpo_groups_need_not_be_contiguous() -> None:
    adv = grpo_advantages(torch.tensor([1.0, 3.0, 2.0, 6.0]), torch.tensor([7, 3, 7, 3]))
    torch.testing.assert_close(adv, torch.tensor([-0.5, -1.5, 0.5, 1.5]))


def test_terminal_rewards_on_last_trained_token() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 1.0]])
    out = terminal_rewards(torch.tensor([1.0, 2.0, 3.0, 4.0]), mask)
    expect = [[0.0, 1.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 4.0]]
    torch.testing.assert_close(out, torch.tensor(expect))


def test_gae_hand_computed() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3)
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=0.5)
    # delta2 = 1 - 0.7 = 0.3; delta1 = 0.7 - 0.6; delta0 = 0.6 - 0.5; A_t = delta_t + 0.5 A_t+1
    torch.testing.assert_close(adv, torch.tensor([[0.225, 0.25, 0.3]]))
    torch.testing.assert_close(ret, torch.tensor([[0.725, 0.85, 1.0]]))


def test_gae_discount_and_lambda_one() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    adv, ret = gae_advantages(rewards, torch.zeros(1, 3), torch.ones(1, 3), gamma=0.5, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.25, 0.5, 1.0]]))
    torch.testing.assert_close(ret, adv)


def test_gae_skips_masked_tokens_and_padding() -> None:
    # row 0: an environment token in the middle (mask 0, any value) is passed through
    # row 1: a shorter, right-padded row
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    values = torch.tensor([[0.5, 9.9, 0.7], [0.2, 0.0, 0.0]])
    rewards = terminal_rewards(torch.tensor([1.0, 1.0]), mask)
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=0.5)
    # row 0: A2 = 0.3; A0 = (0.7 - 0.5) + 0.5 * 0.3 = 0.35; row 1: A0 = 1 - 0.2
    torch.testing.assert_close(adv, torch.tensor([[0.35, 0.0, 0.3], [0.8, 0.0, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.85, 0.0, 1.0], [1.0, 0.0, 0.0]]))


def test_masked_whiten() -> None:
    x = torch.tensor([1.0, 2.0, 3.0, 100.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    z = math.sqrt(1.5)
    torch.testing.assert_close(masked_whiten(x, mask), torch.tensor([-z, 0.0, z, 0.0]))
    flat = masked_whiten(torch.full((4,), 0.7), torch.ones(4))
    torch.testing.assert_close(flat, torch.zeros(4))


def test_explained_variance() -> None:
    ret = torch.tensor([1.0, 2.0, 3.0, 4.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    assert explained_variance(ret, ret, mask) == 1.0
    assert abs(explained_variance(torch.zeros(4), ret, mask)) < 1e-6
    assert explained_variance(ret, torch.ones(4), mask) == 0.0  # constant returns: no NaN
