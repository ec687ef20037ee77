"""The TrainEngine seam: one execution path for every way the trainer touches the model.

Contract (:class:`TrainEngine`, the compute side):

- ``forward_backward_batch(seqs, loss_fn, forward_only)`` splits ``seqs`` into
  micro-batches by a token budget (balanced; every rank runs the same number),
  runs input preparation -> model -> output preparation on each, and returns
  the per-token outputs of every sequence in the original order: for an actor
  the log-prob of each response token, for a critic the value predicted at the
  position that predicts each response token (float32, shape ``(response_len,)``
  either way; ``output="entropy"`` gives an actor's per-token entropy instead).
  With ``forward_only=False`` it also back-propagates ``loss_fn``'s
  loss, scaled so the accumulated gradient equals that of the whole batch
  (across all ranks) however it was split. ``loss_fn`` gets the outputs of one
  micro-batch concatenated, and copies of that micro-batch's ``Seq`` objects; a
  loss with ``needs_entropy = True`` finds each copy's per-token entropy (with
  grad) in ``fields["entropy"]``.
- ``train_batch`` = zero grads + forward_backward_batch + ``optimizer_step``;
  ``forward_batch`` = forward_backward_batch(forward_only=True).
- ``optimizer_step()`` clips gradients and returns ``{"grad_norm", "lr",
  "skipped"}``; a non-finite grad norm skips the update and reports ``skipped=1``.

Contract (:class:`EngineState`, the state side; every method is collective):

- ``named_weights()`` yields full (unsharded) tensors under Hugging Face names,
  gathered one FSDP unit (decoder layer) at a time, on every rank.
- ``save(dir)`` / ``load(dir)``: torch distributed checkpoint of model,
  optimizer, LR schedule, RNG and step; a checkpoint loads at any world size.
  ``save(dir, async_group)`` writes the files in the background over that
  (Gloo) group and returns a future that completes when they are complete;
  without a group it returns None once they are.
- ``export_hf(dir)`` writes a Hugging Face folder ``from_pretrained`` loads.
- ``offload()`` / ``onload()`` move parameters, gradients and optimizer state
  to CPU and back (a no-op on a CPU engine).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

__all__ = [
    "EngineState",
    "LossFn",
    "Role",
    "Seq",
    "TrainEngine",
    "TrainerEngine",
    "all_reduce_floats",
]

Role = Literal["actor", "critic"]
"""``actor``: outputs are response log-probs; ``critic``: per-token values."""


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
        self, out: torch.Tensor, mb: Sequence[Seq], /
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token loss of the micro-batch and summed stats. ``out`` is the engine's
        per-token output (log-probs, or values for a critic), response tokens concatenated
        in the order of ``mb``. Positional: each loss names ``out`` after what it holds."""
        ...


class TrainEngine(Protocol):
    """Compute side of a training engine (see the module docstring for the contract)."""

    def forward_backward_batch(
        self,
        seqs: Sequence[Seq],
        loss_fn: LossFn | None,
        forward_only: bool = False,
        output: Literal["logp", "entropy"] = "logp",
    ) -> tuple[list[torch.Tensor], dict[str, float]]: ...

    def train_batch(self, seqs: Sequence[Seq], loss_fn: LossFn) -> dict[str, float]: ...

    def forward_batch(
        self, seqs: Sequence[Seq], output: Literal["logp", "entropy"] = "logp"
    ) -> list[torch.Tensor]: ...

    def optimizer_step(self) -> dict[str, float]: ...


class EngineState(Protocol):
    """State side of a training engine: weights out, checkpoints, memory placement."""

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def save(
        self, path: str, async_group: dist.ProcessGroup | None = None
    ) -> Future[Any] | None: ...

    def load(self, path: str) -> None: ...

    def export_hf(self, path: str) -> None: ...

    def offload(self) -> None: ...

    def onload(self) -> None: ...


class TrainerEngine(TrainEngine, EngineState, Protocol):
    """A train engine as the trainer process holds it (``FSDPEngine`` is one): both sides,
    and the optimizer, on which the trainer hooks its wait for weight sync (the next
    optimizer step waits until the sender has read the weights)."""

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...


def all_reduce_floats(
    *values: float, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
) -> list[float]:
    """``values`` reduced with ``op`` (sum by default) over the ranks of the default process
    group, in float64; the values themselves on one process or without a group."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.tolist()
