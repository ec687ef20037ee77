"""Hermes / Qwen tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

:func:`parse` splits a completion's text into its content and OpenAI ``tool_calls``;
a block that is not a JSON object with a string ``name`` stays in the content (the
model's text is never dropped). :class:`Holdback` streams text while holding back
what may be the start of a tool call or of a stop string.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

__all__ = ["END", "START", "Holdback", "parse"]

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def parse(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)``: content is the text before the first call (None when
    empty and calls were found); each call gets a fresh ``call_...`` id and its arguments
    as a JSON string, as OpenAI returns them."""
    first = text.find(START)
    if first < 0:
        return text, []
    calls = []
    for m in _BLOCK.finditer(text, first):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        args = obj.get("arguments", obj.get("parameters", {}))
        args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": obj["name"], "arguments": args_text},
            }
        )
    content = text[:first].strip()
    return (content or None), calls


class Holdback:
    """Text deltas safe to stream: everything except a tail that could begin one of
    ``markers`` (a stop string, ``<tool_call>``) or an incomplete UTF-8 character;
    once a tool call starts (``tools``), nothing more streams as content."""

    def __init__(self, markers: list[str], tools: bool):
        self.markers = [m for m in markers if m]
        self.tools = tools
        self.sent = 0  # characters of the text streamed so far

    def delta(self, text: str, final: bool) -> str:
        """The content to send now, given the whole text so far."""
        limit = len(text)
        if self.tools and (i := text.find(START)) >= 0:
            limit = i
        elif not final:
            while limit > self.sent and text[limit - 1] == "\ufffd":
                limit -= 1  # a character split across tokens
            for m in [*self.markers, *([START] if self.tools else [])]:
                for k in range(min(len(m) - 1, limit - self.sent), 0, -1):
                    if text[:limit].endswith(m[:k]):
                        limit -= k
                        break
        if final and self.tools and START in text:
            limit = text.find(START)
        out = text[self.sent : max(limit, self.sent)]
        self.sent = max(limit, self.sent)
        return out
