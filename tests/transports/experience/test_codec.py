"""Codec: round trips of every field and dtype, zero-copy views, and each reject reason."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.core import ARRAY_FIELDS, Trajectory
from asyncrl.transports.experience.codec import MalformedMessage, decode, encode, encode_batch
from asyncrl.transports.experience.control import ConsumerLost, Shutdown, StepDone
from asyncrl.transports.experience.wire import SCHEMA_VERSION, Credit, Hello, TrainBatch, TrajMeta


def traj(eid: int, n_prompt: int = 5, n_resp: int = 7, seed: int = 0) -> Trajectory:
    rng = np.random.default_rng(seed + eid)
    return Trajectory(
        prompt_ids=rng.integers(-(2**31), 2**31 - 1, n_prompt, dtype=np.int32),
        response_ids=rng.integers(0, 2**31 - 1, n_resp, dtype=np.int32),
        behav_logprobs=-rng.random(n_resp, dtype=np.float32),
        versions=rng.integers(0, 1000, n_resp, dtype=np.int32),
        loss_mask=rng.integers(0, 2, n_resp, dtype=np.uint8),
        reward=float(rng.random()),
        group_id=eid // 2,
        episode_id=eid,
        rewards={"format": 0.5, "answer": -1.0},
        timings={"gen_s": 1.25},
        metadata={"task": "x", "turns": 3, "tags": ["a", None], "nested": {"k": 1.5}},
    )


def assert_same(a: Trajectory, b: Trajectory) -> None:
    for name, dtype in ARRAY_FIELDS.items():
        x, y = getattr(a, name), getattr(b, name)
        assert y.dtype == dtype and x.dtype == dtype, name
        np.testing.assert_array_equal(x, y, err_msg=name)
    for name in ("reward", "group_id", "episode_id", "rewards", "timings", "metadata"):
        assert getattr(a, name) == getattr(b, name), name


def wire(frames: list) -> list[bytes]:
    return [bytes(f) for f in frames]


@pytest.mark.parametrize("n", [0, 1, 3])
def test_batch_round_trip_every_field(n: int) -> None:
    trajs = [traj(i, n_prompt=i + 1, n_resp=2 * i) for i in range(n)]  # includes empty response
    frames = wire(encode_batch(42, 7, trajs))
    assert len(frames) == 2  # header + one payload frame
    msg, out = decode(frames)
    assert isinstance(msg, TrainBatch) and (msg.seq, msg.step, msg.schema) == (
        42,
        7,
        SCHEMA_VERSION,
    )
    assert len(out) == n
    for a, b in zip(trajs, out, strict=True):
        assert_same(a, b)


@pytest.mark.parametrize("n", [1, 3])
def test_payload_is_one_aligned_frame_and_decoding_never_copies(n: int) -> None:
    trajs = [traj(i, 300 + i, 4096 - i) for i in range(n)]
    received = wire(encode_batch(0, 0, trajs))
    payload = np.frombuffer(received[1], np.uint8)
    _, out = decode(received)
    for t in out:
        for name in ARRAY_FIELDS:
            arr = getattr(t, name)
            assert np.shares_memory(arr.view(np.uint8), payload), name
            assert not arr.flags.writeable, name
            assert (arr.ctypes.data - payload.ctypes.data) % arr.dtype.itemsize == 0, name


@pytest.mark.parametrize(
    "msg",
    [
        StepDone(step=3, version=4, metrics={"loss": 0.5}),
        Shutdown(reason="bye", error=True),
        Shutdown(reason="weights undefined", error=True, fatal=True),
        Shutdown(),
        Hello(rank=1, world_size=2, incarnation=2**61, credit=8),
        Hello(rank=0, world_size=1, incarnation=5, control=True),
        Credit(acked=[1, 2, 3], grant=3),
        Credit(),
        ConsumerLost(rank=1, seqs=[4], episode_ids=[9, 10]),
    ],
)
def test_control_round_trip(msg: object) -> None:
    frames = encode(msg)  # type: ignore[arg-type]
    assert len(frames) == 1
    assert decode(frames) == (msg, [])


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=6),
    reward=st.floats(allow_nan=False),
    meta=st.dictionaries(
        st.text(max_size=5), st.integers(-(2**63), 2**63 - 1) | st.text(max_size=5), max_size=3
    ),
)
def test_round_trip_property(lengths: list[tuple[int, int]], reward: float, meta: dict) -> None:
    trajs = []
    for i, (p, r) in enumerate(lengths):
        t = traj(i, p, r)
        t.reward, t.metadata = reward, meta
        trajs.append(t)
    _, out = decode(wire(encode_batch(1, -1, trajs)))
    for a, b in zip(trajs, out, strict=True):
        assert_same(a, b)


def _valid() -> list[bytes]:
    return wire(encode_batch(0, 0, [traj(0), traj(1)]))


def _header(**change: object) -> bytes:
    msg, _ = decode(_valid())
    return msgspec.msgpack.encode(msgspec.structs.replace(msg, **change))


def _cases() -> dict[str, tuple[str, list[bytes]]]:
    v = _valid()
    bad_len = [TrajMeta(lengths=(5, 8), reward=0.0, group_id=0, episode_id=0)] * 2
    neg_len = [TrajMeta(lengths=(-5, 7), reward=0.0, group_id=0, episode_id=0)]
    # log-probs of both trajectories sent as float64: 4 more bytes per response token
    n_p, n_r = 5 + 5, 7 + 7
    lp = slice(4 * (n_p + n_r), 4 * (n_p + 2 * n_r))
    f64 = v[1][: lp.start] + np.frombuffer(v[1][lp], np.float32).astype(np.float64).tobytes()
    f64 += v[1][lp.stop :]
    return {
        "no frames": ("empty", []),
        "garbage header": ("bad_header", [b"\xc1\xff\x00", *v[1:]]),
        "truncated header": ("bad_header", [v[0][:-3], *v[1:]]),
        "not an array": ("bad_header", [msgspec.msgpack.encode({"a": 1}), *v[1:]]),
        "unknown type": ("unknown_type", [msgspec.msgpack.encode(["nope", 1, 2]), *v[1:]]),
        "schema version": ("schema", [_header(schema=SCHEMA_VERSION + 1), *v[1:]]),
        "missing frame": ("frame_count", v[:-1]),
        "extra frame": ("frame_count", [*v, b""]),
        "control with arrays": ("frame_count", [encode(Shutdown())[0], b"x"]),
        "truncated payload": ("size", [v[0], v[1][:-4]]),
        "extended payload": ("size", [v[0], v[1] + b"\x00"]),
        "wrong dtype": ("size", [v[0], f64]),
        "lengths disagree": ("size", [_header(trajs=bad_len), *v[1:]]),
        "negative length": ("shape", [_header(trajs=neg_len), *v[1:]]),
        "wrong field type": ("bad_header", [_header(step="seven"), *v[1:]]),
        "extra trailing element": ("bad_header", [_extra(v[0]), *v[1:]]),
    }


def _extra(header: bytes) -> bytes:
    """``header`` with one more element than the known fields (all of them written out)."""
    items = msgspec.msgpack.decode(header)
    return msgspec.msgpack.encode(items + [SCHEMA_VERSION, -1, 0][len(items) - 4 :] + [0])


@pytest.mark.parametrize("case", list(_cases()))
def test_malformed_messages_are_rejected_with_a_kind(case: str) -> None:
    kind, frames = _cases()[case]
    with pytest.raises(MalformedMessage) as err:
        decode(frames)
    assert err.value.kind == kind, str(err.value)


def test_oversized_message_is_rejected_before_decoding() -> None:
    frames = _valid()
    with pytest.raises(MalformedMessage) as err:
        decode(frames, max_bytes=sum(len(f) for f in frames) - 1)
    assert err.value.kind == "oversized"
    decode(frames, max_bytes=sum(len(f) for f in frames))


def test_trajectory_rejects_misaligned_or_multi_dimensional_arrays() -> None:
    t = traj(0)
    with pytest.raises(ValueError, match="align"):
        msgspec.structs.replace(t, versions=np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="1-D"):
        msgspec.structs.replace(t, prompt_ids=np.zeros((2, 2), np.int32))


def test_unserializable_metadata_is_a_clear_error() -> None:
    t = traj(0)
    t.metadata = {"big": 2**70}
    with pytest.raises(TypeError, match="metadata"):
        encode_batch(0, 0, [t])


@pytest.mark.parametrize("cls", [TrainBatch, TrajMeta, Hello, Credit, StepDone, Shutdown])
def test_wire_structs_are_array_like_untracked_and_omit_defaults(cls: type) -> None:
    cfg = cls.__struct_config__
    assert cfg.array_like and not cfg.gc and cfg.omit_defaults and cfg.forbid_unknown_fields
