"""SGLang's streamed ``/generate`` read as :class:`GenerateResult` events (client side).

SGLang 0.5.23 answers ``stream: true`` with server-sent events
(srt/entrypoints/http_server.py:949-981): ``data: {json}\\n\\n`` per step, each the
request's output so far (cumulative unless the server runs with
``--incremental-streaming-output``: then each event holds only the new tokens and their
log-probs, srt/managers/tokenizer_manager.py:2674-2700), an error as ``data:
{"error": {...}}``, and ``data: [DONE]`` last. The embedded engine serves the same.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec

from asyncrl.core import GenerateResult
from asyncrl.engines.rollout.base import (
    EngineBadRequest,
    EngineError,
    EngineUnavailable,
    parse_sglang_generate,
)

__all__ = ["read_generate_stream"]

_MAX_EVENT = 64 << 20


async def read_generate_stream(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], incremental: bool = False
) -> AsyncIterator[GenerateResult]:
    """POST ``body`` (``stream: true`` is set) to ``url`` (a ``/generate``) and yield the
    cumulative result after every event, the final one (``finish_reason`` set) last.
    ``incremental``: the server sends deltas (SGLang ``--incremental-streaming-output``).
    Raises EngineBadRequest / EngineError for an error answer or event, EngineUnavailable
    when the connection fails or the stream ends without a final event."""
    body = {**body, "stream": True}
    ids: list[int] = []
    lps: list[float] = []
    versions: list[int] = []
    try:
        async with http.post(url, json=body) as resp:
            if resp.status >= 400:
                raw = await resp.read()
                cls = EngineBadRequest if resp.status < 500 else EngineError
                raise cls("/generate", resp.status, raw.decode(errors="replace")[:2000])
            async for data in _events(resp.content):
                if data == b"[DONE]":
                    return
                res = _parse(data)
                if incremental:
                    ids += res.output_ids
                    lps += res.logprobs
                    versions += res.token_versions()
                    res = GenerateResult(
                        list(ids),
                        list(lps),
                        res.weight_version,
                        res.finish_reason,
                        res.prompt_tokens,
                        list(versions),
                    )
                yield res
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError) as exc:
        raise EngineUnavailable(f"{url} (stream): {type(exc).__name__}: {exc}") from exc
    raise EngineUnavailable(f"{url} (stream): ended without data: [DONE]")


async def _events(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The ``data:`` payloads of an SSE stream, one per event (other fields ignored).
    Read in chunks (aiohttp's ``readline`` refuses lines over 128 KiB; a cumulative event
    of a long completion is longer)."""
    buf = b""
    async for chunk in content.iter_any():
        buf += chunk.replace(b"\r\n", b"\n")
        while (end := buf.find(b"\n\n")) >= 0:
            event, buf = buf[:end], buf[end + 2 :]
            data = [ln[5:].lstrip(b" ") for ln in event.split(b"\n") if ln.startswith(b"data:")]
            if data:
                yield b"\n".join(data)
        if len(buf) > _MAX_EVENT:
            raise EngineError("/generate", 200, "a stream event over 64 MiB")


def _parse(data: bytes) -> GenerateResult:
    try:
        out = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise EngineError("/generate", 200, f"stream event is not JSON: {data[:200]!r}") from exc
    if isinstance(out, dict) and isinstance(out.get("error"), dict):
        err = out["error"]
        code = err.get("code") if isinstance(err.get("code"), int) else 400
        cls = EngineBadRequest if 400 <= code < 500 else EngineError
        raise cls("/generate", code, str(err.get("message", err))[:2000])
    return parse_sglang_generate(out, partial=True)
