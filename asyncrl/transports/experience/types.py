"""Wire types of the experience channel (producers -> trainer ranks) and its control messages.

A :class:`Trajectory` is one finished episode. Its arrays (token ids, behaviour
log-probs, per-token versions, loss mask) never go through msgspec: the codec
packs them into one raw payload frame and describes them in a small header.
Everything else is a tagged, array-like msgspec Struct (no pickle anywhere).

Messages and who sends them (see ``zmq_send.py`` for the protocol)::

    consumer -> producer   Hello (once per connection), Credit (acks + new credit, heartbeat)
    producer -> consumer   Ring (a shared-memory ring, same host), TrainBatch (+ one payload
                           frame, or none when the payload is in the ring), Save, Shutdown
    consumer -> producer   StepDone (the version announcement of the trainer), Saved,
                           Synced, Shutdown
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

__all__ = [
    "ARRAY_FIELDS",
    "SCHEMA_VERSION",
    "ConsumerLost",
    "Credit",
    "Engines",
    "EnginesSynced",
    "Hello",
    "Message",
    "Ring",
    "Save",
    "Saved",
    "Shutdown",
    "StepDone",
    "Synced",
    "TrainBatch",
    "TrajMeta",
    "Trajectory",
]

SCHEMA_VERSION = 6
"""Bumped on any change of the wire layout; peers with another schema are rejected."""

# Every wire Struct below is array_like (positional), gc=False (untracked), omit_defaults and
# forbid_unknown_fields: an extra trailing element is rejected, never silently ignored.

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
    reward: float
    group_id: int
    episode_id: int
    rewards: dict[str, float] = {}
    timings: dict[str, float] = {}
    metadata: dict[str, Any] = {}

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


class TrajMeta(
    msgspec.Struct,
    array_like=True,
    gc=False,
    omit_defaults=True,
    forbid_unknown_fields=True,
):
    """Header entry of one trajectory: its scalars and the length of each array."""

    lengths: tuple[int, int]  # (prompt tokens, response tokens)
    reward: float
    group_id: int
    episode_id: int
    rewards: dict[str, float] = {}
    timings: dict[str, float] = {}
    metadata: dict[str, Any] = {}


class TrainBatch(
    msgspec.Struct,
    tag="batch",
    array_like=True,
    gc=False,
    omit_defaults=True,
    forbid_unknown_fields=True,
):
    """Header of one experience message: whole GRPO groups for one consumer (trainer rank).

    ``seq`` numbers the messages of one producer to one rank (acked by the
    consumer); ``step`` is the train step they belong to (-1: not tied to a
    step). The payload is each field of every trajectory, back to back, field
    after field in ``ARRAY_FIELDS`` order. With ``ring == -1`` it follows as one
    payload frame; otherwise it lies at byte ``offset`` of the shared-memory ring
    ``ring`` that this producer announced (a :class:`Ring`) and no frame follows.
    """

    seq: int
    step: int
    trajs: list[TrajMeta]
    schema: int = SCHEMA_VERSION
    ring: int = -1
    offset: int = 0


class Hello(
    msgspec.Struct,
    tag="hello",
    array_like=True,
    gc=False,
    omit_defaults=True,
    forbid_unknown_fields=True,
):
    """Consumer -> producer, first message of a connection: who I am and my initial credit.

    Each consumer opens two connections per producer: the data connection
    (``control=False``: batches in, credits out) and a control connection
    (``control=True``: heartbeats and reports, usable from any thread). A data
    Hello with a new ``incarnation`` for a known ``rank`` means the consumer
    restarted: the producer redelivers what the old incarnation had not acked.

    A data Hello with the rank's current ``incarnation`` from a new routing id is a
    *resume*: the consumer's data connection was cut (a frame over libzmq's size limit,
    a network fault) and it reconnected. ``last_seq`` is the highest seq it received from
    this producer (-1: none) and ``unacked`` the seqs it received and has not acked yet;
    ``credit`` is what it grants now. The producer takes every pending seq up to
    ``last_seq`` that is not in ``unacked`` as acked, redelivers every pending seq after
    ``last_seq`` in order, and sets the rank's credit to ``credit`` (absolute, not added).
    ``controls`` counts the broadcasts (Save, Shutdown, Engines) received: the producer
    sends the later ones again, each in its place among the redelivered batches.
    ``max_bytes`` is the consumer's size limit: the producer sends nothing larger.
    """

    rank: int
    world_size: int
    incarnation: int
    credit: int = 0
    control: bool = False
    schema: int = SCHEMA_VERSION
    shm: str = ""  # the consumer's shm.host_token() ("": no rings); rings if equal to ours
    last_seq: int = -1
    unacked: list[int] = []
    max_bytes: int = 0  # the consumer's message size limit (0: not said)
    controls: int = 0  # broadcasts received from this producer (a resume)


class Ring(
    msgspec.Struct,
    tag="ring",
    array_like=True,
    gc=False,
    omit_defaults=True,
    forbid_unknown_fields=True,
):
    """Producer -> consumer (data connection, before any batch that uses it): payloads may
    lie in the shared-memory segment ``name`` (in ``/dev/shm``) of ``nbytes`` bytes, called
    ``ring`` in batch headers. Sent after every data Hello that offered ``shm``."""

    ring: int
    name: str
    nbytes: int


class Credit(
    msgspec.Struct,
    tag="credit",
    array_like=True,
    gc=False,
    omit_defaults=True,
    forbid_unknown_fields=True,
):
    """Consumer -> producer: ``acked`` seqs are done (may be forgotten); ``grant`` more may come.

    An empty Credit is the consumer's heartbeat.
    """

    acked: list[int] = []
    grant: int = 0


class StepDone(
    msgspec.Struct,
    tag="step_done",
    array_like=True,
    gc=False,
    omit_defaults=True,
    forbid_unknown_fields=True,
):
    """Trainer -> producers (version announcement): step ``step`` is trained and ``version``
    is live on the engines."""

    step: int
    version: int
    metrics: dict[str, float] = {}


class Save(
    msgspec.Struct,
    tag="save",
    array_like=True,
    gc=False,
    omit_defaults=True,
    forbid_unknown_fields=True,
):
    """Producer -> every consumer, in order after the batch of step ``step - 1``: save the
    trainer's state (every step before ``step`` trained) under ``checkpoint`` and/or export
    the actor as a Hugging Face folder to ``export`` ("": not asked)."""

    step: int
    checkpoint: str = ""
    export: str = ""


class Saved(
    msgspec.Struct,
    tag="saved",
    array_like=True,
    gc=False,
    omit_defaults=True,
    forbid_unknown_fields=True,
):
    """Consumer rank 0 -> producers: what :class:`Save` asked for of ``step`` is on disk on
    every rank. ``stall_s``: how long training stood still for it (the rest ran in the
    background); ``save_s``: from the request to the files being complete."""

    step: int
    stall_s: float = 0.0
    save_s: float = 0.0
    error: str = ""


class Synced(
    msgspec.Struct,
    tag="synced",
    array_like=True,
    gc=False,
    omit_defaults=True,
    forbid_unknown_fields=True,
):
    """Consumer rank 0 -> producers: a (re)started trainer restored step ``step`` from a
    checkpoint and the engines now serve its weights as ``version``."""

    step: int
    version: int


class Shutdown(
    msgspec.Struct,
    tag="shutdown",
    array_like=True,
    gc=False,
    omit_defaults=True,
    forbid_unknown_fields=True,
):
    """Either side: stop after this message; ``reason`` says why. From the trainer,
    ``error`` is a failure the run may survive by restarting the trainer; ``fatal`` one it
    cannot (e.g. SGLang engines whose weights a failed push left undefined): the run stops
    with ``reason``."""

    reason: str = ""
    error: bool = False
    fatal: bool = False


class Engines(
    msgspec.Struct,
    tag="engines",
    array_like=True,
    gc=False,
    omit_defaults=True,
    forbid_unknown_fields=True,
):
    """Producer -> every trainer rank: the rollout engines are now ``urls`` (one restarted,
    joined or left), as of the run's ``epoch``-th change of its engine set.

    Sent twice. On the data connection, between steps (never inside one step's messages):
    rank 0 re-forms the weight group with them and pushes the current weights (the other
    ranks take part in gathering them), then answers :class:`EnginesSynced`. On the control
    connection at once, as a notice (``ExperienceSender.notify``): rank 0's weight sender
    takes the new set for its next push and stops waiting on an engine that is not in it,
    while the trainer is still busy with a step. The newer ``epoch`` wins."""

    urls: list[str]
    epoch: int = 0


class EnginesSynced(
    msgspec.Struct,
    tag="engines_synced",
    array_like=True,
    gc=False,
    omit_defaults=True,
    forbid_unknown_fields=True,
):
    """Trainer rank 0 -> producers: every engine of ``urls`` holds weight ``version``;
    ``error`` says why not (the engines keep their old weights)."""

    urls: list[str]
    version: int
    error: str = ""


class ConsumerLost(
    msgspec.Struct,
    tag="lost",
    array_like=True,
    gc=False,
    omit_defaults=True,
    forbid_unknown_fields=True,
):
    """Producer-local report: consumer ``rank`` went silent with messages unacknowledged.

    ``seqs`` and ``episode_ids`` name what it had not acked; they stay pending
    and are redelivered, in order, when the rank says Hello again.
    """

    rank: int
    seqs: list[int]
    episode_ids: list[int]


Message = (
    TrainBatch
    | Hello
    | Ring
    | Credit
    | StepDone
    | Save
    | Saved
    | Synced
    | Shutdown
    | ConsumerLost
    | Engines
    | EnginesSynced
)
