"""Off-policy corrections (TIS, MIS, IcePop) of the decoupled and on-policy objectives, where a
rejected token counts in the normaliser, and the train/inference mismatch metrics, against
reference formulas written here token by token, on random inputs.

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
- Rejected tokens out of the denominator (``behav_reject_norm = "kept"``): verl
  docs/algo/rollout_corr.md, "Rejection Sampling ... used for loss aggregation (denominator
  calculation)"; in it (``all``): IcePop's ``1/|y|``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

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


def _reference_weights(seqs: list[Seq], correction: str, band: tuple = BAND) -> list[float]:
    """The correction's weight of every token, one token (or sequence) at a time."""
    lo, hi = band
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


@pytest.mark.parametrize("objective", ["decoupled", "on-policy"])
@pytest.mark.parametrize("correction", ["tis", "mis", "icepop"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_correction_loss_and_gradient_match_the_reference(
    correction: str, seed: int, objective: str
) -> None:
    """Both objectives with a behaviour log-prob and the trainer's (staleness 0 included: a
    real engine's log-probs differ from the trainer's) weigh every token by the correction."""
    seqs, logp0 = _random_batch(seed, [7, 1, 12, 5, 9, 3])
    weights = _reference_weights(seqs, correction)
    mask = torch.cat([s.fields["mask"] for s in seqs])
    rejected = sum(1 for w, m in zip(weights, mask.tolist(), strict=True) if w == 0.0 and m)
    if correction != "tis":  # the inputs exercise both sides of the band
        assert 0 < rejected < int(mask.sum())
    loss_fn = PolicyLoss(objective, CLIP, CAP, correction=correction, band=BAND)  # type: ignore[arg-type]
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
    from asyncrl.algorithms.base import correction_band
    from asyncrl.config import load_config

    algo = load_config(None, []).algo
    assert (algo.behav_correction, algo.behav_reject_norm) == ("tis", "all")
    # one band per correction: slime's MIS bounds (mis.yaml), IcePop's alpha and beta
    assert (algo.behav_mis_low, algo.behav_mis_high) == (0.5, 2.0)
    assert (algo.behav_icepop_low, algo.behav_icepop_high) == (0.5, 5.0)
    both = ["--algo.behav_mis_high=3", "--algo.behav_icepop_low=0.25"]
    mis = load_config(None, ["--algo.behav_correction=mis", *both]).algo
    icepop = load_config(None, ["--algo.behav_correction=icepop", *both]).algo
    assert correction_band(mis) == (0.5, 3.0) and correction_band(icepop) == (0.25, 5.0)
    with pytest.raises(ValueError, match="behav_correction"):
        load_config(None, ["--algo.behav_correction=clip"])
    with pytest.raises(ValueError, match="behav_icepop_low"):
        load_config(None, ["--algo.behav_icepop_low=1.5"])
    with pytest.raises(ValueError, match="behav_reject_norm"):
        load_config(None, ["--algo.behav_reject_norm=some"])
    with pytest.raises(ValueError, match=r"behav_mask_low is now algo\.behav_mis_low or"):
        load_config(None, ["--algo.behav_mask_low=0.3"])  # the shared band of before
    from asyncrl.config import RunConfig, to_dict

    old = to_dict(RunConfig())  # a run recorded with the shared band still resumes
    old["algo"].update(behav_mask_low=0.5, behav_mask_high=2.0)
    assert load_config(None, [], base=old) == RunConfig()


@pytest.mark.parametrize("correction", ["tis", "mis", "icepop"])
def test_naive_objective_takes_no_correction(correction: str) -> None:
    """``decoupled = false``: the ratio against the behaviour policy, clipped, weight 1."""
    seqs, logp0 = _random_batch(4, [5, 8, 2])
    logp = logp0.clone().requires_grad_(True)
    loss, stats = PolicyLoss("naive", CLIP, CAP, correction=correction, band=BAND)(logp, seqs)  # type: ignore[arg-type]
    f = {k: torch.cat([s.fields[k] for s in seqs]).tolist() for k in ("behav", "adv", "mask")}
    for i, (b, a) in enumerate(zip(f["behav"], f["adv"], strict=True)):
        assert float(loss[i]) == pytest.approx(-_surrogate(float(logp0[i]), b, a))
    assert float(stats["behav_rejected_frac_sum"]) == 0.0


def _normalised(loss_fn: PolicyLoss, seqs: list[Seq], logp: torch.Tensor) -> torch.Tensor:
    """The engine's reduction ``sum(loss * w) / sum(w)``, ``w`` the loss's token weights."""
    loss, _ = loss_fn(logp, seqs)
    w = torch.cat([loss_fn.token_weight(s) for s in seqs])
    return (loss * w).sum() / w.sum()


def _reference_normalised(
    seqs: list[Seq], logp: torch.Tensor, correction: str, norm: str, agg: str
) -> torch.Tensor:
    """Token by token: each trained token's ``-w * surrogate``, over the tokens the normaliser
    counts (``all``: every trained token; ``kept``: those the correction did not reject), as a
    token mean or a mean over sequences of their token means."""
    weights = _reference_weights(seqs, correction)
    i, per_seq = 0, []
    for s in seqs:
        terms, counted = logp.new_zeros(()), 0
        for k in range(len(s.fields["mask"])):
            prox, a = float(s.fields["prox"][k]), float(s.fields["adv"][k])
            if s.fields["mask"][k]:
                r = torch.exp(logp[i] - prox)
                terms = terms - weights[i] * torch.minimum(r * a, r.clamp(1 - CLIP, 1 + CLIP) * a)
                counted += 1 if norm == "all" or weights[i] != 0.0 else 0
            i += 1
        per_seq.append((terms, counted))
    if agg == "token-mean":
        return sum(t for t, _ in per_seq) / sum(c for _, c in per_seq)
    kept = [(t, c) for t, c in per_seq if c > 0]
    return sum(t / c for t, c in kept) / len(kept)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean"])
@pytest.mark.parametrize("norm", ["all", "kept"])
@pytest.mark.parametrize("correction", ["mis", "icepop"])
def test_rejected_tokens_in_or_out_of_the_normaliser(correction: str, norm: str, agg: str) -> None:
    seqs, logp0 = _random_batch(5, [7, 1, 12, 5, 9, 3, 6])
    loss_fn = PolicyLoss("decoupled", CLIP, CAP, agg, correction=correction, band=BAND,  # type: ignore[arg-type]
                         reject_norm=norm)  # type: ignore[arg-type]  # fmt: skip
    assert loss_fn.needs_prox == (norm == "kept")
    logp = logp0.clone().requires_grad_(True)
    got = _normalised(loss_fn, seqs, logp)
    got.backward()
    ref_logp = logp0.clone().requires_grad_(True)
    ref = _reference_normalised(seqs, ref_logp, correction, norm, agg)
    ref.backward()
    torch.testing.assert_close(got.detach(), ref.detach())
    torch.testing.assert_close(logp.grad, ref_logp.grad)
    other = "all" if norm == "kept" else "kept"
    assert float(ref) != pytest.approx(float(_reference_normalised(seqs, logp0, correction,
                                                                   other, agg)))  # fmt: skip
    tis = PolicyLoss("decoupled", CLIP, CAP, agg, correction="tis", reject_norm="kept")  # type: ignore[arg-type]
    assert not tis.needs_prox  # nothing rejected: nothing to leave out
    del seqs[0].fields["prox"]
    if norm == "kept":
        with pytest.raises(ValueError, match="prox"):
            loss_fn.token_weight(seqs[0])


def test_rejected_tokens_leave_the_engines_denominator(tiny_model_dir: Path) -> None:
    """On the real training engine: with ``kept`` the gradient is ``all``'s scaled by trained /
    kept tokens (token-mean); a GRPO step at staleness 0 computes ``prox`` first and rejects
    the tokens whose engine log-prob is far from the trainer's."""
    from asyncrl.algorithms.base import make_algorithm
    from asyncrl.config import load_config
    from asyncrl.engines.train.fsdp import FSDPEngine

    cfg = load_config(None, ["--controller.max_staleness=0", "--algo.behav_correction=icepop",
                             "--algo.behav_reject_norm=kept"])  # fmt: skip
    engine = FSDPEngine(str(tiny_model_dir), cfg, role="actor")
    g = torch.Generator().manual_seed(0)
    seqs = [Seq(torch.randint(3, 13, (4 + n,), generator=g), 4, {}) for n in (3, 5, 2, 6)]
    for s, lp in zip(seqs, engine.forward_batch(seqs), strict=True):
        drift = torch.where(torch.rand(len(lp), generator=g) < 0.4, 2.5, 0.1)  # rho e^2.5: out
        s.fields.update(prox=lp.float(), behav=lp.float() - drift, mask=torch.ones(len(lp)),
                        adv=torch.randn(len(lp), generator=g))  # fmt: skip
    grads = {}
    for norm in ("all", "kept"):
        loss_fn = PolicyLoss("on-policy", CLIP, CAP, correction="icepop", band=(0.5, 5.0),
                             reject_norm=norm)  # type: ignore[arg-type]  # fmt: skip
        engine.optimizer.zero_grad(set_to_none=True)
        engine.forward_backward_batch(seqs, loss_fn)
        grads[norm] = _grads(engine)
        counted = sum(float(loss_fn.token_weight(s).sum()) for s in seqs)
        grads[norm + "_n"] = torch.tensor(counted)
    n_all, n_kept = float(grads.pop("all_n")), float(grads.pop("kept_n"))
    assert 0 < n_kept < n_all
    for k in grads["all"]:
        torch.testing.assert_close(grads["kept"][k], grads["all"][k] * n_all / n_kept)
    algo = make_algorithm(cfg, lambda role, c: FSDPEngine(str(tiny_model_dir), c, role=role))
    m = algo.train_step(0, _trajectories(seqs))
    assert m["updates"] == 1.0 and 0.2 < m["behav_rejected_frac"] < 0.8  # prox was computed
    assert math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0


def _grads(engine: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in engine.model.named_parameters():
        grad = p.grad
        out[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()
    return out


def _trajectories(seqs: list[Seq]) -> list[Any]:
    """Trajectories of ``seqs`` (one GRPO group, rewards 0/1) with their behaviour log-probs."""
    import numpy as np

    from asyncrl.core import Trajectory

    return [
        Trajectory(
            prompt_ids=s.input_ids[: s.prompt_len].numpy().astype(np.int32),
            response_ids=s.input_ids[s.prompt_len :].numpy().astype(np.int32),
            behav_logprobs=s.fields["behav"].numpy().astype(np.float32),
            versions=np.zeros(s.response_len, np.int32),
            loss_mask=np.ones(s.response_len, np.uint8),
            reward=float(i % 2),
            group_id=0,
            episode_id=i,
        )
        for i, s in enumerate(seqs)
    ]
