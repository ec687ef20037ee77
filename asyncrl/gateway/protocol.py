"""OpenAI request bodies checked and read: what is supported, ignored, or refused (400).

Contract: :func:`chat_request` / :func:`completion_request` turn a decoded JSON body into
a :class:`Params` plus the prompt (messages or text/ids), or raise :class:`ApiError`
(an OpenAI-style error with a 4xx status naming the parameter). A parameter that would
change what is sampled and that the gateway cannot honour is refused, never ignored
(:data:`REFUSED`); metadata that SDKs send is accepted and ignored (:data:`IGNORED`,
listed in docs/agents.md); any other key is refused as unrecognized, as OpenAI does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["IGNORED", "REFUSED", "ApiError", "Params", "chat_request", "completion_request"]

IGNORED = frozenset(
    {
        "model",
        "user",
        "metadata",
        "store",
        "parallel_tool_calls",
        "service_tier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "safety_identifier",
        "reasoning_effort",
        "verbosity",
        "modalities",
        "function_call",
        "functions",
    }
)
"""Accepted and ignored (metadata, or no effect on this model's sampling)."""

REFUSED = {
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logit_bias": None,
    "response_format": None,
    "audio": None,
    "prediction": None,
    "web_search_options": None,
    "best_of": 1,
    "echo": False,
    "suffix": None,
}
"""Accepted only at these (no-op) values; any other value is a 400 naming the key."""

_ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """An OpenAI-style error answer: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}
        self.code = code

    def body(self) -> dict[str, Any]:
        err = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return {"error": err}


@dataclass
class Params:
    """What one request asks of the sampler and of the answer."""

    n: int = 1
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    tools: list[dict[str, Any]] | None = None
    parse_tools: bool = False

    def sampling(self, budget: int) -> dict[str, Any]:
        """SGLang ``sampling_params`` for a completion of at most ``budget`` tokens."""
        sp: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_new_tokens": budget,
        }
        if self.top_k is not None:
            sp["top_k"] = self.top_k
        if self.seed is not None:
            sp["sampling_seed"] = self.seed
        if self.ignore_eos:
            sp["ignore_eos"] = True
        return sp


def _num(body: dict[str, Any], key: str, lo: float, hi: float, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ApiError(400, f"{key} must be a number", key)
    if not lo <= v <= hi:
        raise ApiError(400, f"{key} must be in [{lo:g}, {hi:g}], got {v!r}", key)
    return float(v)


def _int(body: dict[str, Any], key: str, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"{key} must be an integer", key)
    if not lo <= v <= hi:
        raise ApiError(400, f"{key} must be in [{lo}, {hi}], got {v}", key)
    return v


def _bool(body: dict[str, Any], key: str) -> bool:
    v = body.get(key)
    if v is not None and not isinstance(v, bool):
        raise ApiError(400, f"{key} must be true or false", key)
    return bool(v)


_COMMON_KEYS = frozenset(
    {"n", "temperature", "top_p", "top_k", "seed", "stream", "ignore_eos", "stop", "stream_options"}
)
"""The keys :func:`_common` reads, which both endpoints take."""


def _common(body: Any, known: frozenset[str], max_n: int) -> Params:
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    for key, inert in REFUSED.items():
        v = body.get(key)
        if v is not None and v != inert and not (key == "response_format" and _text_format(v)):
            raise ApiError(400, f"{key}={v!r:.80} is not supported by this gateway", key)
    unknown = sorted(k for k in body if k not in known and k not in IGNORED and k not in REFUSED)
    if unknown:
        raise ApiError(400, f"Unrecognized request argument supplied: {unknown[0]}", unknown[0])
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise ApiError(400, "model must be a string", "model")
    p = Params()
    p.n = _int(body, "n", 1, max_n) or 1
    p.temperature = _num(body, "temperature", 0, 2, 1.0)
    p.top_p = _num(body, "top_p", 0, 1, 1.0)
    if p.top_p == 0:
        raise ApiError(400, "top_p must be > 0", "top_p")
    p.top_k = _int(body, "top_k", -1, 1 << 30)
    p.seed = _int(body, "seed", -(1 << 63), (1 << 63) - 1)
    p.stream = _bool(body, "stream")
    p.ignore_eos = _bool(body, "ignore_eos")
    p.stop = _stop(body.get("stop"))
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict) or not p.stream:
            raise ApiError(
                400, "stream_options needs stream=true and must be an object", "stream_options"
            )
        p.include_usage = _bool(opts, "include_usage")
    return p


def _text_format(v: Any) -> bool:
    return isinstance(v, dict) and v.get("type") == "text"


def _stop(v: Any) -> list[str]:
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "stop must be a non-empty string or a list of them", "stop")
    if len(stops) > 4:
        raise ApiError(400, "stop takes at most 4 sequences", "stop")
    return stops


_CHAT_KEYS = _COMMON_KEYS | {
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
}


def chat_request(body: Any, max_n: int) -> tuple[Params, list[dict[str, Any]]]:
    """A ``/v1/chat/completions`` body: its params and its messages, normalized
    (:func:`asyncrl.gateway.transcript.normalize`)."""
    from asyncrl.gateway.transcript import normalize

    p = _common(body, _CHAT_KEYS, max_n)
    p.max_tokens = _int(body, "max_completion_tokens", 1, 1 << 30)
    if p.max_tokens is None:
        p.max_tokens = _int(body, "max_tokens", 1, 1 << 30)
    p.logprobs = _bool(body, "logprobs")
    p.top_logprobs = _int(body, "top_logprobs", 0, 20) or 0
    if p.top_logprobs and not p.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    p.tools = _tools(body.get("tools"))
    p.parse_tools = _tool_choice(body.get("tool_choice"), p.tools)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise ApiError(400, f"messages[{i}] needs a role in {_ROLES}", f"messages[{i}].role")
    return p, [normalize(m, i) for i, m in enumerate(msgs)]


def _tools(v: Any) -> list[dict[str, Any]] | None:
    if v is None:
        return None
    if not isinstance(v, list):
        raise ApiError(400, "tools must be a list", "tools")
    for i, t in enumerate(v):
        fn = t.get("function") if isinstance(t, dict) else None
        if t.get("type") != "function" if isinstance(t, dict) else True:
            raise ApiError(400, f"tools[{i}].type must be 'function'", f"tools[{i}].type")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ApiError(400, f"tools[{i}].function needs a name", f"tools[{i}].function")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ApiError(400, f"tools[{i}].function.parameters must be an object", "tools")
    return v or None


def _tool_choice(v: Any, tools: list[dict[str, Any]] | None) -> bool:
    """Whether tool calls are parsed from the output (``auto``; ``none``: not parsed).
    ``required`` or a named function would constrain sampling: refused."""
    if v is None or v == "auto":
        return tools is not None
    if v == "none":
        return False
    raise ApiError(
        400,
        f"tool_choice={v!r:.80} is not supported: the gateway cannot force a tool call "
        "(use 'auto' or 'none')",
        "tool_choice",
    )


_COMPLETION_KEYS = _COMMON_KEYS | {"prompt", "max_tokens", "logprobs"}


def completion_request(body: Any, max_n: int) -> tuple[Params, str | list[int]]:
    """A ``/v1/completions`` body: its params and its prompt (text, or token ids)."""
    p = _common(body, _COMPLETION_KEYS, max_n)
    p.max_tokens = _int(body, "max_tokens", 1, 1 << 30)
    lp = _int(body, "logprobs", 0, 5)
    p.logprobs, p.top_logprobs = lp is not None, lp or 0
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return p, prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    ):
        return p, list(prompt)
    raise ApiError(400, "prompt must be a non-empty string or a list of token ids", "prompt")
