"""Sessions: one episode each, admitted by the controller, ended by a reward.

Contract:

- A session opened by an episode (:meth:`Sessions.open`, what ``task.name = "agent"``
  does) is admitted already. A session first named by a client
  (``/sessions/{id}/v1/...`` with an unknown id, or an unknown Bearer key when the
  gateway has no API key) is submitted to the controller as a :class:`SessionSample`;
  its requests wait for the episode that claims it (admission under the staleness
  bound), or get 429 per ``gateway.admission``.
- A session ends with ``POST /sessions/{id}/reward`` (or its episode's own end): each
  branch with a turn becomes a :class:`Trajectory` with that reward
  (``metadata = {"session", "branch"}``). Idle for ``session_timeout_s``, or cut by a
  client hang-up under ``on_disconnect = "drop"``, it is dropped: no trajectory.
- Requests answered once: a request whose body equals an earlier one of the session
  (an SDK retry) joins that turn or gets its answer again; no second turn is made.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from asyncrl.gateway.chat import Turn
from asyncrl.gateway.transcript import Transcript
from asyncrl.transports.experience.types import Trajectory

if TYPE_CHECKING:
    from asyncrl.controllers.episode import EpisodeContext
    from asyncrl.tasks.text import ChatTokenizer

__all__ = ["Session", "SessionSample", "Sessions"]


class SessionSample(msgspec.Struct, frozen=True):
    """The sample of a session a client opened: the controller admits it as any sample."""

    session: str
    id: int = 0


class Session:
    def __init__(self, sid: str, key: str, tok: ChatTokenizer):
        self.id = sid
        self.key = key
        self.transcript = Transcript(tok)
        self.ctx: EpisodeContext | None = None
        self.admitted = asyncio.Event()
        self.ended: asyncio.Future[float | None] = asyncio.get_running_loop().create_future()
        self.turns: dict[str, Turn] = {}  # request fingerprint -> its turn
        self.last_seen = time.monotonic()
        self.dropped = False
        self.inflight = 0

    def admit(self, ctx: EpisodeContext) -> None:
        self.ctx = ctx
        self.admitted.set()

    def end(self, reward: float | None) -> None:
        """Close the session with ``reward`` (None: dropped, no trajectory)."""
        if reward is None:
            self.dropped = True
        if not self.ended.done():
            self.ended.set_result(reward)
        for t in self.turns.values():
            t.cancel()

    @property
    def closed(self) -> bool:
        return self.ended.done()

    def trajectories(self, reward: float) -> list[Trajectory]:
        """One trajectory per branch that has a turn (their order: branch order)."""
        assert self.ctx is not None
        out = []
        for b in self.transcript.branches:
            if b.turns == 0:
                continue
            n = b.prompt_len
            traj = Trajectory(
                prompt_ids=np.asarray(b.ids[:n], np.int32),
                response_ids=np.asarray(b.ids[n:], np.int32),
                behav_logprobs=np.asarray(b.logprobs[n:], np.float32),
                versions=np.asarray(b.versions[n:], np.int32),
                loss_mask=np.asarray(b.mask[n:], np.uint8),
                reward=float(reward),
                group_id=self.ctx.group_id,
                episode_id=self.ctx.episode_id,
                metadata={"session": self.id, "branch": b.index},
            )
            model = [v for v, m in zip(b.versions[n:], b.mask[n:], strict=True) if m]
            self.ctx.made.append((traj, min(model) if model else 0))
            out.append(traj)
        return out

    def snapshot(self) -> dict[str, Any]:
        """The session's branches as JSON (``GET /sessions/{id}``)."""
        return {
            "id": self.id,
            "closed": self.closed,
            "dropped": self.dropped,
            "branches_opened": self.transcript.branches_opened,
            "branches": [
                {
                    "index": b.index,
                    "turns": b.turns,
                    "prompt_len": b.prompt_len,
                    "token_ids": b.ids,
                    "loss_mask": b.mask,
                    "logprobs": b.logprobs,
                    "versions": b.versions,
                }
                for b in self.transcript.branches
            ],
        }


def fingerprint(path: str, raw: bytes) -> str:
    return hashlib.sha256(path.encode() + b"\0" + raw).hexdigest()


class Sessions:
    """Every session of the gateway, by id and by key."""

    def __init__(self, tok: ChatTokenizer):
        self.tok = tok
        self.by_id: dict[str, Session] = {}
        self.by_key: dict[str, Session] = {}
        self.counters = dict.fromkeys(
            (
                "sessions",
                "turns",
                "retries_answered",
                "disconnects",
                "dropped",
                "timed_out",
                "rewarded",
                "branches_opened",
                "rejected",
            ),
            0,
        )

    def create(self, sid: str | None = None, key: str | None = None) -> Session:
        sid = sid or secrets.token_hex(8)
        if sid in self.by_id:
            raise ValueError(f"session {sid!r} exists already")
        s = Session(sid, key or f"sk-asyncrl-{secrets.token_urlsafe(24)}", self.tok)
        self.by_id[sid] = s
        self.by_key[s.key] = s
        self.counters["sessions"] += 1
        return s

    def forget(self, s: Session) -> None:
        self.by_id.pop(s.id, None)
        self.by_key.pop(s.key, None)
        self.counters["branches_opened"] += s.transcript.branches_opened
