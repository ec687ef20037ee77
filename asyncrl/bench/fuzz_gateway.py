"""Hostile OpenAI requests at the gateway (the ``gateway`` part of ``asyncrl bench fuzz``).

:func:`cases` draws requests to the gateway's routes: malformed JSON, bodies and fields of
the wrong type, out-of-range numbers, parameters it refuses (``logit_bias``,
``frequency_penalty``, ``response_format``), ``n`` over the limit, broken tool schemas,
token ids outside the vocabulary, bad session ids, junk rewards, unknown routes and
methods; and, scattered among them, valid 2-token requests each sent 3 times to a session
of its own (an SDK's retries). :func:`run` serves the gateway (controller + tiny chat
model engine) and sends them concurrently; it counts answers by status, 5xx, requests
never answered, 4xx answers that are not OpenAI's error JSON (``{"error": {"message",
"type", ...}}``), and turns recorded per retried session (each must hold exactly one).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

__all__ = ["cases", "run"]

Case = tuple[str, str, bytes | None]
CHAT = "/v1/chat/completions"
JUNK: list[Any] = [None, True, 0, -1, 1 << 70, 1e308, -1e308, "", "x" * 3000, [], {}, [[]],
                   {"a": 1}, [1, "a"], 0.5, "NaN"]  # fmt: skip


def _msgs(rng: random.Random) -> Any:
    return rng.choice([
        [{"role": "user", "content": "hi"}],
        [{"role": rng.choice(["user", "bogus", None, 3]), "content": rng.choice(JUNK)}],
        [{"role": "tool", "content": "x"}],
        [{"role": "assistant", "tool_calls": rng.choice(JUNK)}],
        rng.choice(JUNK),
        [rng.choice(JUNK)],
    ])  # fmt: skip


def _chat(rng: random.Random, vocab: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "messages": _msgs(rng), "max_tokens": 2}
    for _ in range(rng.randrange(1, 4)):
        key = rng.choice([
            "max_tokens", "n", "temperature", "top_p", "stop", "seed", "logprobs",
            "top_logprobs", "stream", "stream_options", "tools", "tool_choice",
            "frequency_penalty", "logit_bias", "response_format", "presence_penalty",
            "best_of", "echo", "model", "max_completion_tokens", "bogus_field",
        ])  # fmt: skip
        body[key] = rng.choice(
            [*JUNK, 64, 2.5, [{"type": "function", "function": {"name": 3}}], {"type": "x"}]
        )
    return body


def cases(n: int, vocab: int, seed: int) -> tuple[list[Case], dict[str, int]]:
    """``n`` requests, and the retried sessions (id -> copies sent of its one valid body)."""
    rng = random.Random(seed)
    out: list[Case] = []
    retried: dict[str, int] = {}
    while len(out) < n:
        kind = rng.randrange(100)
        sid = f"fz-h-{rng.randrange(16)}"
        if kind < 10:  # malformed JSON
            raw = rng.choice([b"{", b"\xff\xfe", b"[" * 1000 + b"]" * 1000, b'{"n": 1e400}',
                              b'{"messages": NaN}', b""])  # fmt: skip
            out.append(("POST", f"/sessions/{sid}{CHAT}", raw))
        elif kind < 15:  # unknown routes, methods, bad session ids
            path = rng.choice(["/v1/nope", f"/sessions/{sid}/v2/x", "/sessions/a.b" + CHAT,
                               "/sessions/" + "a" * 300 + CHAT, "/sessions/x.99" + CHAT,
                               "/sessions/%00" + CHAT])  # fmt: skip
            out.append((rng.choice(["GET", "POST", "PUT", "DELETE"]), path, b"{}"))
        elif kind < 22:  # junk rewards, to sessions known and not
            body = json.dumps({"reward": rng.choice(JUNK)}).encode()
            out.append(("POST", f"/sessions/{rng.choice([sid, 'fz-nope'])}/reward", body))
        elif kind < 32:  # completions: prompts of ids out of range, junk
            prompt = rng.choice([[vocab + 5], [-1], [], "", [[1, 2]], rng.choice(JUNK)])
            body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 2}).encode()
            out.append(("POST", f"/sessions/{sid}/v1/completions", body))
        elif kind < 37:  # a valid request, sent 3 times to its own session (retries)
            vid = f"fz-v-{len(retried)}"
            msgs = [{"role": "user", "content": vid}]
            body = json.dumps({"model": "m", "max_tokens": 2, "messages": msgs}).encode()
            retried[vid] = 3
            out += [("POST", f"/sessions/{vid}{CHAT}", body)] * 3
        else:
            raw = json.dumps(_chat(rng, vocab), allow_nan=True).encode()
            out.append(("POST", f"/sessions/{sid}{CHAT}", raw))
    rng.shuffle(out)
    return out, retried


def _openai_error(status: int, text: str) -> bool:
    """A 4xx body in OpenAI's shape."""
    try:
        err = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(err, dict) and isinstance(err.get("message"), str) and "type" in err


async def send(
    url: str, reqs: list[Case], concurrency: int, timeout_s: float, key: str = ""
) -> dict[str, Any]:
    """Send ``reqs`` (``key``: the gateway key, as Bearer on every request)."""
    import aiohttp

    by_status: Counter[str] = Counter()
    bad: list[str] = []
    queue = list(reqs)

    async def worker(http: aiohttp.ClientSession) -> None:
        while queue:
            method, path, raw = queue.pop()
            try:
                async with http.request(method, url + path, data=raw) as r:
                    text = await r.text(errors="replace")
                    by_status[str(r.status)] += 1
                    if r.status >= 500 or (r.status >= 400 and not _openai_error(r.status, text)):
                        by_status["not_openai_error" if r.status < 500 else "5xx"] += 1
                        if len(bad) < 5:
                            bad.append(f"{method} {path[:60]} {(raw or b'')[:120]!r} -> "
                                       f"{r.status} {text[:200]}")  # fmt: skip
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                by_status["unanswered"] += 1
                if len(bad) < 5:
                    bad.append(f"{method} {path[:60]}: {exc!r}")

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return {"by_status": dict(sorted(by_status.items())), "examples": bad}


async def run(n: int, concurrency: int, seed: int, log: Path) -> dict[str, Any]:
    """Serve the gateway over a tiny chat model engine, send :func:`cases`; the counts."""
    from asyncrl.config import AlgoConfig, ControllerConfig, GatewayConfig, RunConfig
    from asyncrl.controllers.controller import Controller
    from asyncrl.engines.rollout.sglang import SGLangClient
    from asyncrl.forkserver import spawn_shared
    from asyncrl.gateway import Gateway
    from asyncrl.procs import free_port, stop
    from asyncrl.tasks.tiny_chat_model import ensure_tiny_chat_model

    model = ensure_tiny_chat_model()
    port = free_port()
    args = ["-m", "asyncrl.entrypoints.engine", "--model-path", str(model), "--port", str(port)]
    proc = spawn_shared(
        [*args, "--threads", "1", "--max-batch-size", "64"], log, die_with_parent=True
    )
    engine = SGLangClient(f"http://127.0.0.1:{port}")
    cfg = RunConfig(
        controller=ControllerConfig(batch_size=1, max_staleness=1 << 30),
        algo=AlgoConfig(group_size=1),
        gateway=GatewayConfig(enabled=True, max_tokens=2, admission_timeout_s=60),
    )
    gw = Gateway(cfg.gateway, str(model))
    try:
        await engine.wait_healthy(180)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        reqs, retried = cases(n, vocab, seed)
        async with Controller(cfg, gw.episode, engines=[engine]) as ctl:
            gw.attach(ctl)
            url = await gw.start()
            t0 = time.perf_counter()
            out = await send(url, reqs, concurrency, timeout_s=120, key=gw.api_key)
            out["wall_s"] = time.perf_counter() - t0
            turns = {
                sid: sum(b.turns for b in s.transcript.branches)
                for sid, s in gw.sessions.by_id.items()
                if sid in retried
            }
            out.update(
                sent=len(reqs),
                retried_sessions=len(retried),
                recorded_twice=sum(1 for t in turns.values() if t > 1),
                retried_without_turn=len(retried) - sum(1 for t in turns.values() if t == 1),
                stats=gw.stats(),
            )
            await gw.close()
        by = out["by_status"]
        out.update(
            {k: by.get(k, 0) for k in ("5xx", "unanswered", "not_openai_error")},
            alive=proc.poll() is None,
        )
        return out
    finally:
        await gw.close()
        await engine.close()
        stop([proc])
