"""The ``trainer`` and ``algo`` sections: optimisation and the RL objective."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from asyncrl.config.base import (
    _MAX,
    Finite,
    Fraction,
    NonNegative,
    NonNegativeFloat,
    OpenFraction,
    Positive,
    PositiveFloat,
    _Section,
)


class TrainerConfig(_Section, frozen=True):
    lr: Finite = 1.5e-3
    """AdamW learning rate."""
    weight_decay: Finite = 0.0
    """AdamW weight decay."""
    grad_clip: Finite = 1.0
    """Max global grad norm; <= 0 disables clipping."""
    micro_batch_tokens: Positive = 8192
    """Token budget of one micro-batch."""
    world_size: Positive = 1
    """Data-parallel trainer ranks (processes)."""
    device: str = "cpu"
    """``cpu`` (Gloo) or ``cuda`` (NCCL)."""
    threads: Positive = 1
    """torch intra-op threads per trainer rank on CPU."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """LR after warm-up: ``constant``, ``linear`` or ``cosine`` decay to ``lr * min_lr_ratio``."""
    warmup_steps: NonNegative = 0
    """Optimizer steps of linear LR warm-up from 0 to ``lr``."""
    decay_steps: NonNegative = 0
    """Steps (warm-up included) over which the LR decays; 0: ``controller.total_steps``."""
    min_lr_ratio: Fraction = 0.0
    """Final LR of the ``linear``/``cosine`` schedules as a fraction of ``lr``."""
    adam_betas: tuple[OpenFraction, OpenFraction] = (0.9, 0.99)
    """AdamW betas."""
    mixed_precision: Literal["none", "bf16"] = "none"
    """FSDP2 compute dtype: ``bf16`` runs forward/backward in bfloat16 over the master
    parameters (dtype ``model.dtype``) and reduces gradients in float32."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward (less memory, ~30% more compute)."""
    packing: Literal["auto", "on", "off"] = "auto"
    """Padding-free micro-batches (sequences packed in one row, position ids restarting at 0).
    ``auto``: per micro-batch, packed where the attention backend supports it and that costs
    less compute than padding (SDPA/eager attend over a packed row's every token: many short
    sequences go padded; FlashAttention varlen and flex attention always pack)."""
    max_restarts: NonNegative = 2
    """A trainer rank that dies restarts every rank from the last checkpoint (the steps
    after it are trained again, exactly once) at most this many times per run; 0: a trainer
    death ends the run."""
    reshard_after_forward: bool | None = None
    """FSDP2: free gathered parameters after forward (ZeRO-3); False keeps them until backward.
    None: True when more than one rank shares the model, False at world size 1."""


class AlgoConfig(_Section, frozen=True):
    name: Literal["grpo", "ppo"] = "grpo"
    """RL algorithm. ``grpo``: group-relative advantages, no critic. ``ppo``: a critic (value
    model from the same checkpoint) and GAE advantages."""
    group_size: Positive = 8
    """Samples per prompt (GRPO group; PPO samples each prompt this many times too)."""
    clip_eps: PositiveFloat = 0.2
    """PPO clip range of the surrogate objective."""
    norm_adv_by_std: bool = True
    """GRPO: divide group-centred advantages by the group's std (off = Dr.GRPO's unbiased form)."""
    behav_imp_weight_cap: Annotated[float, msgspec.Meta(ge=1, le=_MAX)] = 1.0
    """Cap of the importance weight proximal/behaviour (>= 1). 1 (V-trace style) only
    down-weights tokens the policy has moved away from and never amplifies stale ones."""
    decoupled: bool = True
    """Decoupled off-policy objective: clip against the proximal policy (the trainer's weights at
    the start of the step), weighted by the truncated ratio proximal/behaviour. Used when
    ``controller.max_staleness > 0``; at 0 the plain on-policy objective is used. ``False``:
    naive PPO clipped against the behaviour policy (the ablation)."""
    loss_agg: Literal["token-mean", "seq-mean", "token-sum-norm"] = "token-mean"
    """Loss aggregation. ``token-mean``: mean over every trained token of the batch;
    ``seq-mean``: mean over sequences of each sequence's token mean; ``token-sum-norm``:
    token sum over (sequences x max_new_tokens), Dr.GRPO's length-unbiased constant norm."""
    epochs: Positive = 1
    """Passes over each batch (the proximal policy is recomputed first when > 1 update)."""
    num_minibatches: Positive = 1
    """Optimizer steps per pass; the batch is split into this many minibatches."""
    kl_coef: NonNegativeFloat = 0.0
    """Weight of the KL penalty (k3 estimator) to the frozen initial model; 0 builds no
    reference model."""
    entropy_coef: NonNegativeFloat = 0.0
    """Weight of the entropy bonus (sample estimate -log p of the trained tokens)."""
    gamma: Fraction = 1.0
    """PPO: discount of GAE."""
    lam: Fraction = 0.95
    """PPO: GAE lambda."""
    whiten_adv: bool = True
    """PPO: normalise advantages to zero mean, unit std over the batch's trained tokens."""
    value_clip: Finite = 0.2
    """PPO: clip range of the value update around the old values; <= 0 disables it."""
    value_coef: NonNegativeFloat = 0.5
    """PPO: scale of the squared-error value loss."""
    critic_lr: NonNegativeFloat = 0.0
    """PPO: learning rate of the critic; 0 uses ``trainer.lr``."""
    critic_warmup_steps: NonNegative = 0
    """PPO: first steps that train only the critic (the actor is held)."""
    behav_correction: Literal["tis", "mis", "icepop"] = "tis"
    """Off-policy correction on the per-token ratio rho = proximal / behaviour (the trainer's
    log-prob of the sampled token at the start of the step over the engine's): staleness and
    the engine/trainer numerical mismatch together. Applied by the ``decoupled`` objective and
    the ``on-policy`` one (staleness 0: rho is then the pure mismatch, ~1 on the embedded
    engine, not on SGLang/vLLM); not by ``naive`` (``decoupled = false``), whose clipped ratio
    against the behaviour policy is its only correction. ``tis``: weight ``min(rho,
    behav_imp_weight_cap)`` (truncated IS). ``mis``: the same, but a sequence whose
    geometric-mean rho lies outside ``[behav_mis_low, behav_mis_high]`` gets weight 0 (masked
    IS: IS plus rejection, verl's mask mode). ``icepop``: weight ``rho`` inside
    ``[behav_icepop_low, behav_icepop_high]`` and 0 outside it, token by token (IcePop). See
    docs/algorithms.md."""
    behav_mis_low: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.5
    """``mis``: lower end of the accepted geometric-mean ratio (0 < this <= 1). 0.5 and 2 are
    slime's MIS defaults (examples/train_infer_mismatch_helper/mis.yaml: ``mis_lower_bound``,
    ``mis_upper_bound``); the far tighter bands of verl's/slime's geometric rejection presets
    for pure engine mismatch (1 +- 1e-4 ... 1e-3) would reject every stale sequence here."""
    behav_mis_high: Annotated[float, msgspec.Meta(ge=1, le=_MAX)] = 2.0
    """``mis``: upper end of the accepted geometric-mean ratio (>= 1)."""
    behav_icepop_low: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.5
    """``icepop``: lower end of the accepted per-token ratio (0 < this <= 1): IcePop's alpha
    = 0.5 (Ring-1T report, arXiv 2510.18855, and its IcePop write-up)."""
    behav_icepop_high: Annotated[float, msgspec.Meta(ge=1, le=_MAX)] = 5.0
    """``icepop``: upper end of the accepted per-token ratio (>= 1): IcePop's beta = 5."""
    behav_reject_norm: Literal["all", "kept"] = "all"
    """``mis``/``icepop``: what the loss's normaliser counts. ``all`` (default): every trained
    token, a rejected one as a zero (IcePop's ``1/|y|``): the step shrinks by the rejected
    share, and no extra pass is needed. ``kept``: only the tokens the correction kept, a
    rejected token counting as masked (verl's rejection sampling: rejected tokens leave the
    denominator); it needs the trainer's log-probs before the update, i.e. one extra forward
    pass per step when ``epochs x num_minibatches = 1``. ``token-sum-norm``'s constant
    normaliser is the same either way."""
    behav_clip_eps: OpenFraction = 0.2
    """Decoupled objective: behaviour-side trust region. A token whose proximal/behaviour
    ratio is already above ``1 + this`` (positive advantage) or below ``1 - this`` (negative)
    gets no gradient, so stale samples do not push tokens the intervening updates already
    moved. 0 disables it. No effect on the ``on-policy`` (staleness 0) and ``naive`` objectives."""
