"""Sampling of the embedded engine: SGLang's ``sampling_params`` subset, batched.

Contract of :func:`sample`: one token per row from ``softmax(logits / T)``
restricted by top-k then top-p (nucleus); ``temperature == 0`` is greedy (as
in SGLang, where it means ``top_k = 1``). The returned log-prob of each token
is ``log_softmax(logits / T)`` at that token — the temperature-scaled
distribution *before* top-k/top-p truncation, which is what a trainer
recomputes from the same weights (with ``T = 1`` it is the plain model
log-prob).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asyncrl.config import DEFAULT_MAX_NEW_TOKENS

__all__ = ["SamplingParams", "sample"]

# SGLang sampling keys the embedded engine accepts only at their default value.
_INERT_DEFAULTS: dict[str, Any] = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "stop": None,
    "stop_regex": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
}
# SGLang sampling keys that only concern detokenisation/streaming: accepted, ignored.
_IGNORED = {
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
    "custom_params",
    "sampling_seed",
}


def _convert(key: str, value: Any, kind: type) -> Any:
    """``value`` as ``kind``: ints must be whole numbers that fit 64 bits, floats finite or
    not, booleans real booleans; ValueError names the key otherwise."""
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{key} must be true or false, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key} must be a number, got {value!r}")
    if kind is int:
        if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
            raise ValueError(f"{key} must be an integer, got {value!r}")
        if not -(1 << 63) <= value < 1 << 63:
            raise ValueError(f"{key} is out of range: {value!r}")
        return int(value)
    return float(value)


@dataclass(frozen=True)
class SamplingParams:
    """The SGLang ``sampling_params`` the embedded engine honours."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS  # SGLang's default
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Parse SGLang-style sampling params; ValueError names an unsupported or bad key.

        Equal dicts (the same keys, each value of the same type and equal) give the same
        object: every request of a run sends the same few dicts, so each is parsed once
        (at most ``_PARSED_MAX`` kept; a dict with a list value is parsed every time), and
        :func:`sample` takes rows that share one object as one."""
        key = (cls, *((k, type(v), v) for k, v in d.items()))
        try:
            hit = _PARSED.get(key)
        except TypeError:  # an unhashable value (a list of stop_token_ids)
            return cls._parse(d)
        if hit is None:
            if len(_PARSED) >= _PARSED_MAX:
                _PARSED.clear()
            hit = _PARSED[key] = cls._parse(d)
        return hit

    @classmethod
    def _parse(cls, d: dict[str, Any]) -> SamplingParams:
        known = {
            "max_new_tokens": int,
            "temperature": float,
            "top_p": float,
            "top_k": int,
            "ignore_eos": bool,
        }
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            if key in known:
                if value is not None:
                    kwargs[key] = _convert(key, value, known[key])
            elif key == "stop_token_ids":
                if value is not None and not isinstance(value, list):
                    raise ValueError(f"stop_token_ids must be a list of ints, got {value!r}")
                kwargs[key] = tuple(_convert(key, t, int) for t in value or ())
            elif key in _INERT_DEFAULTS:
                if value is not None and value != _INERT_DEFAULTS[key]:
                    raise ValueError(f"{key}={value!r} is not supported by the embedded engine")
            elif key not in _IGNORED:
                raise ValueError(f"unknown sampling parameter {key!r}")
        sp = cls(**kwargs)
        if sp.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {sp.max_new_tokens}")
        if not math.isfinite(sp.temperature) or sp.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {sp.temperature}")
        if not 0 < sp.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {sp.top_p}")
        if sp.top_k == 0 or sp.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {sp.top_k}")
        return sp

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6 or self.top_k == 1


_PARSED: dict[tuple[Any, ...], SamplingParams] = {}
_PARSED_MAX = 256


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` (B, V) float; returns (tokens, log-probs).

    Rows that all share one params object (equal requests' parsed params are one object:
    :meth:`SamplingParams.from_dict`) take its settings as one broadcast column instead of
    a column built row by row; the arithmetic, and so every token and log-prob, is the same.
    """
    dev = logits.device
    vocab = logits.shape[-1]
    first = params[0]
    if all(p is first for p in params):
        params = [first]
    temps = [1.0 if p.greedy else p.temperature for p in params]
    scaled = logits  # x / 1.0 is x: no division where every row's temperature is 1
    if any(t != 1.0 for t in temps):
        scaled = logits / torch.tensor(temps, device=dev)[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    greedy = [p.greedy for p in params]
    if all(greedy):
        tokens = logits.argmax(-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    ps = [p.top_p for p in params]
    filtered = scaled
    if min(ks) < vocab or min(ps) < 1.0:
        sorted_l, idx = torch.sort(scaled, dim=-1, descending=True)
        rank = torch.arange(vocab, device=dev)[None, :]
        drop = rank >= torch.tensor(ks, device=dev)[:, None]
        if min(ps) < 1.0:
            probs = torch.softmax(sorted_l.masked_fill(drop, float("-inf")), dim=-1)
            before = probs.cumsum(-1) - probs  # mass strictly above this token
            drop = drop | (before > torch.tensor(ps, device=dev)[:, None])
        sorted_l = sorted_l.masked_fill(drop, float("-inf"))
        filtered = torch.empty_like(scaled).scatter_(-1, idx, sorted_l)
    probs = torch.softmax(filtered, dim=-1)
    tokens = _draw(probs, generator)
    if any(greedy):
        tokens = torch.where(torch.tensor(greedy, device=dev), logits.argmax(-1), tokens)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def _draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of ``probs`` (B, V): ``torch.multinomial(probs, 1)``'s own algorithm
    for one draw (``argmax(p / q)``, ``q ~ Exp(1)`` from ``generator``: the same tokens from
    the same generator state) without its input checks, which cost more than the draw on a
    decode step (min, max and row sums, each read back to the CPU). The checks' case — a
    row that is not a distribution (NaN or inf logits) — raises here too, from the drawn
    rows: their probability is NaN."""
    q = torch.empty_like(probs).exponential_(1, generator=generator)
    torch.div(probs, q, out=q)
    tokens = q.argmax(-1)
    if probs.gather(-1, tokens[:, None]).isnan().any():
        raise ValueError("probability tensor contains either `inf`, `nan` or element < 0")
    return tokens
