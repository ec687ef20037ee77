"""The gateway's HTTP server (aiohttp, in the controller's event loop) and its episode.

Routes (each also under ``/sessions/{id}``, so an agent only changes ``base_url``):
``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``; and
``POST /sessions/{id}/reward`` (``{"reward": float}``: the session ends, its branches
become trajectories; also ``POST {base_url}/reward``, i.e. ``/sessions/{id}/v1/reward``,
or ``/v1/reward`` naming the session by its key), ``GET /sessions/{id}`` (its branches,
token by token), ``GET /health``, ``GET /stats``.

Every route answers only a request that carries, as ``Authorization: Bearer``, the gateway
key (the user's ``gateway.api_key_*``, else derived from the run secret: any session, and
``/stats``) or a session's own key (:mod:`asyncrl.gateway.auth`: that session only, by its
path or, with no session in the path, by the key alone). Anything else gets 401 (a valid
session key on another session's route or on ``/stats``: 403) before the request's body is
read: no session is opened, nothing recorded. Errors are OpenAI's JSON (``{"error":
{...}}``) with a 4xx for anything the client sent; 503 only when the engines failed the
request after every retry.

:meth:`Gateway.episode` is the controller's episode function: a
:class:`~asyncrl.gateway.sessions.SessionSample` (a group a client opened) binds the
group's next member session and waits for its end; any other sample runs the configured
agent function against a new session (``task.name = "agent"``). An agent function that
raises, or runs past ``gateway.agent_timeout_s`` (default ``session_timeout_s``), loses
its sample only (:class:`~asyncrl.controllers.episode.EpisodeRejected`, logged once with
the sample id; a new error's traceback once): its session ends and its engine requests
are aborted.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import secrets
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from asyncrl import secret
from asyncrl.config import DEFAULT_MAX_NEW_TOKENS, GatewayConfig
from asyncrl.controllers.episode import EpisodeContext, EpisodeFailed, EpisodeRejected
from asyncrl.core import Trajectory
from asyncrl.gateway.auth import gateway_key, session_key, session_of
from asyncrl.gateway.chat import Turn
from asyncrl.gateway.protocol import ApiError, chat_request, completion_request
from asyncrl.gateway.sessions import (
    AGENT_PREFIX,
    Session,
    Sessions,
    SessionSample,
    fingerprint,
    member_of,
)
from asyncrl.gateway.stream import chat_body, completion_body, stream_turn
from asyncrl.tasks.text import ChatTokenizer

if TYPE_CHECKING:
    from asyncrl.controllers.controller import Controller

__all__ = ["AgentFn", "Gateway"]

log = logging.getLogger("asyncrl.gateway")
# who sent a request (Gateway._authorize): "" the gateway key, else the one session its key opens
_KEYED = web.RequestKey("keyed", str)
AgentFn = Callable[[Any, Any], Awaitable["float | None"]]


class Gateway:
    """OpenAI-compatible sessions over a controller (see the module docstring).

    ``gw = Gateway(cfg.gateway, model_path)``; ``Controller(cfg, episode=gw.episode, ...)``;
    ``gw.attach(ctl)``; ``await gw.start()`` (returns the base URL); ``await gw.close()``.
    ``gw.api_key`` is the gateway key every client sends (``gateway.api_key_env`` /
    ``api_key_file``, else derived from this process's run secret, :func:`asyncrl.secret.load`);
    ``gw.session_key(sid)`` the key of one session only.
    """

    def __init__(
        self,
        config: GatewayConfig,
        model_path: str,
        agent: AgentFn | None = None,
        default_max_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        sample_type: Any = None,
    ):
        """``sample_type``: the agent's sample type, which a sample restored from a
        checkpoint as a plain dict is converted to (the controller decodes an agent run's
        samples untyped: its queue holds client-opened groups too)."""
        self.cfg = config
        self.sample_type = sample_type
        self.instance = secrets.token_hex(8)  # this gateway, apart from one before a restart
        self.tok = ChatTokenizer(model_path)
        self.model = config.model_name or Path(model_path).name
        self.agent = agent
        self.max_tokens = config.max_tokens or default_max_tokens
        user_key = _api_key(config)
        self.user_key = user_key is not None  # the user chose it (else: the run secret's)
        self.api_key: str = user_key or gateway_key(secret.load())
        self.sessions = Sessions(self.tok, self.api_key)
        self.agent_timeout_s = config.agent_timeout_s or config.session_timeout_s
        self._agent_errors: set[tuple[str, str, int]] = set()  # tracebacks logged: once each
        self.controller: Controller | None = None
        self.url = ""
        self._runner: web.AppRunner | None = None

    def attach(self, controller: Controller) -> None:
        """The controller whose episodes the sessions are (clients may then open sessions)."""
        self.controller = controller

    # -- lifecycle ------------------------------------------------------------------------
    def session_key(self, sid: str) -> str:
        """The key that opens and names session ``sid`` only (:mod:`asyncrl.gateway.auth`)."""
        return session_key(self.api_key, sid)

    async def start(self) -> str:
        @web.middleware
        async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
            request[_KEYED] = self._authorize(request) or ""  # before anything else of it
            return await handler(request)

        app = web.Application(middlewares=[_errors, guard], client_max_size=32 << 20)
        app.router.add_get("/health", self._health)
        app.router.add_get("/stats", self._stats)
        for prefix in ("", "/sessions/{sid}"):
            app.router.add_post(prefix + "/v1/chat/completions", self._chat)
            app.router.add_post(prefix + "/v1/completions", self._completions)
            app.router.add_get(prefix + "/v1/models", self._models)
            app.router.add_post(prefix + "/v1/reward", self._reward)  # base_url + "/reward"
        app.router.add_post("/sessions/{sid}/reward", self._reward)
        app.router.add_get("/sessions/{sid}", self._show)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port)
        await site.start()
        port = self._runner.addresses[0][1]
        host = self.cfg.host if ":" not in self.cfg.host else f"[{self.cfg.host}]"
        self.url = f"http://{host}:{port}"
        return self.url

    async def close(self) -> None:
        for s in list(self.sessions.by_id.values()):
            s.end(None)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def stats(self) -> dict[str, int]:
        return {**self.sessions.counters, "open": len(self.sessions.by_id)}

    # -- episodes -------------------------------------------------------------------------
    def open(self, ctx: EpisodeContext) -> Session:
        """A new session of episode ``ctx`` (already admitted); ``session_url(s)`` is its
        base URL, ``s.key`` its API key."""
        s = self.sessions.create()
        s.admit(ctx)
        return s

    def session_url(self, s: Session) -> str:
        return f"{self.url}/sessions/{s.id}/v1"

    async def episode(self, ctx: EpisodeContext, sample: Any) -> list[Trajectory] | None:
        if isinstance(sample, dict):  # restored from a checkpoint
            kind = SessionSample if "session" in sample else self.sample_type
            sample = msgspec.convert(sample, kind) if kind is not None else sample
        if isinstance(sample, SessionSample):
            if sample.gateway != self.instance:  # opened before a restart: its transcript is
                self.sessions.counters["restart_dropped"] += 1  # not in the checkpoint
                return None
            s = self.sessions.bind(sample.session, ctx)
            if s is None:
                return None
            try:
                reward = await self._until_end(s)
            finally:
                self.sessions.forget(s)
        else:
            if self.agent is None:
                raise TypeError("the gateway has no agent function for this sample")
            s = self.open(ctx)
            try:
                reward = await self._run_agent(s, sample)
            finally:
                self.sessions.forget(s)
        if reward is None or s.dropped:
            self.sessions.counters["dropped"] += 1
            return None
        self.sessions.counters["rewarded"] += 1
        return s.trajectories(reward) or None

    async def _run_agent(self, s: Session, sample: Any) -> float | None:
        """The agent's reward (None: it rejected the sample). An agent that raises, returns
        no number or outlives ``agent_timeout_s`` raises :class:`EpisodeRejected` (logged
        here with the sample id); its session ends, which aborts its engine requests."""
        import openai

        agent = self.agent
        assert agent is not None
        # the session URL is plain http: no TLS, so no CA bundle to load (loading it made
        # each episode's client cost ~24 ms, 2.5 ms without); the agent may close its own
        http = openai.DefaultAsyncHttpxClient(verify=False)
        client = openai.AsyncOpenAI(
            base_url=self.session_url(s), api_key=s.key, max_retries=2, http_client=http
        )

        async def call() -> Any:  # a sync function's value fails here, as the agent's error
            return await agent(client, sample)

        task = asyncio.ensure_future(call())
        try:
            done, _ = await asyncio.wait({task}, timeout=self.agent_timeout_s)
            if not done:
                self.sessions.counters["timed_out"] += 1
                raise self._agent_failed(s, sample, None)
            if task.cancelled():  # the agent cancelled itself: an error of the agent's
                raise self._agent_failed(s, sample, RuntimeError("the agent was cancelled"))
            exc = task.exception()
            if exc is not None:
                raise self._agent_failed(s, sample, exc) from exc
            value = task.result()
            try:
                reward = None if value is None else float(value)
            except (TypeError, ValueError) as bad:
                raise self._agent_failed(s, sample, bad) from bad
            s.end(reward)
            return reward
        finally:
            if not s.closed:  # its turns cancelled: the engine aborts their requests
                s.end(None)
            if not task.done():
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.close()

    def _agent_failed(self, s: Session, sample: Any, exc: BaseException | None) -> EpisodeRejected:
        """Log one line for this sample (the traceback once per distinct error) and return
        the rejection that names the cause."""
        sid = getattr(sample, "id", None)
        name = _agent_name(self.agent)
        if exc is None:
            knob = "agent_timeout_s" if self.cfg.agent_timeout_s else "session_timeout_s"
            cause = (
                f"agent {name} ran past gateway.{knob}={self.agent_timeout_s:g}s on sample id "
                f"{sid!r}: cancelled, its requests aborted"
            )
            log.warning("%s; episode rejected (session %s)", cause, s.id)
            return EpisodeRejected(cause)
        self.sessions.counters["agent_failed"] += 1
        if isinstance(exc, EpisodeRejected):  # the agent's own account (a command's exit)
            log.warning("agent %s on sample id %r: %s; episode rejected", name, sid, exc)
            return EpisodeRejected(f"agent {name} on sample id {sid!r}: {exc}")
        frames = traceback.extract_tb(exc.__traceback__)
        where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        cause = f"agent {name} raised {type(exc).__name__}: {exc}{where} (sample id {sid!r})"
        last = (frames[-1].filename, frames[-1].lineno or 0) if frames else ("", 0)
        key = (type(exc).__name__, *last)
        if key in self._agent_errors:
            log.warning("%s; episode rejected (traceback logged at its first time)", cause)
        else:
            self._agent_errors.add(key)
            log.error("%s; episode rejected", cause, exc_info=exc)
        return EpisodeRejected(cause)

    async def _until_end(self, s: Session) -> float | None:
        timeout = self.cfg.session_timeout_s
        while True:
            idle = time.monotonic() - s.last_seen
            try:
                return await asyncio.wait_for(asyncio.shield(s.ended), max(0.05, timeout - idle))
            except asyncio.TimeoutError:
                if s.inflight == 0 and time.monotonic() - s.last_seen >= timeout:
                    self.sessions.counters["timed_out"] += 1
                    s.end(None)
                    return None

    # -- sessions of requests ---------------------------------------------------------------
    def _token(self, request: web.Request) -> str | None:
        auth = request.headers.get("Authorization", "")
        return auth[7:].strip() if auth[:7].lower() == "bearer " else None

    async def _session(self, request: web.Request) -> Session:
        """The session a completion request names (its path's id, else its session key's),
        opened for a client when new (a client-opened group's member)."""
        sid = request.match_info.get("sid") or request[_KEYED]
        if not sid:
            msg = "name a session: /sessions/{id}/v1/..., or a session's key as Bearer"
            raise ApiError(400, msg)
        s = self.sessions.by_id.get(sid) or self._external(sid)
        if s.closed:
            raise ApiError(409, f"session {s.id} has ended", kind="session_ended")
        s.last_seen = time.monotonic()
        if not s.admitted.is_set():
            try:
                wait = self.cfg.admission_timeout_s  # under "reject", _external checked it fits
                await asyncio.wait_for(asyncio.shield(s.admitted.wait()), wait)
            except asyncio.TimeoutError:
                raise self._busy() from None
        return s

    def _busy(self) -> ApiError:
        self.sessions.counters["rejected"] += 1
        after = str(self.cfg.retry_after_s)
        msg = "no episode may start now (staleness bound): retry later"
        headers = {"Retry-After": after}
        return ApiError(
            429, msg, kind="rate_limit_error", headers=headers, code="rate_limit_exceeded"
        )

    def _external(self, sid: str) -> Session:
        ctl = self.controller
        if ctl is None:
            raise ApiError(404, f"no session {sid!r} (this gateway opens none for clients)")
        if sid.startswith(AGENT_PREFIX):  # an agent's session, ended with its episode
            raise ApiError(404, f"no open session {sid!r}", kind="not_found")
        size = ctl.config.algo.group_size
        try:
            group, k = member_of(sid, size)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        new = group not in self.sessions.groups
        if new and (still := self.sessions.open_members(group, size, k)):
            # an earlier group of that name still has a member open (waiting for its client):
            # a new group's member of the same id could not be told from it
            msg = (
                f"session group {group!r} still has member {still[0]!r} open (of an earlier "
                "group of that name): name it, or a new group"
            )
            raise ApiError(409, msg, kind="session_ended")
        if new and self.cfg.admission == "reject" and not ctl.staleness.can_admit():
            raise self._busy()
        s = self.sessions.join(group, k, size, sid)
        if new:
            ctl.submit([SessionSample(group, gateway=self.instance)])
        return s

    # -- handlers ---------------------------------------------------------------------------
    def _authorize(self, request: web.Request) -> str | None:
        """Who sent the request: None for the gateway key (any session), else the id of the
        one session its key opens. 401 for no key or a wrong one; 403 for a session key on a
        route of another session. Run on every request before its handler (so before its
        body is read, a session opened or anything recorded)."""
        token = self._token(request)
        if token is None:
            raise _unauthorized(None)
        if hmac.compare_digest(token.encode(errors="replace"), self.api_key.encode()):
            return None
        sid = session_of(self.api_key, token)
        if sid is None:
            raise _unauthorized(token)
        named = request.match_info.get("sid")
        if named is not None and named != sid:
            raise _forbidden(f"this key opens session {sid!r} only")
        return sid

    def _check_model(self, body: Any) -> None:
        name = body.get("model") if isinstance(body, dict) else None
        if self.cfg.strict_model and name != self.model:
            msg = f"The model `{name}` does not exist (this gateway serves `{self.model}`)"
            raise ApiError(404, msg, "model", code="model_not_found")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = _json(raw)
        params, msgs = chat_request(body, self.cfg.max_n)
        self._check_model(body)
        s = await self._session(request)

        def make() -> Turn:
            branch, text = s.transcript.prompt(msgs, params.tools)
            turn = self._turn(s, params, branch, "chat")

            def record(t: Turn) -> None:
                for c in t.choices:
                    out = (c.ids, c.logprobs, c.versions)
                    cut = c.finish == "length"
                    s.transcript.record(c.branch, msgs, text, out, c.reply(), truncated=cut)
                self.sessions.counters["turns"] += 1

            turn.start(record)
            return turn

        turn = self._join_or(s, fingerprint("chat", raw), make)
        return await self._answer(request, s, turn, chat_body)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = _json(raw)
        params, prompt = completion_request(body, self.cfg.max_n)
        self._check_model(body)
        s = await self._session(request)
        if isinstance(prompt, list) and max(prompt) >= self.tok.tokenizer.get_vocab_size(True):
            raise ApiError(400, "prompt holds a token id outside the vocabulary", "prompt")

        def make() -> Turn:
            branch = s.transcript.completion_prompt(prompt)
            turn = self._turn(s, params, branch, "text")

            def record(t: Turn) -> None:
                for c in t.choices:
                    out = (c.ids, c.logprobs, c.versions)
                    cut = c.finish == "length"
                    s.transcript.record_completion(c.branch, prompt, out, c.text, truncated=cut)
                self.sessions.counters["turns"] += 1

            turn.start(record)
            return turn

        turn = self._join_or(s, fingerprint("text", raw), make)
        return await self._answer(request, s, turn, completion_body)

    def _turn(self, s: Session, params: Any, branch: Any, kind: str) -> Turn:
        assert s.ctx is not None
        budget = params.max_tokens or self.max_tokens
        return Turn(s.ctx, self.tok, s.transcript, params, branch, budget, kind)

    def _join_or(self, s: Session, fp: str, make: Callable[[], Turn]) -> Turn:
        """The turn of an identical earlier request (an SDK retry) unless it failed; else a
        new one."""
        turn = s.turns.get(fp)
        if turn is not None and not (turn.done.is_set() and turn.error is not None):
            self.sessions.counters["retries_answered"] += 1
            return turn
        turn = s.turns[fp] = make()
        return turn

    async def _answer(
        self, request: web.Request, s: Session, turn: Turn, body: Callable[..., Any]
    ) -> web.StreamResponse:
        turn.readers += 1
        s.inflight += 1
        try:
            if turn.params.stream:
                return await stream_turn(request, turn, self.model)
            await asyncio.shield(turn.done.wait())
            if turn.error is not None:
                raise turn.error
            return web.json_response(body(turn, self.model))
        except (asyncio.CancelledError, ConnectionError):
            if turn.readers == 1 and not turn.done.is_set():
                self._disconnected(s, turn)
            raise
        except EpisodeFailed as exc:
            msg = f"the engines failed this request: {exc}"
            raise ApiError(503, msg, kind="server_error") from exc
        finally:
            turn.readers -= 1
            s.inflight -= 1
            s.last_seen = time.monotonic()

    def _disconnected(self, s: Session, turn: Turn) -> None:
        """The last reader of an unfinished turn hung up: ``on_disconnect`` decides."""
        self.sessions.counters["disconnects"] += 1
        turn.cancel()
        if self.cfg.on_disconnect == "drop":
            s.end(None)

    async def _models(self, request: web.Request) -> web.Response:
        model = {"id": self.model, "object": "model", "created": 0, "owned_by": "asyncrl"}
        return web.json_response({"object": "list", "data": [model]})

    async def _reward(self, request: web.Request) -> web.Response:
        s = self._named(request)
        body = _json(await request.read())
        reward = body.get("reward") if isinstance(body, dict) else None
        if isinstance(reward, bool) or not isinstance(reward, int | float) or reward != reward:
            raise ApiError(400, 'the body must be {"reward": number}', "reward")
        if s.closed:
            raise ApiError(409, f"session {s.id} has ended", kind="session_ended")
        s.end(float(reward))
        return web.json_response({"session": s.id, "reward": float(reward)})

    async def _show(self, request: web.Request) -> web.Response:
        return web.json_response(self._named(request).snapshot())

    def _named(self, request: web.Request) -> Session:
        """The open session the request names: by its path's id, or (no id in the path:
        ``POST /v1/reward``) by its session key. 400 for the gateway key with no session in
        the path; 404 for no such open session."""
        sid = request.match_info.get("sid") or request[_KEYED]
        if not sid:
            msg = "name a session: /sessions/{id}/v1/reward, or a session's key as Bearer"
            raise ApiError(400, msg)
        s = self.sessions.by_id.get(sid)
        if s is None:
            raise ApiError(404, f"no open session {sid!r}", kind="not_found")
        return s

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _stats(self, request: web.Request) -> web.Response:
        if request[_KEYED]:
            raise _forbidden("/stats answers the gateway key only")
        return web.json_response(self.stats())


def _unauthorized(token: str | None) -> ApiError:
    """OpenAI's 401 (its body as api.openai.com writes it; the key itself is not echoed)."""
    msg = "Incorrect API key provided" if token else "You didn't provide an API key"
    return ApiError(401, msg, kind="invalid_request_error", code="invalid_api_key")


def _forbidden(msg: str) -> ApiError:
    """A valid session key on a route it does not open: 403 (the ``openai`` client raises
    ``PermissionDeniedError``)."""
    return ApiError(403, msg, kind="permission_error", code="wrong_session")


def _agent_name(fn: Any) -> str:
    """``module:qualname`` of an agent function (a command agent: its argv)."""
    argv = getattr(fn, "argv", None)
    if argv is not None:
        return f"command {argv!r}"
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}:{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def _api_key(cfg: GatewayConfig) -> str | None:
    """The gateway's key, from ``api_key_env`` or ``api_key_file`` (never from the config
    itself); None when neither is named."""
    if cfg.api_key_env and cfg.api_key_file:
        raise ValueError("gateway.api_key_env and gateway.api_key_file: name at most one")
    if cfg.api_key_env:
        key = os.environ.get(cfg.api_key_env, "").strip()
        if not key:
            raise ValueError(f"gateway.api_key_env names {cfg.api_key_env!r}, which is not set")
        return key
    if cfg.api_key_file:
        try:
            lines = Path(cfg.api_key_file).read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"gateway.api_key_file: cannot read it: {exc.strerror}") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise ValueError(f"gateway.api_key_file {cfg.api_key_file!r} is empty")
        return key
    return None


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        raise ApiError(400, "the body is not valid JSON") from None


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        if exc.status >= 500:
            log.warning("%s: %s", request.path, exc.message)
        return web.json_response(exc.body(), status=exc.status, headers=exc.headers)
    except web.HTTPException as exc:  # aiohttp's own: 404 route, 405 method, 413 too large
        if exc.status < 400:
            raise
        body = ApiError(exc.status, exc.reason or "request refused").body()
        return web.json_response(body, status=exc.status)
