"""A protocol-faithful SGLang server for the tests, written from SGLang's source.

Run as ``python -m tests.engines.rollout.sglang.standin --sglang-version V ...`` with
SGLang ``V``'s source first on ``PYTHONPATH`` (``code.sglang_env``). It is not
SGLang's scheduler (no GPU here); it plays what asyncrl's client meets on the
wire, each behaviour cited from the version's source (``tm`` =
``srt/managers/tokenizer_manager.py``, ``hs`` = ``srt/entrypoints/http_server.py``,
``swu`` = ``srt/managers/scheduler_components/weight_updater.py``; 0.5.23 lines
unless noted):

- Weight-receiving side is SGLang's own code: TP rank 0 runs in this process,
  ranks 1.. in child processes (``rank.py``), all joining with SGLang's
  ``init_custom_process_group`` as ``rank_offset + tp_rank`` and rebuilding each
  bucket with SGLang's ``FlattenedTensorBucket``.
- Update calls are served one at a time in arrival order (the scheduler's
  queue); unknown request fields are ignored (and logged here).
- ``/update_weights_from_distributed``: outside a session -> 400 without
  receiving (0.5.22+, swu:192-198); while not paused it waits for running
  requests (``model_update_lock.writer_lock``, tokenizer_control_mixin.py:516-524);
  receives on every TP rank, loads into the live model at once (no staging,
  swu:199-220); a failed load answers 400 ``success: false`` after receiving
  (hs:1488-1505); ``weight_version`` relabels with the load (swu:224,
  tokenizer_control_mixin.py:529-531); ``flush_cache`` on a non-idle engine:
  400 "Weights were updated, but the cache was not flushed" (swu:120-133);
  0.5.10: an assertion kills the scheduler (scheduler_update_weights_mixin.py:80-82).
- ``/begin_weight_update`` / ``/end_weight_update``: 0.5.22+ only (404 before);
  one session at a time (swu:309-337).
- ``/update_weight_version``: relabel only (hs:1527-1556); 0.5.22+ records a version
  event on every live request with output (scheduler.py:5636-5655), reported as
  ``meta_info.weight_versions`` spans computed by SGLang's own
  ``srt/utils/weight_versions.py`` (0.5.10: one ``weight_version``, the label at
  the answer, tm:1553 in 0.5.10).
- ``/pause_generation``: ``abort`` aborts everything and polls every 1.0 s until no
  request holds the lock (tm:2267-2280); ``retract`` returns running requests to
  the queue, KV dropped (scheduler.py:5817-5931); ``in_place`` only stops
  scheduling. New requests wait while paused (tm:938-939).
- ``/abort_request``: ``rid`` is matched as a prefix (scheduler.py:5688), only when
  that exact rid is known (tm:2241-2253).
- ``/generate`` with ``stream: true`` (0.5.10 lines: ``hs`` = http_server.py:662-681,
  ``tm`` = tokenizer_manager.py): a ``text/event-stream`` of ``data: {json}\n\n`` events,
  one per decode step (``stream_interval`` 1, scheduler_output_processor_mixin.py:998-1005),
  each the request's output *so far* (``output_ids`` and ``meta_info.output_token_logprobs``
  cumulative: tm:1616-1617, 1725-1735; a slow reader gets only the latest, tm:1148-1180),
  ``finish_reason`` null until the last (tm:1551, 1638); after it, or after an abort's
  event (``finish_reason.type == "abort"``), ``data: [DONE]\n\n`` (hs:676). An error
  raised while generating (a rid already in flight, tm:774-783; 0.5.23 tm:3833-3836) becomes
  ``data: {"error": {"message": ...}}`` then ``data: [DONE]``, HTTP 200 (hs:672-676);
  non-streamed it is a 400 ``{"error": {"message"}}`` (hs:684-689, 1723-1726). A reader
  that hangs up: the request is aborted 2 s after the response ends (the background
  ``create_abort_task``, hs:681, tm:1484-1496).
- ``/get_weight_version``: 404 (0.5.10: hs:581-587; gone after); ``/model_info``
  has the served label; ``/server_info`` (alias ``/get_server_info``) the launch
  arguments (``tp_size``, ``version``, launch ``weight_version``).
- ``/health``: a one-token generation, >= 1 s (hs:721-799); while paused no
  answer comes and it is 503 after 20 s.

- ``--api-key``: SGLang's own ``decide_request_auth`` (srt/utils/auth.py, 0.5.10
  lines 74-146; hs:1757 installs it only when a key is set) judges every request
  before its route: ``/health*`` and ``/metrics`` stay open (auth.py:100), OPTIONS too
  (auth.py:97), every other route needs ``Authorization: Bearer KEY`` (NORMAL and,
  with no admin key, ADMIN_OPTIONAL alike: auth.py:128-144), else 401
  ``{"error": "Unauthorized"}`` (auth.py:187-197) and the route never runs.

LoRA adapters (``/load_lora_adapter``, ``/unload_lora_adapter``, ``lora_path`` in
``/generate``, the flags): ``lora.py``, which cites SGLang's source for each behaviour.

Test-only: ``GET /standin/state`` (ground truth: per rid, the version of the
weights that produced each token and the label it carried; per push and TP rank,
whether every received bucket's bytes match the checksum asyncrl sent).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from aiohttp import web

from tests.engines.rollout.sglang.lora import LoraServing, add_flags
from tests.engines.rollout.sglang.rank import Rank
from tests.engines.rollout.sglang.ranks import SGLangRank
from tests.engines.rollout.standin_model import last_logits

KNOWN_UPDATE_FIELDS = {
    "names",
    "dtypes",
    "shapes",
    "group_name",
    "flush_cache",
    "abort_all_requests",
    "weight_version",
    "load_format",
    "rid",
    "http_worker_ipc",
    "torch_empty_cache",
    "selector",
}  # (UpdateWeightsFromDistributedReqInput, io_struct.py)


@dataclass
class Req:
    rid: str
    input_ids: list[int]
    max_new: int
    temperature: float
    stop: set[int]
    ignore_eos: bool
    done: asyncio.Event = field(default_factory=asyncio.Event)
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    truth: list[int | None] = field(default_factory=list)  # weights that made each token
    labels: list[str] = field(default_factory=list)  # the label when each token was made
    events: list[Any] = field(default_factory=list)  # SGLang's WeightVersionEvent list
    finish: str | None = None
    lora_id: str | None = None  # the adapter it acquired (lora.py)
    lora_name: str | None = None
    adapter_truth: list[str | None] = field(default_factory=list)  # adapter of each token
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # a step or an end


class StandIn:
    def __init__(self, args: argparse.Namespace):
        from transformers import AutoModelForCausalLM

        self.args = args
        self.version = tuple(int(x) for x in args.sglang_version.split("."))
        self.version_text = args.sglang_version
        self.new = self.version >= (0, 5, 22)  # sessions, spans, non-fatal flush
        self.tp = args.tp_size
        self.step_s = args.step_s
        self.model_path = args.model_path
        self.model = AutoModelForCausalLM.from_pretrained(
            args.model_path, torch_dtype=torch.float32
        )
        self.model.eval()
        self.params = dict(self.model.named_parameters())
        self.eos = self.model.config.eos_token_id
        self.rank0 = Rank(args.sglang_version)
        self.ranks = [SGLangRank(args.sglang_version) for _ in range(self.tp - 1)]
        self.fail_calls = {int(x) for x in args.fail_calls.split(",") if x}
        self.calls_log = open(args.calls, "a") if args.calls else None
        self.label = "default"  # server_args.weight_version's default
        self.loaded: dict[str, int] = {n: 0 for n in self.params}  # truth per parameter
        self.reqs: dict[str, Req] = {}
        self.running: list[Req] = []
        self.waiting: list[Req] = []
        self.inflight = 0  # /generate handlers holding the reader lock
        self.writer = False
        self.paused = False  # tokenizer_manager.is_pause
        self.sched_paused = False  # scheduler._engine_paused
        self.session = False
        self.update_calls = 0
        self.cond: asyncio.Condition | None = None
        self.wake: asyncio.Event | None = None
        self.weight_lock: asyncio.Lock | None = None
        self.verified: dict[str, dict[str, int]] = {}  # push version -> {"ok", "bad"} per rank
        self.label_errors = 0  # tokens whose label differed from the weights that made them
        self.mixed_tokens = 0  # tokens made on half-loaded weights
        self.spans_fn = self._load_spans_fn()
        self.lora = LoraServing(args, self.model)

    def _load_spans_fn(self) -> Any:
        if not self.new:
            return None
        from sglang.srt.utils import weight_versions as wv

        return wv

    # -- ground truth --------------------------------------------------------------------
    def truth(self) -> int | None:
        versions = set(self.loaded.values())
        return versions.pop() if len(versions) == 1 else None

    # -- generation ----------------------------------------------------------------------
    async def scheduler(self) -> None:
        assert self.wake is not None
        while True:
            if self.sched_paused or not (self.running or self.waiting):
                self.wake.clear()
                await self.wake.wait()
                continue
            self.running += self.waiting
            self.waiting = []
            batch = self.lora.admit([r for r in self.running if r.finish is None])
            if batch:  # the forward in a thread; its tokens land here, on the event loop, where
                # aborts are taken too: between steps, as SGLang's scheduler loop ingests them
                # before each batch (scheduler.py:2026-2040), so no answer sees half a step
                truth, label = self.truth(), self.label
                logits = await asyncio.to_thread(self._forward, batch)
                self._emit(batch, logits, truth, label)
            if self.step_s:
                await asyncio.sleep(self.step_s)  # test knob: decode slower, so pushes overlap
            for r in batch:
                r.changed.set()
                if r.finish is not None:
                    r.done.set()
            self.running = [r for r in self.running if r.finish is None]
            await asyncio.sleep(0)

    def _forward(self, batch: list[Req]) -> torch.Tensor:
        """The last position's logits of each request of ``batch`` (in a worker thread)."""
        self.lora.rows = [r.lora_id for r in batch]
        return last_logits(self.model, [r.input_ids + r.output for r in batch])

    def _emit(self, batch: list[Req], logits: torch.Tensor, truth: Any, label: str) -> None:
        """Each request's next token from ``logits``; a request aborted during the forward
        gets none (its answer may be out already)."""
        for i, r in enumerate(batch):
            if r.finish is not None:
                continue
            t = max(r.temperature, 1e-5)
            lp = torch.log_softmax(logits[i].float() / t, -1)
            tok = int(lp.argmax()) if r.temperature == 0 else int(torch.multinomial(lp.exp(), 1))
            r.output.append(tok)
            r.logprobs.append(float(lp[tok]))
            r.truth.append(truth)
            r.labels.append(label)
            r.adapter_truth.append(r.lora_name)
            if truth is None:
                self.mixed_tokens += 1
            elif str(truth) != label and not (truth == 0 and label == "default"):
                self.label_errors += 1
            if tok in r.stop or (tok == self.eos and not r.ignore_eos):
                r.finish = "stop"
            elif len(r.output) >= r.max_new:
                r.finish = "length"

    def record_version_change(self, new: str | None) -> None:
        """scheduler.py:5636-5655 (0.5.22+: events on live requests with output)."""
        if new is None or new == self.label:
            return
        if self.new:
            for r in self.running + self.waiting:
                if r.output and r.finish is None:
                    r.events.append(self.spans_fn.WeightVersionEvent(self.label, len(r.output)))
        self.label = new

    def meta(self, r: Req, partial: bool = False) -> dict[str, Any]:
        """The answer of ``r``; ``partial``: a stream event before the end (no
        ``finish_reason``)."""
        n = len(r.output)
        reason: dict[str, Any] | None = {"type": r.finish or "abort"}
        if r.finish == "length":
            reason["length"] = n
        if partial:
            reason = None
        meta: dict[str, Any] = {
            "id": r.rid,
            "finish_reason": reason,
            "prompt_tokens": len(r.input_ids),
            "completion_tokens": n,
            "weight_version": self.label,
            "output_token_logprobs": [
                [lp, t, None] for lp, t in zip(r.logprobs, r.output, strict=True)
            ],
        }
        if self.new:  # tm:2561-2566 with SGLang's own span functions
            spans = self.spans_fn.compute_weight_version_spans(r.events, self.label, n)
            self.spans_fn.add_weight_versions_to_meta_info(meta, spans, n)
        return {"text": "", "output_ids": list(r.output), "meta_info": meta}

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        for r in self.running + self.waiting:
            if r.finish is None and (abort_all or r.rid.startswith(rid)):
                r.finish = "abort"
                r.done.set()
                r.changed.set()
        self.running = [r for r in self.running if r.finish is None]
        self.waiting = [r for r in self.waiting if r.finish is None]

    # -- HTTP ----------------------------------------------------------------------------
    def log_call(self, request: web.Request, body: Any, status: int, note: str = "") -> None:
        if self.calls_log is None:
            return
        small = body
        if isinstance(body, dict) and "names" in body:
            small = {k: v for k, v in body.items() if k not in ("names", "shapes", "dtypes")}
            small["n_names"] = len(body["names"])
        self.calls_log.write(
            json.dumps(
                {
                    "t": time.time(),
                    "method": request.method,
                    "path": request.path,
                    "status": status,
                    "body": small,
                    "note": note,
                }
            )
            + "\n"
        )
        self.calls_log.flush()

    async def body(self, request: web.Request) -> Any:
        raw = await request.read()
        return json.loads(raw) if raw else {}

    def answer(
        self, request: web.Request, body: Any, content: Any, status: int = 200, note: str = ""
    ) -> web.Response:
        self.log_call(request, body, status, note)
        return web.json_response(content, status=status)

    async def generate(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        assert self.cond is not None and self.wake is not None
        single = isinstance(body["input_ids"][0], int)
        ids = [body["input_ids"]] if single else body["input_ids"]
        sps = body.get("sampling_params") or {}
        sps = [sps] * len(ids) if isinstance(sps, dict) else sps
        rids = body.get("rid")
        rids = [rids] if single and rids is not None else rids
        live = [r for r in rids or [] if r in self.reqs and self.reqs[r].finish is None]
        if live:  # a ValueError inside generate_request: tm:774-783 (0.5.10), 3833-3836
            msg = f"Duplicate request ID detected: {live[0]}"
            if not self.new:
                msg = f"Duplicate request IDs detected: {live}"
            if body.get("stream"):
                return await self.stream_error(request, body, msg)
            return self.answer(request, body, {"error": {"message": msg}}, status=400)
        paths = body.get("lora_path")
        paths = [paths] * len(ids) if paths is None or isinstance(paths, str) else paths
        async with self.cond:  # tm:938-939
            await self.cond.wait_for(lambda: not self.paused)
        if body.get("stream"):
            if not single or any(paths):
                raise web.HTTPBadRequest(text="the stand-in streams single base-model requests")
            return await self.generate_stream(request, body, ids[0], sps[0], rids)
        self.inflight += 1  # model_update_lock.reader_lock, tm:941
        try:
            try:
                lora_ids = await self.lora.resolve(paths)  # tm:513-514
            except ValueError as exc:  # hs:689-691
                return self.answer(request, body, {"error": {"message": str(exc)}}, 400)
            reqs = []
            for i, (x, sp) in enumerate(zip(ids, sps, strict=True)):
                r = self.new_req(rids[i] if rids else f"auto-{time.monotonic_ns()}-{i}", x, sp)
                r.lora_id, r.lora_name = lora_ids[i], paths[i]
                reqs.append(r)
                self.waiting.append(r)
            self.wake.set()
            await asyncio.gather(*(r.done.wait() for r in reqs))
            out = [self.meta(r) for r in reqs]
            for r in reqs:  # tm:1683-1684 (finished), 1229-1230 (aborted)
                await self.lora.release(r.lora_id)
        finally:
            self.inflight -= 1
        note = {"n": len(ids), "lora_path": body.get("lora_path")}
        return self.answer(request, note, out[0] if single else out)

    def new_req(self, rid: str, x: list[int], sp: dict[str, Any]) -> Req:
        r = Req(
            rid,
            list(x),
            int(sp.get("max_new_tokens", 128)),
            float(sp.get("temperature", 1.0)),
            set(sp.get("stop_token_ids") or []),
            bool(sp.get("ignore_eos")),
        )
        self.reqs[rid] = r
        return r

    async def generate_stream(
        self, request: web.Request, body: Any, x: list[int], sp: dict[str, Any], rids: Any
    ) -> web.StreamResponse:
        """hs:664-681: one event per step with the output so far, ``[DONE]`` last."""
        assert self.wake is not None
        r = self.new_req(rids[0] if rids else f"auto-{time.monotonic_ns()}", x, sp)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.inflight += 1
        self.waiting.append(r)
        self.wake.set()
        try:
            sent = 0
            while True:
                await r.changed.wait()
                r.changed.clear()  # a reader behind gets only the latest (tm:1148-1180)
                end = r.finish is not None
                if len(r.output) > sent or end:
                    sent = len(r.output)
                    event = self.meta(r, partial=not end)
                    await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                if end:
                    break
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):  # the reader hung up
            asyncio.get_running_loop().call_later(2.0, self.abort, r.rid)  # hs:681, tm:1487
            raise
        finally:
            self.inflight -= 1
        self.log_call(request, {"stream": True, "rid": r.rid}, 200)
        return resp

    async def stream_error(self, request: web.Request, body: Any, msg: str) -> web.StreamResponse:
        """hs:672-676: a ValueError while streaming: an error event, then ``[DONE]``."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: " + json.dumps({"error": {"message": msg}}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        self.log_call(request, {"stream": True}, 200, note=msg)
        return resp

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        mode = body.get("mode", "abort")
        assert self.cond is not None
        t0 = time.perf_counter()
        async with self.cond:
            self.paused = True
            if mode != "abort":
                self.sched_paused = True
                if mode == "retract":  # back to the queue, KV dropped; resumed later
                    self.waiting = [r for r in self.running if r.finish is None] + self.waiting
                    self.running = []
            else:
                while True:  # tm:2274-2280
                    self.abort(abort_all=True)
                    await asyncio.sleep(0)
                    if self.inflight == 0 and not self.writer:
                        break
                    await asyncio.sleep(1.0)
        note = f"pause_s={time.perf_counter() - t0:.3f}"
        return self.answer(
            request, body, {"message": "Generation paused successfully.", "status": "ok"}, note=note
        )

    async def continue_generation(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        assert self.cond is not None and self.wake is not None
        async with self.cond:
            self.paused = False
            self.sched_paused = False
            self.cond.notify_all()
        self.wake.set()
        return self.answer(
            request, body, {"message": "Generation continued successfully.", "status": "ok"}
        )

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        rid, abort_all = str(body.get("rid", "")), bool(body.get("abort_all", False))
        if abort_all or (rid and rid in self.reqs):  # tm:2241-2253
            self.abort(rid, abort_all)
        self.log_call(request, body, 200)
        return web.Response(status=200)

    async def _with_writer(self, fn: Any) -> Any:
        """tokenizer_control_mixin.py:516-524: paused -> at once; else wait for requests."""
        assert self.weight_lock is not None
        async with self.weight_lock:  # the scheduler serves them one at a time, in order
            if self.paused:
                return await fn()
            self.writer = True
            try:
                while self.inflight:
                    await asyncio.sleep(0.01)
                return await fn()
            finally:
                self.writer = False

    async def init_group(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        fields = {
            k: body[k]
            for k in ("master_address", "master_port", "rank_offset", "world_size", "group_name")
        }
        fields["backend"] = body.get("backend", "nccl")
        for i, r in enumerate(self.ranks, start=1):
            r.send("init", tp_rank=i, **fields)
        try:
            await asyncio.to_thread(self.rank0.init, {"tp_rank": 0, **fields})
            others = [await asyncio.to_thread(r.answer, 300) for r in self.ranks]
            bad = [o["error"] for o in others if not o["ok"]]
            if bad:
                raise RuntimeError(bad[0])
        except Exception as exc:  # hs:1404-1417: success false -> 400
            msg = f"Failed to initialize custom process group: {exc}."
            return self.answer(request, body, {"success": False, "message": msg}, 400)
        return self.answer(
            request,
            body,
            {"success": True, "message": "Succeeded to initialize custom process group."},
        )

    async def destroy_group(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        name = body.get("group_name", "weight_update_group")
        found = self.rank0.groups.get(name) is not None
        for r in self.ranks:
            r.send("destroy", group_name=name)
        await asyncio.to_thread(self.rank0.destroy, {"group_name": name})
        for r in self.ranks:
            await asyncio.to_thread(r.answer, 60)
        msg = "Succeeded to destroy custom process group." if found else "does not exist."
        return self.answer(request, body, {"success": found, "message": msg}, 200 if found else 400)

    async def session_call(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        if not self.new:
            return self.answer(request, body, {"detail": "Not Found"}, 404)
        begin = request.path == "/begin_weight_update"

        async def run() -> tuple[bool, str]:
            if begin and self.session:
                return False, "a weight-update session is already open; call end first"
            if not begin and not self.session:
                return False, "no weight-update session is open; call begin first"
            self.session = begin
            return True, "Success"

        ok, msg = await self._with_writer(run)
        return self.answer(request, body, {"success": ok, "message": msg}, 200 if ok else 400)

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        ignored = sorted(set(body) - KNOWN_UPDATE_FIELDS)
        if body.get("abort_all_requests"):
            self.abort(abort_all=True)
        ok, msg = await self._with_writer(lambda: self._update(body))
        return self.answer(
            request,
            body,
            {"success": ok, "message": msg},
            200 if ok else 400,
            note=f"ignored={ignored}",
        )

    async def _update(self, body: dict[str, Any]) -> tuple[bool, str]:
        if self.new and not self.session:  # swu:192-198, nothing received
            return False, (
                "update_weights_from_distributed must run between "
                "begin_weight_update() and end_weight_update()"
            )
        self.update_calls += 1
        failing = self.update_calls in self.fail_calls  # a load failing after the receive
        c = {k: body.get(k) for k in ("names", "dtypes", "shapes", "group_name", "load_format")}
        c["group_name"] = c["group_name"] or "weight_update_group"
        c["asyncrl_bucket"] = body.get("asyncrl_bucket")  # ground truth only (see rank.as_sent)
        for r in self.ranks:
            r.send("recv", load=not failing, **c)
        try:
            got0 = await asyncio.to_thread(self.rank0.recv, {**c, "load": False})
            others = [await asyncio.to_thread(r.answer, 300) for r in self.ranks]
        except Exception as exc:
            return False, f"Failed to receive weights: {exc}"
        meta = body.get("asyncrl_bucket") or {}  # ground truth only: SGLang ignores it
        push = str(meta.get("version"))
        counts = self.verified.setdefault(push, {})
        for i, ans in enumerate([{"ok": True, **got0}, *others]):
            good = ans["ok"] and meta.get("checksum") is not None
            good = good and ans["checksum"] == meta["checksum"]
            key = f"rank{i}:" + ("ok" if good else "bad")
            counts[key] = counts.get(key, 0) + 1
        if failing:
            return False, (
                "Failed to update parameter online: injected load failure. The full "
                "weights of the ModelRunner are partially updated. Please discard "
                "the whole weights."
            )
        try:
            for name, t in self.rank0.received:  # the live model, no staging
                self.params[name].data.copy_(t)
                self.loaded[name] = int(meta.get("version", -1))
            self.rank0.load(self.rank0.received)
        except (KeyError, RuntimeError) as exc:
            return False, (
                f"Failed to update parameter online: {exc}. The full weights of the "
                "ModelRunner are partially updated. Please discard the whole weights."
            )
        self.record_version_change(body.get("weight_version"))
        if body.get("flush_cache", True) and not self.idle():
            if not self.new:  # scheduler_update_weights_mixin.py:80-82 (0.5.10): the
                os._exit(3)  # assertion kills the scheduler
            return False, (
                "Weights were updated, but the cache was not flushed because "
                "requests are still running or queued."
            )
        return True, "Succeeded to update parameter online."

    def idle(self) -> bool:
        """is_fully_idle(ignore_waiting=self._engine_paused) (scheduler.py:5337, 5520)."""
        running = any(r.finish is None for r in self.running)
        waiting = bool(self.waiting) and not (self.new and self.sched_paused)
        return not running and not waiting

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        if body.get("abort_all_requests", True):
            self.abort(abort_all=True)
        self.record_version_change(str(body["new_version"]))
        return self.answer(
            request,
            body,
            {
                "success": True,
                "new_version": body["new_version"],
                "message": f"Weight version updated to {body['new_version']}",
            },
        )

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        out, status = await self.lora.load(str(body["lora_name"]), str(body["lora_path"]))
        return self.answer(request, body, out, status)

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        out, status = await self.lora.unload(str(body["lora_name"]))
        return self.answer(request, body, out, status)

    async def model_info(self, request: web.Request) -> web.Response:
        return self.answer(
            request,
            None,
            {"model_path": self.model_path, "is_generation": True, "weight_version": self.label},
        )

    async def get_weight_version(self, request: web.Request) -> web.Response:
        if self.new:
            return self.answer(request, None, {"detail": "Not Found"}, 404)
        detail = "Endpoint '/get_weight_version' is deprecated. Please use '/model_info'."
        return self.answer(request, None, {"detail": detail}, 404)

    async def server_info(self, request: web.Request) -> web.Response:
        info = {
            "tp_size": self.tp,
            "version": self.version_text,
            "weight_version": "default",
            "model_path": self.model_path,
        }
        return self.answer(request, None, info)

    async def health(self, request: web.Request) -> web.Response:
        t0 = time.monotonic()
        while self.paused and time.monotonic() - t0 < 20:  # no answer while paused
            await asyncio.sleep(0.1)
        if self.paused:
            return self.answer(request, None, None, 503)
        await asyncio.sleep(1.0)  # hs:772-774: the first check is after one second
        return self.answer(request, None, None, 200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        ok = self.idle()
        return self.answer(request, None, {"success": ok}, 200 if ok else 400)

    async def state(self, request: web.Request) -> web.Response:
        sums = {"rank0": self.rank0.checksums({})["sha256"]}
        for i, r in enumerate(self.ranks, start=1):
            sums[f"rank{i}"] = (await asyncio.to_thread(r.call, "checksums"))["sha256"]
        return web.json_response(
            {
                "label": self.label,
                "truth": self.truth(),
                "verified": self.verified,
                "label_errors": self.label_errors,
                "mixed_tokens": self.mixed_tokens,
                "update_calls": self.update_calls,
                "sha256": sums,
                "loaded_how": self.rank0.loaded_how,
                "reqs": {
                    rid: {
                        "truth": r.truth,
                        "labels": r.labels,
                        "finish": r.finish,
                        "adapters": r.adapter_truth,
                    }
                    for rid, r in self.reqs.items()
                },
                "lora": self.lora.state(),
            }
        )

    def app(self) -> web.Application:
        mw = [_api_key_middleware(self.args.api_key)] if self.args.api_key else []
        app = web.Application(client_max_size=1 << 30, middlewares=mw)
        post = {
            "/generate": self.generate,
            "/pause_generation": self.pause_generation,
            "/continue_generation": self.continue_generation,
            "/abort_request": self.abort_request,
            "/init_weights_update_group": self.init_group,
            "/destroy_weights_update_group": self.destroy_group,
            "/begin_weight_update": self.session_call,
            "/end_weight_update": self.session_call,
            "/update_weights_from_distributed": self.update_from_distributed,
            "/update_weight_version": self.update_weight_version,
            "/flush_cache": self.flush_cache,
            "/load_lora_adapter": self.load_lora_adapter,
            "/unload_lora_adapter": self.unload_lora_adapter,
        }
        for path, fn in post.items():
            app.router.add_post(path, fn)
        for path, fn in {
            "/model_info": self.model_info,
            "/get_model_info": self.model_info,
            "/get_weight_version": self.get_weight_version,
            "/server_info": self.server_info,
            "/get_server_info": self.server_info,
            "/health": self.health,
            "/standin/state": self.state,
        }.items():
            app.router.add_get(path, fn)

        async def start(_: web.Application) -> None:
            self.cond, self.wake = asyncio.Condition(), asyncio.Event()
            self.weight_lock = asyncio.Lock()
            self.lora.lock = asyncio.Lock()  # tm lora_update_lock
            self._task = asyncio.ensure_future(self.scheduler())

        app.on_startup.append(start)
        return app


def _api_key_middleware(api_key: str) -> Any:
    """SGLang's ``add_api_key_middleware`` (srt/utils/auth.py:149-200) on aiohttp: its own
    ``decide_request_auth`` decides; the stand-in's routes carry no ``@auth_level`` that
    matters without an admin key (NORMAL and ADMIN_OPTIONAL both require ``api_key``)."""
    import importlib.util
    import sys

    # auth.py imports only the standard library; loaded by its file, since the package's
    # __init__ (srt/utils/common.py:90 in 0.5.10) imports torchvision, absent beside CPU torch
    found = importlib.util.find_spec("sglang")  # the package's folder, its __init__ not run
    assert found is not None and found.submodule_search_locations, "SGLang's source"
    path = os.path.join(found.submodule_search_locations[0], "srt", "utils", "auth.py")
    spec = importlib.util.spec_from_file_location("sglang_srt_utils_auth", path)
    assert spec is not None and spec.loader is not None, path
    auth = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = auth  # dataclasses resolve their module by name
    spec.loader.exec_module(auth)
    AuthLevel, decide_request_auth = auth.AuthLevel, auth.decide_request_auth

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        decision = decide_request_auth(
            method=request.method,
            path=request.path,
            authorization_header=request.headers.get("Authorization"),
            api_key=api_key,
            admin_api_key=None,
            auth_level=AuthLevel.NORMAL,
        )
        if not decision.allowed:
            err = "Unauthorized" if decision.error_status_code == 401 else "Forbidden"
            return web.json_response({"error": err}, status=decision.error_status_code)
        return await handler(request)

    return check


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--api-key", default=None, help="SGLang's --api-key (server_args.py:4435)")
    p.add_argument("--sglang-version", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model-path", required=True)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--calls", default="", help="append every request here (JSON lines)")
    p.add_argument("--fail-calls", default="", help="update calls (1-based) whose load fails")
    p.add_argument("--step-s", type=float, default=0.0, help="sleep after each decode step")
    add_flags(p)
    args = p.parse_args()
    torch.set_num_threads(1)
    server = StandIn(args)
    threading.current_thread().name = "standin"
    web.run_app(server.app(), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
