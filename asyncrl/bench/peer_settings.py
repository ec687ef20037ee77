"""``asyncrl bench peer``'s settings: TRL's arguments from asyncrl's config, and the table.

The TRL side gets every setting from the asyncrl config the asyncrl side runs with
(:func:`trl_args`); the table (:func:`settings_table`) prints both sides' values, asyncrl's
read from its config and TRL's read back from TRL's own ``GRPOConfig`` and optimizer in the
TRL process, marks the rows that differ and lists every difference that remains, including
the ones of structure no single value shows (asynchrony, the off-policy objective, where
generation runs).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from asyncrl.config import RunConfig
from asyncrl.config.task import ReverseTaskConfig

__all__ = ["TRL_VERSION", "check_trl", "settings_table", "trl_args"]

TRL_VERSION = "1.16.0"
"""The TRL the bench was written against (``asyncrl[peer]`` pins it)."""


def check_trl() -> None:
    """SystemExit naming the install command when TRL or ``datasets`` is not importable."""
    missing = [m for m in ("trl", "datasets") if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(
            f"asyncrl bench peer runs TRL's GRPOTrainer: {', '.join(missing)} not installed "
            "(pip install 'asyncrl[peer]')"
        )


def trl_args(cfg: RunConfig, model_dir: str) -> list[str]:
    """``asyncrl.bench.peer_trl``'s flags for the job ``cfg`` describes."""
    tc, algo = cfg.trainer, cfg.algo
    if not isinstance(cfg.task, ReverseTaskConfig):
        raise ValueError(f"bench peer runs the default job's reverse task, not {cfg.task.name!r}")
    return [
        f"--model-dir={model_dir}",
        f"--prompts={cfg.controller.batch_size}",
        f"--group-size={algo.group_size}",
        f"--num-digits={cfg.task.num_digits}",
        f"--max-new-tokens={cfg.generation_budget()}",
        f"--lr={tc.lr}",
        "--betas",
        *(str(b) for b in tc.adam_betas),
        f"--weight-decay={tc.weight_decay}",
        f"--grad-clip={tc.grad_clip}",
        f"--clip-eps={algo.clip_eps}",
    ]


def _rows(cfg: RunConfig, trl: dict[str, Any], threads: list[int]) -> list[tuple[str, Any, Any]]:
    """(setting, asyncrl's value, TRL's value); values equal where the two sides agree."""
    tc, algo, ro = cfg.trainer, cfg.algo, cfg.rollout
    prompts = trl["generation_batch_size"] // trl["num_generations"]
    low = algo.clip_eps_low or algo.clip_eps
    return [
        ("model", "tiny Qwen2 (built locally)", "the same folder"),
        ("dtype", cfg.model.dtype, trl["dtype"]),
        ("prompts per step", cfg.controller.batch_size, prompts),
        ("samples per prompt", algo.group_size, trl["num_generations"]),
        ("max new tokens", cfg.generation_budget(), trl["max_completion_length"]),
        ("temperature", ro.temperature, trl["temperature"]),
        ("top_p", ro.top_p, trl["top_p"]),
        ("top_k (0: off)", 0, trl["top_k"]),
        ("optimizer", "AdamW", trl["optimizer"]),
        ("learning rate", tc.lr, trl["learning_rate"]),
        ("lr schedule", tc.lr_schedule, trl["lr_scheduler_type"]),
        ("warm-up steps", tc.warmup_steps, 0),
        ("adam betas", list(tc.adam_betas), trl["optimizer_betas"]),
        ("adam eps", 1e-8, trl["optimizer_eps"]),
        ("weight decay", tc.weight_decay, trl["weight_decay"]),
        ("grad clip (max norm)", tc.grad_clip, trl["max_grad_norm"]),
        ("KL coefficient", algo.kl_coef, trl["beta"]),
        ("reference model", algo.kl_coef > 0, trl["ref_model"]),
        (
            "advantage",
            f"{algo.name}, std: {algo.scale_rewards}",
            f"grpo, std: {trl['scale_rewards']}",
        ),
        ("policy loss clip eps", low, trl["epsilon"]),
        ("loss aggregation", algo.loss_agg, f"token-mean ({trl['loss_type']})"),
        (
            "updates per batch",
            algo.epochs * algo.num_minibatches,
            trl["num_iterations"] * trl["steps_per_generation"],
        ),
        ("activation checkpointing", tc.activation_checkpointing, trl["gradient_checkpointing"]),
        ("max staleness (steps)", cfg.controller.max_staleness, 0),
        (
            "off-policy correction",
            f"decoupled, {algo.behav_correction} cap {algo.behav_imp_weight_cap:g}"
            if algo.decoupled
            else "none (naive)",
            "none (on-policy)",
        ),
        ("generation", f"{ro.backend} engine, own process", "HF generate, trainer process"),
        ("torch threads", f"engine 1 + trainer {tc.threads}", " or ".join(map(str, threads))),
    ]


def settings_table(
    cfg: RunConfig, trl: dict[str, Any], threads: list[int]
) -> tuple[str, list[str]]:
    """The printed table and the list of remaining differences (one sentence each)."""
    rows = _rows(cfg, trl, threads)
    width = max(len(r[0]) for r in rows)
    lines = [f"{'setting':<{width}}  {'asyncrl run':<34} {'TRL GRPOTrainer':<30}"]
    for name, ours, theirs in rows:
        mark = "" if _same(ours, theirs) else "  <- differs"
        lines.append(f"{name:<{width}}  {ours!s:<34} {theirs!s:<30}{mark}")
    return "\n".join(lines), _differences(cfg, trl, rows)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(float(a) - float(b)) <= 1e-12 * max(1.0, abs(float(a)))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b or b == "the same folder" or (a == "token-mean" and "(dapo)" in str(b))


def _differences(
    cfg: RunConfig, trl: dict[str, Any], rows: list[tuple[str, Any, Any]]
) -> list[str]:
    out = [
        f"{name}: asyncrl {ours}, TRL {theirs}"
        for name, ours, theirs in rows
        if not _same(ours, theirs) and name not in _EXPLAINED
    ]
    algo = cfg.algo
    if cfg.controller.max_staleness > 0:
        out.append(
            f"asynchrony: asyncrl trains a step on samples up to {cfg.controller.max_staleness} "
            "policy version(s) old while the engine generates the next ones; TRL generates "
            "each batch with the weights it then trains (on-policy, generation and training "
            "take turns)"
        )
    if algo.decoupled and cfg.controller.max_staleness > 0:
        out.append(
            f"objective: asyncrl's decoupled PPO (clip against the trainer's own log-probs at "
            f"the step's start, weighted by min(proximal/behaviour, "
            f"{algo.behav_imp_weight_cap:g}), behaviour-side trust region "
            f"{algo.behav_clip_eps:g}); TRL's clip is against the same log-probs, no "
            "behaviour weight (its batch is on-policy)"
        )
    out.append(
        "generation: asyncrl's embedded engine in its own process (batched decoding, the group's "
        "prompt prefilled once, 1 thread); TRL calls Hugging Face generate in the training "
        "process between optimizer steps"
    )
    out.append(
        f"optimizer kernels: asyncrl AdamW foreach=True; TRL optim={trl['optim']} (same update "
        "rule, other kernel)"
    )
    out.append(
        "prompts: the same stream (the reverse task's, seeded, in order); asyncrl's steps take "
        "the groups that finish first among those admitted, TRL's take the next 32 in order; "
        "sampling random streams differ"
    )
    out.append(
        f"threads: asyncrl runs two processes of one torch thread each (engine, trainer "
        f"threads {cfg.trainer.threads}); TRL runs one process with the stated thread count (2: "
        "the same two cores; 1: its training step at the trainer's thread count)"
    )
    out.append(
        "TRL computes each completion's entropy for its logs in every training forward (part "
        "of its measured training step); asyncrl computes none (entropy_coef 0)"
    )
    return out


_EXPLAINED = {"max staleness (steps)", "off-policy correction", "generation", "torch threads"}
