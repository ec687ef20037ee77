"""vLLM 0.33 HTTP client: the RolloutEngine that speaks vLLM's token-in/token-out and RL API.

Cited from vLLM 0.33.0's source (``tito`` = ``vllm/entrypoints/scale_out/
token_in_token_out/``, ``rl`` = ``vllm/entrypoints/rl/online/api_router.py``):

- generation: ``POST /inference/v1/generate`` with ``request_id``, ``token_ids``,
  ``sampling_params`` (vLLM's ``SamplingParams`` names: ``max_tokens``, ``logprobs=0`` for
  the sampled token's log-prob only) and ``stream`` (tito/protocol.py:221-326); the answer's
  ``choices[0]`` has ``token_ids``, ``logprobs.content[i].logprob``, ``finish_reason``
  (``stop``/``length``/``abort``) and ``weight_versions``: ``[{version, start, end}]`` spans
  over output-token indexes, on the final output only (tito/protocol.py:486-508;
  vllm/outputs.py:50-55, 82-83; built in v1/engine/output_processor.py:531-545). The
  version before any update is ``"default"`` (v1/engine/core.py:147): version 0 here.
- streaming: ``text/event-stream`` of ``data: {json}`` chunks, each with the delta
  ``token_ids`` and log-probs, spans on the final chunk, an error as a ``data:`` chunk, then
  ``data: [DONE]`` (tito/serving.py:646-820).
- generate is served only by a vLLM started with ``--enable-scale-out`` (or
  ``--tokens-only``); without it every route of the scale-out group answers 403
  ``PermissionDeniedError`` "Scale-out endpoints are disabled"
  (entrypoints/scale_out/factories.py:95-128, the flag off by default:
  entrypoints/common/cli_args.py:216). That answer raises :class:`ScaleOutDisabled`, which
  is no :class:`EngineError`: a run stops at once, naming the flag, instead of failing
  every group.
- pause: ``POST /pause?mode=keep|abort|wait`` (query parameters, rl:31-75), ``POST
  /resume`` (rl:78-94), ``GET /is_paused`` (rl:145-159). In ``abort`` and ``wait`` new
  requests are refused with a retryable error until ``/resume`` (v1/engine/core.py:
  1796-1815, 2226-2233) which the server answers 503 (vllm/exceptions.py:139-144,
  entrypoints/serve/exception_handling/error_response.py:60-67); in a stream it is an
  error chunk (tito/serving.py:812-815). The client then polls ``/is_paused`` and sends
  the request again (``retry_503_s``): it waits, it does not fail.
- abort: ``POST /abort_requests`` ``{"request_ids": [...]}``, empty: all (rl:97-142). The
  ids are the engine's external ids, which the generate route makes ``generate-tokens-{rid}``
  (tito/serving.py:202-204; v1/engine/input_processor.py:363-371; an id matches those
  requests only, v1/engine/output_processor.py:599-629): the client sends that form.
- ``n > 1``: :meth:`VLLMClient.generate_batch` sends equal prompts with equal sampling
  parameters as one request with ``n`` (vLLM's parallel sampling: one prefill, children
  ``{i}_{id}`` seeded ``seed + i``, v1/engine/parallel_sampling.py:52-96; the final answer's
  choices ordered by ``index``, each with its own log-probs and spans,
  parallel_sampling.py:120-126, tito/serving.py:455-512).
- version: ``GET /weight_info`` (rl:226-229); liveness: ``GET /health``.

Errors as :mod:`asyncrl.engines.rollout.base` (vLLM's error body is ``{"error": {"message",
"type", "code"}}``, error_response.py:98-105).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec

from asyncrl.config import VLLM_PAUSE_MODES
from asyncrl.core import GenerateRequest, GenerateResult
from asyncrl.engines.rollout.base import (
    EngineBadRequest,
    EngineError,
    EngineUnavailable,
    KeyedHttp,
    PolledHealth,
    batch_rids,
    failure,
    parse_version,
)
from asyncrl.engines.rollout.sglang.client import _is_json_object, _server_message

__all__ = ["ScaleOutDisabled", "VLLMClient", "expand_spans", "vllm_sampling"]

GENERATE = "/inference/v1/generate"
ENGINE_ID = "generate-tokens-{}"
"""The engine's (external) id of a generate request ``rid`` (tito/serving.py:202-204)."""

SCALE_OUT_OFF = "Scale-out endpoints are disabled"
"""vLLM 0.33's 403 message without ``--enable-scale-out`` (scale_out/factories.py:101-104)."""


class ScaleOutDisabled(RuntimeError):
    """The vLLM server refuses ``/inference/v1/generate`` (403): it was started without
    ``--enable-scale-out``. Not an :class:`EngineError` (no retry, no other engine helps:
    the run stops with this one line)."""

    def __init__(self, url: str, status: int, message: str):
        super().__init__(
            f"vLLM at {url} refuses {GENERATE} ({status}: {message!r}): a vLLM started by "
            "hand needs `--enable-scale-out` (asyncrl's launcher passes it)"
        )


def _refusal(url: str, status: int, raw: bytes) -> EngineError:
    """The error of an HTTP error answer to a generate request; :class:`ScaleOutDisabled`
    (raised) for vLLM's scale-out refusal."""
    message = _server_message(raw)
    if status == 403 and SCALE_OUT_OFF in message:
        raise ScaleOutDisabled(url, status, message)
    cls = EngineBadRequest if status < 500 else EngineError
    return cls(GENERATE, status, message, answered=_is_json_object(raw))


_RENAMED = {"max_new_tokens": "max_tokens"}
_KEPT = ("temperature", "top_p", "top_k", "min_p", "stop_token_ids", "ignore_eos", "seed", "n")


def vllm_sampling(sp: dict[str, Any]) -> dict[str, Any]:
    """SGLang-style ``sampling_params`` (what the controller sends every engine) as vLLM's
    ``SamplingParams`` fields (vllm/sampling_params.py:337-379): ``max_new_tokens`` ->
    ``max_tokens``; ``logprobs=0`` (the sampled token's log-prob only); ``detokenize=False``
    (token-in/token-out). Keys vLLM has under the same name pass; others are refused."""
    out: dict[str, Any] = {"logprobs": 0, "detokenize": False}
    for key, value in sp.items():
        if key in _RENAMED:
            out[_RENAMED[key]] = value
        elif key in _KEPT:
            out[key] = value
        else:
            raise ValueError(f"sampling parameter {key!r} has no vLLM equivalent here")
    return out


def expand_spans(spans: Any, n: int) -> list[int]:
    """vLLM's ``weight_versions`` spans (``[{version, start, end}]`` over this request's
    output tokens, from 0: a request sent again restarts them) as one version per token.
    Missing spans (vLLM reports none when no label was seen, output_processor.py:541-543):
    every token gets version 0."""
    out = [0] * n
    if spans is None:
        return out
    try:
        for span in spans:
            v = parse_version(span["version"])
            start, end = max(0, int(span["start"])), min(n, int(span["end"]))
            out[start:end] = [v] * max(0, end - start)
    except (KeyError, TypeError, ValueError) as exc:
        raise EngineError(GENERATE, 200, f"malformed weight_versions {spans!r:.200}") from exc
    return out


def _result(ids: list[int], lps: list[float], finish: str, spans: Any) -> GenerateResult:
    """A result; without spans (a stream's chunks before the last) no per-token versions."""
    if spans is None:
        return GenerateResult(ids, lps, 0, finish)
    versions = expand_spans(spans, len(ids))
    last = versions[-1] if versions else (parse_version(spans[-1]["version"]) if spans else 0)
    return GenerateResult(ids, lps, last, finish, versions=versions if ids else None)


def _choice(out: Any) -> dict[str, Any]:
    if not isinstance(out, dict) or not isinstance(out.get("choices"), list) or not out["choices"]:
        raise EngineError(GENERATE, 200, f"unexpected response: {str(out)[:200]}")
    choice = out["choices"][0]
    if not isinstance(choice, dict):
        raise EngineError(GENERATE, 200, f"unexpected choice: {str(choice)[:200]}")
    return choice


def _logprobs(choice: dict[str, Any]) -> list[float]:
    content = (choice.get("logprobs") or {}).get("content") or []
    return [float(c["logprob"]) for c in content]


def _parse_choice(choice: dict[str, Any]) -> GenerateResult:
    """A final (non-streamed) choice as a result, per-token versions from its spans."""
    if not isinstance(choice, dict):
        raise EngineError(GENERATE, 200, f"unexpected choice: {str(choice)[:200]}")
    ids = [int(t) for t in choice.get("token_ids") or []]
    lps = _logprobs(choice)
    if len(lps) != len(ids):
        raise EngineError(GENERATE, 200, f"{len(ids)} tokens but {len(lps)} log-probs")
    finish = str(choice.get("finish_reason") or "stop")
    return _result(ids, lps, finish, choice.get("weight_versions"))


_IDEMPOTENT = frozenset(
    {
        "/pause",
        "/resume",
        "/is_paused",
        "/abort_requests",
        "/weight_info",
        "/health",
        "/weight_checker",
    }
)
"""Calls sent once more when a kept-alive connection turns out reset (the same state after
one or two of them)."""


class VLLMClient(KeyedHttp, PolledHealth):
    """One vLLM 0.33 server at ``base_url`` (module docstring); one event loop.

    ``record=True`` keeps every request sent as ``(method, path, body)`` in ``self.sent``.
    """

    def __init__(
        self,
        base_url: str,
        timeout_s: float = 120.0,
        retry_503_s: float = 600.0,
        record: bool = False,
    ):
        self.url = base_url.rstrip("/")
        self.retry_503_s = retry_503_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self.sent: list[tuple[str, str, Any]] | None = [] if record else None
        self._runs: dict[str, str] = {}  # rid of an n>1 run's member -> the run's request rid

    def __repr__(self) -> str:
        return f"VLLMClient({self.url!r})"

    async def _call(
        self, method: str, path: str, body: Any = None, params: dict[str, str] | None = None
    ) -> Any:
        """One call; a reset kept-alive connection is retried once for ``_IDEMPOTENT`` paths."""
        if self.sent is not None:
            self.sent.append((method, path + _query(params), body))
        for again in (path in _IDEMPOTENT, False):
            try:
                async with self._http().request(
                    method, self.url + path, json=body, params=params
                ) as resp:
                    raw, status = await resp.read(), resp.status
                break
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                # vLLM's server (uvicorn) closes a connection after an error it answered
                # with 500 (an exception out of the app); the next call on that kept-alive
                # connection is reset: an idempotent call is sent once more, on a new one
                if not again:
                    raise EngineUnavailable(
                        f"{self.url}{path}: {type(exc).__name__}: {exc}"
                    ) from exc
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                raise EngineUnavailable(f"{self.url}{path}: {type(exc).__name__}: {exc}") from exc
        if status >= 400:
            if path == GENERATE:
                raise _refusal(self.url, status, raw)
            cls = EngineBadRequest if status < 500 else EngineError
            raise cls(path, status, _server_message(raw), answered=_is_json_object(raw))
        if not raw:
            return None
        try:
            return msgspec.json.decode(raw)
        except msgspec.DecodeError:
            return raw.decode(errors="replace")

    # -- generation ---------------------------------------------------------------------
    def _body(self, ids: list[int], sp: dict[str, Any], rid: str | None, stream: bool) -> Any:
        """``sp["lora_path"]`` (an adapter version's name) becomes the request's ``model``
        (tito/protocol.py:284, resolved to the loaded adapter by ``_maybe_get_adapters``,
        tito/serving.py:197-198; an unknown name: 404, models/serving.py:53-62)."""
        lora = sp.get("lora_path")
        body = {
            "request_id": str(rid) if rid is not None else uuid.uuid4().hex,
            "token_ids": [int(t) for t in ids],
            "sampling_params": vllm_sampling({k: v for k, v in sp.items() if k != "lora_path"}),
            "stream": stream,
        }
        if lora is not None:
            body["model"] = str(lora)
        return body

    async def _until_resumed(self, first: EngineError) -> None:
        """After a 503 (paused in ``abort``/``wait`` mode): poll ``/is_paused`` until it is
        False, at most ``retry_503_s``; then EngineUnavailable naming the engine."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.retry_503_s
        while True:
            await asyncio.sleep(0.05)
            out = await self._call("GET", "/is_paused")
            if isinstance(out, dict) and not out.get("is_paused"):
                return
            if loop.time() > deadline:
                raise EngineUnavailable(
                    f"{self.url} paused for over {self.retry_503_s:g}s (503: {first.message})"
                )

    async def _post_generate(self, body: dict[str, Any]) -> Any:
        """POST a non-streamed generate; a 503 (paused) waits for the resume and resends."""
        while True:
            try:
                return await self._call("POST", GENERATE, body)
            except EngineError as exc:
                if exc.status != 503:
                    raise
                await self._until_resumed(exc)

    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str | None = None
    ) -> GenerateResult:
        """One completion of ``input_ids``; a 503 (paused) waits for the resume and resends.
        ``sampling_params["n"] > 1`` is refused (one result only: :meth:`generate_batch`)."""
        if int(sampling_params.get("n", 1)) != 1:
            raise ValueError("generate returns one completion: use generate_batch for n > 1")
        out = await self._post_generate(self._body(input_ids, sampling_params, rid, False))
        return _parse_choice(_choice(out))

    async def generate_batch(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Several completions, answered in order once all finished. Runs of equal prompts
        with equal sampling parameters (a GRPO group's samples) go as one request with ``n``
        = the run's length (module docstring), named by the run's first rid; the others as
        requests of their own, all at once. :meth:`abort_request` of any rid of a run
        aborts the whole run (vLLM aborts a parallel-sampling parent with its children and
        cannot abort one child by its external id, output_processor.py:610-629)."""
        names = batch_rids(requests) or [uuid.uuid4().hex for _ in requests]
        keys = [(r.input_ids, r.sampling_params) for r in requests]
        runs: list[list[int]] = []
        for i, key in enumerate(keys):
            if runs and key == keys[runs[-1][0]] and "n" not in key[1]:
                runs[-1].append(i)
            else:
                runs.append([i])
        answers = await asyncio.gather(
            *(self._generate_n(*keys[r[0]], [names[i] for i in r]) for r in runs)
        )
        return [res for answer in answers for res in answer]

    async def _generate_n(
        self, input_ids: list[int], sp: dict[str, Any], rids: list[str]
    ) -> list[GenerateResult]:
        """``len(rids)`` completions of one prompt in one request (``n``), by choice index."""
        if len(rids) == 1:
            return [await self.generate(input_ids, sp, rids[0])]
        body = self._body(input_ids, {**sp, "n": len(rids)}, rids[0], stream=False)
        for r in rids[1:]:
            self._runs[r] = rids[0]
        try:
            out = await self._post_generate(body)
        finally:
            for r in rids[1:]:
                self._runs.pop(r, None)
        choices = out.get("choices") if isinstance(out, dict) else None
        if not isinstance(choices, list) or len(choices) != len(rids):
            got = len(choices) if isinstance(choices, list) else type(out).__name__
            raise EngineError(GENERATE, 200, f"n={len(rids)}: got {got} choices")
        try:
            ordered = sorted(choices, key=lambda c: int(c["index"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineError(GENERATE, 200, f"choices without an index: {out!r:.200}") from exc
        if [int(c["index"]) for c in ordered] != list(range(len(rids))):
            raise EngineError(GENERATE, 200, f"choice indexes {[c['index'] for c in ordered]}")
        return [_parse_choice(c) for c in ordered]

    async def generate_stream(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str | None = None
    ) -> AsyncIterator[GenerateResult]:
        """Yield the cumulative partial result after every chunk; the last one carries the
        finish reason and per-token versions from vLLM's spans (earlier ones: none, vLLM
        sends spans on the final chunk only). A 503 (or a retryable error
        chunk before any token) waits for the resume and resends. One completion only:
        ``n > 1`` is refused (vLLM streams it as one choice per chunk, the children's chunks
        interleaved by ``index``, tito/serving.py:681-754; use :meth:`generate_batch`)."""
        if int(sampling_params.get("n", 1)) != 1:
            raise ValueError(
                "generate_stream streams one completion (vLLM interleaves the chunks of n > 1 "
                "choices by index): use generate_batch for n > 1"
            )
        body = self._body(input_ids, sampling_params, rid, stream=True)
        while True:
            try:
                async for partial in self._stream_once(body):
                    yield partial
                return
            except _Retry as exc:
                await self._until_resumed(exc.error)

    async def _stream_once(self, body: dict[str, Any]) -> AsyncIterator[GenerateResult]:
        if self.sent is not None:
            self.sent.append(("POST", GENERATE, body))
        ids: list[int] = []
        lps: list[float] = []
        try:
            async with self._http().post(self.url + GENERATE, json=body) as resp:
                if resp.status >= 400:
                    err = _refusal(self.url, resp.status, await resp.read())
                    if resp.status == 503:
                        raise _Retry(err)
                    raise err
                async for chunk in _events(resp.content):
                    if "error" in chunk:
                        err = _stream_error(chunk)
                        if err.status == 503 and not ids:
                            raise _Retry(err)
                        raise err
                    if not chunk.get("choices"):
                        continue  # the usage chunk
                    choice = _choice(chunk)
                    if choice.get("index", 0) != 0:  # n == 1: vLLM's one choice is index 0
                        raise EngineError(
                            GENERATE, 200, f"a stream chunk of choice {choice.get('index')!r}"
                        )
                    ids += [int(t) for t in choice.get("token_ids") or []]
                    lps += _logprobs(choice)
                    finish = choice.get("finish_reason")
                    spans = choice.get("weight_versions")
                    yield _result(list(ids), list(lps), str(finish or ""), spans)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
            raise EngineUnavailable(f"{self.url}{GENERATE}: {type(exc).__name__}: {exc}") from exc

    # -- LoRA adapters (VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, serve/lora/api_router.py:30-96) --
    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Load the PEFT folder ``lora_path`` as ``lora_name`` (400 when the name is loaded
        already, models/serving.py:270-278)."""
        body = {"lora_name": str(lora_name), "lora_path": str(lora_path)}
        await self._call("POST", "/v1/load_lora_adapter", body)

    async def unload_lora_adapter(self, lora_name: str) -> None:
        """Forget ``lora_name`` (404 "cannot be found" when unknown). vLLM does not wait for
        the requests using it: they keep their adapter (models/serving.py:234-248)."""
        await self._call("POST", "/v1/unload_lora_adapter", {"lora_name": str(lora_name)})

    def refusal(self, exc: EngineError) -> str:
        """vLLM's adapter refusals (see ``AdapterControl``): a name loaded already ("has
        already been loaded", models/serving.py:270-278), one not loaded ("cannot be found",
        :293-300)."""
        text = str(exc)
        if "has already been loaded" in text:
            return "held"
        return "gone" if "cannot be found" in text else ""

    # -- pause, abort, version, liveness -------------------------------------------------
    async def pause_generation(self, mode: str = "keep") -> None:
        """``POST /pause?mode=``: ``keep`` | ``abort`` | ``wait`` (vLLM's modes). ``keep``
        goes with ``clear_cache=false``: the parameter defaults to true
        (entrypoints/rl/online/api_router.py:35) and the engine core then resets the prefix
        cache with ``reset_running_requests=True`` in every mode, ``keep`` included
        (v1/engine/core.py:930-953, 2181-2218): every kept request would re-prefill.
        ``abort`` and ``wait`` keep vLLM's default (no request is kept; the cache the old
        weights filled is dropped)."""
        if mode not in VLLM_PAUSE_MODES:
            allowed = ", ".join(VLLM_PAUSE_MODES)
            raise ValueError(f"vLLM pause mode must be one of {allowed}, got {mode!r}")
        query = {"mode": mode, **({"clear_cache": "false"} if mode == "keep" else {})}
        await self._call("POST", "/pause", None, query)

    async def continue_generation(self) -> None:
        await self._call("POST", "/resume")

    async def is_paused(self) -> bool:
        out = await self._call("GET", "/is_paused")
        return bool(isinstance(out, dict) and out.get("is_paused"))

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """Abort request ``rid`` (or all): its generate answers with what it has, ``abort``.
        Sent as the engine's id ``generate-tokens-{rid}``; a member of an ``n > 1`` run
        aborts the whole run (:meth:`generate_batch`)."""
        request = ENGINE_ID.format(self._runs.get(str(rid), str(rid)))
        body: dict[str, Any] = {} if abort_all else {"request_ids": [request]}
        await self._call("POST", "/abort_requests", body)

    async def get_weight_version(self) -> str:
        out = await self._call("GET", "/weight_info")
        if not isinstance(out, dict) or "weight_version" not in out:
            raise EngineError("/weight_info", 200, f"unexpected response: {out!r:.200}")
        return str(out["weight_version"])

    async def _why_unhealthy(self) -> str | None:
        """vLLM's ``/health`` answers 200 (:meth:`health`, :meth:`wait_healthy`)."""
        return await failure(self._call("GET", "/health"))


class _Retry(Exception):
    """A 503 before any token: the engine is paused (abort/wait mode)."""

    def __init__(self, error: EngineError):
        super().__init__(str(error))
        self.error = error


def _query(params: dict[str, str] | None) -> str:
    return "?" + "&".join(f"{k}={v}" for k, v in params.items()) if params else ""


async def _events(content: aiohttp.StreamReader) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of an SSE stream's ``data:`` lines, until ``data: [DONE]``."""
    async for line in content:
        text = line.decode(errors="replace").strip()
        if not text.startswith("data:"):
            continue
        data = text[5:].strip()
        if data == "[DONE]":
            return
        try:
            obj = json.loads(data)
        except ValueError as exc:
            raise EngineError(GENERATE, 200, f"malformed stream chunk {data[:200]!r}") from exc
        if isinstance(obj, dict):
            yield obj


def _stream_error(chunk: dict[str, Any]) -> EngineError:
    err = chunk.get("error")
    info = err if isinstance(err, dict) else {"message": str(err)}
    code = int(info.get("code") or 500)
    cls = EngineBadRequest if 400 <= code < 500 else EngineError
    return cls(GENERATE, code, str(info.get("message", "")))
