"""The TrainEngine seam: one execution path for every way the trainer touches the model.

Contract:

- ``forward_backward_batch(seqs, loss_fn, forward_only)`` splits ``seqs`` into
  micro-batches by a token budget, runs input preparation -> model -> output
  preparation on each, and returns the per-token outputs (response log-probs)
  of every sequence in the original order. With ``forward_only=False`` it also
  back-propagates ``loss_fn``'s loss, scaled so the accumulated gradient equals
  that of the whole batch (across ranks) however it was split.
- ``train_batch`` = forward_backward_batch + ``optimizer_step``;
  ``forward_batch`` = forward_backward_batch(forward_only=True).
- ``optimizer_step()`` clips gradients and returns ``{"grad_norm", "lr"}``; a
  non-finite grad norm skips the update and reports ``skipped = 1``.
- ``named_weights()`` yields full (unsharded) tensors under Hugging Face names,
  one at a time, on every rank (it is collective under sharding).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

__all__ = ["LossFn", "Seq", "TrainEngine"]


@dataclass
class Seq:
    """One sequence for the trainer: prompt + response ids and per-response-token fields."""

    input_ids: torch.Tensor  # (prompt_len + response_len,) int64
    prompt_len: int
    fields: dict[str, torch.Tensor] = field(default_factory=dict)  # each (response_len,)

    @property
    def response_len(self) -> int:
        return len(self.input_ids) - self.prompt_len


class LossFn(Protocol):
    """A token-level loss. The engine back-propagates ``sum(loss * weight) / W`` where
    ``W`` is the sum of ``token_weight`` over the whole batch on every rank, so the
    gradient does not depend on how the batch was split."""

    def token_weight(self, seq: Seq) -> torch.Tensor:
        """Weight of each response token of ``seq`` (mask for token-mean, mask/len for seq-mean)."""
        ...

    def __call__(
        self, logp: torch.Tensor, mb: Sequence[Seq]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token loss of the micro-batch (response tokens concatenated) and summed stats."""
        ...


class TrainEngine(Protocol):
    def forward_backward_batch(
        self, seqs: Sequence[Seq], loss_fn: LossFn | None, forward_only: bool = False
    ) -> tuple[list[torch.Tensor], dict[str, float]]: ...

    def train_batch(self, seqs: Sequence[Seq], loss_fn: LossFn) -> dict[str, float]: ...

    def forward_batch(self, seqs: Sequence[Seq]) -> list[torch.Tensor]: ...

    def optimizer_step(self) -> dict[str, float]: ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]: ...
