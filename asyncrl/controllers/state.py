"""The controller's part of a run checkpoint, as msgspec Structs (no pickle, no torch).

:class:`ControllerState` is taken at one event-loop instant right after the batch of
step ``step - 1`` was handed out, so together with a trainer checkpoint of "steps
``0 .. step-1`` trained" it is a consistent cut of the whole run:

- ``version`` and the admission counters (``admitted``, ``released``) and every
  accounting counter, so the staleness rule and ``stats()`` continue exactly;
- the data stream's position: ``drawn`` samples taken from the source (a resumed
  controller skips that many of the same deterministic stream: its RNG included)
  and the ``queued`` samples taken but not yet admitted (re-queued stale groups);
- every ready group not yet trained (its trajectories, arrays as raw bytes);
- every running group: its sample and, per episode, the journal of its generate
  calls, the last one partial (tokens, log-probs and per-token versions received so
  far; its remaining budget is ``max_new_tokens`` minus those). On resume each
  episode runs again and is answered from its journal (see ``episode.py``).

Samples travel as msgpack (``msgspec.Raw``), decoded with the sample type the
resuming controller is given.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from asyncrl.controllers.episode import Generation, input_crc
from asyncrl.transports.experience.types import ARRAY_FIELDS, Trajectory

__all__ = [
    "ControllerState",
    "EpisodeState",
    "GroupState",
    "ReadyState",
    "TrajState",
    "decode_sample",
    "encode_sample",
    "journal_of",
    "traj_from_state",
    "traj_state",
]

STATE_FORMAT = 1


class TrajState(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """A finished trajectory: each of ``ARRAY_FIELDS`` as raw bytes, in that order."""

    arrays: list[bytes]
    reward: float
    group_id: int
    episode_id: int
    rewards: dict[str, float] = {}
    timings: dict[str, float] = {}
    metadata: dict[str, Any] = {}


class ReadyState(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """A ready group: finished, not yet trained."""

    gid: int
    sample: msgspec.Raw
    trajs: list[TrajState]
    min_version: int
    admitted_at: int


class EpisodeState(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """One episode of a running group: its generate calls so far (the last may be partial:
    ``finish_reason == "partial"``)."""

    episode_id: int
    calls: list[Generation]
    next_rid: int = 0  # request ids of the episode go on from here (never reused)


class GroupState(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """A running group: admitted, episodes in progress."""

    gid: int
    sample: msgspec.Raw
    admitted_at: int
    episodes: list[EpisodeState]


class ControllerState(msgspec.Struct, gc=False, omit_defaults=True):
    """Everything the controller needs to continue a run exactly (see the module docs)."""

    step: int
    version: int
    admitted: int
    released: int
    counters: dict[str, int]
    next_gid: int
    next_eid: int
    drawn: int
    queued: list[msgspec.Raw]
    ready: list[ReadyState]
    running: list[GroupState]
    format: int = STATE_FORMAT

    @property
    def kept_tokens(self) -> int:
        """Generated tokens of running groups that a resume keeps (not generated again)."""
        return sum(len(c.output_ids) for g in self.running for e in g.episodes for c in e.calls)


def encode_sample(sample: Any) -> msgspec.Raw:
    try:
        return msgspec.Raw(msgspec.msgpack.encode(sample))
    except TypeError as exc:
        raise TypeError(
            f"a checkpoint stores every pending sample as msgpack; {type(sample).__name__} "
            f"is not encodable ({exc}): use msgspec Structs, dicts, lists and scalars"
        ) from None


def decode_sample(raw: msgspec.Raw, sample_type: Any) -> Any:
    return msgspec.msgpack.decode(raw, type=sample_type)


def traj_state(t: Trajectory) -> TrajState:
    return TrajState(
        arrays=[getattr(t, name).tobytes() for name in ARRAY_FIELDS],
        reward=t.reward,
        group_id=t.group_id,
        episode_id=t.episode_id,
        rewards=t.rewards,
        timings=t.timings,
        metadata=t.metadata,
    )


def traj_from_state(s: TrajState) -> Trajectory:
    arrays = {
        name: np.frombuffer(buf, dtype).copy()
        for (name, dtype), buf in zip(ARRAY_FIELDS.items(), s.arrays, strict=True)
    }
    return Trajectory(
        **arrays,
        reward=s.reward,
        group_id=s.group_id,
        episode_id=s.episode_id,
        rewards=s.rewards,
        timings=s.timings,
        metadata=s.metadata,
    )


def journal_of(journal: list[tuple[list[int], Generation]], current: Any) -> list[Generation]:
    """An episode context's journal (and its call in progress, as ``partial``) for a file."""
    out = []
    for prefix, g in journal:
        out.append(msgspec.structs.replace(g, input_crc=input_crc(prefix)))
    if current is not None:
        prefix, g = current
        out.append(
            Generation(
                list(g.output_ids),
                list(g.logprobs),
                list(g.versions),
                "partial",
                g.calls,
                input_crc(prefix),
            )
        )
    return out
