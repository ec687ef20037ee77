"""ZeroMQ channels between the controller and the trainer ranks.

Topology (all sockets bound by the controller, 127.0.0.1 unless configured)::

    controller PUSH[r] ──batches──▶ trainer rank r PULL      (one socket per rank)
    controller PULL    ◀─StepDone── trainer rank 0 PUSH

Sends are back-pressured by ZeroMQ's high-water mark: a trainer that does not
read makes ``send_batch`` wait, nothing is dropped. A malformed message is
logged, counted in ``rejected`` and skipped; the receiver keeps serving.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import zmq
import zmq.asyncio

from asyncrl.transports.experience.codec import MalformedMessage, decode, encode, encode_batch
from asyncrl.transports.experience.types import Message, Trajectory

__all__ = ["ControllerChannel", "TrainerChannel"]

log = logging.getLogger(__name__)
_HWM = 8  # batches in flight per rank before the controller waits


class ControllerChannel:
    """Controller side: one PUSH per trainer rank, one PULL for trainer reports."""

    def __init__(self, num_ranks: int, host: str = "127.0.0.1", max_message_bytes: int = 1 << 28):
        self._ctx = zmq.asyncio.Context()
        self._push: list[zmq.asyncio.Socket] = []
        self.batch_endpoints: list[str] = []
        for _ in range(num_ranks):
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, _HWM)
            sock.setsockopt(zmq.LINGER, 0)
            port = sock.bind_to_random_port(f"tcp://{host}")
            self._push.append(sock)
            self.batch_endpoints.append(f"tcp://{host}:{port}")
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._pull.setsockopt(zmq.LINGER, 0)
        port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.report_endpoint = f"tcp://{host}:{port}"
        self.rejected = 0

    async def send_batch(self, rank: int, step: int, trajs: Sequence[Trajectory]) -> None:
        """Send one step's shard to ``rank``; waits (never drops) while that rank is behind."""
        await self._push[rank].send_multipart(encode_batch(step, trajs), copy=False)

    async def broadcast(self, msg: Message) -> None:
        """Send a control message to every rank."""
        for sock in self._push:
            await sock.send_multipart(encode(msg))

    async def recv_report(self) -> Message:
        """Next well-formed message from the trainer; malformed ones are logged and skipped."""
        while True:
            frames = await self._pull.recv_multipart(copy=False)
            try:
                msg, _ = decode([f.buffer for f in frames])
                return msg
            except MalformedMessage as exc:
                self.rejected += 1
                log.warning("rejected malformed trainer report: %s", exc)

    def close(self) -> None:
        for sock in [*self._push, self._pull]:
            sock.close(linger=0)
        self._ctx.term()


class TrainerChannel:
    """Trainer side (blocking): PULL batches for this rank; rank 0 also PUSHes reports."""

    def __init__(
        self,
        batch_endpoint: str,
        report_endpoint: str | None,
        max_message_bytes: int = 1 << 28,
    ):
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, _HWM)
        self._pull.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.connect(batch_endpoint)
        self._push = None
        self._report_lock = threading.Lock()
        if report_endpoint:
            self._push = self._ctx.socket(zmq.PUSH)
            self._push.setsockopt(zmq.LINGER, 2000)
            self._push.connect(report_endpoint)
        self.rejected = 0

    def recv(self, timeout_s: float) -> tuple[Message, list[Trajectory]] | None:
        """Next well-formed message within ``timeout_s``, else None."""
        if not self._pull.poll(int(timeout_s * 1000)):
            return None
        frames = self._pull.recv_multipart(copy=False)
        try:
            return decode([f.buffer for f in frames])
        except MalformedMessage as exc:
            self.rejected += 1
            log.warning("rejected malformed batch: %s", exc)
            return None

    def report(self, msg: Message) -> None:
        """Send a report; safe to call from any thread."""
        assert self._push is not None, "only the reporting rank sends reports"
        with self._report_lock:
            self._push.send_multipart(encode(msg))

    def close(self) -> None:
        self._pull.close(linger=0)
        if self._push is not None:
            with self._report_lock:
                self._push.close()
        self._ctx.term()
