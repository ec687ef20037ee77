"""The gateway's cost: chat completions through it (real ``openai`` client) vs the same
generations sent straight to the engine's ``/generate``.

One embedded engine (tiny chat model, CPU) serves both paths in the same run:

- gateway: a :class:`~asyncrl.controllers.controller.Controller` with the
  :class:`~asyncrl.gateway.Gateway` in front of it, in a thread with its own event
  loop (as an agent process beside it would see it); clients are ``openai.AsyncOpenAI``
  in the main loop. ``--sessions`` sessions of ``--turns`` chat turns each (every turn
  appends the reply and a new user message), ``--concurrency`` sessions at a time, each
  completion exactly ``--max-tokens`` tokens (``ignore_eos``); then a reward ends each
  session.
- engine: every ``/generate`` the gateway made (input ids and sampling parameters,
  recorded at the engine seam) replayed by the SGLang client (the controller's own),
  with the same concurrency: ``generate`` for whole answers, ``generate_stream`` for
  streamed ones.
- gateway-http: the gateway path again by plain aiohttp with the same bodies (no SDK): the
  gateway's own cost, apart from the ``openai`` client's (httpx + pydantic).

Each path runs whole (``stream: false``) and streamed (``stream: true``,
``include_usage``); latency is from the call to the last byte, time to first token to the
first content chunk (the engine: its first event with a token). Added latency = gateway -
engine (p50, p99) at concurrency 1 (``--serial-sessions``), where it is the gateway's own
cost per request, and at ``--concurrency``. Paired (the number to read on a shared
machine): ``--serial-sessions`` sessions again, each gateway call followed at once by its
own engine call replayed, the added latency per call a difference of neighbours; and
the same call through a pass-through proxy (aiohttp on the gateway's event loop, forwarding
bytes only): the floor of any HTTP hop there, so gateway - floor is the gateway's own work.
``--hold N`` then opens N sessions at once (one 1-token completion each, all open
together) and counts errors.

``asyncrl bench gateway [--json PATH] [--model-path DIR] [--sessions 16] [--turns 3] ...``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

from asyncrl.bench import bench_parser, log_dir
from asyncrl.bench.common import start, write_json
from asyncrl.bench.gateway_paths import (
    Call,
    direct_run,
    gateway_run,
    hold_sessions,
    paired_run,
    start_proxy,
)

__all__ = ["main"]


class RecordingEngine:
    """The controller's engine client, recording every generation's (input ids, params)."""

    def __init__(self, client: Any):
        self.client = client
        self.url = client.url
        self.calls: list[Call] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    async def generate(self, input_ids: list[int], sp: dict[str, Any], rid: Any = None) -> Any:
        self.calls.append((list(input_ids), dict(sp)))
        return await self.client.generate(input_ids, sp, rid=rid)

    async def generate_stream(
        self, input_ids: list[int], sp: dict[str, Any], rid: Any = None
    ) -> AsyncIterator[Any]:
        self.calls.append((list(input_ids), dict(sp)))
        async for res in self.client.generate_stream(input_ids, sp, rid=rid):
            yield res


class Served:
    """Controller + gateway over one engine, on an event loop in a thread of their own."""

    def __init__(self, model: Path, engine_url: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.trajectories = 0
        self.run(self._start(model, engine_url))

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 300) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self, model: Path, engine_url: str) -> None:
        from asyncrl.config import AlgoConfig, ControllerConfig, GatewayConfig, RunConfig
        from asyncrl.controllers.controller import Controller
        from asyncrl.engines.rollout.sglang import SGLangClient
        from asyncrl.gateway import Gateway

        cfg = RunConfig(
            controller=ControllerConfig(batch_size=1, max_staleness=1 << 30),
            algo=AlgoConfig(group_size=1),
            gateway=GatewayConfig(enabled=True, admission_timeout_s=120),
        )
        self.engine = RecordingEngine(SGLangClient(engine_url, timeout_s=600))
        self.gw = Gateway(cfg.gateway, str(model))
        self.ctl = Controller(cfg, self.gw.episode, engines=[self.engine])
        self.gw.attach(self.ctl)
        await self.ctl.__aenter__()
        self.url = await self.gw.start()
        self.drain = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        while True:
            batch = await self.ctl.next_batch()
            self.trajectories += len(batch.trajectories)

    def take_calls(self) -> list[Call]:
        calls, self.engine.calls = self.engine.calls, []
        return calls

    async def _stop(self) -> None:
        self.drain.cancel()
        await self.gw.close()
        await self.ctl.close()
        await self.engine.client.close()

    def close(self) -> None:
        try:
            self.run(self._stop(), 60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def added_latency(gateway: list[float], engine: list[float], paired: bool) -> dict[str, Any]:
    """What the gateway adds to the engine's latency (seconds in, ms out). ``paired``: the
    i-th call of each list is the same call (one at a time, in the same order): the p50 and
    p99 of the per-call differences. Not paired (calls at once, finishing in any order):
    only the difference of the medians; the tails are the two p99s side by side (a
    difference of p99s is no percentile of anything, and may be below the p50's)."""
    if paired and len(gateway) == len(engine):
        diffs = [g - e for g, e in zip(gateway, engine, strict=True)]
        return {"paired": True, "added_p50_ms": 1e3 * _pct(diffs, 0.5),
                "added_p99_ms": 1e3 * _pct(diffs, 0.99)}  # fmt: skip
    return {
        "paired": False,
        "added_p50_ms": 1e3 * (_pct(gateway, 0.5) - _pct(engine, 0.5)),
        "gateway_p99_ms": 1e3 * _pct(gateway, 0.99),
        "engine_p99_ms": 1e3 * _pct(engine, 0.99),
    }


def summarize(rows: list[tuple[float, float | None, int]], wall: float) -> dict[str, Any]:
    """(latency s, ttft s or None, completion tokens) per request -> the table's columns."""
    lat = [r[0] for r in rows]
    ttft = [r[1] for r in rows if r[1] is not None]
    tokens = sum(r[2] for r in rows)
    return {
        "requests": len(rows),
        "tokens": tokens,
        "wall_s": wall,
        "requests_per_s": len(rows) / wall,
        "tokens_per_s": tokens / wall,
        "latency_p50_ms": 1e3 * _pct(lat, 0.5),
        "latency_p99_ms": 1e3 * _pct(lat, 0.99),
        "ttft_p50_ms": 1e3 * _pct(ttft, 0.5) if ttft else None,
        "ttft_p99_ms": 1e3 * _pct(ttft, 0.99) if ttft else None,
    }


async def _phase(
    srv: Served, engine_url: str, args: argparse.Namespace, stream: bool, sessions: int, conc: int
) -> dict[str, dict[str, Any]]:
    """One gateway run by the openai client, its replay at the engine, and one by plain
    HTTP: their summaries by path."""
    srv.take_calls()
    rows, wall = await gateway_run(srv.url, args, stream, sessions, conc)
    calls = srv.take_calls()
    assert len(calls) == len(rows), (len(calls), len(rows))
    drows, dwall = await direct_run(engine_url, calls, stream, conc)
    hrows, hwall = await gateway_run(srv.url, args, stream, sessions, conc, sdk=False)
    return {
        "engine": {**summarize(drows, dwall), "latencies": [r[0] for r in drows]},
        "gateway-http": {**summarize(hrows, hwall), "latencies": [r[0] for r in hrows]},
        "gateway": {**summarize(rows, wall), "latencies": [r[0] for r in rows]},
    }


async def _bench(srv: Served, engine_url: str, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"rows": []}
    await _phase(srv, engine_url, args, True, 2, 2)  # warm-up: both paths, both shapes
    await _phase(srv, engine_url, args, False, 2, 2)
    plan = [(1, args.serial_sessions), (args.concurrency, args.sessions)]
    for conc, sessions in plan:
        for stream in (False, True):
            paths = await _phase(srv, engine_url, args, stream, sessions, conc)
            mode = "stream" if stream else "whole"
            lat = {path: res.pop("latencies") for path, res in paths.items()}
            for path, res in paths.items():
                out["rows"].append({"path": path, "mode": mode, "concurrency": conc, **res})
            direct = paths["engine"]
            for client in ("gateway", "gateway-http"):
                gw = paths[client]
                added = {
                    "client": "openai" if client == "gateway" else "http",
                    "mode": mode,
                    "concurrency": conc,
                    # one at a time, the i-th call of each path is the same session's same turn
                    **added_latency(lat[client], lat["engine"], paired=conc == 1),
                }
                if stream:
                    added["ttft_added_p50_ms"] = gw["ttft_p50_ms"] - direct["ttft_p50_ms"]
                out.setdefault("added", []).append(added)
    proxy_url, proxy = srv.run(start_proxy(engine_url))
    try:
        for stream in (False, True):
            for sdk in (False, True):
                diffs, floor = await paired_run(srv, engine_url, args, stream, sdk, proxy_url)
                own = [d - f for d, f in zip(diffs, floor, strict=True)]
                out.setdefault("paired", []).append(
                    {
                        "client": "openai" if sdk else "http",
                        "mode": "stream" if stream else "whole",
                        "requests": len(diffs),
                        "added_p50_ms": 1e3 * _pct(diffs, 0.5),
                        "added_p99_ms": 1e3 * _pct(diffs, 0.99),
                        "floor_p50_ms": 1e3 * _pct(floor, 0.5),
                        "floor_p99_ms": 1e3 * _pct(floor, 0.99),
                        "over_floor_p50_ms": 1e3 * _pct(own, 0.5),
                    }
                )
    finally:
        srv.run(proxy.cleanup())
    if args.hold:
        out["hold"] = await hold_sessions(srv, args.hold)
    return out


def _print(res: dict[str, Any]) -> None:
    head = f"{'path':13}{'mode':8}{'conc':>5}{'req/s':>9}{'tok/s':>9}"
    head += f"{'p50 ms':>9}{'p99 ms':>9}{'ttft50':>9}{'ttft99':>9}"
    print(head)
    for r in res["rows"]:
        ttft = "".join(
            f"{r[k]:9.1f}" if r[k] is not None else f"{'-':>9}"
            for k in ("ttft_p50_ms", "ttft_p99_ms")
        )
        print(
            f"{r['path']:13}{r['mode']:8}{r['concurrency']:5d}{r['requests_per_s']:9.1f}"
            f"{r['tokens_per_s']:9.1f}{r['latency_p50_ms']:9.1f}{r['latency_p99_ms']:9.1f}{ttft}"
        )
    for a in res["added"]:
        line = f"added by the gateway ({a['client']} client, {a['mode']}, concurrency "
        if a["paired"]:
            line += (
                f"{a['concurrency']}, call by call): p50 {a['added_p50_ms']:.2f} ms, "
                f"p99 {a['added_p99_ms']:.2f} ms"
            )
        else:
            line += (
                f"{a['concurrency']}): median {a['added_p50_ms']:+.2f} ms (difference of the "
                f"medians); p99 {a['gateway_p99_ms']:.1f} ms through it vs "
                f"{a['engine_p99_ms']:.1f} ms at the engine"
            )
        if "ttft_added_p50_ms" in a:
            line += f", time to first token p50 {a['ttft_added_p50_ms']:+.2f} ms"
        print(line)
    for a in res["paired"]:
        print(
            f"added by the gateway, paired ({a['client']} client, {a['mode']}, each call then "
            f"its engine replay, {a['requests']} calls): p50 {a['added_p50_ms']:.2f} ms, "
            f"p99 {a['added_p99_ms']:.2f} ms; pass-through proxy floor p50 "
            f"{a['floor_p50_ms']:.2f} ms, p99 {a['floor_p99_ms']:.2f} ms; gateway over the "
            f"floor p50 {a['over_floor_p50_ms']:.2f} ms"
        )
    if "hold" in res:
        h = res["hold"]
        print(
            f"held {h['sessions']} sessions at once: {h['open_at_peak']} open together, "
            f"{h['errors']} errors, {h['trajectories']} trajectories, {h['wall_s']:.1f} s"
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = bench_parser("gateway", __doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--model-path", default=None, help="HF chat model folder (default: tiny chat)")
    p.add_argument("--sessions", type=int, default=16, help="sessions of the concurrent phase")
    p.add_argument("--concurrency", type=int, default=8, help="sessions at a time")
    p.add_argument("--serial-sessions", type=int, default=8, help="sessions one at a time")
    p.add_argument("--turns", type=int, default=3, help="chat turns per session")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per completion (exact)")
    p.add_argument("--hold", type=int, default=1000, help="sessions held open at once (0: no)")
    p.add_argument("--threads", type=int, default=1, help="the engine's torch threads")
    args = p.parse_args(argv)
    for k in ("sessions", "concurrency", "serial_sessions", "turns", "max_tokens"):
        if getattr(args, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from asyncrl.engines.rollout.launcher import (
        LOCAL_SERVER,
        LaunchSpec,
        launch,
        stop_servers,
        wait_healthy,
    )
    from asyncrl.procs import free_port
    from asyncrl.tasks.tiny_chat_model import ensure_tiny_chat_model

    model = Path(args.model_path) if args.model_path else ensure_tiny_chat_model()
    extra = ("--threads", str(args.threads), "--max-batch-size", "256", "--seed", "0")
    spec = LaunchSpec(str(model), free_port(), module=LOCAL_SERVER, extra_args=extra)
    print(
        f"gateway bench: model {model.name}, {args.turns} turns x {args.max_tokens} tokens per "
        f"session; {args.serial_sessions} sessions one at a time, {args.sessions} "
        f"{args.concurrency} at a time; hold {args.hold}",
        flush=True,
    )
    with log_dir("asyncrl-bench-gw-") as logs:
        server = launch(spec, logs / "engine.log", spawner=start)
        try:
            asyncio.run(wait_healthy([server], timeout_s=300))
            srv = Served(model, server.url)
            try:
                res = asyncio.run(_bench(srv, server.url, args))
            finally:
                srv.close()
        finally:
            stop_servers([server])
    res.update(
        model=str(model),
        turns=args.turns,
        max_tokens=args.max_tokens,
        argv=sys.argv[1:] if argv is None else list(argv),
    )
    _print(res)
    write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
