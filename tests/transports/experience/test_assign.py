"""Group-to-rank assignment: a group is never split; ranks stay balanced; deterministic."""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl.core import Trajectory
from asyncrl.transports.experience.assign import BalancedAssigner, ModuloAssigner, make_assigner


def group(gid: int, size: int, n_resp: int) -> list[Trajectory]:
    return [
        Trajectory(
            prompt_ids=np.zeros(4, np.int32),
            response_ids=np.zeros(n_resp, np.int32),
            behav_logprobs=np.zeros(n_resp, np.float32),
            versions=np.zeros(n_resp, np.int32),
            loss_mask=np.ones(n_resp, np.uint8),
            reward=0.0,
            group_id=gid,
            episode_id=gid * 100 + k,
        )
        for k in range(size)
    ]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_balanced_counts_and_tokens(world: int) -> None:
    rng = np.random.default_rng(world)
    groups = [group(g, 4, int(rng.integers(1, 200))) for g in range(10)]
    ranks = BalancedAssigner().assign(groups, world)
    assert ranks == BalancedAssigner().assign(groups, world)  # deterministic
    counts = np.bincount(ranks, minlength=world)
    assert counts.max() - counts.min() <= 1 and counts.max() <= -(-10 // world)
    tokens = np.zeros(world)
    for g, r in zip(groups, ranks, strict=True):
        tokens[r] += sum(t.num_tokens for t in g)
    biggest = max(sum(t.num_tokens for t in g) for g in groups)
    assert tokens.max() - tokens.min() <= 2 * biggest


def test_balanced_fewer_groups_than_ranks() -> None:
    assert BalancedAssigner().assign([group(0, 2, 5)], 3) == [0]
    assert BalancedAssigner().assign([], 3) == []


def test_modulo_is_stateless_by_group_id() -> None:
    groups = [group(g, 2, 3) for g in (5, 2, 7, 4)]
    assert ModuloAssigner().assign(groups, 2) == [1, 0, 1, 0]
    assert ModuloAssigner().assign(groups[:1], 3) == [2]


def test_make_assigner_names() -> None:
    assert isinstance(make_assigner("balanced"), BalancedAssigner)
    assert isinstance(make_assigner("modulo"), ModuloAssigner)
    with pytest.raises(ValueError, match="allowed values"):
        make_assigner("random")  # type: ignore[arg-type]
