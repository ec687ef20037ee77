"""The vLLM 0.33.0 test server: vLLM's own API server code, over the stand-in's engine core.

Run as ``python -m tests.engines.rollout.vllm.app VLLM_SERVE_ARGV...`` with vLLM's source
and its pinned server dependencies on ``PYTHONPATH`` (``code.vllm_env``); the argv is what
asyncrl's launcher gives ``vllm serve`` (``vllm_args``, plus ``--api-key=KEY`` that
``asyncrl.entrypoints.keyed`` appends), the stand-in's own test options come as JSON in
``ASYNCRL_VLLM_STANDIN`` (``standin.arg_parser``).

What runs as vLLM's code (``ep`` = ``vllm/entrypoints``):

- the CLI: ``make_arg_parser`` parses that argv (ep/common/cli_args.py:431-480), the
  positional model as ``vllm serve`` takes it (ep/cli/serve.py:56-57), then
  ``validate_parsed_serve_args`` (an unknown or malformed flag exits 2, as ``vllm serve``);
- the app: ``build_app(args, ("generate",))`` (ep/launchers/app.py) — every router ``vllm
  serve`` registers for a generate model (ep/launchers/api_server/routers.py:13-90: the RL
  routes only with ``VLLM_SERVER_DEV_MODE=1``, the token-in/token-out routes only with
  ``--enable-scale-out``, else vLLM's own 403), its request models (``GenerateRequest``
  with vLLM's ``SamplingParams``, ``WeightTransferUpdatePayload``, ...), its exception
  handlers (ep/serve/exception_handling/register.py) and middleware (``--api-key``'s
  ``AuthenticationMiddleware``, ``--middleware``), served by vLLM's ``serve_http`` on
  uvicorn (ep/launchers/launcher.py:177) on the socket of its ``setup_server`` (:365);
- ``AsyncLLM``'s own methods for everything the RL routes call
  (v1/engine/async_llm.py:989-1032 pause/resume/is_paused, :948-959 abort, :1129-1134
  health, :1230-1259, :1396-1444 weight transfer, versions, checksums): :class:`StandInLLM`
  is an ``AsyncLLM`` whose ``__init__`` is not run (it builds the engine-core processes).

Imitated (they need a GPU, or the engine core behind them; file:line in ``standin.py``):

- the engine core client (``AsyncMPClient``, v1/engine/core_client.py) and what is behind
  it — scheduler, pause states, workers, weight transfer, checksums: :class:`CoreClient`
  over ``standin.StandIn`` (its ranks join with vLLM's own ``StatelessProcessGroup`` and
  rebuild chunks with vLLM's ``unpack_tensor``; Gloo in place of NCCL);
- ``AsyncLLM``'s output processor (only the id maps ``abort`` reads,
  v1/engine/output_processor.py:599-629) and renderer (``clear_mm_cache_async``: no
  multimodal cache here);
- ``ServingTokens`` (ep/scale_out/token_in_token_out/serving.py), which needs a
  ``ModelConfig`` — built by inspecting the model architecture in a subprocess that
  imports vLLM's CUDA model code — and a tokenizer-backed renderer: :class:`Tokens` answers
  with vLLM's own response models (``GenerateTokensResponse``, stream chunks, spans as
  ``WeightVersionSpan``), a paused engine's refusal raised as vLLM's
  ``RetryableRequestError`` (formatted by vLLM's handlers: 503);
- ``OpenAIServingModels``' LoRA load/unload (ep/openai/models/serving.py): ``lora.py``.

Test-only: ``GET /standin/state`` (ground truth) and the wire log (``--calls``): every
request's method, path, query, status and JSON body.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncGenerator, Iterable
from http import HTTPStatus
from typing import Any

import torch

from tests.engines.rollout.vllm.standin import PAUSED_MSG, Req, StandIn, arg_parser
from tests.session_forks import as_imported

ENV = "ASYNCRL_VLLM_STANDIN"


def parse_vllm_argv(argv: list[str]) -> argparse.Namespace:
    """``vllm serve ARGV`` as vLLM parses it (module docstring)."""
    from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    args = parser.parse_args(argv)
    if args.model_tag is not None:  # cli/serve.py:56-57
        args.model = args.model_tag
    validate_parsed_serve_args(args)
    return args


class Resources:
    engine_dead = False  # core_client.py BackgroundResources: the engine core is alive


class OutputIds:
    """The part of ``OutputProcessor`` that ``AsyncLLM.abort`` and ``/abort_requests`` read
    (output_processor.py:599-629): external id -> the internal ids of its requests (a
    parallel-sampling parent's children included)."""

    def __init__(self, core: StandIn):
        self.core = core
        self.parent_requests: dict[str, Any] = {}

    @property
    def request_states(self) -> dict[str, Req]:
        return {rid: r for rid, r in self.core.reqs.items() if r.finish is None}

    def abort_requests(self, request_ids: Iterable[str], internal: bool) -> list[str]:
        ids = set(request_ids)
        if internal:
            return [rid for rid in ids if rid in self.core.reqs]
        return [rid for rid, r in self.core.reqs.items() if r.ext in ids and r.finish is None]


class Renderer:
    async def clear_mm_cache_async(self) -> None:  # renderer: no multimodal cache here
        return None


class CoreClient:
    """The engine core client's methods ``AsyncLLM`` calls (core_client.py), answered by the
    stand-in's engine core (``standin.StandIn``, each behaviour cited there)."""

    def __init__(self, core: StandIn):
        self.core = core
        self.resources = Resources()

    async def pause_generation_async(self, mode: str, clear_cache: bool) -> None:
        await self.core.pause_engine(mode, clear_cache)

    async def resume_scheduler_async(self) -> None:
        self.core.resume_engine()

    async def is_scheduler_paused_async(self) -> bool:
        return self.core.pause != "none"

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        await self.core.abort_internal(request_ids)

    async def collective_rpc_async(
        self, method: str, timeout: float | None = None, args: tuple = (), kwargs: Any = None
    ) -> list[Any]:
        return await self.core.worker_rpc(method, **(kwargs or {}))

    async def set_weight_version_async(self, version: str) -> None:
        await self.core.set_label(version)

    async def get_weight_version_async(self) -> str:
        return self.core.label

    async def compute_weight_checksums_async(self) -> list[dict[str, str]]:
        return await self.core.worker_checksums()


def _llm_class() -> type:
    from vllm.v1.engine.async_llm import AsyncLLM

    class StandInLLM(AsyncLLM):
        """vLLM's ``AsyncLLM`` (its methods run as they are) without its ``__init__``, which
        starts the engine-core processes; the attributes those methods read are set here."""

        def __init__(self, core: StandIn, vllm_config: Any):
            self.engine_core = CoreClient(core)
            self.output_processor = OutputIds(core)
            self.renderer = Renderer()
            self.output_handler = None  # is_running: no output-handler task (async_llm:1376)
            self.log_requests = False
            self.vllm_config = vllm_config

        def shutdown(self, timeout: float | None = None) -> None:
            """No engine-core processes to end (async_llm.py:305-330)."""

    return StandInLLM


class Tokens:
    """``ServingTokens.serve_tokens`` (tito/serving.py) over the stand-in's engine core,
    answering with vLLM's own response models (module docstring)."""

    def __init__(self, core: StandIn):
        self.core = core

    async def serve_tokens(self, request: Any, raw_request: Any) -> Any:
        from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
            GenerateTokensResponse,
        )
        from vllm.exceptions import RetryableRequestError

        sp = request.sampling_params
        if self.core.reject_new:  # core.py:1796-1815: a retryable error, 503
            if not request.stream:
                raise RetryableRequestError(PAUSED_MSG)
            return self._error_stream(RetryableRequestError(PAUSED_MSG))
        adapter, missing = self.core.lora.resolve(request.model)  # es:199-213
        if missing is not None:
            from vllm.entrypoints.serve.exception_handling.error_response import (
                create_error_response,
            )

            return create_error_response(missing, "NotFoundError", HTTPStatus.NOT_FOUND)
        base = request.request_id
        n = int(sp.n or 1)
        reqs = [
            self.core.add_request(
                f"{i}_{base}" if n > 1 else base,
                list(request.token_ids),
                int(sp.max_tokens or 16),
                float(sp.temperature),
                set(sp.stop_token_ids or []),
                bool(sp.ignore_eos),
                adapter,
                request.model if adapter else None,
                f"generate-tokens-{base}",  # tito/serving.py:202-204
            )
            for i in range(n)
        ]
        if request.stream:
            return self._stream(reqs)
        try:
            for r in reqs:  # FINAL_ONLY: answered once every child finished (:120-126)
                while r.finish is None:
                    r.changed.clear()
                    await r.changed.wait()
        except asyncio.CancelledError:  # the client hung up: aborted (async_llm.py:807-812)
            await self.core.abort_internal([r.rid for r in reqs], hung_up=True)
            raise
        choices = [_choice(r, r.output, r.logprobs, True, i) for i, r in enumerate(reqs)]
        return GenerateTokensResponse(request_id=reqs[0].ext, choices=choices)

    async def _stream(self, reqs: list[Req]) -> AsyncGenerator[str, None]:
        """tito/serving.py:646-820: one chunk per output that brought tokens or finished,
        one choice with its ``index``; spans on a child's final chunk; ``data: [DONE]``."""
        try:
            async for line in self._chunks(reqs):
                yield line
        except (asyncio.CancelledError, GeneratorExit):  # hung up (async_llm.py:807-812)
            await self.core.abort_internal([r.rid for r in reqs], hung_up=True)
            raise

    async def _chunks(self, reqs: list[Req]) -> AsyncGenerator[str, None]:
        from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
            GenerateTokensStreamResponse,
        )

        sent = [0] * len(reqs)
        done = [False] * len(reqs)
        while not all(done):
            for r in reqs:
                r.changed.clear()
            for i, r in enumerate(reqs):
                final = r.finish is not None
                if done[i] or not (len(r.output) > sent[i] or final):
                    continue
                choice = _choice(r, r.output[sent[i] :], r.logprobs[sent[i] :], final, i, True)
                sent[i], done[i] = len(r.output), final
                chunk = GenerateTokensStreamResponse(request_id=r.ext, choices=[choice])
                skip = {"prompt_token_ids", "mm_placeholders", "metrics"}  # serving.py:765-771
                yield f"data: {chunk.model_dump_json(exclude=skip)}\n\n"
            if not all(done):
                await _any_change([r for i, r in enumerate(reqs) if not done[i]])
        yield "data: [DONE]\n\n"

    async def _error_stream(self, err: Exception) -> AsyncGenerator[str, None]:
        """tito/serving.py:812-815: a GenerationError as one error chunk, then [DONE]."""
        from vllm.entrypoints.serve.exception_handling.error_response import (
            create_error_response,
        )

        # create_streaming_error_response (generate/base/serving.py:183-197, 209-213)
        yield f"data: {json.dumps(create_error_response(err).model_dump())}\n\n"
        yield "data: [DONE]\n\n"


def _choice(
    r: Req, new: list[int], lps: list[float], final: bool, index: int, stream: bool = False
) -> Any:
    from vllm.entrypoints.scale_out.token_in_token_out import protocol as p

    content = [
        p.GenerateLogProbsContent(token_id=t, logprob=lp) for t, lp in zip(new, lps, strict=True)
    ]
    cls = p.GenerateTokensStreamChoice if stream else p.GenerateTokensChoice
    return cls(
        index=index,
        finish_reason=r.finish if final else None,
        token_ids=new,
        logprobs=p.GenerateLogProbs(content=content),
        weight_versions=r.spans() if final else None,
    )


async def _any_change(reqs: list[Req]) -> None:
    waits = [asyncio.ensure_future(r.changed.wait()) for r in reqs]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


class Models:
    """``OpenAIServingModels``' runtime LoRA load/unload (ep/openai/models/serving.py),
    imitated by ``lora.py``; answers as the real one: a message or vLLM's ErrorResponse."""

    def __init__(self, core: StandIn):
        self.core = core

    async def _do(self, request: Any, load: bool) -> Any:
        from vllm.entrypoints.serve.exception_handling.error_response import (
            create_error_response,
        )

        body = request.model_dump()
        msg, status = (self.core.lora.load if load else self.core.lora.unload)(body)
        if status != 200:
            kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
            return create_error_response(msg, kind, HTTPStatus(status))
        return msg

    async def load_lora_adapter(self, request: Any) -> Any:
        return await self._do(request, True)

    async def unload_lora_adapter(self, request: Any) -> Any:
        return await self._do(request, False)


class Routed:
    """Marks a request that reached the routes (``WireLog`` logs only those)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        scope[ROUTED] = True
        await self.app(scope, receive, send)


ROUTED = "asyncrl.standin.routed"


class WireLog:
    """The app's outermost ASGI wrapper: every routed request's method, path, query,
    status and JSON body (``update_info`` summarised) appended to the ``--calls`` file.

    The line is written before the answer's last body chunk is sent, so a client that
    has read an answer finds its request in the log (a test reading the log right after
    a request sees it there, never later)."""

    def __init__(self, app: Any, path: str):
        self.app = app
        self.out = open(path, "a") if path else None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or self.out is None:
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []
        status = [0]
        errors: list[int] = []  # the codes of error chunks in an SSE answer
        written = [False]

        def write(note: str) -> None:
            if scope.get(ROUTED) and not written[0]:
                written[0] = True
                note = " ".join([note, *(f"error {c} chunk" for c in errors)]).strip()
                self._write(scope, b"".join(chunks), status[0], note)

        async def rx() -> dict[str, Any]:
            msg = await receive()
            if msg["type"] == "http.request":
                chunks.append(msg.get("body", b""))
            return msg

        async def tx(msg: dict[str, Any]) -> None:
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            elif msg["type"] == "http.response.body":
                for line in msg.get("body", b"").split(b"\n"):
                    if line.startswith(b"data: {") and b'"error"' in line:
                        errors.append(json.loads(line[6:])["error"]["code"])
                if not msg.get("more_body", False):
                    write("")
            await send(msg)

        note = ""
        try:
            await self.app(scope, rx, tx)
        except Exception:  # answered 500 by Starlette's ServerErrorMiddleware, outside this one
            status[0], note = status[0] or 500, "unhandled exception"
            raise
        finally:
            write(note)

    def _write(self, scope: dict[str, Any], raw: bytes, status: int, note: str) -> None:
        from urllib.parse import parse_qsl

        assert self.out is not None
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")[:200]
        if isinstance(body, dict) and isinstance(body.get("update_info"), dict):
            u = body["update_info"]
            body = {"update_info": {"n_names": len(u.get("names", [])), "keys": sorted(u)}}
        if isinstance(body, dict) and "token_ids" in body:
            body = {"rid": body.get("request_id"), "stream": bool(body.get("stream")),
                    "n": (body.get("sampling_params") or {}).get("n", 1),
                    "model": body.get("model")}  # fmt: skip
        line = {
            "t": time.time(),
            "method": scope["method"],
            "path": scope["path"],
            "query": dict(parse_qsl(scope.get("query_string", b"").decode())),
            "status": status,
            "body": body,
            "note": note,
        }
        self.out.write(json.dumps(line) + "\n")
        self.out.flush()


def standin_options(args: argparse.Namespace) -> argparse.Namespace:
    """The stand-in's own options (``ASYNCRL_VLLM_STANDIN``, JSON list) with what it takes
    from vLLM's parsed flags: the model, TP size, LoRA limits."""
    own = arg_parser().parse_args(json.loads(os.environ.get(ENV, "[]")))
    own.model_path = args.model
    own.tp_size = args.tensor_parallel_size
    own.dtype = args.dtype  # vLLM's --dtype: the served dtype (model_layout.served_dtype)
    own.enable_lora = bool(args.enable_lora)
    own.max_loras = args.max_loras
    own.max_lora_rank = args.max_lora_rank
    own.max_cpu_loras = args.max_cpu_loras
    own.lora_target_modules = args.lora_target_modules
    return own


async def serve(args: argparse.Namespace) -> None:
    from types import SimpleNamespace

    from fastapi.responses import JSONResponse

    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server

    own = standin_options(args)
    _, sock = setup_server(args, reuse_port=False)  # binds first, as run_server does
    core = StandIn(own)
    tasks = ("generate",)
    app = build_app(args, tasks, None)
    world = args.tensor_parallel_size * args.pipeline_parallel_size
    parallel = SimpleNamespace(world_size=world, world_size_across_dp=world)
    llm = _llm_class()(core, SimpleNamespace(parallel_config=parallel))
    state = app.state  # what init_app_state sets and these routes read (app_state.py:55-178)
    state.engine_client, state.args, state.log_stats = llm, args, False
    state.serving_tokens, state.openai_serving_models = Tokens(core), Models(core)
    state.enable_server_load_tracking, state.server_load_metrics = False, 0

    async def standin_state() -> JSONResponse:
        return JSONResponse(await core.ground_truth())

    app.add_api_route("/standin/state", standin_state, methods=["GET"])
    # the wire log around the whole app (the status as vLLM's handlers answer it), of the
    # requests that reached the routes (one its --api-key or --middleware refuses is not
    # logged): the stack rebuilt as the SageMaker bootstrap of build_app rebuilt it
    # (model_hosting_container_standards common/fastapi/middleware/core.py:99), with the
    # router marked for the build
    router = app.router
    app.router = Routed(router)  # type: ignore[assignment]
    app.middleware_stack = WireLog(app.build_middleware_stack(), own.calls)
    app.router = router
    core.start()
    shutdown = await serve_http(
        app,
        sock=sock,
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
    )
    await shutdown


def main() -> None:
    torch.set_num_threads(1)
    as_imported()  # forked from the session's vLLM fork server: what vLLM's imports set
    args = parse_vllm_argv(sys.argv[1:])
    import uvloop

    uvloop.run(serve(args))


if __name__ == "__main__":
    main()
