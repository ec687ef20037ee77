"""Every route of a vLLM server asyncrl launches needs the run secret (vLLM ``--middleware``).

vLLM 0.33's own ``--api-key`` guards only paths under ``/v1``, ``/v2``, ``/inference`` and
``/cohere`` (entrypoints/serve/middleware/authenticate.py:11, :59): ``/pause``,
``/resume``, ``/init_weight_transfer_engine``, ``/update_weights``, ``/weight_checker``,
``/collective_rpc``, ``/sleep``, ``/metrics`` ... answer anyone who reaches the port.
vLLM loads ASGI middleware named on its command line: ``--middleware MODULE.NAME``
(repeatable, entrypoints/common/cli_args.py:361-366, :406-411); a class is added with
``app.add_middleware(cls)`` and no arguments, after vLLM's own middleware
(serve/middleware/register.py:57-66), so it is the outermost one (Starlette's
``add_middleware`` inserts at the front, applications.py:107) and runs before vLLM's
authentication, CORS and every route.

:class:`RunSecretMiddleware` (``--middleware`` :data:`MIDDLEWARE`, added by the launcher)
answers a request only when it carries ``Authorization: Bearer <key>``
(:func:`asyncrl.secret.check_bearer`: constant time), on every path and method,
``/health``, ``/metrics`` and ``OPTIONS`` included; any other HTTP request gets 401 with
a JSON body before vLLM sees it (its body is not read), a websocket is closed before it is
accepted (the server answers 403). The key:

1. the run secret this process holds (:func:`asyncrl.secret.held`): a server asyncrl
   launches runs in :mod:`asyncrl.entrypoints.keyed`, which read it from the launcher's
   pipe; a server started by hand reads ``ASYNCRL_SECRET_FILE`` (or ``ASYNCRL_SECRET``);
2. else vLLM's own keys (``--api-key``, ``VLLM_API_KEY``: register.py:32-36, from
   ``app.state.args``, entrypoints/launchers/api_server/app_state.py:66): the API server
   processes vLLM starts itself (``--api-server-count`` > 1) got the run secret as
   ``--api-key`` from the keyed parent's arguments, not the pipe;
3. none: every request is refused (a server no key opens is safer than an open one) and
   the log says what to set.

Pure ASGI: this module imports no Starlette, FastAPI or vLLM.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from asyncrl import secret

__all__ = ["MIDDLEWARE", "RunSecretMiddleware"]

MIDDLEWARE = f"{__name__}.RunSecretMiddleware"
"""The import path vLLM's ``--middleware`` takes."""

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_BODY = json.dumps({"error": "Unauthorized: the run secret is required (docs/security.md)"})
log = logging.getLogger(__name__)


def _vllm_keys(scope: Scope) -> list[str]:
    """vLLM's own API keys, as register.py:32-36 takes them (the flag before the variable)."""
    args = getattr(getattr(scope.get("app"), "state", None), "args", None)
    keys = list(getattr(args, "api_key", None) or [os.environ.get("VLLM_API_KEY", "")])
    return [k for k in keys if k]


class RunSecretMiddleware:
    """ASGI middleware: the Bearer key on every route, else 401 (module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.keys: list[str] = []
        self.warned = False
        try:
            found = secret.held()
        except ValueError as exc:  # a secret file readable by others: refuse, say why
            log.error("asyncrl run-secret middleware: %s; every request is refused", exc)
            found = None
        if found is not None:
            self.keys = [found]

    def _keys(self, scope: Scope) -> list[str]:
        if not self.keys:
            self.keys = _vllm_keys(scope)
            if not self.keys and not self.warned:
                self.warned = True
                log.error(
                    "asyncrl run-secret middleware: no key (set ASYNCRL_SECRET_FILE to the "
                    "run's secret file); every request is refused"
                )
        return self.keys

    def allowed(self, scope: Scope) -> bool:
        """Whether the request's ``Authorization`` header carries one of the keys."""
        header = None
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                header = value.decode("latin-1")
                break
        return any(secret.check_bearer(header, key) for key in self._keys(scope))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or self.allowed(scope):
            await self.app(scope, receive, send)  # lifespan, or the key: on to vLLM
        elif kind == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # before accept: 403
        else:
            body = _BODY.encode()
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b"Bearer"),
            ]
            await send({"type": "http.response.start", "status": 401, "headers": headers})
            await send({"type": "http.response.body", "body": body})
