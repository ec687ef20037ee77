"""Answers of a turn in OpenAI's shapes: whole (JSON) or streamed (server-sent events).

Streaming is real: a reader wakes on every token batch of the turn and sends what is
safe to send (:class:`~asyncrl.gateway.tools.Holdback`): content deltas, log-probs of
the tokens they cover, then tool calls and ``finish_reason`` per choice, the usage
chunk when ``stream_options.include_usage``, and ``data: [DONE]``. Several readers
(an SDK retry joining the turn) each get the whole stream.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from asyncrl.gateway.chat import Choice, Turn
from asyncrl.gateway.tools import Holdback

__all__ = ["chat_body", "completion_body", "stream_turn"]


def _token_logprobs(turn: Turn, c: Choice, lo: int, hi: int) -> list[dict[str, Any]]:
    out = []
    for tid, lp in zip(c.ids[lo:hi], c.logprobs[lo:hi], strict=True):
        text = turn.tok.tokenizer.decode([tid], skip_special_tokens=False)
        entry: dict[str, Any] = {"token": text, "logprob": lp, "bytes": list(text.encode())}
        # only the sampled token's log-prob is known: top_logprobs lists it alone
        entry["top_logprobs"] = [dict(entry)] if turn.params.top_logprobs else []
        out.append(entry)
    return out


def chat_body(turn: Turn, model: str) -> dict[str, Any]:
    choices = []
    for c in turn.choices:
        msg: dict[str, Any] = {"role": "assistant", "content": c.content}
        if c.tool_calls:
            msg["tool_calls"] = c.tool_calls
        choice: dict[str, Any] = {"index": c.index, "message": msg, "finish_reason": c.finish}
        choice["logprobs"] = (
            {"content": _token_logprobs(turn, c, 0, len(c.ids))} if turn.params.logprobs else None
        )
        choices.append(choice)
    return {
        "id": turn.id,
        "object": "chat.completion",
        "created": turn.created,
        "model": model,
        "choices": choices,
        "usage": turn.usage(),
    }


def completion_body(turn: Turn, model: str) -> dict[str, Any]:
    choices = []
    for c in turn.choices:
        lps = None
        if turn.params.logprobs:
            toks = [turn.tok.tokenizer.decode([t], skip_special_tokens=False) for t in c.ids]
            top = [{t: lp} for t, lp in zip(toks, c.logprobs, strict=True)]
            offsets, at = [], 0
            for t in toks:
                offsets.append(at)
                at += len(t)
            lps = {
                "tokens": toks,
                "token_logprobs": list(c.logprobs),
                "top_logprobs": top if turn.params.top_logprobs else None,
                "text_offset": offsets,
            }
        choices.append(
            {"index": c.index, "text": c.text, "logprobs": lps, "finish_reason": c.finish}
        )
    return {
        "id": turn.id,
        "object": "text_completion",
        "created": turn.created,
        "model": model,
        "choices": choices,
        "usage": turn.usage(),
    }


async def stream_turn(request: web.Request, turn: Turn, model: str) -> web.StreamResponse:
    """Stream ``turn`` to this reader (raises the turn's error if it failed). The events of
    one wake-up go out in one write, the last ones (the final piece, ``finish_reason``,
    usage, ``[DONE]``) with the end of the response: one send each, not one per event."""
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    ev = _Events(turn, model)
    if ev.chat:
        ev.send([_delta(i, {"role": "assistant", "content": ""}) for i in range(turn.params.n)])
    while True:
        wake = turn.wake
        done = turn.done.is_set()
        if done and turn.error is not None:  # the answer has begun: the error as an event
            err = {
                "message": f"the completion failed: {turn.error!r}"[:500],
                "type": "server_error",
            }
            ev.out.append(b"data: " + _encode({"error": err}) + b"\n\n")
            break
        for c in turn.choices:
            ev.advance(c, done)
        if all(ev.finished):
            break
        if ev.out:
            await resp.write(ev.take())
        await wake.wait()
    if turn.params.include_usage:
        ev.send([], turn.usage())
    ev.out.append(b"data: [DONE]\n\n")
    await resp.write_eof(ev.take())
    return resp


class _Events:
    """One reader's stream of ``turn``: the events not yet written (``out``) and each
    choice's progress (its stop-string holdback, the tokens whose log-probs went out,
    whether its end went out)."""

    def __init__(self, turn: Turn, model: str) -> None:
        self.turn, self.chat, self.p = turn, turn.kind == "chat", turn.params
        self.holds = [Holdback(self.p.stop, self.p.parse_tools) for _ in turn.choices]
        self.sent_tokens = [0] * len(turn.choices)
        self.finished = [False] * len(turn.choices)
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        self.head = {"id": turn.id, "object": obj, "created": turn.created, "model": model}
        self.out: list[bytes] = []

    def send(self, choices: list[dict[str, Any]], usage: Any = None) -> None:
        chunk = {**self.head, "choices": choices}
        if self.p.include_usage:
            chunk["usage"] = usage
        self.out.append(b"data: " + _encode(chunk) + b"\n\n")

    def advance(self, c: Choice, done: bool) -> None:
        """The events for what choice ``c`` can send now: its safe text and the log-probs
        of the tokens it covers, and, once it finished and the turn is ``done``, its end."""
        i, turn, p = c.index, self.turn, self.p
        if self.finished[i]:
            return
        final = c.finish is not None and done
        text = self.holds[i].delta(c.text, final)
        if not text and not final:
            return
        lps = None
        if p.logprobs:  # the tokens the text sent so far covers
            sent = self.sent_tokens[i]
            hi = len(c.ids) if final else _covered(turn, c, self.holds[i].sent, sent)
            lps = _token_logprobs(turn, c, sent, hi)
            self.sent_tokens[i] = max(sent, hi)
        if text or lps:
            self.send([_piece(self.chat, i, text, lps)])
        if final:
            self.finished[i] = True
            self.send([_end(self.chat, c)])

    def take(self) -> bytes:
        """The events not yet written, in one piece; ``out`` is empty after."""
        data = b"".join(self.out)
        self.out.clear()
        return data


_encode = msgspec.json.Encoder().encode


def _covered(turn: Turn, c: Choice, chars: int, start: int) -> int:
    """How many of ``c``'s tokens the first ``chars`` characters of its text cover (at
    least ``start``: as many as an earlier answer)."""
    if chars >= len(c.text):
        return len(c.ids)
    n = start
    while n < len(c.ids) and len(turn.tok.decode(c.ids[: n + 1])) <= chars:
        n += 1
    return n


def _delta(i: int, delta: dict[str, Any]) -> dict[str, Any]:
    return {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}


def _piece(chat: bool, i: int, text: str, lps: list[dict[str, Any]] | None) -> dict[str, Any]:
    if chat:
        out = _delta(i, {"content": text})
        out["logprobs"] = {"content": lps} if lps is not None else None
        return out
    lp = None
    if lps is not None:
        lp = {"tokens": [e["token"] for e in lps], "token_logprobs": [e["logprob"] for e in lps]}
    return {"index": i, "text": text, "logprobs": lp, "finish_reason": None}


def _end(chat: bool, c: Choice) -> dict[str, Any]:
    if not chat:
        return {"index": c.index, "text": "", "logprobs": None, "finish_reason": c.finish}
    delta: dict[str, Any] = {}
    if c.tool_calls:
        delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(c.tool_calls)]
    out = _delta(c.index, delta)
    out["finish_reason"] = c.finish
    return out
