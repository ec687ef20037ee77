"""Wire types of the experience channel (controller -> trainer) and its control messages.

A :class:`Trajectory` is one finished episode. Its arrays (token ids, behaviour
log-probs, per-token versions, loss mask) never go through msgspec: the codec
sends them as separate zero-copy frames and describes them in a small header.
Everything else is a tagged, array-like msgspec Struct.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

__all__ = [
    "ARRAY_FIELDS",
    "Shutdown",
    "StepDone",
    "TrainBatch",
    "Trajectory",
]

# name -> dtype of every per-trajectory array; the codec relies on this order.
ARRAY_FIELDS: dict[str, np.dtype] = {
    "prompt_ids": np.dtype(np.int32),
    "response_ids": np.dtype(np.int32),
    "behav_logprobs": np.dtype(np.float32),
    "versions": np.dtype(np.int32),
    "loss_mask": np.dtype(np.uint8),
}


class Trajectory(msgspec.Struct, kw_only=True, gc=False):
    """One finished episode, as trained on.

    ``response_ids``, ``behav_logprobs``, ``versions`` and ``loss_mask`` are
    aligned per response token. ``versions[i]`` is the policy version that
    generated token i; environment/tool tokens carry the version of the turn they
    follow and ``loss_mask[i] == 0`` (not trained on). ``reward`` is the scalar
    the algorithm uses; ``rewards`` may hold named components.
    """

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    behav_logprobs: np.ndarray
    versions: np.ndarray
    loss_mask: np.ndarray
    reward: float
    group_id: int
    episode_id: int
    rewards: dict[str, float] = {}
    timings: dict[str, float] = {}
    metadata: dict[str, Any] = {}

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        for name in ("behav_logprobs", "versions", "loss_mask"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"Trajectory.{name} has {len(getattr(self, name))} entries, "
                    f"response_ids has {n}: they must align per response token"
                )
        for name, dtype in ARRAY_FIELDS.items():
            arr = np.ascontiguousarray(getattr(self, name), dtype=dtype)
            if arr.ndim != 1:
                raise ValueError(f"Trajectory.{name} must be 1-D, got shape {arr.shape}")
            setattr(self, name, arr)

    @property
    def min_version(self) -> int:
        """Version of the oldest trained token (or of any token if none is trained)."""
        trained = self.versions[self.loss_mask.astype(bool)]
        src = trained if len(trained) else self.versions
        return int(src.min()) if len(src) else 0


class TrajMeta(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """Header entry of one trajectory: its scalars and the length of each array."""

    lengths: tuple[int, int]  # (prompt tokens, response tokens)
    reward: float
    group_id: int
    episode_id: int
    rewards: dict[str, float] = {}
    timings: dict[str, float] = {}
    metadata: dict[str, Any] = {}


class TrainBatch(msgspec.Struct, tag="batch", array_like=True, gc=False, omit_defaults=True):
    """Header of one train step's data for one trainer rank; arrays follow as frames."""

    step: int
    trajs: list[TrajMeta]


class StepDone(msgspec.Struct, tag="step_done", array_like=True, gc=False, omit_defaults=True):
    """Trainer -> controller: step ``step`` is trained and ``version`` is live on the engines."""

    step: int
    version: int
    metrics: dict[str, float] = {}


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True, gc=False, omit_defaults=True):
    """Either side: stop after this message; ``reason`` says why."""

    reason: str = ""
    error: bool = False


Message = TrainBatch | StepDone | Shutdown
