"""The ``eval`` section: evaluation on held-out prompts during training
(:mod:`asyncrl.controllers.evaluation`)."""

from __future__ import annotations

from asyncrl.config.base import NonNegative, NonNegativeFloat, Positive, _Section
from asyncrl.config.task import DataSource


class EvalConfig(_Section, frozen=True):
    every_steps: NonNegative = 0
    """Evaluate the weights of every this-many-th step (0: never periodically). An eval runs on
    the same engines beside training, never blocks it, never counts toward staleness and never
    trains; its metrics go to metrics.jsonl as one row with ``eval/...`` keys."""
    before_train: bool = False
    """Evaluate the initial weights (version 0) as training starts (not on a resumed run)."""
    at_end: bool = False
    """Evaluate the final weights once the last step is trained."""
    path: str = ""
    """Held-out prompts: a local ``.jsonl`` / ``.parquet`` file or ``datasets`` folder in the
    training task's format (``math``: the ``task.prompt_key`` / ``task.answer_key`` columns).
    Empty: the built-in task's own eval split (``reverse``: a prompt stream seeded apart from
    training's, ``task.seed + 1000003``; ``math``: needs ``path`` or ``sources``)."""
    sources: list[DataSource] = []
    """Several held-out sources instead of ``path`` (as ``task.sources``): the eval's prompts
    are drawn from them by weight, and each eval also reports ``eval/<source>/...`` per
    source (``reward_mean``, ``pass@1``, ``pass@k``, ``response_len``, ``num_prompts``)."""
    num_prompts: Positive = 32
    """Prompts per eval (the first ones of the source, the same every eval)."""
    k: Positive = 4
    """Sampled responses per prompt (``temperature``): pass@1 and pass@k come from them with
    the unbiased estimator (Chen et al. 2021) over these ``k`` samples."""
    greedy: bool = True
    """Also one greedy (temperature 0) response per prompt: ``eval/greedy_*`` metrics."""
    temperature: NonNegativeFloat = 1.0
    """Sampling temperature of the ``k`` samples."""
    max_new_tokens: NonNegative = 0
    """Generation budget per response; 0: the training budget (``generation_budget()``)."""
    pass_threshold: NonNegativeFloat = 1.0
    """A response passes when its reward is at least this (1: fully right; the reverse task's
    reward is partial credit)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.path and self.sources:
            raise ValueError("eval.path and eval.sources are exclusive: give one or the other")

    @property
    def enabled(self) -> bool:
        return bool(self.every_steps or self.before_train or self.at_end)
