"""Framing and flow control of the experience channel (producers -> trainer ranks).

A :class:`~asyncrl.core.Trajectory` never goes through msgspec whole: the codec packs its
arrays into one raw payload frame and describes them in a small header (:class:`TrainBatch`
of :class:`TrajMeta`). Everything else is a tagged, array-like msgspec Struct (no pickle
anywhere). :data:`Message` is every message of the channel, control messages included
(``control.py``).

Messages and who sends them (see ``zmq_send.py`` for the protocol)::

    consumer -> producer   Hello (once per connection), Credit (acks + new credit, heartbeat)
    producer -> consumer   Ring (a shared-memory ring, same host), TrainBatch (+ one payload
                           frame, or none when the payload is in the ring)
"""

from __future__ import annotations

import msgspec

from asyncrl.core import TrajScalars
from asyncrl.transports.experience.control import (
    ConsumerLost,
    Engines,
    EnginesSynced,
    Save,
    Saved,
    Shutdown,
    StepDone,
    Synced,
)

__all__ = ["SCHEMA_VERSION", "Credit", "Hello", "Message", "Ring", "TrainBatch", "TrajMeta"]

SCHEMA_VERSION = 6
"""Bumped on any change of the wire layout; peers with another schema are rejected."""


# Every wire Struct below is array_like (positional), gc=False (untracked), omit_defaults and
# forbid_unknown_fields: an extra trailing element is rejected, never silently ignored.


class TrajMeta(
    TrajScalars,
    array_like=True,
    gc=False,
    omit_defaults=True,
    forbid_unknown_fields=True,
):
    """Header entry of one trajectory: the length of each array, then its scalars
    (:class:`~asyncrl.core.TrajScalars`)."""

    lengths: tuple[int, int]  # (prompt tokens, response tokens)


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
