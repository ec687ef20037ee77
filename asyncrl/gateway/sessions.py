"""Sessions: one episode each, admitted by the controller, ended by a reward.

Contract:

- Every session has its own key (:func:`asyncrl.gateway.auth.session_key`: derived from
  the gateway key and the session id), which opens and names that session only.
- A session opened by an episode (:meth:`Sessions.create`, what ``task.name = "agent"``
  does) is admitted already. A session first named by a client
  (``/sessions/{id}/v1/...`` with an unknown id under the gateway key, or the Bearer
  session key of an unknown id) is one member of a client-opened group: id
  ``GROUP.K`` is member ``K`` of ``GROUP``, ``K`` in ``0..group_size-1`` (a plain
  ``GROUP`` is member 0, and only when ``group_size`` is 1). The group's first member
  submits a :class:`SessionSample` to the controller; each of the group's
  ``group_size`` episodes binds one member (:meth:`Sessions.bind`; a member no client
  named yet is opened for it and waits for its client, up to ``session_timeout_s``).
  Requests wait for their episode (admission under the staleness bound), or get 429
  per ``gateway.admission``.
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
import re
import secrets
import time
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from asyncrl.core import Trajectory
from asyncrl.gateway.auth import session_key
from asyncrl.gateway.chat import Turn
from asyncrl.gateway.transcript import Transcript

if TYPE_CHECKING:
    from asyncrl.controllers.episode import EpisodeContext
    from asyncrl.tasks.text import ChatTokenizer

__all__ = ["Session", "SessionGroup", "SessionSample", "Sessions", "member_of"]

_MEMBER = re.compile(r"([A-Za-z0-9_-]{1,128})(?:\.([0-9]{1,4}))?")


class SessionSample(msgspec.Struct, frozen=True):
    """The sample of a group of sessions a client opened (``session``: the group's name):
    the controller admits it as any sample, and each of its ``group_size`` episodes binds
    one member session."""

    session: str
    id: int = 0
    gateway: str = ""  # the instance of the gateway that opened it (a restart makes another)


def member_of(name: str, group_size: int) -> tuple[str, int]:
    """``(group, k)`` of a client-named session ``GROUP`` or ``GROUP.K`` (an ApiError-ready
    ValueError, naming the form, for anything else or a ``K`` outside ``0..group_size-1``).
    A plain ``GROUP`` is member 0 of a group of one: with ``group_size > 1`` it is refused
    (each episode of the group is its own session, so the client names which)."""
    m = _MEMBER.fullmatch(name)
    if m is None:
        raise ValueError("a session id is GROUP or GROUP.K: 1-128 letters, digits, '-', '_'")
    group, k = m.group(1), m.group(2)
    if k is None:
        if group_size > 1:
            raise ValueError(
                f"algo.group_size is {group_size}: each episode of a group is its own session;"
                f" name it GROUP.K with K in 0..{group_size - 1} (e.g. {group}.0)"
            )
        return group, 0
    if int(k) >= group_size:
        raise ValueError(f"session {name!r}: K must be in 0..{group_size - 1} (algo.group_size)")
    return group, int(k)


class SessionGroup:
    """The ``size`` member sessions of one client-opened group, by index; an episode of the
    group binds the next unbound member (opening it if no client named it yet)."""

    def __init__(self, name: str, size: int):
        self.name = name
        self.members: list[Session | None] = [None] * size
        self.bound = 0


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
                metadata={
                    "session": self.id,
                    "branch": b.index,
                    **({"truncated": True} if b.truncated else {}),  # algo.mask_truncated
                },
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


AGENT_PREFIX = "agent-"
"""The ids of sessions an agent-mode episode opens (a client cannot open one of that name)."""


class Sessions:
    """Every session of the gateway, by id; ``gateway_key`` derives each session's key."""

    def __init__(self, tok: ChatTokenizer, gateway_key: str):
        self.tok = tok
        self.gateway_key = gateway_key
        self.by_id: dict[str, Session] = {}
        self.groups: dict[str, SessionGroup] = {}  # client-opened groups not fully bound
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
                "restart_dropped",
                "agent_failed",
            ),
            0,
        )

    def create(self, sid: str | None = None) -> Session:
        """A new session named ``sid`` (None: an agent-mode episode's, ``agent-`` + random)."""
        sid = sid or AGENT_PREFIX + secrets.token_hex(8)
        if sid in self.by_id:
            raise ValueError(f"session {sid!r} exists already")
        s = Session(sid, session_key(self.gateway_key, sid), self.tok)
        self.by_id[sid] = s
        self.counters["sessions"] += 1
        return s

    def join(self, group: str, k: int, size: int, sid: str) -> Session:
        """Open member ``k`` of ``group`` as session ``sid`` (the group too, when new: the
        caller then submits its :class:`SessionSample`)."""
        g = self.groups.get(group)
        if g is None:
            g = self.groups[group] = SessionGroup(group, size)
        prior = g.members[k]
        if prior is not None:  # opened already (by the group's episode, waiting for it)
            return prior
        s = g.members[k] = self.create(sid)
        return s

    def bind(self, group: str, ctx: EpisodeContext) -> Session | None:
        """The session of the next episode of ``group`` (admitted as ``ctx``); None when
        the group is unknown (e.g. a run resumed from a checkpoint) or fully bound."""
        g = self.groups.get(group)
        if g is None or g.bound >= len(g.members):
            return None
        k = g.bound
        g.bound += 1
        if g.bound == len(g.members):
            del self.groups[group]  # every member has its episode: the name is free again
        s = g.members[k]
        if s is None:
            s = g.members[k] = self.create(f"{group}.{k}")
        s.admit(ctx)
        return s

    def open_members(self, group: str, size: int, but: int) -> list[str]:
        """Ids ``GROUP.J`` (J != ``but``) still open: members of an earlier group of that
        name, which a new group's episodes could not open again (:meth:`bind`)."""
        names = [f"{group}.{j}" for j in range(size) if j != but] if size > 1 else []
        return [n for n in names if n in self.by_id]

    def forget(self, s: Session) -> None:
        self.by_id.pop(s.id, None)
        self.counters["branches_opened"] += s.transcript.branches_opened
