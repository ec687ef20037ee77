"""The data model every part of a run shares: what a prompt is, what an engine returns,
what an episode produces and what a train step gets.

- :class:`Sample`: one prompt of a task (token ids plus what its reward needs).
- :class:`GenerateResult`: one generation from a rollout engine (tokens, log-probs and the
  weight version of every token).
- :class:`Trajectory`: one finished episode, as trained on.
- :class:`Batch`: one train step's groups of trajectories, as the controller hands them out.

No transport, engine or controller owns these: the experience channel carries
trajectories (``asyncrl.transports.experience``), engines return generate results,
controllers build batches. Plain msgspec Structs and numpy arrays; no torch.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

__all__ = [
    "ARRAY_FIELDS",
    "Batch",
    "GenerateRequest",
    "GenerateResult",
    "Sample",
    "TrajScalars",
    "Trajectory",
    "scalars_of",
]

# name -> dtype of every per-trajectory array; the codec relies on this order.
ARRAY_FIELDS: dict[str, np.dtype] = {
    "prompt_ids": np.dtype(np.int32),
    "response_ids": np.dtype(np.int32),
    "behav_logprobs": np.dtype(np.float32),
    "versions": np.dtype(np.int32),
    "loss_mask": np.dtype(np.uint8),
}


class Sample(msgspec.Struct, frozen=True):
    """A prompt of a task: token ids plus whatever the reward needs (the episode function's
    input; the controller hands each one to an episode).

    ``answer`` must be checkpointable, since a run checkpoint stores every pending sample as
    msgpack: plain data (dict, list, tuple, str, int, float, bool, None, bytes) or msgspec
    Structs / dataclasses of it. The controller refuses a sample that is not when it is
    submitted or drawn (``TypeError`` naming the field and its type), not at the first
    checkpoint. Tuples come back from a checkpoint as lists, Structs and dataclasses as
    dicts unless the resuming controller is given their type (``sample_type``).
    """

    prompt_ids: list[int]
    answer: Any = None
    id: int = 0


class GenerateRequest(msgspec.Struct, frozen=True, gc=False):
    """One completion asked of a rollout engine: the prompt's token ids, its sampling
    parameters (the engine's own names; ``lora_path`` names an adapter version) and the
    request id it can be aborted by (None: the engine names it)."""

    input_ids: list[int]
    sampling_params: dict[str, Any]
    rid: str | None = None


class GenerateResult(msgspec.Struct, frozen=True, gc=False):
    output_ids: list[int]
    logprobs: list[float]
    weight_version: int
    finish_reason: str
    prompt_tokens: int = 0
    versions: list[int] | None = None
    """The weight version of each output token, when the server reported spans (SGLang >=
    0.5.22's ``meta_info.weight_versions``); None: every token has ``weight_version``."""

    def token_versions(self) -> list[int]:
        """The weight version of every output token."""
        if self.versions is not None:
            return self.versions
        return [self.weight_version] * len(self.output_ids)


class TrajScalars(msgspec.Struct, kw_only=True, gc=False):
    """The scalars of a finished trajectory, declared once for every form it takes: the
    :class:`Trajectory`, its entry in an experience header (``TrajMeta``) and its record in
    a run checkpoint (``TrajState``). Those two are positional (``array_like``) and not
    keyword-only, so msgspec puts their own fields ahead of these: their layouts are
    ``<own fields>, reward, group_id, episode_id, rewards, timings, metadata``."""

    reward: float
    group_id: int
    episode_id: int
    rewards: dict[str, float] = {}
    timings: dict[str, float] = {}
    metadata: dict[str, Any] = {}


def scalars_of(t: TrajScalars) -> dict[str, Any]:
    """``t``'s :class:`TrajScalars` fields by name (to build another form of the trajectory)."""
    return {name: getattr(t, name) for name in TrajScalars.__struct_fields__}


class Trajectory(TrajScalars, kw_only=True, gc=False):
    """One finished episode, as trained on.

    ``response_ids``, ``behav_logprobs``, ``versions`` and ``loss_mask`` are
    aligned per response token. ``versions[i]`` is the policy version that
    generated token i; environment/tool tokens carry the version of the turn they
    follow and ``loss_mask[i] == 0`` (not trained on). ``reward`` is the scalar
    the algorithm uses; ``rewards`` may hold named components. ``metadata`` is a
    small map of JSON-able values (it travels inline in the header).

    The arrays are writable (``torch.from_numpy`` wraps them without a copy or a warning)
    where their memory is the trajectory's own: built by an episode (``ctx.trajectory``,
    the gateway) or received as ZeroMQ frames. Received through the producer's
    shared-memory ring they are read-only views of it, valid until their delivery is
    acknowledged (``ExperienceReceiver``): copy what outlives the ack (``copy=True`` there
    gives writable arrays of their own).
    """

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    behav_logprobs: np.ndarray
    versions: np.ndarray
    loss_mask: np.ndarray

    def __post_init__(self) -> None:
        for name, dtype in ARRAY_FIELDS.items():
            arr = getattr(self, name)
            if not (
                type(arr) is np.ndarray
                and arr.dtype == dtype
                and arr.ndim == 1
                and arr.flags.c_contiguous
            ):
                arr = np.ascontiguousarray(arr, dtype=dtype)
                if arr.ndim != 1:
                    raise ValueError(f"Trajectory.{name} must be 1-D, got shape {arr.shape}")
                setattr(self, name, arr)
        n = len(self.response_ids)
        for name in ("behav_logprobs", "versions", "loss_mask"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"Trajectory.{name} has {len(getattr(self, name))} entries, "
                    f"response_ids has {n}: they must align per response token"
                )

    @property
    def min_version(self) -> int:
        """Version of the oldest trained token (or of any token if none is trained)."""
        trained = self.versions[self.loss_mask.astype(bool)]
        src = trained if len(trained) else self.versions
        return int(src.min()) if len(src) else 0

    @property
    def num_tokens(self) -> int:
        """Prompt plus response tokens."""
        return len(self.prompt_ids) + len(self.response_ids)


class Batch(msgspec.Struct, gc=False):
    """One train step's data, as ``next_batch()`` hands it out.

    - ``step``: the train step it is for (0, 1, ...; one per ``next_batch()``). Every token
      in it was generated by a policy version ``v`` with ``step - v <= max_staleness``.
    - ``groups``: ``batch_size`` groups (fewer only in the last batch after ``end_input()``),
      oldest admitted first; a group holds the trajectories of one sample's episodes
      (``algo.group_size`` episodes; a rejected episode, None, is left out; a group never
      splits across batches). Each :class:`~asyncrl.Trajectory` has ``group_id`` set.
    - ``samples``: the sample of each group, in the same order.

    ``trajectories`` (flat list), ``staleness_max`` and ``reward_mean`` are derived.
    The batch is the caller's: the controller keeps no reference to it.
    """

    step: int
    groups: list[list[Trajectory]]
    samples: list[Any] = []
    filtered: int = 0
    """Groups dynamic sampling (``algo.filter_groups``) dropped since the previous batch."""

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g]

    @property
    def staleness_max(self) -> int:
        return max(self.step - t.min_version for t in self.trajectories)

    @property
    def reward_mean(self) -> float:
        ts = self.trajectories
        return sum(t.reward for t in ts) / len(ts)
