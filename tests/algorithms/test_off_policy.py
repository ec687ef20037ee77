"""Off-policy corrections of the decoupled objective (TIS, MIS, IcePop) and the train/inference
mismatch metrics, against reference formulas written here token by token, on random inputs.

References (formulas re-derived here, no code copied):
- TIS: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
  Training" (fengyao.notion.site/off-policy-rl); verl docs/advance/rollout_is.md,
  ``rollout_is_mode = "truncate"``, token level: weight ``min(pi_train / pi_rollout, C)``.
- MIS: verl docs/advance/rollout_is.md, ``rollout_is_mode = "mask"`` at the ``geometric``
  level (a sequence rejected when ``exp(mean log ratio)`` leaves ``[lower, upper]``); the
  Miles/slime write-up (lmsys blog 2026-01-16, "Masked Importance Sampling": IS weights plus
  rejection sampling).
- IcePop: Ring-1T report (arXiv 2510.18855), ``J = E[M(k) * min(r A, clip(r) A)]`` with
  ``k = pi_train(theta_old) / pi_infer(theta_old)`` and ``M(k) = k`` on ``[alpha, beta]``,
  else 0.
"""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.algorithms.losses import PolicyLoss, behaviour_weight
from asyncrl.engines.train.base import Seq

CLIP, CAP, BAND = 0.2, 1.5, (0.6, 1.8)


def _random_batch(seed: int, lengths: list[int]) -> tuple[list[Seq], torch.Tensor]:
    """Sequences with random behaviour/proximal log-probs (ratios spread over ~[0.3, 3]),
    advantages of both signs and some masked tokens; plus the current log-probs."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for n in lengths:
        base = -torch.rand(n, generator=g, dtype=torch.float64) * 3 - 0.05
        prox = base + torch.randn(n, generator=g, dtype=torch.float64) * 0.1
        drift = float(torch.randn(1, generator=g)) * 0.6  # a sequence several versions old
        behav = base + drift + torch.randn(n, generator=g, dtype=torch.float64) * 0.4
        adv = torch.full((n,), float(torch.randn(1, generator=g)), dtype=torch.float64)
        mask = (torch.rand(n, generator=g) > 0.15).double()
        fields = {"prox": prox, "behav": behav, "adv": adv, "mask": mask}
        seqs.append(Seq(torch.arange(3 + n), 3, fields))
    prox_all = torch.cat([s.fields["prox"] for s in seqs])
    logp = prox_all + torch.randn(len(prox_all), generator=g, dtype=torch.float64) * 0.25
    return seqs, logp


def _surrogate(lp: float, prox: float, a: float) -> float:
    r = math.exp(lp - prox)
    return min(r * a, min(max(r, 1 - CLIP), 1 + CLIP) * a)


def _reference_weights(seqs: list[Seq], correction: str) -> list[float]:
    """The correction's weight of every token, one token (or sequence) at a time."""
    lo, hi = BAND
    out: list[float] = []
    for s in seqs:
        k = (s.fields["prox"] - s.fields["behav"]).exp().tolist()
        m = s.fields["mask"].tolist()
        if correction == "tis":
            out += [min(x, CAP) for x in k]
        elif correction == "icepop":
            out += [x if lo <= x <= hi else 0.0 for x in k]
        else:  # mis: geometric mean of the ratio over the sequence's trained tokens
            logs = [math.log(x) for x, on in zip(k, m, strict=True) if on]
            geo = math.exp(sum(logs) / len(logs)) if logs else 1.0
            keep = lo <= geo <= hi
            out += [min(x, CAP) if keep else 0.0 for x in k]
    return out


def _reference(seqs: list[Seq], logp: torch.Tensor, correction: str) -> torch.Tensor:
    """``-w * min(r A, clip(r) A)`` token by token, as a differentiable sum over trained tokens
    (the gradient comes from autograd through ``r = exp(logp - prox)`` only)."""
    weights = _reference_weights(seqs, correction)
    prox = torch.cat([s.fields["prox"] for s in seqs]).tolist()
    adv = torch.cat([s.fields["adv"] for s in seqs]).tolist()
    mask = torch.cat([s.fields["mask"] for s in seqs]).tolist()
    total = logp.new_zeros(())
    for i in range(len(weights)):
        r = torch.exp(logp[i] - prox[i])
        term = torch.minimum(r * adv[i], r.clamp(1 - CLIP, 1 + CLIP) * adv[i])
        plain = _surrogate(float(logp.detach()[i]), prox[i], adv[i])
        assert math.isclose(float(term.detach()), plain, rel_tol=1e-9)
        total = total - weights[i] * term * mask[i]
    return total


@pytest.mark.parametrize("correction", ["tis", "mis", "icepop"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_correction_loss_and_gradient_match_the_reference(correction: str, seed: int) -> None:
    seqs, logp0 = _random_batch(seed, [7, 1, 12, 5, 9, 3])
    weights = _reference_weights(seqs, correction)
    mask = torch.cat([s.fields["mask"] for s in seqs])
    rejected = sum(1 for w, m in zip(weights, mask.tolist(), strict=True) if w == 0.0 and m)
    if correction != "tis":  # the inputs exercise both sides of the band
        assert 0 < rejected < int(mask.sum())
    loss_fn = PolicyLoss("decoupled", CLIP, CAP, correction=correction, band=BAND)  # type: ignore[arg-type]
    logp = logp0.clone().requires_grad_(True)
    loss, stats = loss_fn(logp, seqs)
    (loss * mask).sum().backward()
    ref_logp = logp0.clone().requires_grad_(True)
    ref = _reference(seqs, ref_logp, correction)
    ref.backward()
    torch.testing.assert_close((loss.detach() * mask).sum(), ref.detach())
    torch.testing.assert_close(logp.grad, ref_logp.grad)
    assert float(stats["behav_rejected_frac_sum"]) == pytest.approx(rejected)


def test_mismatch_metrics_match_the_reference() -> None:
    seqs, logp = _random_batch(3, [6, 10, 4])
    _, stats = PolicyLoss("decoupled", CLIP, CAP)(logp, seqs)
    f = {k: torch.cat([s.fields[k] for s in seqs]).tolist() for k in ("prox", "behav", "mask")}
    pairs = [(p, b) for p, b, m in zip(f["prox"], f["behav"], f["mask"], strict=True) if m]
    abs_diff = sum(abs(p - b) for p, b in pairs)
    # k3 estimate of KL(behaviour || trainer) from behaviour samples: k - 1 - log k, k = ratio
    k3 = sum(math.exp(p - b) - 1 - (p - b) for p, b in pairs)
    assert float(stats["tokens"]) == len(pairs)
    assert float(stats["mismatch_abs_logp_sum"]) == pytest.approx(abs_diff)
    assert float(stats["mismatch_k3_kl_sum"]) == pytest.approx(k3)


def test_weights_at_the_band_edges_and_on_policy() -> None:
    rho = torch.tensor([0.5, 0.49, 2.0, 2.01, 1.0], dtype=torch.float64)
    w, rej = behaviour_weight(rho, "icepop", band=(0.5, 2.0))
    torch.testing.assert_close(w, torch.tensor([0.5, 0.0, 2.0, 0.0, 1.0], dtype=torch.float64))
    torch.testing.assert_close(rej, torch.tensor([0.0, 1, 0, 1, 0], dtype=torch.float64))
    # an on-policy batch (rho = 1) is never rejected nor reweighted by any correction
    ones = torch.ones(6, dtype=torch.float64)
    for corr in ("tis", "mis", "icepop"):
        w, rej = behaviour_weight(ones, corr, cap=1.0, lengths=[2, 4])  # type: ignore[arg-type]
        torch.testing.assert_close(w, ones)
        assert float(rej.sum()) == 0.0
    with pytest.raises(ValueError, match="correction"):
        behaviour_weight(ones, "bogus")  # type: ignore[arg-type]


def test_correction_config_is_validated() -> None:
    from asyncrl.config import load_config

    algo = load_config(None, []).algo
    assert (algo.behav_correction, algo.behav_mask_low, algo.behav_mask_high) == ("tis", 0.5, 2.0)
    cfg = load_config(None, ["--algo.behav_correction=icepop", "--algo.behav_mask_high=5"])
    assert cfg.algo.behav_correction == "icepop" and cfg.algo.behav_mask_high == 5.0
    with pytest.raises(ValueError, match="behav_correction"):
        load_config(None, ["--algo.behav_correction=clip"])
    with pytest.raises(ValueError, match="behav_mask_low"):
        load_config(None, ["--algo.behav_mask_low=1.5"])
