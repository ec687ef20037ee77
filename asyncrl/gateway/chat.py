"""One turn of a session: ``n`` choices generated through the episode's context.

A :class:`Turn` runs as its own task (an SDK retry of the same request joins it, and a
client that hangs up does not cut it while another reader waits). Each choice streams
through :meth:`EpisodeContext.generate_stream` (weight updates and engine retries are
invisible; every token keeps its version). Stop strings are matched on the decoded
text: the choice ends at the first token that completes one (later tokens are
dropped, the request is cancelled), and its text is cut before the stop string. When
the turn finishes, each choice's exact tokens are recorded on its own branch.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asyncrl.gateway import tools as toolcalls
from asyncrl.gateway.protocol import Params
from asyncrl.gateway.transcript import Branch, Transcript

if TYPE_CHECKING:
    from asyncrl.controllers.episode import EpisodeContext
    from asyncrl.tasks.text import ChatTokenizer

__all__ = ["Choice", "Detokenizer", "Turn"]


@dataclass
class Choice:
    index: int
    branch: Branch
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    finish: str | None = None  # "stop" | "length" | "tool_calls", once done
    content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def reply(self) -> dict[str, Any]:
        """The assistant message as the client gets it (normalized form)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or ""}
        if self.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": c["id"],
                    "name": c["function"]["name"],
                    "arguments": _args(c["function"]["arguments"]),
                }
                for c in self.tool_calls
            ]
        return msg


def _args(text: str) -> Any:
    import json

    try:
        return json.loads(text)
    except ValueError:
        return text


class Detokenizer:
    """The text of a growing list of token ids, decoded incrementally (vLLM's prefix/read
    offsets): each :meth:`update` decodes only the tokens since the last point where the
    text was whole, so a completion of n tokens costs O(n) decoding, not O(n^2). The text
    holds no incomplete character (those tokens wait for the next update); with a
    byte-level tokenizer it is always a prefix of ``decode(ids)``."""

    def __init__(self, tok: ChatTokenizer):
        self.tok = tok
        self.text = ""
        self.prefix = 0  # ids[prefix:read] decode to the text's last whole piece
        self.read = 0  # ids[:read] are in the text

    def update(self, ids: list[int]) -> str:
        if len(ids) > self.read:
            before = self.tok.decode(ids[self.prefix : self.read]) if self.read else ""
            now = self.tok.decode(ids[self.prefix :])
            if len(now) > len(before) and not now.endswith("\ufffd"):
                self.text += now[len(before) :]
                self.prefix, self.read = self.read, len(ids)
        return self.text


class Turn:
    """``n`` choices of one request on one session (see the module docstring)."""

    def __init__(
        self,
        ctx: EpisodeContext,
        tok: ChatTokenizer,
        transcript: Transcript,
        params: Params,
        branch: Branch,
        budget: int,
        kind: str = "chat",
    ):
        self.ctx, self.tok, self.transcript, self.params = ctx, tok, transcript, params
        self.kind = kind
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.prompt_ids = list(branch.ids)
        self.budget = budget
        branches = [branch] + [transcript.fork_for_choice(branch) for _ in range(params.n - 1)]
        self.choices = [Choice(i, b) for i, b in enumerate(branches)]
        self.wake = asyncio.Event()
        self.done = asyncio.Event()
        self.error: BaseException | None = None
        self.readers = 0
        self.task: asyncio.Task | None = None
        self.body: dict[str, Any] | None = None  # the non-streamed answer, once built

    def start(self, record: Any) -> None:
        """Run the turn; ``record(turn)`` is called once every choice finished."""
        self.task = asyncio.ensure_future(self._run(record))

    async def _run(self, record: Any) -> None:
        try:
            if len(self.choices) == 1:  # no child task: one loop hop less per engine event
                await self._choice(self.choices[0])
            else:
                await asyncio.gather(*(self._choice(c) for c in self.choices))
            record(self)
        except BaseException as exc:
            self.error = exc
            for c in self.choices:
                self.transcript.release(c.branch)
            if not isinstance(exc, asyncio.CancelledError):
                return
            raise
        finally:
            self.done.set()
            self._notify()

    def _notify(self) -> None:
        self.wake.set()
        self.wake = asyncio.Event()

    async def _choice(self, c: Choice) -> None:
        """Generate choice ``c``: streamed from the engine when the client streams or a stop
        string may cut it early, else one whole engine call (no per-token work here)."""
        p = self.params
        sp = p.sampling(self.budget)
        if p.stream or p.stop:
            gen = None
            text = Detokenizer(self.tok)
            async for gen in self.ctx.generate_stream(self.prompt_ids, **sp):
                c.ids, c.logprobs, c.versions = gen.output_ids, gen.logprobs, gen.versions
                c.text = text.update(c.ids)
                if p.stop and self._stopped(c):
                    break
                self._notify()
            assert gen is not None
        else:
            gen = await self.ctx.generate(self.prompt_ids, **sp)
            c.ids, c.logprobs, c.versions = gen.output_ids, gen.logprobs, gen.versions
        c.ids, c.logprobs, c.versions = list(c.ids), list(c.logprobs), list(c.versions)
        if c.finish is None:
            c.finish = "length" if gen.finish_reason == "length" else "stop"
            c.text = self.tok.decode(c.ids)  # the exact text (a stop string cut it already)
        c.content = c.text
        if p.parse_tools and c.finish == "stop":
            c.content, c.tool_calls = toolcalls.parse(c.text)
            if c.tool_calls:
                c.finish = "tool_calls"

    def _stopped(self, c: Choice) -> bool:
        """Cut ``c`` at the first stop string in its text (True: the choice is over)."""
        hits = [(i, s) for s in self.params.stop if (i := c.text.find(s)) >= 0]
        if not hits:
            return False
        at = min(i for i, _ in hits)
        for k in range(1, len(c.ids) + 1):  # the first token that completes a stop string
            if any(s in self.tok.decode(c.ids[:k]) for _, s in hits):
                break
        c.ids, c.logprobs, c.versions = c.ids[:k], c.logprobs[:k], c.versions[:k]
        c.text, c.finish = c.text[:at], "stop"
        return True

    def cancel(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def usage(self) -> dict[str, int]:
        out = sum(len(c.ids) for c in self.choices)
        n = len(self.prompt_ids)
        return {"prompt_tokens": n, "completion_tokens": out, "total_tokens": n + out}
