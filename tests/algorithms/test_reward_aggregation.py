"""Several reward functions, ``task.reward_aggregation = "normalize_then_sum"``: the advantage
equals TRL 1.16's own lines (``trl/trainer/grpo_trainer.py:2790-2799``, inline in
``GRPOTrainer._generate_and_score_completions``: compiled here from the wheel's source as
written, line numbers kept) on random inputs, within 1e-5, through the product's path
(``load_config`` -> :func:`aggregation_of` -> :func:`build_seqs` on trajectories carrying
``rewards``)."""

from __future__ import annotations

import ast
import json
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from asyncrl.algorithms.advantages import normalize_then_sum_advantages
from asyncrl.algorithms.grpo import aggregation_of, build_seqs, reward_components
from asyncrl.config import load_config
from asyncrl.core import Trajectory
from tests.algorithms.reference import GRPO_TRAINER, load

NAMES = ["correct", "format", "brevity"]


def trl_normalize_then_sum(
    rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int
) -> torch.Tensor:
    """TRL's advantages: the ``elif self.multi_objective_aggregation == "normalize_then_sum"``
    branch of ``_generate_and_score_completions`` run as the file writes it, then its
    ``torch.nan_to_num`` (grpo_trainer.py:2811)."""
    if not GRPO_TRAINER.is_file():
        pytest.skip(f"{GRPO_TRAINER} is missing: run scripts/setup.sh")
    ns: dict[str, Any] = load(GRPO_TRAINER.parent / "utils.py", ["nanstd"], {"torch": torch})
    tree = ast.parse(GRPO_TRAINER.read_text(), str(GRPO_TRAINER))
    branch = next(
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.If)
        and ast.unparse(n.test) == "self.multi_objective_aggregation == 'normalize_then_sum'"
    )
    assert branch.lineno == 2790  # the lines the docstrings cite
    ns.update(
        torch=torch,
        self=SimpleNamespace(reward_funcs=[None] * weights.numel(), reward_weights=weights),
        rewards_per_func=rewards_per_func,
        num_generations=num_generations,
        device="cpu",
        unscorable_mask=torch.isnan(rewards_per_func).all(dim=1),
    )
    code = compile(ast.Module(body=branch.body, type_ignores=[]), str(GRPO_TRAINER), "exec")
    exec(code, ns)
    return torch.nan_to_num(ns["advantages"], nan=0.0)


def _inputs(seed: int, groups: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    correct = torch.randint(0, 2, (groups * n,), generator=g).float()  # ties, uniform groups
    fmt = torch.randint(0, 3, (groups * n,), generator=g).float() / 2
    brevity = torch.rand(groups * n, generator=g)
    fmt[:n] = 0.5  # a group where one function carries no signal
    correct[n : 2 * n] = 1.0
    weights = torch.tensor([1.0, 0.5, -0.25]) * (1 + torch.rand(3, generator=g))
    return torch.stack([correct, fmt, brevity], dim=1), weights


@pytest.mark.parametrize(("seed", "groups", "n"), [(0, 6, 4), (1, 3, 8), (2, 8, 2), (3, 1, 5)])
def test_normalize_then_sum_equals_trl(seed: int, groups: int, n: int) -> None:
    parts, weights = _inputs(seed, groups, n)
    want = trl_normalize_then_sum(parts, weights, n)
    ids = torch.arange(groups).repeat_interleave(n)
    got = normalize_then_sum_advantages(parts, weights, ids)
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got, want)
    # groups need not be consecutive rows (asyncrl's group_id): the same values, permuted
    perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed))
    shuffled = normalize_then_sum_advantages(parts[perm], weights, ids[perm] * 7 + 3)
    assert torch.allclose(shuffled, want[perm], atol=1e-5, rtol=0)


def test_the_grpo_step_uses_trls_advantage_from_the_trajectories_components() -> None:
    """From the config (``task.rewards`` + ``normalize_then_sum``) to each token's advantage
    in the trainer's sequences; the trajectory's own ``reward`` is not used. With ``sum`` the
    estimator runs on the summed reward as before."""
    groups, n = 5, 4
    parts, weights = _inputs(7, groups, n)
    specs = [{"fn": "task", "name": NAMES[0], "weight": float(weights[0])}]
    for k, w in zip(NAMES[1:], weights[1:].tolist(), strict=True):
        specs.append({"fn": f"m:{k}", "weight": w})
    over = [f"--task.rewards={json.dumps(specs)}", "--task.reward_aggregation=normalize_then_sum"]
    cfg = load_config(None, over)
    agg = aggregation_of(cfg)
    assert agg == tuple((k, float(w)) for k, w in zip(NAMES, weights.tolist(), strict=True))
    rng = np.random.default_rng(0)
    trajs = []
    for i in range(groups * n):
        length = int(rng.integers(1, 6))
        trajs.append(
            Trajectory(
                prompt_ids=[1, 2], response_ids=rng.integers(0, 9, length),
                behav_logprobs=np.zeros(length), versions=np.zeros(length),
                loss_mask=np.ones(length), reward=123.0, group_id=i // n, episode_id=i,
                rewards=dict(zip(NAMES, parts[i].tolist(), strict=True)),
            )
        )  # fmt: skip
    seqs = build_seqs(trajs, cfg.algo, 8, agg)
    want = trl_normalize_then_sum(parts, weights, n)
    for s, a in zip(seqs, want, strict=True):
        assert s.fields["adv"].shape == (s.response_len,)
        assert torch.allclose(s.fields["adv"], a.expand(s.response_len), atol=1e-5, rtol=0)
    assert aggregation_of(load_config(None, over[:1])) == ()  # "sum": the reward is the sum
    trajs[3].rewards.pop("format")
    with pytest.raises(ValueError, match=r"episode 3 has no reward component\(s\) \['format'\]"):
        reward_components(trajs, agg)
