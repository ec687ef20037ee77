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
    lr: NonNegativeFloat = 1.5e-3
    """AdamW learning rate (>= 0, as AdamW takes it: a negative one is refused here, not by
    the trainer process at start)."""
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
    after it are trained again, exactly once) at most this many times in any
    ``restart_window_s``; one more failure in that window ends the run. 0: a trainer death
    ends the run."""
    restart_window_s: NonNegativeFloat = 600.0
    """The window of ``max_restarts`` (a rate, so a run of any length survives faults that
    come no faster than it allows); 0: ``max_restarts`` per run."""
    reshard_after_forward: bool | None = None
    """FSDP2: free gathered parameters after forward (ZeRO-3); False keeps them until backward.
    None: True when more than one rank shares the model, False at world size 1."""


class AlgoConfig(_Section, frozen=True):
    name: Literal["grpo", "ppo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"] = (
        "grpo"
    )
    """RL algorithm, i.e. its advantage estimator (verl's ``algorithm.adv_estimator`` names).
    ``grpo``: group-relative advantages (``scale_rewards``), no critic. ``ppo``: a critic (value
    model from the same checkpoint) and GAE advantages. ``rloo``: reward minus the mean of the
    other samples of its group (RLOO). ``reinforce_plus_plus``: discounted return (``gamma``)
    whitened over the batch's trained tokens (REINFORCE++). ``reinforce_plus_plus_baseline``:
    reward minus its group's mean, whitened over the batch's trained tokens. The last three
    need no critic. See docs/algorithms.md."""
    group_size: Positive = 8
    """Samples per prompt (GRPO group; PPO samples each prompt this many times too)."""
    clip_eps: PositiveFloat = 0.2
    """PPO clip range of the surrogate objective."""
    norm_adv_by_std: bool = True
    """GRPO: divide group-centred advantages by a std (``scale_rewards`` says which); off is
    ``scale_rewards = "none"`` (Dr.GRPO's unbiased form)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """GRPO: the std the group-centred advantages are divided by (TRL's ``scale_rewards``):
    ``group`` (the group's), ``batch`` (the std of the rank's whole batch of rewards, Lite
    PPO), ``none`` (no scaling, Dr.GRPO). Sample (Bessel) std, as verl and TRL. Only
    ``algo.name = "grpo"`` uses it; ``norm_adv_by_std = false`` means ``none``."""
    behav_imp_weight_cap: Annotated[float, msgspec.Meta(ge=1, le=_MAX)] = 1.0
    """Cap of the importance weight proximal/behaviour (>= 1). 1 (V-trace style) only
    down-weights tokens the policy has moved away from and never amplifies stale ones."""
    decoupled: bool = True
    """Decoupled off-policy objective: clip against the proximal policy (the trainer's weights at
    the start of the step), weighted by the truncated ratio proximal/behaviour. Used when
    ``controller.max_staleness > 0``; at 0 the plain on-policy objective is used. ``False``:
    naive PPO clipped against the behaviour policy (the ablation)."""
    loss_agg: Literal["token-mean", "seq-mean", "token-sum-norm", "seq-mean-token-sum"] = (
        "token-mean"
    )
    """Loss aggregation. ``token-mean``: mean over every trained token of the batch;
    ``seq-mean``: mean over sequences of each sequence's token mean; ``token-sum-norm``:
    token sum over (sequences x max_new_tokens), Dr.GRPO's length-unbiased constant norm;
    ``seq-mean-token-sum``: token sum over sequences (verl's name; with ``policy_loss =
    "gspo"`` this is LUSPO, TRL's ``loss_type = "luspo"``)."""
    policy_loss: Literal["ppo", "gspo", "cispo", "sapo"] = "ppo"
    """The policy loss (verl's ``policy_loss.loss_mode``). ``ppo``: the clipped surrogate
    (``clip_eps``/``clip_eps_low``/``clip_eps_high``, dual-clip ``clip_ratio_c``). ``gspo``: the
    same clip on the sequence-level ratio ``exp(mean_t log ratio)`` (GSPO). ``cispo``: the
    detached clipped ratio times the advantage times the log-prob (CISPO). ``sapo``: a smooth
    sigmoid gate of the ratio instead of a clip (``sapo_tau_pos/neg``; SAPO; needs
    ``loss_agg = "seq-mean"``). Each is weighted by the off-policy correction
    (``behav_correction``) token by token. See docs/algorithms.md."""
    clip_eps_low: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0
    """Lower clip range (ratio >= 1 - this) of ``ppo``, ``gspo`` and ``cispo``; 0: ``clip_eps``.
    1 removes the lower bound (TRL's CISPO clips only from above)."""
    clip_eps_high: NonNegativeFloat = 0.0
    """Upper clip range (ratio <= 1 + this), "clip-higher" (DAPO: 0.28); 0: ``clip_eps``. For
    ``cispo`` TRL's ``epsilon_high`` (an absolute bound, 5 recommended) is 1 + this."""
    clip_ratio_c: NonNegativeFloat = 0.0
    """Dual-clip PPO (Ye et al. 2020; verl's ``clip_ratio_c``): for a negative advantage the
    token loss is at most ``-clip_ratio_c * A``. 0 disables it (verl's default is 3); else
    > 1. Only ``policy_loss = "ppo"``."""
    sapo_tau_pos: PositiveFloat = 1.0
    """``sapo``: gate temperature of tokens with a positive advantage (verl/TRL default 1)."""
    sapo_tau_neg: PositiveFloat = 1.05
    """``sapo``: gate temperature of the other tokens (verl/TRL default 1.05)."""
    mask_truncated: bool = False
    """Leave responses that hit the token budget (finish reason ``length``) out of the loss
    and its normaliser (DAPO's overlong filtering; TRL's ``mask_truncated_completions``).
    Their rewards still count in the group baselines."""
    overlong_buffer_len: NonNegative = 0
    """DAPO's overlong reward shaping: a response longer than ``max_new_tokens - this`` loses
    ``(length - (max_new_tokens - this)) / this * overlong_penalty_factor`` of reward, linearly
    up to the budget (verl's ``overlong_buffer.len``; the trainer shapes the reward the
    advantage is computed from, the logged ``reward_mean`` stays the task's). 0: off."""
    overlong_penalty_factor: NonNegativeFloat = 1.0
    """DAPO's overlong shaping: the penalty at the budget (verl's
    ``overlong_buffer.penalty_factor``)."""
    filter_groups: bool = False
    """DAPO's dynamic sampling in the controller: a finished group whose rewards are all equal
    (no signal for a group baseline) is dropped before it reaches the trainer; its staleness
    slot is released, so admission refills the batch from running and new groups. Counted per
    step as ``filtered_groups`` (verl's ``algorithm.filter_groups``, metric ``acc``/reward)."""
    filter_max_groups: NonNegative = 0
    """Dynamic sampling's cap: at most this many groups are dropped per step (verl's
    ``max_num_gen_batches``, in groups); past it the step takes uniform groups too rather than
    make the trainer wait longer. 0: ``10 x controller.batch_size``."""
    top_entropy_quantile: Fraction = 1.0
    """Keep in the policy loss only the tokens whose entropy is in this top quantile of the
    rank's batch (Wang et al. 2025, "Beyond the 80/20 rule": 0.2; TRL's
    ``top_entropy_quantile``); the others stay in the normaliser as zeros. 1 keeps all (no
    extra pass); below 1 costs one no-grad forward pass per step for the entropies."""
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

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.clip_ratio_c and self.clip_ratio_c <= 1:
            raise ValueError(
                f"algo.clip_ratio_c ({self.clip_ratio_c}) must be > 1 (dual-clip bound) or 0 (off)"
            )
        if self.clip_ratio_c and self.policy_loss != "ppo":
            raise ValueError(
                f"algo.clip_ratio_c (dual-clip) applies to algo.policy_loss='ppo' only, not "
                f"{self.policy_loss!r}: the bound is defined on the clipped token surrogate "
                "(verl's gspo/cispo/sapo losses ignore it); set algo.clip_ratio_c=0"
            )
        if self.policy_loss == "sapo" and self.loss_agg != "seq-mean":
            raise ValueError(
                f"algo.policy_loss='sapo' aggregates per sequence (verl and TRL fix it): set "
                f"algo.loss_agg='seq-mean' (got {self.loss_agg!r})"
            )
        if self.scale_rewards != "group" and not self.norm_adv_by_std:
            raise ValueError(
                "algo.norm_adv_by_std=false is algo.scale_rewards='none'; set one of them only"
            )
        if self.scale_rewards != "group" and self.name != "grpo":
            raise ValueError(
                f"algo.scale_rewards={self.scale_rewards!r} applies to algo.name='grpo' only, "
                f"not {self.name!r} (its estimator fixes its own normalisation)"
            )

    def grpo_scale(self) -> Literal["group", "batch", "none"]:
        """The effective ``scale_rewards`` (``none`` when ``norm_adv_by_std`` is off)."""
        return self.scale_rewards if self.norm_adv_by_std else "none"

    def clip_range(self) -> tuple[float, float]:
        """``(low, high)`` clip ranges: ``clip_eps_low/high``, or ``clip_eps`` where 0."""
        return (self.clip_eps_low or self.clip_eps, self.clip_eps_high or self.clip_eps)
