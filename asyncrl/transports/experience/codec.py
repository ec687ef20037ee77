"""Zero-copy codec of experience messages: a msgspec header frame plus one frame per array kind.

Frame layout of a :class:`TrainBatch`: ``[header, prompt_ids, response_ids,
behav_logprobs, versions, loss_mask]``, each array frame the concatenation of
that array over the batch's trajectories (lengths in the header). Control
messages are a single header frame. Decoding validates frame count, byte sizes
and the schema, and raises :class:`MalformedMessage` on any mismatch; arrays
are ``np.frombuffer`` views of the received frames (no copy).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from asyncrl.transports.experience.types import (
    ARRAY_FIELDS,
    Message,
    TrainBatch,
    Trajectory,
    TrajMeta,
)

__all__ = ["MalformedMessage", "decode", "encode", "encode_batch"]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class MalformedMessage(ValueError):
    """A received message does not match the wire schema; it is rejected, the channel goes on."""


def encode(msg: Message) -> list[bytes]:
    """Frames of a control message (no arrays)."""
    assert not isinstance(msg, TrainBatch), "use encode_batch for batches"
    return [_encoder.encode(msg)]


def encode_batch(step: int, trajs: Sequence[Trajectory]) -> list[bytes | memoryview]:
    """Frames of one step's batch; array frames are memoryviews of contiguous numpy buffers."""
    metas = [
        TrajMeta(
            lengths=(len(t.prompt_ids), len(t.response_ids)),
            reward=float(t.reward),
            group_id=t.group_id,
            episode_id=t.episode_id,
            rewards=t.rewards,
            timings=t.timings,
            metadata=t.metadata,
        )
        for t in trajs
    ]
    frames: list[bytes | memoryview] = [_encoder.encode(TrainBatch(step=step, trajs=metas))]
    for name, dtype in ARRAY_FIELDS.items():
        parts = [getattr(t, name) for t in trajs]
        arr = np.concatenate(parts).astype(dtype, copy=False) if parts else np.empty(0, dtype)
        frames.append(memoryview(np.ascontiguousarray(arr)).cast("B"))
    return frames


def decode(frames: Sequence[bytes | memoryview]) -> tuple[Message, list[Trajectory]]:
    """Decode frames into (message, trajectories); trajectories are empty for control messages."""
    if not frames:
        raise MalformedMessage("empty message")
    try:
        msg = _decoder.decode(frames[0])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedMessage(f"bad header: {exc}") from None
    if not isinstance(msg, TrainBatch):
        if len(frames) != 1:
            raise MalformedMessage(f"{type(msg).__name__} must be 1 frame, got {len(frames)}")
        return msg, []
    if len(frames) != 1 + len(ARRAY_FIELDS):
        raise MalformedMessage(f"batch must be {1 + len(ARRAY_FIELDS)} frames, got {len(frames)}")
    n_prompt = sum(m.lengths[0] for m in msg.trajs)
    n_resp = sum(m.lengths[1] for m in msg.trajs)
    if any(a < 0 or b < 0 for a, b in (m.lengths for m in msg.trajs)):
        raise MalformedMessage("negative array length in header")
    arrays: dict[str, np.ndarray] = {}
    for (name, dtype), frame in zip(ARRAY_FIELDS.items(), frames[1:], strict=True):
        count = n_prompt if name == "prompt_ids" else n_resp
        buf = memoryview(frame)
        if buf.nbytes != count * dtype.itemsize:
            raise MalformedMessage(
                f"frame {name}: {buf.nbytes} bytes, header implies {count * dtype.itemsize}"
            )
        arrays[name] = np.frombuffer(buf, dtype=dtype)
    return msg, _split(msg.trajs, arrays)


def _split(metas: list[TrajMeta], arrays: dict[str, np.ndarray]) -> list[Trajectory]:
    out: list[Trajectory] = []
    p_off = r_off = 0
    for m in metas:
        lp, lr = m.lengths
        fields = {
            name: arr[p_off : p_off + lp] if name == "prompt_ids" else arr[r_off : r_off + lr]
            for name, arr in arrays.items()
        }
        try:
            out.append(
                Trajectory(
                    **fields,
                    reward=m.reward,
                    group_id=m.group_id,
                    episode_id=m.episode_id,
                    rewards=m.rewards,
                    timings=m.timings,
                    metadata=m.metadata,
                )
            )
        except ValueError as exc:
            raise MalformedMessage(str(exc)) from None
        p_off += lp
        r_off += lr
    return out
