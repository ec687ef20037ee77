"""How a producer encodes a batch for one rank: into the rank's ring, or as frames.

Contract (run by the sending process): :func:`shm_token` says which consumers get rings
(``experience.shm``); :func:`ring_for` gives a rank on this host its
:class:`~asyncrl.transports.experience.shm.RingWriter` (made once, kept across its
incarnations) and the :class:`Ring` notice that must reach it before any batch that uses
it; :func:`encode_for` encodes one message — its payload written into the rank's ring
when the rank maps it and there is room (one copy; only the header then goes through
ZeroMQ), else as frames — and refuses (ValueError, the ring space freed) a message the
rank would reject for its size (:func:`check_size`).

Same-host fast path (``shm``): the producer creates one shared-memory ring per rank
whose consumer shares its ``/dev/shm`` (``Hello.shm`` carries the consumer's
:func:`~asyncrl.transports.experience.shm.host_token`; equal tokens mean same boot,
same tmpfs, same user: one host, whatever the endpoint), announces it (a
:class:`Ring` message) and writes each batch's arrays into it (one copy); only the
header goes through ZeroMQ. Ring space of a message is freed when it
is acked, so credits bound ring use as they bound frames; a message that finds no room
(or an empty one) goes as frames. Unacked messages stay in the ring: a restarted
consumer is told the ring again and maps it, and redelivery resends just the headers.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from typing import Any

from asyncrl.core import Trajectory
from asyncrl.transports.experience.codec import (
    encode_batch,
    encode_header,
    header_limits,
    payload_size,
)
from asyncrl.transports.experience.send_peers import Peer
from asyncrl.transports.experience.shm import RingWriter, host_token
from asyncrl.transports.experience.wire import Ring

__all__ = ["check_size", "encode_for", "ring_for", "shm_token"]

log = logging.getLogger(__name__)


def shm_token(mode: str) -> str:
    """The host token a producer offers rings to (``experience.shm``); empty: no rings.

    ``auto``: rings for every consumer that shares this host's ``/dev/shm`` (frames for the
    others, e.g. over tcp from another host); ``on``: the same, but a ValueError where this
    host cannot have rings; ``off``: frames only."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"experience.shm must be 'auto', 'on' or 'off', got {mode!r}")
    token = host_token() if mode != "off" else ""
    if mode == "on" and not token:
        raise ValueError("experience.shm='on' needs Linux with /dev/shm: use 'auto' or 'off'")
    return token


def ring_for(peer: Peer, rank: int, shm_bytes: int) -> Ring:
    """The ring of ``rank`` (``peer``'s, made of ``shm_bytes`` on its first use) and the
    notice that announces it."""
    if peer.ring is None:
        peer.ring = RingWriter(shm_bytes)
        log.info("trainer rank %d shares this host: batches via ring %s (%d MiB)",
                 rank, peer.ring.name, shm_bytes >> 20)  # fmt: skip
    return Ring(ring=rank, name=peer.ring.name, nbytes=peer.ring.nbytes)


def encode_for(
    peer: Peer,
    rank: int,
    seq: int,
    step: int,
    trajs: Sequence[Trajectory],
    max_bytes: int,
    counters: collections.Counter[str],
) -> tuple[list[Any], int, bool]:
    """Message ``seq`` to ``rank``: its frames (the header only when the payload went into
    the rank's ring), their bytes, and whether the ring holds the payload. ``max_bytes``:
    the producer's limit (the rank's own, if smaller, applies too); ``counters``: the
    sender's (``ring_full``, ``sent_shm``)."""
    size = payload_size(trajs)
    limit = min(max_bytes, peer.max_bytes or max_bytes)
    check_size(size, len(trajs), 0, limit, rank)
    offset = None
    if peer.shm and size > 0:
        assert peer.ring is not None
        offset = peer.ring.write(seq, trajs, size)
        counters["ring_full"] += offset is None
    if offset is None:
        frames = encode_batch(seq, step, trajs)
    else:
        frames = [encode_header(seq, step, trajs, ring=rank, offset=offset)]
        counters["sent_shm"] += 1
    total = size + len(frames[0])
    try:
        check_size(total, len(trajs), len(frames[0]), limit, rank)
    except ValueError:
        if offset is not None:
            assert peer.ring is not None
            peer.ring.free(seq)
        raise
    return frames, total, offset is not None


def check_size(size: int, n_trajs: int, header: int, limit: int, rank: int) -> None:
    """ValueError for a message ``rank`` would reject: over the size limit (the smaller
    of ours and the rank's, whose socket would cut the connection on it), or with more
    trajectories or header bytes than :func:`codec.header_limits` allows."""
    head_cap, traj_cap = header_limits(limit)
    if size > limit:
        raise ValueError(
            f"experience message of {size} bytes exceeds experience.max_message_mb "
            f"({limit >> 20} MiB, the smaller of the producer's and rank {rank}'s): "
            f"raise it or send fewer groups per message"
        )
    if n_trajs > traj_cap or header > head_cap:
        raise ValueError(
            f"experience message of {n_trajs} trajectories with a header of {header} "
            f"bytes exceeds what experience.max_message_mb ({limit >> 20} MiB) allows: "
            f"at most {traj_cap} trajectories and {head_cap} header bytes "
            f"(rewards/timings/metadata); send fewer groups per message or raise it"
        )
