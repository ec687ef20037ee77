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
resuming controller is given. So every sample must be msgpack-encodable: the
controller refuses one that is not when it is submitted or drawn from the source
(:func:`check_sample`), not at the first checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
import numpy as np

from asyncrl.controllers.calls import Generation, input_crc
from asyncrl.core import ARRAY_FIELDS, Trajectory, TrajScalars, scalars_of

__all__ = [
    "CHECKPOINTABLE",
    "ControllerState",
    "EpisodeState",
    "GroupState",
    "ReadyState",
    "TrajState",
    "check_sample",
    "decode_sample",
    "encode_sample",
    "journal_of",
    "traj_from_state",
    "traj_state",
]

STATE_FORMAT = 1


class TrajState(TrajScalars, array_like=True, gc=False, omit_defaults=True):
    """A finished trajectory: each of ``ARRAY_FIELDS`` as raw bytes, in that order, then its
    scalars (:class:`~asyncrl.core.TrajScalars`)."""

    arrays: list[bytes]


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


_ENCODER = msgspec.msgpack.Encoder()
_UNENCODABLE = (TypeError, OverflowError, msgspec.EncodeError)

CHECKPOINTABLE = (
    "plain data (dict, list, tuple, str, int, float, bool, None, bytes) or msgspec Structs "
    "and dataclasses of it; convert anything else (an object, a numpy array, a tensor) "
    "to those before submitting"
)


def check_sample(sample: Any) -> None:
    """Raise ``TypeError`` unless ``sample`` can go into a checkpoint (msgpack-encodable).

    The message names the first value that cannot, by its path from the sample and its
    type (``Sample.answer[1] is a Lengths``), and says what a checkpointable payload is
    (:data:`CHECKPOINTABLE`). Costs one msgpack encoding of the sample.
    """
    try:
        _ENCODER.encode(sample)
    except _UNENCODABLE as exc:
        raise TypeError(_unencodable(sample, exc)) from None


def _unencodable(sample: Any, exc: BaseException) -> str:
    path, kind = _culprit(sample, type(sample).__name__)
    return (
        f"sample {getattr(sample, 'id', '')!r} cannot be checkpointed: {path} is a {kind} "
        f"({exc}); a checkpoint stores every pending sample as msgpack: use {CHECKPOINTABLE}"
    )


def _culprit(value: Any, path: str) -> tuple[str, str]:
    """The path and type name of the first part of ``value`` that msgpack cannot encode."""
    if isinstance(value, msgspec.Struct):
        parts = [(f".{f}", getattr(value, f)) for f in value.__struct_fields__]
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        parts = [(f".{f.name}", getattr(value, f.name)) for f in dataclasses.fields(value)]
    elif isinstance(value, dict):
        parts = [(f"[{k!r}]", v) for k, v in value.items()]
        parts += [(f" key {k!r}", k) for k in value]
    elif isinstance(value, list | tuple | set | frozenset):
        parts = [(f"[{i}]", v) for i, v in enumerate(value)]
    else:
        parts = []
    for suffix, part in parts:
        try:
            _ENCODER.encode(part)
        except _UNENCODABLE:
            return _culprit(part, path + suffix)
    return path, type(value).__qualname__


def encode_sample(sample: Any) -> msgspec.Raw:
    """``sample`` as msgpack for a checkpoint (``TypeError`` as :func:`check_sample`)."""
    try:
        return msgspec.Raw(_ENCODER.encode(sample))
    except _UNENCODABLE as exc:
        raise TypeError(_unencodable(sample, exc)) from None


def decode_sample(raw: msgspec.Raw, sample_type: Any) -> Any:
    return msgspec.msgpack.decode(raw, type=sample_type)


def traj_state(t: Trajectory) -> TrajState:
    return TrajState(arrays=[getattr(t, name).tobytes() for name in ARRAY_FIELDS], **scalars_of(t))


def traj_from_state(s: TrajState) -> Trajectory:
    arrays = {
        name: np.frombuffer(buf, dtype).copy()
        for (name, dtype), buf in zip(ARRAY_FIELDS.items(), s.arrays, strict=True)
    }
    return Trajectory(**arrays, **scalars_of(s))


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
