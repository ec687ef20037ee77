"""Token losses (torch): the decoupled off-policy PPO objective, value loss, KL and entropy terms.

Per response token with advantage A, current log-prob ``logp``, proximal log-prob
``prox`` (the trainer's policy at the start of the step) and behaviour log-prob
``behav`` (the engine's, possibly several versions old)::

    ratio = exp(logp - prox)
    w     = min(exp(prox - behav), cap)                       # truncated importance weight
    loss  = -w * min(ratio * A, clip(ratio, 1-eps, 1+eps) * A)

Behaviour-side trust region (``behav_clip_eps = eps_b > 0``, decoupled only): a token
whose proximal/behaviour ratio already lies beyond ``1 + eps_b`` (A > 0) or below
``1 - eps_b`` (A < 0) gets weight 0, i.e. no gradient. The stale updates since the
sample was generated have already moved it past the trust region in the direction its
advantage asks for, so pushing it further overshoots. This is the cut naive PPO makes
with its ratio against the behaviour policy, kept here while the ratio of the clipped
surrogate stays against the proximal policy; with one update per step (ratio = 1)
it is the only trust region that acts.

Off-policy corrections (``correction``; the ``decoupled`` and ``on-policy`` objectives, i.e.
wherever the trainer's own log-prob of the behaviour tokens is known), all on the per-token
proximal/behaviour ratio ``rho = exp(prox - behav)`` (the trainer's recomputation over the
engine's log-prob: staleness and engine/trainer numerical mismatch together; at staleness 0
the mismatch alone), detached:

- ``tis`` (truncated importance sampling): ``w = min(rho, cap)`` (Yao et al. 2025, "Your
  efficient RL framework secretly brings you off-policy RL training"; verl's
  ``rollout_is_mode = "truncate"`` at token level). The default.
- ``mis`` (masked importance sampling: importance weights plus rejection sampling, as
  verl's ``rollout_is_mode = "mask"`` at the ``geometric`` level and Miles' MIS): a
  sequence whose geometric-mean ratio ``exp(mean_t log rho)`` over its trained tokens lies
  outside ``band = [lo, hi]`` is rejected (``w = 0`` for all its tokens); the others keep
  ``w = min(rho, cap)`` per token.
- ``icepop`` (Ring-1T / IcePop, 2025): ``w = rho`` where ``lo <= rho <= hi``, else 0 —
  each token outside the band is dropped from the gradient, not clipped.

Each correction has its own band (``algo.behav_mis_low/high``, ``algo.behav_icepop_low/
high``). Where a rejected token counts (``reject_norm``): ``all`` keeps it in the loss's
normaliser (the engine's ``sum(loss * w) / sum(w)``, ``w`` from :meth:`PolicyLoss.token_weight`
before the forward pass) as a zero, as IcePop's ``1/|y|``; ``kept`` treats it as masked
there too, as verl's rejection sampling does, which needs ``prox`` before the forward pass.

The three objectives of :class:`PolicyLoss` (see ``objective``):

- ``decoupled``: as above (AReaL's decoupled PPO); used when samples may be stale.
- ``on-policy``: the same without the behaviour-side trust region: the objective of
  synchronous training (staleness 0), where behaviour and proximal are the same weights up
  to the engine/trainer mismatch, which the correction's weight handles.
- ``naive``: ratio against the behaviour policy, ``w = 1`` (standard PPO run off-policy;
  its clip against the behaviour policy is its only correction).

With one optimizer step per batch ``prox`` is ``logp``'s value (detached), so the proximal
policy costs no extra forward pass; with several minibatches or epochs the trainer
recomputes it once at the start of the step and stores it as the ``prox`` field.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from asyncrl.engines.train.base import Seq

__all__ = [
    "Correction",
    "Objective",
    "PolicyKind",
    "PolicyLoss",
    "RejectNorm",
    "ValueLoss",
    "aggregation_weight",
    "behaviour_weight",
    "entropy_surrogate",
    "kl_k3",
    "policy_surrogate",
    "ppo_token_loss",
    "seq_token_mean",
    "value_token_loss",
]

_TRUNCATED_BY = 1.0 + 1e-4
"""``truncated`` counts a weight only when it exceeds the cap by more than 0.01 %: a fully
on-policy token's weight is 1 within float rounding (engine and trainer kernels differ by
~1e-6 in log-prob), which is no truncation (the clamp itself still applies to it)."""

Objective = Literal["decoupled", "on-policy", "naive"]
Aggregation = Literal["token-mean", "seq-mean", "token-sum-norm", "seq-mean-token-sum"]
PolicyKind = Literal["ppo", "gspo", "cispo", "sapo"]
Correction = Literal["tis", "mis", "icepop"]
RejectNorm = Literal["all", "kept"]


def behaviour_weight(
    rho: torch.Tensor,
    correction: Correction = "tis",
    cap: float = 5.0,
    band: tuple[float, float] = (0.5, 2.0),
    lengths: Sequence[int] | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token weight of the decoupled objective from the detached ratio ``rho`` =
    proximal/behaviour, and where the correction rejected the token (1.0) — see the module
    docstring. ``lengths`` (one sequence if None) split ``rho`` into sequences for ``mis``;
    ``mask`` (all ones if None) selects the trained tokens its geometric mean runs over."""
    lo, hi = band
    if correction == "tis":
        return rho.clamp(max=cap), torch.zeros_like(rho)
    if correction == "icepop":
        keep = ((rho >= lo) & (rho <= hi)).to(rho.dtype)
        return rho * keep, 1.0 - keep
    if correction != "mis":
        raise ValueError(f"unknown correction {correction!r} (allowed: 'tis', 'mis', 'icepop')")
    n = [len(rho)] if lengths is None else list(lengths)
    m = torch.ones_like(rho) if mask is None else mask.to(rho.dtype)
    seg = torch.repeat_interleave(torch.arange(len(n)), torch.tensor(n)).to(rho.device)
    log_rho = torch.log(rho) * m
    sums = torch.zeros(len(n), dtype=rho.dtype, device=rho.device).index_add_(0, seg, log_rho)
    count = torch.zeros(len(n), dtype=rho.dtype, device=rho.device).index_add_(0, seg, m)
    geo = torch.exp(sums / count.clamp(min=1.0))
    keep = ((geo >= lo) & (geo <= hi)).to(rho.dtype)[seg]
    return rho.clamp(max=cap) * keep, 1.0 - keep


def segments(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    """The sequence index of every token of sequences of ``lengths``, concatenated."""
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(list(lengths))).to(
        device
    )


def seq_token_mean(x: torch.Tensor, lengths: Sequence[int], mask: torch.Tensor) -> torch.Tensor:
    """Each sequence's mean of ``x`` over its trained tokens (``mask``), on every one of its
    tokens (0 for a sequence without trained tokens)."""
    seg = segments(lengths, x.device)
    m = mask.to(x.dtype)
    sums = torch.zeros(len(lengths), dtype=x.dtype, device=x.device).index_add_(0, seg, x * m)
    count = torch.zeros(len(lengths), dtype=x.dtype, device=x.device).index_add_(0, seg, m)
    return (sums / count.clamp(min=1.0))[seg]


def policy_surrogate(
    logp: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    policy: PolicyKind = "ppo",
    clip: tuple[float, float] = (0.2, 0.2),
    clip_ratio_c: float = 0.0,
    tau: tuple[float, float] = (1.0, 1.05),
    lengths: Sequence[int] | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token policy loss before the off-policy weight, the (detached) ratio it used and
    where its clip cut the gradient (1.0). ``old``: the log-prob the ratio is taken against;
    ``clip = (low, high)``: ratio kept in ``[1 - low, 1 + high]``. The formulas (verl 0.9.1
    ``core_algos.py`` / TRL 1.16 ``GRPOTrainer._compute_loss``, see docs/algorithms.md):

    - ``ppo``: ``-min(r A, clip(r) A)``; dual-clip (``clip_ratio_c > 0``): for ``A < 0`` at most
      ``-clip_ratio_c * A`` (no gradient beyond it).
    - ``gspo``: the same on ``s = exp(sg(mean_seq log r) + logp - sg(logp))``: the sequence's
      geometric-mean ratio as value, each token's own score as gradient (log ``s`` clamped at
      10, as verl). ``lengths`` and ``mask`` (trained tokens) define the sequences.
    - ``cispo``: ``-sg(clip(r)) * A * logp`` (the clipped ratio only weighs the score).
    - ``sapo``: ``-g(r) A`` with the gate ``g(r) = sigmoid(tau (r - 1)) * 4 / tau``, ``tau =
      tau[0]`` where ``A > 0``, else ``tau[1]``.

    ``cispo`` and ``sapo`` clamp ``log r`` to ``[-20, 20]`` first, as verl does.
    """
    lo, hi = clip
    if policy == "gspo":
        n = [len(logp)] if lengths is None else lengths
        m = torch.ones_like(logp) if mask is None else mask
        seq = seq_token_mean((logp - old).detach(), n, m)
        ratio = torch.exp(torch.clamp(logp - logp.detach() + seq, max=10.0))
    elif policy == "ppo":
        ratio = torch.exp(logp - old)
    else:
        ratio = torch.exp(torch.clamp(logp - old, min=-20.0, max=20.0))
    if policy in ("ppo", "gspo"):
        unclipped = ratio * adv
        clipped = ratio.clamp(1 - lo, 1 + hi) * adv
        loss = -torch.minimum(unclipped, clipped)
        cut = clipped < unclipped
        if clip_ratio_c > 0:
            over = (adv < 0) & (loss > -clip_ratio_c * adv)
            loss = torch.where(over, -clip_ratio_c * adv, loss)
            cut = cut | over
    elif policy == "cispo":
        weight = ratio.clamp(1 - lo, 1 + hi).detach()
        loss = -weight * adv * logp
        cut = weight != ratio.detach()
    elif policy == "sapo":
        t = torch.where(adv > 0, tau[0], tau[1]).to(ratio.dtype)
        loss = -torch.sigmoid(t * (ratio - 1.0)) * (4.0 / t) * adv
        cut = torch.zeros_like(adv, dtype=torch.bool)
    else:
        raise ValueError(f"unknown policy loss {policy!r} (allowed: ppo, gspo, cispo, sapo)")
    return loss, ratio.detach(), cut.float().detach()


def ppo_token_loss(
    logp: torch.Tensor,
    behav: torch.Tensor,
    adv: torch.Tensor,
    prox: torch.Tensor | None = None,
    clip_eps: float = 0.2,
    cap: float = 5.0,
    decoupled: bool = True,
    behav_clip_eps: float = 0.0,
    correction: Correction = "tis",
    band: tuple[float, float] = (0.5, 2.0),
    lengths: Sequence[int] | None = None,
    mask: torch.Tensor | None = None,
    policy: PolicyKind = "ppo",
    clip_high: float | None = None,
    clip_ratio_c: float = 0.0,
    tau: tuple[float, float] = (1.0, 1.05),
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token policy loss (shape of ``logp``) and detached per-token diagnostics: the
    :func:`policy_surrogate` of ``policy`` (clip range ``[1 - clip_eps, 1 + clip_high]``,
    ``clip_high`` None: ``clip_eps``) times the off-policy weight.

    ``decoupled=True``: ratio vs ``prox`` (default ``logp.detach()``), weighted by
    :func:`behaviour_weight` of ``exp(prox - behav)`` (``correction``, ``cap``, ``band``;
    ``lengths`` and ``mask`` for ``mis``); with ``behav_clip_eps = 0`` this is the
    ``on-policy`` objective (``behav=prox``: no correction at all).
    ``decoupled=False``: ratio vs ``behav``, weight 1. Diagnostics: ``ratio`` (current/old),
    ``clipped`` (1 where clipping cut the gradient), ``imp_weight`` (untruncated
    exp(prox - behav)), ``truncated`` (1 where the weight hit the cap), ``behav_clipped``
    (1 where the behaviour-side trust region ``behav_clip_eps > 0`` zeroed the weight),
    ``rejected`` (1 where ``mis``/``icepop`` rejected the token).
    """
    if prox is None:
        prox = logp.detach()
    if decoupled:
        how = (correction, cap, band, behav_clip_eps)
        raw, weight, flags = _decoupled_weight(logp, prox, behav, adv, how, lengths, mask)
    else:
        raw, weight, flags = _plain_weight(logp, behav)
    old = prox if decoupled else behav
    high = clip_eps if clip_high is None else clip_high
    surrogate, ratio, cut = policy_surrogate(
        logp, old, adv, policy, (clip_eps, high), clip_ratio_c, tau, lengths, mask
    )
    loss = weight * surrogate
    return loss, {"ratio": ratio, "clipped": cut, "imp_weight": raw, **flags}


def _decoupled_weight(
    logp: torch.Tensor,
    prox: torch.Tensor,
    behav: torch.Tensor,
    adv: torch.Tensor,
    how: tuple[Correction, float, tuple[float, float], float],
    lengths: Sequence[int] | None,
    mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`ppo_token_loss`'s off-policy side when decoupled: ``raw = exp(prox - behav)``
    (detached), the weight on each token's surrogate (``how`` = correction, cap, band,
    behav_clip_eps) and the detached per-token 0/1 diagnostics ``truncated``,
    ``behav_clipped`` and ``rejected``."""
    correction, cap, band, behav_clip_eps = how
    raw = torch.exp(prox - behav).detach()
    weight, rejected = behaviour_weight(raw, correction, cap, band, lengths, mask)
    # the metric: rounding is no truncation; icepop has no cap, only its band
    if correction == "icepop":
        truncated = torch.zeros_like(logp)
    else:
        truncated = (raw > cap * _TRUNCATED_BY).float() * (1.0 - rejected)
    behav_clipped = torch.zeros_like(logp)
    if behav_clip_eps > 0:
        out = ((adv > 0) & (raw > 1 + behav_clip_eps)) | ((adv < 0) & (raw < 1 - behav_clip_eps))
        behav_clipped = out.float()
        weight = weight * (1.0 - behav_clipped)
    flags = {"truncated": truncated, "behav_clipped": behav_clipped, "rejected": rejected}
    return raw, weight, {k: v.detach() for k, v in flags.items()}


def _plain_weight(
    logp: torch.Tensor, behav: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`ppo_token_loss`'s off-policy side when not decoupled: the untruncated
    ``exp(logp - behav)`` for the diagnostics, weight 1 and no token flagged."""
    flags = {k: torch.zeros_like(logp) for k in ("truncated", "behav_clipped", "rejected")}
    return torch.exp(logp.detach() - behav), torch.ones_like(logp), flags


def kl_k3(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate ``exp(ref - logp) - (ref - logp) - 1`` (>= 0, unbiased)."""
    d = ref - logp
    return torch.exp(d) - d - 1.0


def entropy_surrogate(logp: torch.Tensor) -> torch.Tensor:
    """Per-token surrogate whose gradient is the score-function estimate of the entropy's.

    Its value is ``-logp`` (the sampled entropy estimate); its gradient is
    ``-logp * grad(logp)``, whose expectation under the sampling policy is grad H.
    """
    h = -logp.detach()
    return h + h * (logp - logp.detach())


def value_token_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``0.5 * max((v - R)^2, (v_clipped - R)^2)`` and where the clipped term won.

    ``v_clipped = old + clamp(v - old, -clip, clip)``; ``clip <= 0`` disables clipping.
    """
    err = (values - returns) ** 2
    if clip <= 0:
        return 0.5 * err, torch.zeros_like(err)
    v_clip = old_values + (values - old_values).clamp(-clip, clip)
    err_clip = (v_clip - returns) ** 2
    return 0.5 * torch.maximum(err, err_clip), (err_clip > err).float().detach()


def aggregation_weight(mask: torch.Tensor, agg: Aggregation) -> torch.Tensor:
    """Token weights of one sequence for the engine's ``sum(loss * w) / sum(w)`` reduction.

    ``token-mean``, ``token-sum-norm`` and ``seq-mean-token-sum``: the mask (the latter two
    rescale the loss itself, :attr:`PolicyLoss.scale`);
    ``seq-mean``: mask / trained tokens, so every sequence weighs 1.
    """
    if agg == "seq-mean":
        return mask / mask.sum().clamp(min=1.0)
    return mask


def _cat(mb: Sequence[Seq], name: str, device: torch.device) -> torch.Tensor:
    """Field ``name`` of every sequence of a micro-batch, concatenated, on ``device``."""
    return torch.cat([s.fields[name] for s in mb]).to(device)


class PolicyLoss:
    """The actor's LossFn: clipped surrogate (+ KL to reference, - entropy bonus).

    Reads per-sequence fields ``behav``, ``adv``, ``mask`` and optionally ``prox``, ``ref``
    and ``entropy_keep`` (1.0 on the tokens top-entropy selection keeps: the others' loss is
    zeroed, they stay in the normaliser). ``policy``, ``clip_high``, ``clip_ratio_c`` and
    ``tau``: the policy loss of :func:`policy_surrogate`. ``correction`` and ``band`` (that
    correction's band): the off-policy correction of the ``decoupled`` and ``on-policy``
    objectives (:func:`behaviour_weight`);
    ``reject_norm``: whether a token it rejects stays in the normaliser (``all``) or leaves
    it (``kept``: then every sequence needs its ``prox`` field, see :attr:`needs_prox`).
    ``scale`` multiplies the loss (``token-sum-norm`` sets it per step to counted tokens /
    (sequences x max length), ``seq-mean-token-sum`` to counted tokens / sequences). Stats
    are sums over trained tokens;
    ``extrema`` keeps the step's min/max importance weight and ratio (reset by the caller).
    """

    def __init__(
        self,
        objective: Objective,
        clip_eps: float,
        cap: float,
        agg: Aggregation = "token-mean",
        kl_coef: float = 0.0,
        entropy_coef: float = 0.0,
        behav_clip_eps: float = 0.0,
        correction: Correction = "tis",
        band: tuple[float, float] = (0.5, 2.0),
        reject_norm: RejectNorm = "all",
        policy: PolicyKind = "ppo",
        clip_high: float | None = None,
        clip_ratio_c: float = 0.0,
        tau: tuple[float, float] = (1.0, 1.05),
    ):
        self.objective = objective
        self.policy: PolicyKind = policy
        self.clip_high = clip_high
        self.clip_ratio_c = clip_ratio_c
        self.tau = tau
        self.correction: Correction = correction
        self.band = band
        self.reject_norm: RejectNorm = reject_norm
        self.clip_eps = clip_eps
        self.cap = cap
        self.agg = agg
        self.kl_coef = kl_coef
        self.entropy_coef = entropy_coef
        self.behav_clip_eps = behav_clip_eps
        self.scale = 1.0
        self.extrema: dict[str, float] = {}

    @property
    def needs_prox(self) -> bool:
        """True when :meth:`token_weight` needs each sequence's ``prox`` (the trainer's
        log-probs at the start of the step) before the forward pass: ``reject_norm = "kept"``
        with a correction that rejects, on an objective that applies it."""
        rejects = self.correction in ("mis", "icepop")
        return self.reject_norm == "kept" and rejects and self.objective != "naive"

    def trained_mask(self, seq: Seq) -> torch.Tensor:
        """The tokens the normaliser counts: the loss mask, less the tokens the correction
        rejects when :attr:`needs_prox` (a rejected token then counts as masked)."""
        mask = seq.fields["mask"]
        if not self.needs_prox:
            return mask
        if "prox" not in seq.fields:
            raise ValueError("algo.behav_reject_norm='kept' needs the prox field of every seq")
        rho = torch.exp(seq.fields["prox"] - seq.fields["behav"]).to(mask.dtype)
        _, rejected = behaviour_weight(rho, self.correction, self.cap, self.band, None, mask)
        return mask * (1.0 - rejected)

    def token_weight(self, seq: Seq) -> torch.Tensor:
        return aggregation_weight(self.trained_mask(seq), self.agg)

    def __call__(
        self, logp: torch.Tensor, mb: Sequence[Seq]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        def cat(name: str) -> torch.Tensor:
            return _cat(mb, name, logp.device)

        behav, adv, mask = cat("behav"), cat("adv"), cat("mask")
        prox = cat("prox") if all("prox" in s.fields for s in mb) else logp.detach()
        corrected = self.objective != "naive"  # decoupled and on-policy: prox/behav weighted
        trust = self.behav_clip_eps if self.objective == "decoupled" else 0.0
        lengths = [len(s.fields["behav"]) for s in mb]
        loss, info = ppo_token_loss(
            logp, behav, adv, prox, self.clip_eps, self.cap, corrected,
            trust, self.correction, self.band, lengths, mask,
            self.policy, self.clip_high, self.clip_ratio_c, self.tau,
        )  # fmt: skip
        if all("entropy_keep" in s.fields for s in mb):  # top-entropy token selection
            keep = cat("entropy_keep")
            loss = loss * keep
        old = behav if self.objective == "naive" else prox  # what the ratio is taken against
        stats = {
            "pg_loss_sum": (loss.detach() * mask).sum(),
            "tokens": mask.sum(),
            "clip_frac_sum": (info["clipped"] * mask).sum(),
            "imp_weight_sum": (info["imp_weight"] * mask).sum(),
            "imp_truncated_sum": (info["truncated"] * mask).sum(),
            "behav_clip_frac_sum": (info["behav_clipped"] * mask).sum(),
            "approx_kl_sum": (0.5 * (logp.detach() - old) ** 2 * mask).sum(),
            "behav_kl_sum": ((behav - prox) * mask).sum(),
            "behav_rejected_frac_sum": (info.get("rejected", torch.zeros_like(mask)) * mask).sum(),
            # train/inference mismatch: the engine's log-probs vs the trainer's recomputation
            "mismatch_abs_logp_sum": ((prox - behav).abs() * mask).sum(),
            "mismatch_k3_kl_sum": (kl_k3(behav, prox).clamp(min=0.0) * mask).sum(),
            "entropy_sum": (-logp.detach() * mask).sum(),
        }
        if all("entropy_keep" in s.fields for s in mb):
            stats["entropy_kept_frac_sum"] = (keep * mask).sum()
        if self.kl_coef > 0:
            kl = kl_k3(logp, cat("ref"))
            loss = loss + self.kl_coef * kl
            stats["kl_ref_sum"] = (kl.detach() * mask).sum()
        if self.entropy_coef > 0:
            loss = loss - self.entropy_coef * entropy_surrogate(logp)
        self._track(info, mask)
        return loss * self.scale, stats

    def _track(self, info: dict[str, torch.Tensor], mask: torch.Tensor) -> None:
        on = mask > 0
        if not bool(on.any()):
            return
        for name in ("imp_weight", "ratio"):
            vals = info[name][on]
            hi, lo = float(vals.max()), float(vals.min())
            self.extrema[f"{name}_max"] = max(self.extrema.get(f"{name}_max", hi), hi)
            self.extrema[f"{name}_min"] = min(self.extrema.get(f"{name}_min", lo), lo)


class ValueLoss:
    """The critic's LossFn: clipped squared error of the values against the returns.

    Receives the critic's per-token values in place of log-probs; reads fields
    ``old_values``, ``returns`` and ``mask``. Token-mean over the batch, times ``coef``.
    """

    def __init__(self, clip: float, coef: float = 0.5):
        self.clip = clip
        self.coef = coef

    def token_weight(self, seq: Seq) -> torch.Tensor:
        return seq.fields["mask"]

    def __call__(
        self, values: torch.Tensor, mb: Sequence[Seq]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        def cat(name: str) -> torch.Tensor:
            return _cat(mb, name, values.device)

        old, ret, mask = cat("old_values"), cat("returns"), cat("mask")
        loss, clipped = value_token_loss(values, old, ret, self.clip)
        stats = {
            "vf_loss_sum": (loss.detach() * mask).sum(),
            "vf_tokens": mask.sum(),
            "vf_clip_frac_sum": (clipped * mask).sum(),
        }
        return self.coef * loss, stats
