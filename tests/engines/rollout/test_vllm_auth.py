"""The run-secret guard asyncrl gives vLLM (``--middleware``, asyncrl/engines/rollout/vllm/
auth.py) in a real Starlette app served by uvicorn on loopback, built as vLLM 0.33 builds
its own (entrypoints/serve/middleware/register.py): CORS (:25-31), vLLM's own
``AuthenticationMiddleware`` for ``--api-key`` (:32-36, its source loaded from vLLM's
file), then ``--middleware``'s class added with ``app.add_middleware(cls)`` and no
arguments (:57-63). The routes: every path vLLM 0.33's routers declare (scanned from its
source), each handler counting its calls."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import urllib.error
import urllib.request
from argparse import Namespace
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from asyncrl import secret
from asyncrl.engines.rollout.vllm.auth import MIDDLEWARE, RunSecretMiddleware
from asyncrl.procs import free_port
from tests.engines.rollout.vllm.code import load_file, vllm_src

starlette = pytest.importorskip("starlette", reason="the test extra installs starlette")
uvicorn = pytest.importorskip("uvicorn", reason="the test extra installs uvicorn")

from starlette.applications import Starlette  # noqa: E402
from starlette.middleware.cors import CORSMiddleware  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse  # noqa: E402
from starlette.routing import Route, WebSocketRoute  # noqa: E402
from starlette.websockets import WebSocket  # noqa: E402

_DECORATED = re.compile(r'@(?:router|app)\.(get|post|websocket)\(\s*"([^"]+)"')
_EXTRA = [
    ("get", "/metrics"),  # serve/instrumentator/metrics.py:77, a Mount
    ("post", "/inference/v1/abort_requests"),  # token_in_token_out/api_router.py:102
]


def vllm_routes() -> list[tuple[str, str]]:
    """``(method, path)`` of every route vLLM 0.33's entrypoints declare; ``{param}`` -> x."""
    found = set(_EXTRA)
    for path in (vllm_src() / "vllm" / "entrypoints").rglob("*.py"):
        found |= {(m, p) for m, p in _DECORATED.findall(path.read_text())}
    return sorted((m, re.sub(r"\{\w+\}", "x", p)) for m, p in found)


def vllm_app(calls: list[str], api_key: str | None) -> Starlette:
    """Routes as vLLM's, middleware as register.py adds them."""
    auth = load_file("vllm/entrypoints/serve/middleware/authenticate.py", "vllm_authenticate")

    async def handler(request: Request) -> JSONResponse:
        calls.append(f"{request.method} {request.url.path}")
        return JSONResponse({"ok": True})

    async def ws(websocket: WebSocket) -> None:
        calls.append(f"WS {websocket.url.path}")
        await websocket.accept()
        await websocket.close()

    routes: list[Any] = []
    for method, path in vllm_routes():
        if method == "websocket":
            routes.append(WebSocketRoute(path, ws))
        else:
            routes.append(Route(path, handler, methods=[method.upper()]))
    app = Starlette(routes=routes)
    app.state.args = Namespace(api_key=[api_key] if api_key else None)  # app_state.py:66
    app.add_middleware(CORSMiddleware, allow_origins=[], allow_methods=["*"])
    if api_key:
        app.add_middleware(auth.AuthenticationMiddleware, tokens=[api_key])
    module_path, name = MIDDLEWARE.rsplit(".", 1)
    imported = getattr(__import__(module_path, fromlist=[name]), name)
    assert imported is RunSecretMiddleware
    app.add_middleware(imported)  # register.py:62, no arguments
    return app


@contextmanager
def serve(app: Starlette) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    try:
        for _ in range(200):
            if server.started or not thread.is_alive():
                break
            thread.join(0.05)
        assert server.started, "uvicorn on loopback did not start within 10 s"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        assert not thread.is_alive(), "uvicorn did not stop within 10 s"


def _call(url: str, method: str, header: str | None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if header is not None:
        headers["Authorization"] = header
    data = b"{}" if method in ("POST", "OPTIONS") else None
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def _refusals(key: str) -> list[str | None]:
    return [None, f"Bearer {secret.generate()}", f"Bearer {key}x", f"Basic {key}", key, "Bearer"]


def test_every_vllm_route_needs_the_run_secret() -> None:
    calls: list[str] = []
    key = secret.load()
    routes = vllm_routes()
    assert ("post", "/pause") in routes and ("post", "/update_weights") in routes
    assert len(routes) > 60  # the scan found vLLM's routers
    with serve(vllm_app(calls, api_key=key)) as url:
        for method, path in routes:
            if method == "websocket":
                continue
            for header in _refusals(key):
                for m in (method.upper(), "OPTIONS"):  # OPTIONS: vLLM's own key lets it by
                    status, body = _call(url + path, m, header)
                    assert status == 401 and "run secret" in body["error"], (m, path, header)
        assert calls == []  # no handler ran
        for method, path in routes:
            if method != "websocket":
                assert _call(url + path, method.upper(), f"bearer {key}")[0] == 200, path
    assert len(calls) == len([r for r in routes if r[0] != "websocket"])


async def _websocket(app: Starlette, header: str | None) -> list[dict[str, Any]]:
    """One websocket handshake through the app's ASGI interface (as uvicorn drives it)."""
    headers = [] if header is None else [(b"authorization", header.encode())]
    scope = {"type": "websocket", "path": "/v1/realtime", "root_path": "", "headers": headers,
             "query_string": b"", "scheme": "ws", "server": ("127.0.0.1", 1),
             "subprotocols": []}  # fmt: skip
    inbox = [{"type": "websocket.connect"}, {"type": "websocket.disconnect", "code": 1000}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return inbox.pop(0) if inbox else {"type": "websocket.disconnect", "code": 1000}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


def test_a_websocket_without_the_key_is_closed_before_accept() -> None:
    calls: list[str] = []
    app = vllm_app(calls, api_key=secret.load())

    async def both() -> None:
        for header in _refusals(secret.load()):
            assert await _websocket(app, header) == [{"type": "websocket.close", "code": 1008}]
        assert calls == []
        sent = await _websocket(app, f"Bearer {secret.load()}")
        assert sent[0]["type"] == "websocket.accept" and calls == ["WS /v1/realtime"]

    asyncio.run(both())


def test_without_a_run_secret_it_takes_vllms_key_or_refuses_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A process holding no run secret (vLLM's own API server processes): vLLM's
    ``--api-key`` (app.state.args) is the key; with none either, every request is refused."""
    monkeypatch.setattr(secret, "_current", None)
    for name in (secret.ENV_FD, secret.ENV_SECRET, secret.ENV_FILE, "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    key = secret.generate()
    calls: list[str] = []
    with serve(vllm_app(calls, api_key=key)) as url:
        assert _call(url + "/pause", "POST", None)[0] == 401
        assert _call(url + "/pause", "POST", f"Bearer {key}")[0] == 200
    assert calls == ["POST /pause"]
    with serve(vllm_app(calls, api_key=None)) as url:
        for header in (None, f"Bearer {key}", "Bearer "):
            assert _call(url + "/pause", "POST", header)[0] == 401
            assert _call(url + "/health", "GET", header)[0] == 401
    assert calls == ["POST /pause"]
    assert secret._current is None  # it made no secret of its own
