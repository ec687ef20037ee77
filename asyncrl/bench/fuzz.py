"""Hostile input at a real engine and a real experience channel: nothing crashes, all answered.

``asyncrl bench fuzz [--requests N] [--messages N] [--producer-messages N] [--cuts N]
[--limit-mb N] [--json PATH]``

- ``http``: starts a real engine (``asyncrl serve --model-path DIR --port P`` on the tiny
  default model, or ``--model-path``), sends ``--requests`` hostile requests from
  :mod:`asyncrl.bench.fuzz_http` (32 at a time) to every endpoint, and counts the
  answers by status code, the 5xx answers and the requests never answered; the
  engine's greedy output for two prompts must be the same before and after, and its
  RSS is read from ``/proc`` before and after.
- ``experience``: :mod:`asyncrl.bench.fuzz_experience`: malformed messages at a real
  consumer (a child process) and a real producer (this one), frames over the size
  limit that cut connections, then one valid message from each producer that must
  arrive bit-exact; rejects counted vs sent, reconnects vs cuts, the consumer's RSS.

- ``gateway``: :mod:`asyncrl.bench.fuzz_gateway`: ``--gateway-requests`` hostile OpenAI
  requests at the gateway (a controller over a tiny chat model engine), among them valid
  requests each sent 3 times to a session of its own: every answer a 4xx in OpenAI's
  error JSON or a 200, 0 5xx, 0 never answered, each retried session one turn.

The baseline is what must hold: 0 answers of 5xx, 0 never answered, every malformed
message counted as rejected (a frame over the size limit is no reject: libzmq cuts the
connection on it), every cut restored or seen (the consumer reconnects exactly once per
cut; the hostile consumer sees the producer cut it once per cut), the valid messages
bit-exact. The command exits 1 if any of it does not hold.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from asyncrl.bench import bench_parser
from asyncrl.bench.common import write_json

__all__ = ["main"]


def _exited(proc: Any) -> str | None:
    return None if proc.poll() is None else f"asyncrl serve exited with {proc.returncode}"


async def greedy(url: str) -> list[list[int]]:
    """Greedy completions of two fixed prompts (8 tokens each): equal before and after the
    fuzz when the engine came through unchanged."""
    from asyncrl.engines.rollout.sglang import SGLangClient

    client = SGLangClient(url)
    try:
        outs = [
            await client.generate(p, {"max_new_tokens": 8, "temperature": 0})
            for p in ([1, 3, 4, 5], [1, 9, 8])
        ]
    finally:
        await client.close()
    return [list(o.output_ids) for o in outs]


async def http_fuzz(n: int, model_path: str, concurrency: int, seed: int, log: Path) -> dict:
    """Start ``asyncrl serve`` on ``model_path``, send ``n`` hostile requests; the counts."""
    from asyncrl.bench.fuzz_experience import rss_kb
    from asyncrl.bench.fuzz_http import cases, send
    from asyncrl.engines.rollout.sglang import SGLangClient
    from asyncrl.forkserver import spawn_shared
    from asyncrl.procs import free_port, stop

    port = free_port()
    args = ["-m", "asyncrl.cli", "serve", "--model-path", model_path, "--port", str(port)]
    proc = spawn_shared([*args, "--threads", "1"], log, die_with_parent=True)
    url = f"http://127.0.0.1:{port}"
    try:
        probe = SGLangClient(url)
        try:
            await probe.wait_healthy(180, gone=lambda: _exited(proc))
        finally:
            await probe.close()
        vocab = json.loads((Path(model_path) / "config.json").read_text())["vocab_size"]
        before = await greedy(url)
        rss0 = rss_kb(proc.pid)
        out = await send(url, cases(n, vocab, free_port(), seed), concurrency, timeout_s=120)
        rss1 = rss_kb(proc.pid)
        out["greedy_unchanged"] = await greedy(url) == before
        out.update(rss_before_kb=rss0, rss_after_kb=rss1, alive=proc.poll() is None)
        return out
    finally:
        stop([proc])


def _rss(before: dict[str, int], after: dict[str, int]) -> str:
    """``RSS before -> RSS after (peak)`` in MB."""
    return (
        f"{before['VmRSS'] / 1024:.0f} -> {after['VmRSS'] / 1024:.0f} ({after['VmHWM'] / 1024:.0f})"
    )


def _table(res: dict[str, Any]) -> str:
    rows = [("fuzz", "sent", "answers / rejects by kind", "5xx", "never answered",
             "RSS MB before -> after (peak)", "counted / sent", "valid after")]  # fmt: skip
    if "http" in res:
        h = res["http"]
        by = " ".join(f"{k}:{v}" for k, v in h["by_status"].items())
        rss = _rss(h["rss_before_kb"], h["rss_after_kb"])
        answered = f"{h['sent'] - h['unanswered']}/{h['sent']} answered"
        rows.append(("http -> asyncrl serve", str(h["sent"]), by, str(h["5xx"]),
                     str(h["unanswered"]), rss, answered,
                     "greedy same" if h["greedy_unchanged"] else "GREEDY CHANGED"))  # fmt: skip
    if "experience" in res:
        e = res["experience"]
        c, p, v = e["consumer"], e["producer"], e["valid_after"]
        ok = "bit-exact" if v["bit_exact"] and v["report_received"] else "LOST/CHANGED"
        by = " ".join(f"{k}:{n}" for k, n in sorted(c["rejected_by"].items()))
        rss = _rss(c["rss_before_kb"], c["rss_after_kb"])
        rows.append(("experience -> consumer", str(c["sent"]), f"{by} cut:{c['cuts_sent']}", "-",
                     "-", rss, f"{c['rejected']}/{c['expected_rejects']}, "
                     f"reconnects {c['reconnects']}/{c['cuts_sent']}", ok))  # fmt: skip
        by = " ".join(f"{k}:{n}" for k, n in sorted(p["rejected_by"].items()))
        rows.append(("experience -> producer", str(p["sent"]), f"{by} cut:{p['cuts_sent']}", "-",
                     "-", "-", f"{p['rejected']}/{p['expected_rejects']}, "
                     f"cuts seen {p['cuts_seen']}/{p['cuts_sent']}", ok))  # fmt: skip
    if "gateway" in res:
        g = res["gateway"]
        by = " ".join(f"{k}:{v}" for k, v in g["by_status"].items())
        rows.append(("http -> gateway", str(g["sent"]), by, str(g["5xx"]), str(g["unanswered"]),
                     "-", f"{g['not_openai_error']} not OpenAI JSON",
                     f"{g['retried_sessions']} retried sessions, "
                     f"{g['recorded_twice']} recorded twice"))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def verdict(res: dict[str, Any]) -> list[str]:
    """What does not hold (empty: all of it holds)."""
    bad = []
    if "http" in res:
        h = res["http"]
        if h["5xx"]:
            bad.append(f"http: {h['5xx']} answers of 5xx: {h['5xx_examples']}")
        if h["unanswered"]:
            bad.append(f"http: {h['unanswered']} never answered: {h['unanswered_examples']}")
        if not h["greedy_unchanged"] or not h["alive"]:
            bad.append("http: the engine's greedy output changed or it died")
    if "gateway" in res:
        g = res["gateway"]
        for k in ("5xx", "unanswered", "not_openai_error", "recorded_twice"):
            if g[k]:
                bad.append(f"gateway: {g[k]} {k}: {g['examples']}")
        if g["retried_without_turn"] or not g["alive"]:
            bad.append(f"gateway: {g['retried_without_turn']} retried sessions without their "
                       f"turn; engine alive: {g['alive']}")  # fmt: skip
    if "experience" in res:
        c, p, v = (res["experience"][k] for k in ("consumer", "producer", "valid_after"))
        if c["rejected"] != c["expected_rejects"] or c["reconnects"] != c["cuts_sent"]:
            bad.append(f"experience consumer counted {c['rejected']} rejects of "
                       f"{c['expected_rejects']}, {c['reconnects']} reconnects of "
                       f"{c['cuts_sent']} cuts")  # fmt: skip
        if p["rejected"] != p["expected_rejects"] or p["cuts_seen"] != p["cuts_sent"]:
            bad.append(f"experience producer counted {p['rejected']} rejects of "
                       f"{p['expected_rejects']}; {p['cuts_seen']} of {p['cuts_sent']} "
                       f"cuts seen by the hostile consumer")  # fmt: skip
        if not (v["bit_exact"] and v["report_received"]):
            bad.append(f"experience: valid messages after the fuzz: {v}")
    return bad


def main(argv: list[str] | None = None) -> None:
    p = bench_parser("fuzz", __doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=5000, help="hostile HTTP requests")
    p.add_argument("--concurrency", type=int, default=32, help="HTTP requests in flight")
    p.add_argument("--messages", type=int, default=10000, help="malformed messages to the consumer")
    p.add_argument("--producer-messages", type=int, default=2000, help="... to the producer")
    p.add_argument("--cuts", type=int, default=5, help="frames over the limit, each way")
    p.add_argument("--heavy", type=int, default=3, help="messages of each heavy kind")
    p.add_argument("--limit-mb", type=int, default=16, help="experience.max_message_mb")
    p.add_argument("--model-path", default="", help="engine model (default: the tiny one)")
    p.add_argument("--gateway-requests", type=int, default=1000, help="... to the gateway")
    p.add_argument("--only", choices=["http", "experience", "gateway"], default="")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default="", help="write the results here")
    a = p.parse_args(argv)
    res: dict[str, Any] = {"argv": sys.argv[1:] if argv is None else list(argv)}
    with tempfile.TemporaryDirectory(prefix="asyncrl-fuzz-") as tmp:
        if a.only in ("", "http"):
            model = a.model_path
            if not model:
                from asyncrl.tasks.tiny_model import ensure_tiny_model

                model = str(ensure_tiny_model(Path(tmp) / "tiny"))
            res["http"] = asyncio.run(
                http_fuzz(a.requests, model, a.concurrency, a.seed, Path(tmp) / "engine.log")
            )
        if a.only in ("", "gateway") and a.gateway_requests:
            from asyncrl.bench.fuzz_gateway import run as gateway_run

            res["gateway"] = asyncio.run(
                gateway_run(a.gateway_requests, a.concurrency, a.seed, Path(tmp) / "gw.log")
            )
        if a.only in ("", "experience"):
            from asyncrl.bench.fuzz_experience import run

            res["experience"] = asyncio.run(
                run(a.messages, a.producer_messages, a.cuts, a.heavy, a.limit_mb << 20, a.seed)
            )
    res["failures"] = verdict(res)
    print(_table(res))
    print("all held" if not res["failures"] else "\n".join(["FAILED:", *res["failures"]]))
    write_json(a.json, res)
    if res["failures"]:
        raise SystemExit(1)
