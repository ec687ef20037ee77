"""Token-exact transcripts: a session's branches and how a new request extends one.

Contract (the gateway's core promise):

- A :class:`Branch` is one trajectory: the exact token ids the model saw and produced,
  with per-token loss mask (1 on model tokens only), log-probs and weight versions,
  and the (normalized) messages those ids stand for.
- :meth:`Transcript.prompt` for a request's messages finds the branch whose messages are
  a prefix of them (ending with the assistant turn the gateway returned) and tokenises
  only what is new: the chat template's text after that history. So turn k+1's prompt
  starts with exactly turn k's prompt and output ids; model output is never
  re-tokenised. Where the template's rendering of the model's reply differs from what
  the model produced (a stop string cut it, tool-call JSON spaced differently), the
  model's tokens stay and the template's end-of-turn text (after ``eos``) follows them.
- A history that matches no branch (edited, truncated, reordered; other tools) opens a
  new branch, tokenised whole, counted in ``branches_opened``. A branch in use by
  another request in flight is forked (copied) rather than shared.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from asyncrl.gateway.protocol import ApiError
from asyncrl.tasks.text import ChatTokenizer

__all__ = ["Branch", "Transcript", "normalize", "template_message"]


def _text(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") not in ("text", "input_text"):
                raise ApiError(400, f"{where}: only text content parts are supported", where)
            if not isinstance(p.get("text"), str):
                raise ApiError(400, f"{where}: a text part needs a string 'text'", where)
            parts.append(p["text"])
        return "".join(parts)
    raise ApiError(400, f"{where} must be a string, a list of text parts or null", where)


def normalize(m: dict[str, Any], i: int) -> dict[str, Any]:
    """One message in the form transcripts compare: role (``developer`` as ``system``),
    text content (``""`` for null), tool calls as ``(id, name, parsed arguments)``."""
    role = "system" if m["role"] == "developer" else m["role"]
    out: dict[str, Any] = {"role": role, "content": _text(m.get("content"), f"messages[{i}]") or ""}
    calls = m.get("tool_calls")
    if calls:
        if role != "assistant" or not isinstance(calls, list):
            raise ApiError(400, f"messages[{i}].tool_calls: a list, on assistant messages only")
        out["tool_calls"] = [
            _call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)
        ]
    if role == "tool":
        tid = m.get("tool_call_id")
        if tid is not None and not isinstance(tid, str):
            raise ApiError(400, f"messages[{i}].tool_call_id must be a string")
        out["tool_call_id"] = tid or ""
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    return out


def _call(c: Any, where: str) -> dict[str, Any]:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError(400, f"{where} needs function.name", where)
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            pass  # kept as the string the client sent
    return {"id": str(c.get("id", "")), "name": fn["name"], "arguments": args}


def _key(m: dict[str, Any]) -> dict[str, Any]:
    """What must be equal for a message to continue a branch (content up to surrounding
    whitespace, which a streamed answer may carry and a whole one not)."""
    return {**m, "content": m["content"].strip()}


def template_message(m: dict[str, Any]) -> dict[str, Any]:
    """A normalized message as chat templates take it (tool arguments as objects)."""
    out = {k: v for k, v in m.items() if k != "tool_calls"}
    if m.get("tool_calls"):
        out["content"] = m["content"] or None
        out["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
            for c in m["tool_calls"]
        ]
    return out


@dataclass
class Branch:
    """One trajectory of a session (see the module docstring)."""

    ids: list[int]
    prompt_len: int
    tools_key: str
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    prompt_text: str = ""  # the rendered prompt of the last turn (generation prompt included)
    raw_text: str = ""  # the model's last output, decoded with special tokens
    turns: int = 0
    busy: bool = False
    index: int = 0
    cut: int = 0  # len(ids) before the turn in progress (its env tokens start here)
    truncated: bool = False  # the last model turn ended at its token limit (finish "length")

    def add_env(self, ids: list[int]) -> None:
        """Template/user/tool tokens: masked out, log-prob 0, the last version."""
        last = self.versions[-1] if self.versions else 0
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [last] * len(ids)

    def add_model(self, ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        self.ids += ids
        self.mask += [1] * len(ids)
        self.logprobs += logprobs
        self.versions += versions
        if self.prompt_len == len(self.ids) - len(ids) and self.turns == 0 and versions:
            # the prompt's (masked) tokens carry the first generated token's version
            self.versions[: self.prompt_len] = [versions[0]] * self.prompt_len

    def fork(self) -> Branch:
        twin = copy.deepcopy(self)
        twin.busy = False
        return twin


class Transcript:
    """The branches of one session and the tokenisation of new turns."""

    def __init__(self, tok: ChatTokenizer):
        self.tok = tok
        self.branches: list[Branch] = []
        self.branches_opened = 0  # branches beyond a session's first
        eos = tok.special.get("eos_token") or ""
        self.eos = eos

    def _new(self, ids: list[int], tools_key: str) -> Branch:
        if self.branches:
            self.branches_opened += 1
        b = Branch(list(ids), len(ids), tools_key, [0] * len(ids), [0.0] * len(ids), [0] * len(ids))
        b.index = len(self.branches)
        self.branches.append(b)
        return b

    def prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> tuple[Branch, str]:
        """The branch this chat request continues (marked busy) and the request's rendered
        prompt text; the branch's ids are the prompt to generate from."""
        tools_key = json.dumps(tools, sort_keys=True) if tools else ""
        full = self._render(messages, tools, True)
        for b in sorted(self.branches, key=lambda b: -len(b.messages)):
            if b.turns == 0 or b.tools_key != tools_key or len(messages) <= len(b.messages):
                continue
            if list(map(_key, messages[: len(b.messages)])) != list(map(_key, b.messages)):
                continue
            env = self._continuation(b, messages, tools, full)
            if env is None:
                continue
            if b.busy:
                b = self._adopt(b.fork())
            b.cut = len(b.ids)
            b.add_env(self.tok.encode(env))
            b.busy = True
            return b, full
        b = self._new(self.tok.encode(full), tools_key)
        b.busy = True
        return b, full

    def _adopt(self, b: Branch) -> Branch:
        self.branches_opened += 1
        b.index = len(self.branches)
        self.branches.append(b)
        return b

    def _render(self, messages: list[dict[str, Any]], tools: Any, gen: bool) -> str:
        try:
            return self.tok.render([template_message(m) for m in messages], tools, gen)
        except Exception as exc:  # a template's raise_exception, or a message it cannot take
            raise ApiError(400, f"the chat template refused these messages: {exc}") from None

    def _continuation(
        self, b: Branch, messages: list[dict[str, Any]], tools: Any, full: str
    ) -> str | None:
        """The text after branch ``b``'s ids in the new prompt ``full`` (None: no such)."""
        hist = self._render(messages[: len(b.messages)], tools, False)
        if not full.startswith(hist) or not hist.startswith(b.prompt_text):
            return None
        reply = hist[len(b.prompt_text) :]  # the template's rendering of the assistant turn
        rest = full[len(hist) :]
        if reply.startswith(b.raw_text):
            return reply[len(b.raw_text) :] + rest
        end = reply.rfind(self.eos) if self.eos else -1
        if end < 0:
            return None
        if b.raw_text.endswith(self.eos):
            return reply[end + len(self.eos) :] + rest
        return reply[end:] + rest

    def record(
        self,
        b: Branch,
        prompt_messages: list[dict[str, Any]],
        prompt_text: str,
        out: tuple[list[int], list[float], list[int]],
        reply: dict[str, Any],
        truncated: bool = False,
    ) -> None:
        """Turn done on ``b``: the model's tokens appended, the reply remembered;
        ``truncated``: the turn ended at its token limit (``algo.mask_truncated`` reads the
        last turn's)."""
        ids, lps, vers = out
        b.add_model(ids, lps, vers)
        b.truncated = truncated
        b.messages = [*prompt_messages, reply]
        b.prompt_text = prompt_text
        b.raw_text = self.tok.tokenizer.decode(ids, skip_special_tokens=False)
        b.turns += 1
        b.busy = False

    def fork_for_choice(self, b: Branch) -> Branch:
        """A copy of ``b`` before its turn is recorded: the trajectory of another choice."""
        return self._adopt(b.fork())

    def release(self, b: Branch) -> None:
        """A turn that did not complete: the branch goes back as it was before it, env
        tokens of the cut turn dropped; a branch with no turn at all is removed."""
        b.busy = False
        for arr in (b.ids, b.mask, b.logprobs, b.versions):
            del arr[b.cut :]
        if b.turns == 0 and b in self.branches:
            self.branches.remove(b)
            for i, x in enumerate(self.branches):
                x.index = i

    # -- /v1/completions: the prompt is text (or ids) that grows by what was returned ------
    def completion_prompt(self, prompt: str | list[int]) -> Branch:
        """The branch a completion prompt continues (its ids + the prompt's new part), or a
        new one; a text prompt continues a branch when it starts with that branch's prompt
        and returned text, an id prompt when it starts with the branch's ids."""
        for b in sorted(self.branches, key=lambda b: -len(b.ids)):
            if b.turns == 0 or b.tools_key != _COMPLETION:
                continue
            if isinstance(prompt, list):
                if len(prompt) <= len(b.ids) or prompt[: len(b.ids)] != b.ids:
                    continue
                env = prompt[len(b.ids) :]
            else:
                if len(prompt) <= len(b.prompt_text) or not prompt.startswith(b.prompt_text):
                    continue
                env = self.tok.encode(prompt[len(b.prompt_text) :])
            if b.busy:
                b = self._adopt(b.fork())
            b.cut = len(b.ids)
            b.add_env(env)
            b.busy = True
            return b
        ids = prompt if isinstance(prompt, list) else self.tok.encode(prompt)
        b = self._new(list(ids), _COMPLETION)
        b.busy = True
        return b

    def record_completion(
        self,
        b: Branch,
        prompt: str | list[int],
        out: tuple[list[int], list[float], list[int]],
        text: str,
        truncated: bool = False,
    ) -> None:
        """A completion turn done on ``b`` (``truncated`` as for :meth:`record`)."""
        ids, lps, vers = out
        b.add_model(ids, lps, vers)
        b.truncated = truncated
        b.prompt_text = (prompt if isinstance(prompt, str) else "") + text
        b.turns += 1
        b.busy = False


_COMPLETION = "<completion>"
