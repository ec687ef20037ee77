"""Every policy loss and advantage estimator of ``algo.policy_loss`` / ``algo.name`` /
``algo.scale_rewards`` / ``algo.mask_truncated`` / ``algo.top_entropy_quantile`` against the
reference implementation's own function (verl 0.9.1 ``verl/trainer/ppo/core_algos.py``, TRL 1.16
``GRPOTrainer._compute_loss``; loaded from their source by ``reference.py``), on random padded
batches with masked tokens inside the sequences: the aggregated loss the training engine
back-propagates and its gradient w.r.t. every log-prob, within 1e-5.

Our side is the product's path: ``load_config`` -> :class:`PolicyUpdate` (its loss and the
per-step scale) -> the engine's reduction ``sum(loss * token_weight) / sum(token_weight)``.
The off-policy correction composes as the references compose it: TIS weights
``min(exp(prox - behav), cap)`` multiply every token loss (verl's ``rollout_is_weights``,
TRL's ``importance_sampling_ratio``), the ratio is taken against ``prox`` (verl's
``old_log_prob``, TRL's ``old_per_token_logps``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import pytest
import torch

from asyncrl.algorithms.advantages import (
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    terminal_rewards,
)
from asyncrl.algorithms.base import (
    PolicyUpdate,
    keep_top_entropy,
    overlong_penalty,
    seqs_from_trajs,
)
from asyncrl.algorithms.grpo import build_seqs
from asyncrl.config import load_config
from asyncrl.core import Trajectory
from asyncrl.engines.train.base import Seq
from tests.algorithms.reference import TrlTrainer, VerlActorConfig, VerlAlgoConfig, verl

CAP = 1.5
LENGTHS = [9, 4, 7, 1, 6, 8]
T = max(LENGTHS)


@dataclass
class Batch:
    """A padded (B, T) batch: positions past a sequence's length hold garbage and mask 0."""

    logp: torch.Tensor  # leaf, requires grad
    prox: torch.Tensor
    behav: torch.Tensor
    adv: torch.Tensor  # (B, T): one value per sequence unless ``token_adv``
    mask: torch.Tensor
    entropy: torch.Tensor

    @property
    def is_weight(self) -> torch.Tensor:
        """TIS: ``min(exp(prox - behav), cap)`` (verl truncate mode / TRL token_truncate)."""
        return torch.exp(self.prox - self.behav).clamp(max=CAP)

    def seqs(self) -> list[Seq]:
        out = []
        for i, n in enumerate(LENGTHS):
            fields = {
                "prox": self.prox[i, :n],
                "behav": self.behav[i, :n],
                "adv": self.adv[i, :n],
                "mask": self.mask[i, :n],
            }
            out.append(Seq(torch.arange(1 + n), 1, fields))
        return out

    def flat_logp(self) -> torch.Tensor:
        return torch.cat([self.logp[i, :n] for i, n in enumerate(LENGTHS)])


def _batch(seed: int, spread: float = 0.3, token_adv: bool = False) -> Batch:
    g = torch.Generator().manual_seed(seed)
    b = len(LENGTHS)
    base = -torch.rand(b, T, generator=g) * 3 - 0.05
    prox = base + torch.randn(b, T, generator=g) * 0.1
    behav = base + torch.randn(b, T, generator=g) * 0.3
    logp = prox + torch.randn(b, T, generator=g) * spread
    adv = (
        torch.randn(b, T, generator=g) if token_adv else torch.randn(b, 1, generator=g).expand(b, T)
    )
    mask = (torch.rand(b, T, generator=g) > 0.2).float()
    for i, n in enumerate(LENGTHS):
        mask[i, n:] = 0.0
        mask[i, 0] = 1.0  # every sequence has a trained token (TRL and verl differ on empty ones)
        garbage = torch.randn(T - n, generator=g) * 5
        logp[i, n:], prox[i, n:], behav[i, n:] = garbage, garbage.flip(0), -garbage
    entropy = torch.rand(b, T, generator=g) * 2
    return Batch(logp.clone().requires_grad_(True), prox, behav, adv.clone(), mask, entropy)


def _ours(batch: Batch, overrides: list[str], entropy_quantile: float = 1.0) -> torch.Tensor:
    """The loss the engine back-propagates for ``batch`` under these ``--algo.*`` overrides."""
    cfg = load_config(
        None,
        [
            "--controller.max_staleness=0",  # the on-policy objective: TIS weight, no trust region
            f"--algo.behav_imp_weight_cap={CAP}",
            f"--algo.top_entropy_quantile={entropy_quantile}",
            *overrides,
        ],
    )
    update = PolicyUpdate(cfg, cast(Any, None), None, budget=T)
    seqs = batch.seqs()
    if entropy_quantile < 1:
        keep_top_entropy(seqs, [batch.entropy[i, :n] for i, n in enumerate(LENGTHS)], cfg.algo)
    update._set_scale(seqs)
    loss, _ = update.loss(batch.flat_logp(), seqs)
    weight = torch.cat([update.loss.token_weight(s) for s in seqs])
    return (loss * weight).sum() / weight.sum()


def _same(ours: torch.Tensor, ref: torch.Tensor, batch: Batch) -> None:
    """Values and gradients w.r.t. every (padded) log-prob agree within 1e-5."""
    torch.testing.assert_close(ours.detach(), ref.detach(), atol=1e-5, rtol=1e-5)
    (g_ours,) = torch.autograd.grad(ours, batch.logp)
    (g_ref,) = torch.autograd.grad(ref, batch.logp)
    assert g_ref.abs().sum() > 0
    torch.testing.assert_close(g_ours, g_ref, atol=1e-5, rtol=1e-5)


VERL_AGG = {
    "token-mean": "token-mean",
    "seq-mean": "seq-mean-token-mean",
    "token-sum-norm": "seq-mean-token-sum-norm",
    "seq-mean-token-sum": "seq-mean-token-sum",
}


def _verl_loss(name: str, batch: Batch, agg: str, **config: Any) -> torch.Tensor:
    fn = getattr(verl(), f"compute_policy_loss_{name}")
    cfg = VerlActorConfig(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None)
    cfg.global_batch_info = {"loss_scale_factor": T} if agg == "token-sum-norm" else {}
    for k, v in config.items():
        setattr(cfg, k, v)
    loss, _ = fn(batch.prox, batch.logp, batch.adv, batch.mask, VERL_AGG[agg], cfg, batch.is_weight)
    return cast(torch.Tensor, loss)


@pytest.mark.parametrize("agg", sorted(VERL_AGG))
@pytest.mark.parametrize("clip", [(0.2, 0.2, 0.0), (0.2, 0.28, 0.0), (0.1, 0.28, 3.0)])
def test_ppo_asymmetric_and_dual_clip_equal_verl(clip: tuple, agg: str) -> None:
    low, high, c = clip
    batch = _batch(1, spread=0.4, token_adv=True)
    ours = _ours(
        batch,
        [
            f"--algo.clip_eps_low={low}",
            f"--algo.clip_eps_high={high}",
            f"--algo.clip_ratio_c={c}",
            f"--algo.loss_agg={agg}",
        ],
    )
    # verl's vanilla loss always dual-clips (clip_ratio_c default 3): "off" is a bound never hit
    ref = _verl_loss(
        "vanilla", batch, agg, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c or 1e30
    )
    _same(ours, ref, batch)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("clip", [(3e-4, 4e-4), (0.2, 0.28)])
def test_gspo_equals_verl(clip: tuple, agg: str) -> None:
    batch = _batch(2, spread=0.05)
    ours = _ours(
        batch,
        [
            "--algo.policy_loss=gspo",
            f"--algo.clip_eps_low={clip[0]}",
            f"--algo.clip_eps_high={clip[1]}",
            f"--algo.loss_agg={agg}",
        ],
    )
    ref = _verl_loss("gspo", batch, agg, clip_ratio_low=clip[0], clip_ratio_high=clip[1])
    _same(ours, ref, batch)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean"])
def test_cispo_equals_verl(agg: str) -> None:
    batch = _batch(3, spread=0.5)
    ours = _ours(
        batch,
        [
            "--algo.policy_loss=cispo",
            "--algo.clip_eps_low=0.2",
            "--algo.clip_eps_high=0.28",
            f"--algo.loss_agg={agg}",
        ],
    )
    ref = _verl_loss("cispo", batch, agg, clip_ratio_low=0.2, clip_ratio_high=0.28)
    _same(ours, ref, batch)


@pytest.mark.parametrize("tau", [(1.0, 1.05), (0.5, 2.0)])
def test_sapo_equals_verl(tau: tuple) -> None:
    batch = _batch(4, spread=0.6)
    overrides = [
        "--algo.policy_loss=sapo",
        "--algo.loss_agg=seq-mean",
        f"--algo.sapo_tau_pos={tau[0]}",
        f"--algo.sapo_tau_neg={tau[1]}",
    ]
    ref = _verl_loss("sapo", batch, "seq-mean", tau_pos=tau[0], tau_neg=tau[1])
    _same(_ours(batch, overrides), ref, batch)


# TRL loss_type -> (our overrides, TRL's settings)
TRL_CASES: dict[str, tuple[list[str], dict[str, Any]]] = {
    "grpo": (["--algo.loss_agg=seq-mean", "--algo.clip_eps_high=0.28"], {"epsilon_high": 0.28}),
    "dapo": (["--algo.clip_eps_high=0.28"], {"epsilon_high": 0.28}),
    "bnpo": ([], {}),
    "dr_grpo": (["--algo.loss_agg=token-sum-norm"], {"max_completion_length": T}),
    "cispo": (
        ["--algo.policy_loss=cispo", "--algo.clip_eps_low=1", "--algo.clip_eps_high=4"],
        {"epsilon_high": 5.0},
    ),
    "sapo": (["--algo.policy_loss=sapo", "--algo.loss_agg=seq-mean"], {}),
    "luspo": (
        ["--algo.policy_loss=gspo", "--algo.loss_agg=seq-mean-token-sum"],
        {"level": "sequence"},
    ),
    "gspo": (["--algo.policy_loss=gspo", "--algo.loss_agg=seq-mean"], {"level": "sequence"}),
}


@pytest.mark.parametrize("case", sorted(TRL_CASES))
def test_losses_equal_trl(case: str) -> None:
    overrides, settings = TRL_CASES[case]
    batch = _batch(5, spread=0.8 if case == "cispo" else 0.3)
    batch.adv = batch.adv[:, :1].expand(-1, T).clone()
    if settings.get("level") == "sequence":
        # TRL multiplies its (B, 1) sequence loss by the (B, T) IS weights, so the gradient of
        # the sequence ratio spreads each sequence's weighted loss evenly over its tokens;
        # verl (and asyncrl) weight each token's own score by its own weight. The values
        # agree either way, the gradients only where a sequence's weights are equal: no
        # engine/trainer mismatch here (behav = prox, weight 1); verl's test covers the rest.
        batch.behav = batch.prox.clone()
    loss_type = "grpo" if case == "gspo" else case  # GSPO is TRL's grpo at sequence level
    trl = TrlTrainer(loss_type, batch.logp, **settings)
    ref = trl.loss(batch.mask.long(), batch.adv[:, 0], batch.prox, batch.is_weight)
    _same(_ours(batch, overrides), ref, batch)


@pytest.mark.parametrize("quantile", [0.2, 0.5])
def test_top_entropy_selection_equals_trl(quantile: float) -> None:
    batch = _batch(6)
    trl = TrlTrainer("dapo", batch.logp, batch.entropy, top_entropy_quantile=quantile)
    ref = trl.loss(batch.mask.long(), batch.adv[:, 0], batch.prox, batch.is_weight)
    _same(_ours(batch, [], entropy_quantile=quantile), ref, batch)


def _traj(i: int, n: int, truncated: bool, reward: float) -> Trajectory:
    return Trajectory(
        prompt_ids=np.array([1, 2], np.int32),
        response_ids=np.arange(3, 3 + n, dtype=np.int32),
        behav_logprobs=np.zeros(n, np.float32),
        versions=np.zeros(n, np.int32),
        loss_mask=np.ones(n, np.uint8),
        reward=reward,
        group_id=i // 3,
        episode_id=i,
        metadata={"truncated": True} if truncated else {},
    )


def test_mask_truncated_equals_trl() -> None:
    """TRL (grpo_trainer.py:2487-2495): a completion whose last token is not EOS/pad is
    truncated and its completion_mask zeroed, so it leaves the loss and ``num_items_in_batch``;
    ours: ``metadata["truncated"]`` (the last generation's finish reason was ``length``)."""
    batch = _batch(7)
    truncated = [False, True, False, False, True, False]
    trajs = [_traj(i, n, t, 0.0) for i, (n, t) in enumerate(zip(LENGTHS, truncated, strict=True))]
    masks = [s.fields["mask"] for s in seqs_from_trajs(trajs, mask_truncated=True)]
    for i, m in enumerate(masks):
        batch.mask[i, : LENGTHS[i]] *= m
    ref_mask = batch.mask.clone()
    trl = TrlTrainer("dapo", batch.logp)
    ref = trl.loss(ref_mask.long(), batch.adv[:, 0], batch.prox, batch.is_weight)
    _same(_ours(batch, []), ref, batch)
    assert [bool(m.any()) for m in masks] == [not t for t in truncated]
    assert all(bool(s.fields["mask"].all()) for s in seqs_from_trajs(trajs))  # off: unchanged


# ---- advantage estimators ---------------------------------------------------------------


def _rewards(seed: int, groups: int = 5, size: int = 4) -> tuple[torch.Tensor, np.ndarray]:
    g = torch.Generator().manual_seed(seed)
    r = torch.randint(0, 3, (groups * size,), generator=g).float() / 2
    r[:size] = 1.0  # one group of equal rewards
    ids = np.repeat(np.arange(groups), size)
    perm = torch.randperm(groups * size, generator=g).numpy()  # groups interleaved
    return r[perm], ids[perm]


def _token_rewards(r: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 7, (len(r),), generator=g)
    mask = torch.zeros(len(r), 6)
    for i, n in enumerate(lengths.tolist()):
        mask[i, :n] = (torch.rand(n, generator=g) > 0.25).float()
        mask[i, 0] = 1.0
    return terminal_rewards(r, mask), mask


def test_grpo_group_scaling_equals_verl() -> None:
    r, ids = _rewards(10)
    tok, mask = _token_rewards(r, 10)
    ref, _ = verl().compute_grpo_outcome_advantage(tok, mask, ids, 1e-6, True)
    ours = grpo_advantages(r, torch.from_numpy(ids), "group")[:, None] * mask
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    ref_none, _ = verl().compute_grpo_outcome_advantage(tok, mask, ids, 1e-6, False)
    ours_none = grpo_advantages(r, torch.from_numpy(ids), "none")[:, None] * mask
    torch.testing.assert_close(ours_none, ref_none, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_scale_rewards_equals_trl(scale: str) -> None:
    """TRL's advantages (grpo_trainer.py:2762-2790, ``sum_then_normalize``, one reward
    function, groups of ``num_generations`` consecutive rows), written from that source: that
    code sits inside ``_generate_and_score_completions`` with generation and reward calls."""
    r, ids = _rewards(11)
    order = np.argsort(ids, kind="stable")
    rewards, num_generations = r[order], 4
    trl = load_trl_utils()
    mean = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean = mean.repeat_interleave(num_generations, dim=0)
    if scale in ("group", "none"):
        std = trl["nanstd"](rewards.view(-1, num_generations), dim=1)
        std = std.repeat_interleave(num_generations, dim=0)
    else:
        std = trl["nanstd"](rewards).expand_as(rewards)
    ref = rewards - mean
    if scale != "none":
        ref = ref / (std + 1e-4)
    ours = grpo_advantages(rewards, torch.from_numpy(ids[order]), scale, eps=1e-4)  # type: ignore[arg-type]
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def load_trl_utils() -> dict[str, Any]:
    from tests.algorithms.reference import TRL, load

    return load(TRL / "trl" / "trainer" / "utils.py", ["nanstd"], {"torch": torch})


def test_rloo_equals_verl() -> None:
    r, ids = _rewards(12)
    ids[0] = 99  # a group of one keeps its raw reward in both
    tok, mask = _token_rewards(r, 12)
    ref, _ = verl().compute_rloo_outcome_advantage(tok, mask, ids)
    ours = rloo_advantages(r, torch.from_numpy(ids))[:, None] * mask
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_equals_verl(gamma: float) -> None:
    r, _ = _rewards(13)
    tok, mask = _token_rewards(r, 13)
    ref, _ = verl().compute_reinforce_plus_plus_outcome_advantage(
        tok, mask, config=VerlAlgoConfig(gamma=gamma)
    )
    torch.testing.assert_close(reinforce_pp_advantages(tok, mask, gamma), ref, atol=1e-5, rtol=1e-5)


def test_reinforce_plus_plus_baseline_equals_verl() -> None:
    r, ids = _rewards(14)
    ids[0] = 99  # a group of one: its raw reward, whitened with the rest, in both
    tok, mask = _token_rewards(r, 14)
    ref, _ = verl().compute_reinforce_plus_plus_baseline_outcome_advantage(tok, mask, ids)
    ours = reinforce_pp_baseline_advantages(r, torch.from_numpy(ids), mask)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "name", ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]
)
def test_build_seqs_uses_the_configured_estimator(name: str) -> None:
    """``algo.name`` picks the estimator for the trainer's sequences, after mask_truncated."""
    r, ids = _rewards(15, groups=2, size=3)
    trajs = [_traj(i, 2 + i % 3, i == 1, float(x)) for i, x in enumerate(r.tolist())]
    for t, gid in zip(trajs, ids.tolist(), strict=True):
        t.group_id = gid
    cfg = load_config(None, [f"--algo.name={name}", "--algo.mask_truncated=true"]).algo
    seqs = build_seqs(trajs, cfg)
    mask = torch.zeros(len(trajs), 4)
    for i, s in enumerate(seqs):
        mask[i, : s.response_len] = s.fields["mask"]
    assert not bool(mask[1].any())  # truncated
    groups = torch.tensor(ids)
    want = {
        "grpo": lambda: grpo_advantages(r, groups, "group")[:, None] * mask,
        "rloo": lambda: rloo_advantages(r, groups)[:, None] * mask,
        "reinforce_plus_plus": lambda: reinforce_pp_advantages(
            terminal_rewards(r, mask), mask, 1.0
        ),
        "reinforce_plus_plus_baseline": lambda: reinforce_pp_baseline_advantages(r, groups, mask),
    }[name]()
    for i, s in enumerate(seqs):
        got = s.fields["adv"] * s.fields["mask"]
        torch.testing.assert_close(got, want[i, : s.response_len] * s.fields["mask"])


@pytest.mark.parametrize(
    ("overrides", "keys"),
    [
        (["--algo.clip_ratio_c=0.5"], ["algo.clip_ratio_c"]),
        (["--algo.clip_ratio_c=3", "--algo.policy_loss=gspo"], ["algo.clip_ratio_c", "gspo"]),
        (["--algo.policy_loss=sapo"], ["algo.policy_loss='sapo'", "algo.loss_agg='seq-mean'"]),
        (["--algo.scale_rewards=batch", "--algo.norm_adv_by_std=false"], ["algo.scale_rewards"]),
        (["--algo.scale_rewards=batch", "--algo.name=rloo"], ["algo.scale_rewards", "'rloo'"]),
        (["--algo.policy_loss=dppo"], ["algo.policy_loss"]),
        (["--algo.top_entropy_quantile=1.5"], ["algo.top_entropy_quantile"]),
    ],
)
def test_refused_combinations_name_their_keys(overrides: list[str], keys: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        load_config(None, overrides)
    for key in keys:
        assert key in str(err.value), (key, str(err.value))


@pytest.mark.parametrize(("budget", "buffer", "factor"), [(16, 4, 1.0), (20, 19, 0.5)])
def test_overlong_penalty_equals_verl_dapo(budget: int, buffer: int, factor: float) -> None:
    """verl 0.9.1 ``verl/workers/reward_manager/dapo.py:121-127`` (inside
    ``DAPORewardManager.__call__``, which needs a ``DataProto`` and a tokenizer), written from
    that source per response; and the advantages are computed from the shaped rewards."""
    lengths = torch.arange(0, budget + 1)
    want = []
    for valid_response_length in lengths.tolist():
        expected_len = budget - buffer
        exceed_len = valid_response_length - expected_len
        want.append(min(-exceed_len / buffer * factor, 0))
    got = overlong_penalty(lengths, budget, buffer, factor)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32))
    trajs = [_traj(i, n, False, 1.0) for i, n in enumerate([budget, budget - buffer, 1])]
    for t in trajs:
        t.group_id = 0
    cfg = load_config(
        None, [f"--algo.overlong_buffer_len={buffer}", f"--algo.overlong_penalty_factor={factor}"]
    ).algo
    shaped = 1.0 + overlong_penalty(
        torch.tensor([budget, budget - buffer, 1]), budget, buffer, factor
    )
    adv = [float(s.fields["adv"][0]) for s in build_seqs(trajs, cfg, budget)]
    torch.testing.assert_close(torch.tensor(adv), grpo_advantages(shaped, torch.zeros(3), "group"))
    assert adv[0] < 0 < adv[2]  # the response at the budget lost reward
    with pytest.raises(ValueError, match=r"algo\.overlong_buffer_len"):
        overlong_penalty(lengths, budget, budget + 1)
