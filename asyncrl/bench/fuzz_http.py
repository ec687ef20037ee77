"""Hostile HTTP requests for an SGLang-protocol engine: the cases and the client that sends them.

:func:`cases` draws requests to every endpoint of the embedded engine —
malformed JSON (truncated, not UTF-8, nested 1,000 deep, ``1e400``, NaN),
bodies of the wrong type, wrong field types, out-of-range numbers, token ids
out of the vocabulary or negative, huge lists, bad shapes and dtypes of
weight updates, weight groups at forbidden addresses or ports, unknown
endpoints and methods. None of them may pause the engine or make it wait on a
peer (``init_weights_update_group`` cases that are well formed point at a
closed loopback port with a short timeout). :func:`send` sends them
concurrently and counts the answers by status, the 5xx answers and the
requests never answered (connection errors, timeouts).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from typing import Any

from asyncrl.secret import auth_headers

__all__ = ["Case", "cases", "send"]

Case = tuple[str, str, bytes | None]  # method, path, raw body (None: no body)

POST = (
    "/generate",
    "/abort_request",
    "/pause_generation",
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/update_weights_from_tensor",
    "/destroy_weights_update_group",
    "/update_weight_version",
    "/flush_cache",
)
GET = (
    "/get_weight_version",
    "/get_model_info",
    "/get_weights_checksum",
    "/get_server_info",
    "/health",
)
JUNK_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1 << 70,
    -(1 << 70),
    0.5,
    -1e308,
    1e308,
    "",
    "x",
    "1",
    "NaN",
    [],
    [None],
    [[]],
    {},
    {"a": 1},
    [1, "a"],
    "\u0000\ud7ff",
]


def _junk(rng: random.Random) -> Any:
    return rng.choice(JUNK_VALUES)


def _ids(rng: random.Random, vocab: int) -> Any:
    kind = rng.randrange(10)
    if kind == 0:
        return [rng.randrange(vocab, vocab + 1000) for _ in range(rng.randint(1, 5))]
    if kind == 1:
        return [-rng.randint(1, 1 << 40) for _ in range(rng.randint(1, 5))]
    if kind == 2:
        return [rng.randrange(vocab) for _ in range(rng.choice([65, 1000, 100_000]))]
    if kind == 3:
        return [[rng.randrange(vocab)] * 3, _junk(rng)]
    if kind == 4:
        return [float(rng.randrange(vocab)) + 0.5, 1]
    if kind == 5:
        return [True, False]
    if kind == 6:
        return [[]]
    return _junk(rng)


def _sampling(rng: random.Random) -> Any:
    keys = ["max_new_tokens", "temperature", "top_p", "top_k", "ignore_eos", "stop_token_ids"]
    keys += ["n", "min_p", "stop", "regex", "nonsense"]
    if rng.random() < 0.1:
        return _junk(rng)
    out = {}
    for key in rng.sample(keys, rng.randint(1, 3)):
        out[key] = rng.choice(
            [_junk(rng), -5, 1e400, 10**30, float("inf"), float("nan"), 3000, -0.0]
        )
    return out


def _generate(rng: random.Random, vocab: int) -> dict[str, Any]:
    body: dict[str, Any] = {"input_ids": _ids(rng, vocab), "sampling_params": _sampling(rng)}
    for key in rng.sample(["rid", "return_logprob", "text", "stream", "sampling_params"], 1):
        body[key] = _junk(rng)
    return body


def _shape(rng: random.Random) -> Any:
    return rng.choice([[-1], [2, -3], [1 << 40, 1 << 40], [10**20], ["a"], 5, None, [[2]], []])


def _weights(rng: random.Random) -> dict[str, Any]:
    body: dict[str, Any] = {
        "names": rng.choice([["model.norm.weight"], [], None, 3, ["x", "y"], [{}]]),
        "dtypes": rng.choice([["float32"], ["int8"], ["nonsense"], None, [1], ["float32"] * 3]),
        "shapes": [_shape(rng)] if rng.random() < 0.7 else _shape(rng),
        "group_name": rng.choice(["weight_update_group", _junk(rng)]),
        "load_format": rng.choice([None, "flattened_bucket", "direct", "pickle", _junk(rng)]),
    }
    if rng.random() < 0.6:
        body["asyncrl_bucket"] = rng.choice(
            [
                _junk(rng),
                {"index": -1, "count": 1, "version": 1},
                {"index": 0, "count": 10**20, "version": "x"},
                {"index": 0, "count": 1, "version": 1, "chunks": [[0, -5]], "full_shapes": [[4]]},
                {"index": 0, "count": 1, "version": 1, "checksum": "abc"},
                {"index": 0, "count": 1, "version": 1, "checksum": 1 << 63, "verify": "sampled"},
                {"index": 0, "count": 1, "version": 1, "verify": "most"},
                {"index": 0, "count": 1, "version": 2, "delta": [1, 1 << 40, None]},
                {"index": 0, "count": 1, "version": 2, "delta": [1, 13, None]},
                {"index": 0, "count": 1, "version": 2, "delta": {"base": 1}},
                {"index": 0, "count": 1, "version": 2, "delta": [1, 16, 0]},  # no base held
            ]
        )
    return body


def _group(rng: random.Random, closed_port: int) -> dict[str, Any]:
    """A weight-group join with one field broken (or missing); the others are valid, with a
    short timeout: a request that gets past validation fails fast on the closed port."""
    body: dict[str, Any] = {
        "master_address": "127.0.0.1",
        "master_port": closed_port,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "fuzz",
        "backend": "gloo",
        "timeout_s": 0.3,
    }
    broken: dict[str, list[Any]] = {
        "master_address": ["10.1.2.3", "0.0.0.0", "", 5, None, "no such host"],
        "master_port": [99999, 0, -1, "80", None, 1 << 40, 1.5],
        "rank_offset": [0, -1, 7, "1", None],
        "world_size": [1, 0, -2, 10**9, "2", None],
        "group_name": [None, 3, [], {}],
        "backend": ["nccl", "mpi", 1, None],
        "timeout_s": [-1, 0, float("inf"), float("nan"), 1e9, "1", None],
    }
    key = rng.choice(list(broken))
    if rng.random() < 0.2 and key != "timeout_s":
        del body[key]
    else:
        body[key] = rng.choice(broken[key])
    return body


def _raw(rng: random.Random) -> bytes:
    kind = rng.randrange(8)
    if kind == 0:
        return b"[" * 1000 + b"]" * 1000
    if kind == 1:
        return b'{"a":' * 1000 + b"1" + b"}" * 1000
    if kind == 2:
        return b'{"input_ids": [1, 2'  # truncated
    if kind == 3:
        return b"\xff\xfe\x00garbage"
    if kind == 4:
        return b'{"sampling_params": {"max_new_tokens": 1e400}, "input_ids": [1]}'
    if kind == 5:
        return b'{"input_ids": [NaN], "sampling_params": {"temperature": Infinity}}'
    if kind == 6:
        return b""
    return rng.choice([b"null", b"[]", b"1", b'"text"', b"true", b'{"a": 1}{"b": 2}'])


def cases(n: int, vocab: int, closed_port: int, seed: int = 0) -> list[Case]:
    """``n`` hostile requests; ``closed_port`` is a loopback port nothing listens on."""
    rng = random.Random(seed)
    out: list[Case] = []
    for _ in range(n):
        kind = rng.randrange(100)
        if kind < 15:  # not /pause_generation: "{}" is a valid pause (mode "abort")
            out.append(("POST", rng.choice(POST[:2] + POST[3:]), _raw(rng)))
            continue
        if kind < 20:
            path = rng.choice(["/nope", "/generate/x", "/../etc/passwd", "/" + "a" * 5000])
            out.append((rng.choice(["GET", "POST", "PUT", "DELETE"]), path, b"{}"))
            continue
        if kind < 25:
            out.append((rng.choice(["GET", "PUT"]), rng.choice(POST), None))
            continue
        if kind < 30:
            out.append(("POST" if rng.random() < 0.5 else "GET", rng.choice(GET), _raw(rng)))
            continue
        if kind < 60:
            path, body = "/generate", _generate(rng, vocab)
        elif kind < 72:
            path, body = (
                rng.choice(["/update_weights_from_distributed", "/update_weights_from_tensor"]),
                _weights(rng),
            )
            if path.endswith("tensor"):
                body = {
                    "load_format": rng.choice(["asyncrl_ipc", "direct", None]),
                    "asyncrl_ipc": rng.choice(
                        [_junk(rng), {"version": _junk(rng)}, {"release": 1}, {"version": 1}]
                    ),
                    "serialized_named_tensors": _junk(rng),
                }
        elif kind < 80:
            path, body = "/init_weights_update_group", _group(rng, closed_port)
        elif kind < 86:
            path, body = "/pause_generation", {"mode": rng.choice(["", "bogus", 3, None, []])}
        elif kind < 92:
            path = "/abort_request"
            body = {"rid": _junk(rng), "abort_all": rng.choice(["false", 1, None, [], "yes"])}
        else:
            path = rng.choice(["/update_weight_version", "/destroy_weights_update_group"])
            body = {"new_version": _junk(rng), "group_name": _junk(rng)}
            if path == "/update_weight_version" and isinstance(body["new_version"], str | int):
                body["new_version"] = [body["new_version"]]  # never a valid relabel
        raw = json.dumps(body, allow_nan=True).encode()
        out.append(("POST", path, raw))
    return out


async def send(
    url: str, reqs: list[Case], concurrency: int = 32, timeout_s: float = 60.0
) -> dict[str, Any]:
    """Send ``reqs``; returns counts: ``sent``, ``by_status``, ``5xx``, ``unanswered`` (with
    up to 5 examples of each of the last two) and ``wall_s``."""
    import aiohttp

    by_status: Counter[str] = Counter()
    bad: list[str] = []
    lost: list[str] = []
    queue = list(enumerate(reqs))
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    t0 = time.perf_counter()

    async def worker(http: aiohttp.ClientSession) -> None:
        while queue:
            _, (method, path, raw) = queue.pop()
            headers = {"Content-Type": "application/json"} if raw is not None else {}
            try:
                async with http.request(method, url + path, data=raw, headers=headers) as r:
                    text = await r.text(errors="replace")
                    by_status[str(r.status)] += 1
                    if r.status >= 500 and len(bad) < 5:
                        body = raw if raw is None else raw[:200]  # None: a request without a body
                        bad.append(f"{method} {path[:60]} {body!r} -> {r.status} {text[:300]}")
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                by_status["unanswered"] += 1
                if len(lost) < 5:
                    lost.append(f"{method} {path[:60]} {(raw or b'')[:200]!r}: {exc!r}")

    async with aiohttp.ClientSession(timeout=timeout, headers=auth_headers()) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return {
        "sent": len(reqs),
        "by_status": dict(sorted(by_status.items())),
        "5xx": sum(v for k, v in by_status.items() if k.startswith("5")),
        "unanswered": by_status.get("unanswered", 0),
        "5xx_examples": bad,
        "unanswered_examples": lost,
        "wall_s": time.perf_counter() - t0,
    }
