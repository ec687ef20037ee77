"""The two paths of ``asyncrl bench gateway`` (see :mod:`asyncrl.bench.gateway`): sessions
through the gateway with the real ``openai`` client, and the same generations replayed
straight to the engine; and the hold phase (many sessions open at once)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from typing import Any

__all__ = ["Call", "direct_run", "gateway_run", "hold_sessions", "paired_run", "start_proxy"]

Call = tuple[list[int], dict[str, Any]]  # (input ids, sampling params) of one /generate
Row = tuple[float, "float | None", int]  # latency s, time to first token s, tokens


def _key() -> str:
    """The gateway key of this process's gateway (derived from its run secret)."""
    from asyncrl import secret
    from asyncrl.gateway.auth import gateway_key

    return gateway_key(secret.load())


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {_key()}"}


def _client(conns: int) -> Any:
    import openai

    limits = openai._httpx.Limits(max_connections=conns, max_keepalive_connections=conns)
    http = openai.DefaultAsyncHttpxClient(limits=limits, timeout=600)
    return openai.AsyncOpenAI(base_url="http://unused/v1", api_key=_key(), http_client=http)


async def _turn(client: Any, msgs: list[dict[str, Any]], stream: bool, n: int) -> tuple[Row, str]:
    kw: dict[str, Any] = {"model": "tiny", "messages": msgs, "max_tokens": n}
    kw["extra_body"] = {"ignore_eos": True}
    t0 = time.perf_counter()
    ttft = None
    if not stream:
        r = await client.chat.completions.create(**kw)
        text = r.choices[0].message.content or ""
        tokens = r.usage.completion_tokens
    else:
        text, tokens = "", 0
        kw["stream_options"] = {"include_usage": True}
        async for chunk in await client.chat.completions.create(stream=True, **kw):
            if chunk.choices and chunk.choices[0].delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text += chunk.choices[0].delta.content
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    lat = time.perf_counter() - t0
    if tokens != n:
        raise RuntimeError(f"the gateway answered {tokens} tokens, asked for exactly {n}")
    return (lat, ttft, tokens), text


async def _raw_turn(
    http: Any, url: str, msgs: list[dict[str, Any]], stream: bool, n: int
) -> tuple[Row, str]:
    """:func:`_turn` by plain aiohttp (no SDK): the gateway's own cost, apart from the
    ``openai`` client's."""
    body: dict[str, Any] = {"model": "tiny", "messages": msgs, "max_tokens": n, "ignore_eos": True}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    t0 = time.perf_counter()
    ttft = None
    text, tokens = "", 0
    async with http.post(f"{url}/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"the gateway answered {r.status}: {await r.text()}")
        if not stream:
            out = await r.json()
            text = out["choices"][0]["message"]["content"]
            tokens = out["usage"]["completion_tokens"]
        else:
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                piece = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
                if piece:
                    ttft = time.perf_counter() - t0 if ttft is None else ttft
                    text += piece
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    if tokens != n:
        raise RuntimeError(f"the gateway answered {tokens} tokens, asked for exactly {n}")
    return (time.perf_counter() - t0, ttft, tokens), text


async def gateway_run(
    url: str, args: argparse.Namespace, stream: bool, sessions: int, conc: int, sdk: bool = True
) -> tuple[list[Row], float]:
    """``sessions`` sessions of ``args.turns`` turns, ``conc`` at a time, each ended by a
    reward, by the ``openai`` client (``sdk``) or plain aiohttp: the rows of every
    request and the wall time."""
    import aiohttp

    base = _client(conc + 4)
    rows: list[Row] = []
    sem = asyncio.Semaphore(conc)

    async def session(k: int, http: aiohttp.ClientSession) -> None:
        async with sem:
            sid = uuid.uuid4().hex[:16]
            client = base.with_options(base_url=f"{url}/sessions/{sid}/v1")
            msgs: list[dict[str, Any]] = [{"role": "user", "content": f"Weather in city {k}?"}]
            for t in range(args.turns):
                if sdk:
                    row, text = await _turn(client, msgs, stream, args.max_tokens)
                else:
                    turl = f"{url}/sessions/{sid}/v1"
                    row, text = await _raw_turn(http, turl, msgs, stream, args.max_tokens)
                rows.append(row)
                msgs += [{"role": "assistant", "content": text}]
                msgs += [{"role": "user", "content": f"And tomorrow, day {t + 1}?"}]
            async with http.post(f"{url}/sessions/{sid}/reward", json={"reward": 1.0}) as r:
                if r.status != 200:
                    raise RuntimeError(f"reward of session {sid}: {r.status} {await r.text()}")

    try:
        conn = aiohttp.TCPConnector(limit=conc + 4)
        async with aiohttp.ClientSession(connector=conn, headers=_auth()) as http:
            t0 = time.perf_counter()
            await asyncio.gather(*(session(k, http) for k in range(sessions)))
            wall = time.perf_counter() - t0
    finally:
        await base.close()
    return rows, wall


async def direct_run(
    engine_url: str, calls: list[Call], stream: bool, conc: int
) -> tuple[list[Row], float]:
    """``calls`` sent to the engine by the SGLang client, ``conc`` at a time, in order."""
    from asyncrl.engines.rollout.sglang import SGLangClient

    client = SGLangClient(engine_url, timeout_s=600)
    rows: list[Row] = []
    todo = iter(calls)

    async def worker() -> None:
        for ids, sp in todo:
            t0 = time.perf_counter()
            ttft = None
            if stream:
                async for res in client.generate_stream(ids, sp):
                    if ttft is None and res.output_ids:
                        ttft = time.perf_counter() - t0
            else:
                res = await client.generate(ids, sp)
            rows.append((time.perf_counter() - t0, ttft, len(res.output_ids)))

    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(conc)))
        wall = time.perf_counter() - t0
    finally:
        await client.close()
    return rows, wall


async def start_proxy(engine_url: str) -> tuple[str, Any]:
    """The floor of any HTTP service in front of the engine: an aiohttp server on the
    caller's event loop (the gateway's own stack and loop) that forwards each request's
    method, path, body and ``Authorization`` to the engine and sends the answer back
    unchanged (an event stream chunk by chunk), nothing else. Returns (its URL, its
    ``AppRunner``: ``await runner.cleanup()`` ends it)."""
    import aiohttp
    from aiohttp import web

    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))

    async def forward(request: web.Request) -> web.StreamResponse:
        headers = {k: v for k in ("Authorization", "Content-Type") if (v := request.headers.get(k))}
        url = engine_url + request.rel_url.path_qs
        async with http.request(
            request.method, url, data=await request.read(), headers=headers
        ) as r:
            if r.content_type != "text/event-stream":
                return web.Response(
                    body=await r.read(), status=r.status, content_type=r.content_type
                )
            out = web.StreamResponse(status=r.status, headers={"Content-Type": r.content_type})
            await out.prepare(request)
            try:
                async for chunk in r.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
            except ConnectionResetError:  # the client read its last event and hung up
                pass
            return out

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    app.on_cleanup.append(lambda _: http.close())
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return f"http://127.0.0.1:{runner.addresses[0][1]}", runner


async def _replay(client: Any, ids: list[int], sp: dict[str, Any], stream: bool) -> float:
    t0 = time.perf_counter()
    if stream:
        async for _ in client.generate_stream(ids, sp):
            pass
    else:
        await client.generate(ids, sp)
    return time.perf_counter() - t0


async def paired_run(
    srv: Any,
    engine_url: str,
    args: argparse.Namespace,
    stream: bool,
    sdk: bool,
    proxy_url: str = "",
) -> tuple[list[float], list[float]]:
    """Serial sessions where each gateway call is followed at once by its own engine call
    (recorded at the engine seam) replayed to the engine, and (``proxy_url``) the same call
    through the pass-through proxy (:func:`start_proxy`): the added latency of every call
    as a difference of neighbouring measurements, so a load that drifts over the run
    (a shared machine) moves them alike. Returns the gateway's and the proxy's differences
    from the engine call (s; the second list empty without a proxy)."""
    import aiohttp

    from asyncrl.engines.rollout.sglang import SGLangClient

    base = _client(4)
    engine = SGLangClient(engine_url, timeout_s=600)
    proxy = SGLangClient(proxy_url, timeout_s=600) if proxy_url else None
    added: list[float] = []
    floor: list[float] = []
    try:
        async with aiohttp.ClientSession(headers=_auth()) as http:
            for k in range(args.serial_sessions):
                sid = uuid.uuid4().hex[:16]
                client = base.with_options(base_url=f"{srv.url}/sessions/{sid}/v1")
                msgs: list[dict[str, Any]] = [{"role": "user", "content": f"Weather in {k}?"}]
                for t in range(args.turns):
                    srv.take_calls()
                    if sdk:
                        row, text = await _turn(client, msgs, stream, args.max_tokens)
                    else:
                        turl = f"{srv.url}/sessions/{sid}/v1"
                        row, text = await _raw_turn(http, turl, msgs, stream, args.max_tokens)
                    ((ids, sp),) = srv.take_calls()
                    direct = await _replay(engine, ids, sp, stream)
                    added.append(row[0] - direct)
                    if proxy is not None:
                        floor.append(await _replay(proxy, ids, sp, stream) - direct)
                    msgs += [{"role": "assistant", "content": text}]
                    msgs += [{"role": "user", "content": f"And tomorrow, day {t + 1}?"}]
                async with http.post(f"{srv.url}/sessions/{sid}/reward", json={"reward": 1}):
                    pass
    finally:
        await base.close()
        await engine.close()
        if proxy is not None:
            await proxy.close()
    return added, floor


async def hold_sessions(srv: Any, n: int) -> dict[str, Any]:
    """``n`` sessions opened at once, one 1-token completion each, all open together until
    every one is answered (counted by the gateway's ``/stats``), then all rewarded; the
    trajectories they became are counted as the controller hands them out."""
    import aiohttp

    base = _client(n + 4)
    before = srv.trajectories
    errors: list[str] = []
    t0 = time.perf_counter()

    async def one(k: int) -> None:
        client = base.with_options(base_url=f"{srv.url}/sessions/hold-{k}/v1")
        try:
            await _turn(client, [{"role": "user", "content": f"Hi {k}"}], False, 1)
        except Exception as exc:  # counted: the bench reports every failure
            errors.append(f"{type(exc).__name__}: {exc}"[:200])

    try:
        await asyncio.gather(*(one(k) for k in range(n)))
        async with aiohttp.ClientSession(headers=_auth()) as http:
            async with http.get(f"{srv.url}/stats") as r:
                open_at_peak = (await r.json())["open"]

            async def reward(k: int) -> None:
                url = f"{srv.url}/sessions/hold-{k}/reward"
                async with http.post(url, json={"reward": 0.5}) as r:
                    if r.status != 200:
                        errors.append(f"reward {k}: {r.status}")

            await asyncio.gather(*(reward(k) for k in range(n)))
        deadline = time.monotonic() + 120
        while srv.trajectories - before < n - len(errors) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    finally:
        await base.close()
    return {
        "sessions": n,
        "open_at_peak": open_at_peak,
        "errors": len(errors),
        "first_errors": errors[:5],
        "trajectories": srv.trajectories - before,
        "wall_s": time.perf_counter() - t0,
    }
