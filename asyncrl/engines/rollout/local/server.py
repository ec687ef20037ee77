"""HTTP server of the embedded engine: the SGLang endpoints a run needs, same field names.

The engine process's entry module is :mod:`asyncrl.entrypoints.engine` (``asyncrl
serve``). Endpoints: ``/generate``, ``/abort_request``,
``/pause_generation``, ``/continue_generation``, ``/init_weights_update_group``,
``/update_weights_from_distributed`` (``load_format="flattened_bucket"``),
``/update_weight_version``, ``/get_weight_version``, ``/flush_cache``,
``/get_model_info``, ``/get_server_info`` (step and token counters), ``/health``.
Bad requests get HTTP 400 with a message and the server keeps serving.

Every route, ``/health`` included, answers only requests that carry the run secret as
``Authorization: Bearer`` (:func:`asyncrl.secret.check_bearer`); any other request gets
HTTP 401 before its handler runs (its body is not read, nothing changes). Stricter than
SGLang, which leaves ``/health*`` and ``/metrics`` open (0.5.10 srt/utils/auth.py:100).

Weight sync (``/init_weights_update_group``, ``/destroy_weights_update_group``,
``/update_weights_from_distributed``, ``/update_weights_from_tensor``,
``/update_weight_version``, ``/get_weights_checksum``) is handled by
:class:`~asyncrl.engines.rollout.local.weights.WeightReceiver`: buckets are
received, verified and staged aside, and ``/update_weight_version`` switches
the model and the version at once; a failure keeps the old weights and version.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import torch
from aiohttp import web

from asyncrl import trace
from asyncrl.engines.rollout.checks import BadRequest
from asyncrl.engines.rollout.local.engine import LocalEngine, Request, SamplingParams
from asyncrl.engines.rollout.local.lora import LoraSpec
from asyncrl.engines.rollout.local.weights import WeightReceiver, WeightRequestError
from asyncrl.secret import check_bearer
from asyncrl.transports.weights.delta import DELTA_CAPABILITY

__all__ = ["ROUTES", "EngineServer", "build_app", "load_engine"]

log = logging.getLogger("asyncrl.engine")


_BadRequest = BadRequest


def _item(body: dict[str, Any], key: str, i: int, n: int, batch: bool) -> Any:
    """Field ``key`` of batch item ``i`` (of ``n``): a per-item list or one shared value."""
    value = body.get(key)
    if batch and isinstance(value, list):
        if len(value) != n:
            raise _BadRequest(f"{key} has {len(value)} entries for {n} input_ids")
        return value[i]
    if batch and key == "rid" and value is not None:
        raise _BadRequest("rid of a batch must be a list (one per input_ids entry)")
    return value


def _answer(req: Request, logprobs: bool, n: int | None = None) -> dict[str, Any]:
    """SGLang's /generate answer for one request: finished, or (``n`` given, streaming) its
    first ``n`` tokens so far with ``finish_reason`` null until the end (SGLang's default,
    cumulative streaming: 0.5.23 srt/managers/tokenizer_manager.py:2674-2700)."""
    n = len(req.output_ids) if n is None else n
    ids = req.output_ids[:n]
    finished = req.finish is not None and n == len(req.output_ids)
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish if finished else None,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": n,
        "cached_tokens": 0,
        "weight_version": req.min_version if req.min_version is not None else "",
    }
    spans = _spans(req.versions[:n])
    if len(spans) > 1:  # SGLang >= 0.5.22's per-token versions (srt/utils/weight_versions.py:63)
        meta["weight_versions"] = spans
    if logprobs:
        meta["output_token_logprobs"] = [
            [lp, tok, None] for lp, tok in zip(req.logprobs[:n], ids, strict=True)
        ]
    return {"text": "", "output_ids": ids, "meta_info": meta}


async def progress(engine: LocalEngine, req: Request) -> AsyncIterator[int]:
    """Submit ``req`` to ``engine`` and yield its count of complete tokens after each step
    that made some, and once it finished (the last count: its whole answer). The caller
    aborts ``req`` when it stops reading early (cancelled, closed, its reader gone)."""
    event = req.progress = asyncio.Event()
    engine.submit(req)
    sent = -1
    while True:
        await event.wait()
        event.clear()
        done = req.future.done()
        n = len(req.logprobs)  # complete tokens: appended last (engine.Request)
        if n > sent or done:
            sent = n
            yield n
        if done and n == len(req.output_ids):
            return


def _spans(versions: list[str]) -> list[dict[str, Any]]:
    """Per-token versions as SGLang's ``weight_versions`` spans ``[{version, start, end}]``."""
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans


def _json_error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}, "success": False}, status=status)


_PARSED = "asyncrl.body"  # the request's parsed JSON body, kept on it for the trace middleware


async def _body(request: web.Request) -> dict[str, Any]:
    """The JSON object the request carries ({} without a body); 400 for anything else. Kept
    on the request: ``_traced`` reads the ``rid`` from it instead of parsing the body again."""
    if not request.can_read_body:
        return {}
    try:
        body = json.loads(await request.read())
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        raise _BadRequest(f"body is not JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise _BadRequest("body must be a JSON object")
    request[_PARSED] = body
    return body


class EngineServer:
    """Binds a LocalEngine to HTTP handlers and owns the weight-sync group."""

    def __init__(
        self,
        engine: LocalEngine,
        model_path: str,
        host: str = "",
        masters: str = "loopback",
        receiver: type[WeightReceiver] = WeightReceiver,
    ):
        """``masters``: addresses/CIDRs where this engine may join a weight group (see
        :mod:`~asyncrl.engines.rollout.checks`); ``receiver``: the receiving side of
        weight sync (a subclass may observe or alter what it receives, as the tests' fault
        injection does)."""
        self.engine = engine
        self.model_path = model_path
        bind = "" if host in ("", "0.0.0.0", "::") else host  # weight-group ranks bind here
        self.weights = receiver(engine, bind, masters)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """One request, or a batch (SGLang's list form: ``input_ids`` a list of lists, with
        ``sampling_params`` / ``rid`` / ``return_logprob`` shared or one per item). A batch's
        items are queued together, so they join one prefill (identical prompts — a GRPO
        group — are prefilled once); the answer is a list, in order, once all finished."""
        body = await _body(request)
        if body.get("text") is not None:
            raise _BadRequest("text prompts are unsupported: send input_ids (token ids)")
        loop = asyncio.get_running_loop()
        ids: Any = body.get("input_ids")  # JSON: a list, or a list of lists (checked per item)
        batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        if body.get("stream") is not None and not isinstance(body.get("stream"), bool):
            raise _BadRequest("stream must be true or false")
        if body.get("stream"):
            if batch:
                raise _BadRequest("stream=true takes one request (input_ids a list of ints)")
            req = self._request(ids, body.get("sampling_params"), body.get("rid"), loop)
            return await self._stream(request, req, bool(body.get("return_logprob")))
        n = len(ids) if batch else 1
        sps = [_item(body, "sampling_params", i, n, batch) for i in range(n)]
        rids = [_item(body, "rid", i, n, batch) for i in range(n)]
        lps = [_item(body, "return_logprob", i, n, batch) for i in range(n)]
        reqs = [self._request(ids[i] if batch else ids, sps[i], rids[i], loop) for i in range(n)]
        self._pin_named(reqs, [_item(body, "lora_path", i, n, batch) for i in range(n)])
        self.engine.submit_all(reqs)
        try:
            await asyncio.gather(*(r.future for r in reqs))
        except asyncio.CancelledError:  # client went away
            await asyncio.shield(asyncio.to_thread(self._abort_each, [r.rid for r in reqs]))
            raise
        out = [_answer(r, bool(lp)) for r, lp in zip(reqs, lps, strict=True)]
        return web.json_response(out if batch else out[0])

    async def _stream(
        self, request: web.Request, req: Request, logprobs: bool
    ) -> web.StreamResponse:
        """SGLang's streamed /generate (0.5.23 srt/entrypoints/http_server.py:949-981): one
        ``data: {json}\\n\\n`` event per step with the cumulative output so far (several
        tokens in one event when the reader fell behind), the finished answer last, then
        ``data: [DONE]``. A reader that hangs up aborts the request."""
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        try:
            async for n in progress(self.engine, req):
                chunk = json.dumps(_answer(req, logprobs, n)).encode()
                await resp.write(b"data: " + chunk + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
        except (asyncio.CancelledError, ConnectionError):  # the reader went away
            await asyncio.shield(asyncio.to_thread(self.engine.abort, req.rid))
            raise
        await resp.write_eof()
        return resp

    def _pin_named(self, reqs: list[Request], paths: list[Any]) -> None:
        """Pin requests that name an adapter version (SGLang's ``lora_path``, ``{name}-v{N}``)
        to it; 400 naming the held versions when the engine does not hold it (or serves no
        adapters). Unnamed requests are pinned to the newest version when they join."""
        if all(p is None for p in paths):
            return
        ring = self.engine.lora
        if ring is None:
            raise _BadRequest("lora_path given, but this engine serves no LoRA adapters")
        pinned: list[Request] = []
        try:
            for req, path in zip(reqs, paths, strict=True):
                if path is None:
                    continue
                if not isinstance(path, str):
                    raise _BadRequest(f"lora_path must be a string, got {path!r}"[:300])
                req.min_version, req.lora_slot = ring.pin_named(path)
                pinned.append(req)
        except BaseException:
            for req in pinned:
                ring.unpin(req.lora_slot)
            raise

    def _abort_each(self, rids: list[str]) -> None:
        for rid in rids:
            self.engine.abort(rid)

    def _request(self, ids: Any, sp: Any, rid: Any, loop: asyncio.AbstractEventLoop) -> Request:
        if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
            raise _BadRequest("input_ids must be a non-empty list of ints or a list of such lists")
        vocab = self.engine.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise _BadRequest(f"input_ids must be in [0, {vocab})")
        sp = sp or {}
        if not isinstance(sp, dict):
            raise _BadRequest("sampling_params must be an object (or a list of them)")
        try:
            sampling = SamplingParams.from_dict(sp)
            sampling = self.engine.admit(len(ids), sampling, sp.get("max_new_tokens") is not None)
        except (TypeError, ValueError, OverflowError) as exc:
            raise _BadRequest(f"sampling_params: {exc}") from None
        if rid is not None and (isinstance(rid, bool) or not isinstance(rid, str | int)):
            raise _BadRequest(f"rid must be a string, got {rid!r}"[:300])
        return Request(
            rid=str(rid or uuid.uuid4().hex),
            input_ids=ids,
            sampling=sampling,
            loop=loop,
            future=loop.create_future(),
        )

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _body(request)
        rid, abort_all = body.get("rid") or "", body.get("abort_all", False)
        if not isinstance(rid, str | int) or not isinstance(abort_all, bool):
            raise _BadRequest("abort_request takes rid (a string) and abort_all (true or false)")
        rid = str(rid)
        n = await asyncio.to_thread(self.engine.abort, rid, abort_all)
        self.engine.stats["aborted"] += n  # asked for (a hung-up client's abort is not counted)
        return web.json_response({"success": True, "aborted": n})

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await _body(request)
        mode = body.get("mode", "abort")
        if not isinstance(mode, str):
            raise _BadRequest(f"mode must be a string, got {mode!r}"[:300])
        try:
            await asyncio.to_thread(self.engine.pause, mode)
        except ValueError as exc:
            raise _BadRequest(str(exc)) from None
        return web.json_response({"success": True})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.engine.resume()
        return web.json_response({"success": True})

    # weight sync: the logic lives in local/weights.py (WeightReceiver). Shielded: a sender
    # that hangs up (the server cancels handlers then) never interrupts an update half-way.
    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        return web.json_response(
            await asyncio.shield(self.weights.init_group(await _body(request)))
        )

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        return web.json_response(
            await asyncio.shield(self.weights.destroy_group(await _body(request)))
        )

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        return web.json_response(
            await asyncio.shield(self.weights.update_from_distributed(await _body(request)))
        )

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        return web.json_response(
            await asyncio.shield(self.weights.update_from_tensor(await _body(request)))
        )

    async def update_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response(await asyncio.shield(self.weights.commit(await _body(request))))

    async def get_weights_checksum(self, request: web.Request) -> web.Response:
        return web.json_response(await asyncio.to_thread(self.weights.weights_checksum))

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.engine.weight_version})

    async def flush_cache(self, request: web.Request) -> web.Response:
        return web.json_response({"success": True})

    async def get_model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model_path, "is_generation": True})

    async def get_server_info(self, request: web.Request) -> web.Response:
        e = self.engine
        return web.json_response(
            {
                "engine": "asyncrl-local",
                DELTA_CAPABILITY: 1,  # applies delta buckets (weights.delta)
                "model_path": self.model_path,
                "device": str(e.device),
                "max_batch_size": e.max_batch_size,
                "weight_version": e.weight_version,
                "paused": e.paused,
                "num_requests": e.num_requests,
                **({"lora": e.lora.info()} if e.lora is not None else {}),
                **e.stats,
            }
        )

    async def health(self, request: web.Request) -> web.Response:
        """200 ``ok``; 503 with the reason when the scheduler is stuck or dead."""
        problem = self.engine.health()
        if problem is not None:
            return web.Response(status=503, text=problem)
        return web.Response(text="ok")


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except (_BadRequest, WeightRequestError) as exc:
        log.warning("bad request to %s: %s", request.path, exc)
        return _json_error(400, str(exc))


_SERVER = web.AppKey("server", EngineServer)


@web.middleware
async def _traced(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every POST as a span on a lane of its path's track (no-op untraced); ``/generate``
    spans carry the request ids (``rid``)."""
    tracer = trace.get()
    if not tracer.enabled or request.method != "POST":
        return await handler(request)
    lane = tracer.take_lane(f"serve {request.path}")
    t0 = trace.now_us()
    try:
        return await handler(request)
    finally:
        t1 = trace.now_us()
        args = None
        if request.path == "/generate" and _PARSED in request:  # parsed by the handler
            args = {"rid": request[_PARSED].get("rid")}
        tracer.complete(request.path, lane, t0, t1, args)
        tracer.free_lane(lane)
        if request.path == "/update_weight_version":
            with contextlib.suppress(TypeError, ValueError):
                tracer.set_step(int(request.app[_SERVER].engine.weight_version))


ROUTES: tuple[tuple[str, str, str], ...] = (
    ("POST", "/generate", "generate"),
    ("POST", "/abort_request", "abort_request"),
    ("POST", "/pause_generation", "pause_generation"),
    ("POST", "/continue_generation", "continue_generation"),
    ("POST", "/init_weights_update_group", "init_weights_update_group"),
    ("POST", "/update_weights_from_distributed", "update_weights_from_distributed"),
    ("POST", "/update_weights_from_tensor", "update_weights_from_tensor"),
    ("POST", "/destroy_weights_update_group", "destroy_weights_update_group"),
    ("POST", "/update_weight_version", "update_weight_version"),
    ("POST", "/flush_cache", "flush_cache"),
    ("GET", "/get_weight_version", "get_weight_version"),
    ("POST", "/get_weight_version", "get_weight_version"),
    ("GET", "/get_model_info", "get_model_info"),
    ("GET", "/get_weights_checksum", "get_weights_checksum"),
    ("GET", "/get_server_info", "get_server_info"),
    ("GET", "/health", "health"),
)
"""Every route the engine serves: ``(method, path, EngineServer method)`` (aiohttp adds HEAD
to each GET)."""


def _authenticated(secret: str) -> Any:
    """The middleware that answers 401 to every request without ``secret`` as its Bearer key,
    before the handler (or any other middleware) sees it."""

    refused = 0

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        nonlocal refused
        if not check_bearer(request.headers.get("Authorization"), secret):
            refused += 1
            if refused & (refused - 1) == 0:  # 1, 2, 4, ...: bounded, never silent
                what = f"{request.method} {request.path} from {request.remote}"
                log.warning("refused %d request(s) without the run's key (last: %s)", refused, what)
            return web.json_response(
                {"error": {"message": "Unauthorized"}, "success": False},
                status=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        return await handler(request)

    return check


def build_app(server: EngineServer, secret: str) -> web.Application:
    """The engine's HTTP app: every route answers only holders of ``secret`` (Bearer)."""
    app = web.Application(
        middlewares=[_authenticated(secret), _traced, _errors], client_max_size=64 << 20
    )
    app[_SERVER] = server
    for method, path, name in ROUTES:
        add = app.router.add_get if method == "GET" else app.router.add_post
        add(path, getattr(server, name))

    async def _on_shutdown(_: web.Application) -> None:
        server.engine.stop()
        log.info("engine stats: %s", json.dumps(server.engine.stats))
        server.weights.close()
        trace.get().close()

    app.on_shutdown.append(_on_shutdown)
    return app


def load_engine(
    model_path: str,
    device: str,
    dtype: str,
    max_batch_size: int,
    seed: int,
    max_prefill_tokens: int = 8192,
    kv_after_update: str = "recompute",
    context_length: int | None = None,
    max_prompt_tokens: int | None = None,
    stall_s: float = 60.0,
    lora: LoraSpec | None = None,
) -> LocalEngine:
    """The model at ``model_path`` (a Hugging Face folder) behind a LocalEngine (serving LoRA
    adapters when ``lora`` is given)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
    eos = model.generation_config.eos_token_id or model.config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    engine = LocalEngine(
        model,
        eos_ids,
        device=device,
        max_batch_size=max_batch_size,
        seed=seed,
        max_prefill_tokens=max_prefill_tokens,
        kv_after_update=kv_after_update,
        context_length=context_length,
        max_prompt_tokens=max_prompt_tokens,
        stall_s=stall_s,
    )
    if lora is not None:
        engine.enable_lora(lora)
    return engine
