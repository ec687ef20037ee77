"""A protocol-faithful vLLM 0.33.0 RL server for the tests, written from vLLM's source.

Run as ``python -m tests.engines.rollout.vllm.standin --port P --model-path DIR ...`` with
vLLM's source on ``PYTHONPATH`` (``code.vllm_env``). It is not vLLM's engine (no GPU
here): it plays what asyncrl's vLLM client meets on the wire, each behaviour cited from
vLLM 0.33.0 (``rl`` = ``vllm/entrypoints/rl/online/api_router.py``, ``tito`` =
``vllm/entrypoints/scale_out/token_in_token_out/``, ``gw`` = ``vllm/v1/worker/
gpu_worker.py``, ``core`` = ``vllm/v1/engine/core.py``, ``nccl`` =
``vllm/distributed/weight_transfer/nccl_engine.py``):

- receiving ranks: TP rank 0 in this process (its tensors are the live model's), ranks
  1.. in ``rank.py`` processes, each joined through vLLM's own
  ``StatelessProcessGroup`` as ``rank_offset + rank`` (nccl_common.py:239-244), chunks
  cut by vLLM's rule and rebuilt with vLLM's own ``unpack_tensor``; Gloo in place of NCCL
  (NCCL cannot run on a CPU).
- ``POST /inference/v1/generate`` (tito/api_router.py:46-72): ``token_ids`` in,
  ``choices[0]`` with ``token_ids``, ``logprobs.content`` (``logprobs=0``: the sampled
  token only), ``finish_reason`` and ``weight_versions`` spans on the final output
  (tito/protocol.py:486-508); a span starts when a new token comes under another label
  (v1/engine/output_processor.py:531-545); the first label is ``"default"`` (core:147).
  ``stream``: SSE ``data:`` chunks of the delta, spans on the last, ``data: [DONE]``
  (tito/serving.py:646-820). Abort: ``finish_reason`` ``abort``. The engine's id of a
  request is ``generate-tokens-{request_id}`` (tito/serving.py:202-204), the id
  ``/abort_requests`` matches. ``sampling_params.n > 1``: ``n`` children
  ``{i}_{request_id}`` decoded in the batch, answered once all finished as choices by
  ``index`` (v1/engine/parallel_sampling.py:84-126); streamed: one choice per chunk, the
  children's chunks interleaved, each with its ``index`` (tito/serving.py:681-754).
- ``POST /pause?mode=``: ``abort`` finishes every request (``abort``) and rejects new ones;
  ``wait`` lets running ones finish, rejects new ones, answers once drained; ``keep``
  freezes everything, new requests queue (core:951-981, 2226-2233). A rejected request
  is 503 ``{"error": {..., "code": 503}}`` (core:1796-1815, vllm/exceptions.py:139-144,
  serve/exception_handling/error_response.py:60-67), an error chunk in a stream
  (tito/serving.py:812-815). ``POST /resume``, ``GET /is_paused`` (rl:78-159).
- ``POST /init_weight_transfer_engine {"init_info"}``: unknown or missing fields refused
  (weight_transfer/base.py:517-535, nccl_common.py:75-107); answers once every rank
  joined; clears the metadata cache (nccl:159-165).
- sessions: ``/start_weight_update`` during a session fails (gw:1569-1573);
  ``/update_weights`` and ``/finish_weight_update`` without one fail (gw:1608-1611,
  1638-1641); a failed update ends the session, the model left mid-reload, ``/health``
  still 200 (gw:1616-1631); ``/finish_weight_update {"weight_version"}`` sets the label
  (v1/engine/async_llm.py:1432-1436); ``/shutdown_weight_transfer_engine`` during a
  session fails (gw:1533-1537). These worker errors are RuntimeErrors: 500 with vLLM's
  error body (serve/exception_handling/register.py:42, error_response.py:93-96).
- ``/update_weights {"update_info"}``: names, dtype_names, shapes of equal length
  (nccl:102-114), empty lists reuse the last call's (nccl:201-204; cached even if that
  call then failed), every rank receives; ``--fail-calls`` makes a call's load fail after
  the receive (the injected failure); ``--corrupt-calls`` makes a call load one element
  wrong on the last TP rank and answer 200 (a silent fault, test-only: what ``weights.verify``
  must find through ``/weight_checker``).
- ``/update_weight_version`` (rl:217-223), ``GET /weight_info`` (rl:226-229),
  ``/weight_checker`` (rl:232-266: ``checksum``; ``compare`` without ``baseline`` 400),
  ``GET /get_world_size`` (rl:269-289), ``/abort_requests`` (rl:97-142), ``GET /health``.

- ``--api-key``: vLLM's ``AuthenticationMiddleware`` (serve/middleware/authenticate.py):
  only paths under ``/v1``, ``/v2``, ``/inference``, ``/cohere`` need the Bearer key
  (:11, :59-61); the RL routes above are served to anyone (see ``_api_key_middleware``).
- ``--middleware MODULE.NAME`` (repeatable, common/cli_args.py:361-366, :406-411): the
  class imported and run as vLLM adds it, outside vLLM's own middleware (register.py:57-66);
  here on aiohttp through an ASGI bridge (``_asgi_middleware``): asyncrl's launcher passes
  its run-secret guard (asyncrl/engines/rollout/vllm/auth.py).

Test-only: ``GET /standin/state`` (ground truth: per request the version of the weights
that made each token and its label; per push and rank the sha256 of every tensor).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib
import inspect
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from aiohttp import web

from tests.engines.rollout.vllm.lora import VLLMLora, add_flags
from tests.engines.rollout.vllm.rank import Rank
from tests.engines.rollout.vllm.ranks import VLLMRank

INIT_FIELDS = {
    "master_address",
    "master_port",
    "rank_offset",
    "world_size",
    "nccl_unique_id_b64",
    "packed",
    "packed_buffer_size_bytes",
    "packed_num_buffers",
}  # fmt: skip  (NCCLWeightTransferInitInfo, nccl_common.py:100-107)
UPDATE_FIELDS = {"names", "dtype_names", "shapes"}  # NCCLWeightTransferUpdateInfo, nccl:98-100
PAUSED_MSG = "Generation is paused. Please retry after it resumes."  # core:1803-1806


@dataclass
class Req:
    rid: str
    ids: list[int]
    max_new: int
    temperature: float
    stop: set[int]
    ignore_eos: bool
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    starts: list[tuple[str, int]] = field(default_factory=list)  # output_processor.py:242
    truth: list[int | None] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    finish: str | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    adapter: Any = None  # its LoRA adapter (vllm/lora.py): kept even when unloaded by name
    adapter_name: str | None = None
    adapter_truth: list[str | None] = field(default_factory=list)
    ext: str = ""  # the engine's external id: generate-tokens-{request_id} (tito/serving.py:203)

    def spans(self) -> list[dict[str, Any]]:
        """output_processor.py:538-545."""
        ends = [s for _, s in self.starts[1:]] + [len(self.output)]
        return [
            {"version": v, "start": s, "end": e}
            for (v, s), e in zip(self.starts, ends, strict=False)
        ]


def _error(message: str, status: int) -> dict[str, Any]:
    kind = {400: "BadRequestError", 503: "ServiceUnavailableError"}.get(status)
    return {"error": {"message": message, "type": kind or "InternalServerError",
                      "param": None, "code": status}}  # fmt: skip


class StandIn:
    def __init__(self, args: argparse.Namespace):
        from transformers import AutoModelForCausalLM

        self.args = args
        self.tp = args.tp_size
        self.step_s = args.step_s
        self.model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32)
        self.model.eval()
        self.params = dict(self.model.named_parameters())
        self.eos = self.model.config.eos_token_id
        log = open(args.log, "a") if args.log else None
        self.rank0 = Rank()
        self.ranks = [VLLMRank(log) for _ in range(self.tp - 1)]
        self.fail_calls = {int(x) for x in args.fail_calls.split(",") if x}
        self.corrupt_calls = {int(x) for x in args.corrupt_calls.split(",") if x}
        self.calls_log = open(args.calls, "a") if args.calls else None
        self.label = "default"  # core:147
        self.truth: int | None = 0  # the version the live weights are wholly (None: mixed)
        self.reqs: dict[str, Req] = {}
        self.pause = "none"  # none | abort | wait | keep
        self.reject_new = False  # core:2232
        self.inited = False
        self.cap = 1 << 30
        self.session = False
        self.session_loaded: set[str] = set()
        self.last_meta: dict[str, Any] | None = None  # nccl:147, per model
        self.update_calls = 0
        self.pushes: dict[str, dict[str, str]] = {}  # label -> rank -> digest of all tensors
        self.mixed_tokens = 0
        self.label_errors = 0
        self.lock = asyncio.Lock()  # the engine serves control calls one at a time
        self.stepping = asyncio.Lock()  # held while a decode step runs
        self.wake: asyncio.Event | None = None
        self.lora = VLLMLora(args, self.model, args.model_path)

    # -- generation ----------------------------------------------------------------------
    async def scheduler(self) -> None:
        assert self.wake is not None
        while True:
            batch = [r for r in self.reqs.values() if r.finish is None]
            if self.pause in ("keep", "abort") or not batch:  # PAUSED_ALL / nothing to do
                self.wake.clear()
                await self.wake.wait()
                continue
            async with self.stepping:  # a pause returns only after the step under way
                await asyncio.to_thread(self._step, batch)
            for r in batch:
                r.changed.set()
            await asyncio.sleep(self.step_s)

    def _step(self, batch: list[Req]) -> None:
        seqs = [r.ids + r.output for r in batch]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, width - len(s) :] = torch.tensor(s)
            mask[i, width - len(s) :] = 1
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        self.lora.rows = [r.adapter for r in batch]
        with torch.no_grad():
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1]
        for i, r in enumerate(batch):
            r.adapter_truth.append(r.adapter_name)
            lp = torch.log_softmax(logits[i].float() / max(r.temperature, 1e-5), -1)
            tok = int(lp.argmax()) if r.temperature == 0 else int(torch.multinomial(lp.exp(), 1))
            if not r.starts or r.starts[-1][0] != self.label:  # output_processor.py:531-536
                r.starts.append((self.label, len(r.output)))
            r.output.append(tok)
            r.logprobs.append(float(lp[tok]))
            r.truth.append(self.truth)
            r.labels.append(self.label)
            if self.truth is None:
                self.mixed_tokens += 1
            elif self.label != ("default" if self.truth == 0 else str(self.truth)):
                self.label_errors += 1
            if tok in r.stop or (tok == self.eos and not r.ignore_eos):
                r.finish = "stop"
            elif len(r.output) >= r.max_new:
                r.finish = "length"

    def _choice(
        self, r: Req, new: list[int], lps: list[float], final: bool, index: int = 0
    ) -> dict[str, Any]:
        content = [
            {"token_id": t, "logprob": lp, "top_logprobs": []}
            for t, lp in zip(new, lps, strict=True)
        ]
        return {
            "index": index,
            "finish_reason": r.finish if final else None,
            "token_ids": new,
            "logprobs": {"content": content},
            "weight_versions": r.spans() if final else None,
        }

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await self.body(request)
        assert self.wake is not None
        sp = body.get("sampling_params") or {}
        if self.reject_new:  # core:1796-1815 -> 503; in a stream an error chunk
            if body.get("stream"):
                return await self._stream_error(request, body)
            return self.answer(request, body, _error(PAUSED_MSG, 503), 503)
        adapter, missing = self.lora.resolve(body.get("model"))  # es:199-213
        if missing is not None:
            return self.answer(request, body, _error(missing, 404), 404)
        base = str(body.get("request_id") or f"auto-{time.monotonic_ns()}")
        n = int(sp.get("n") or 1)
        reqs = [self._request(f"{i}_{base}" if n > 1 else base, body, sp) for i in range(n)]
        for r in reqs:  # parallel_sampling.py:84-96: children {i}_{id}, one external id
            r.adapter, r.adapter_name = adapter, (body.get("model") if adapter else None)
            r.ext = f"generate-tokens-{base}"  # tito/serving.py:202-204
            self.reqs[r.rid] = r
        self.wake.set()
        if body.get("stream"):
            return await self._stream(request, body, reqs)
        for r in reqs:  # FINAL_ONLY: answered once every child finished (:120-126)
            while r.finish is None:
                r.changed.clear()
                await r.changed.wait()
        choices = [self._choice(r, r.output, r.logprobs, True, i) for i, r in enumerate(reqs)]
        out = {"request_id": reqs[0].ext, "choices": choices}
        return self.answer(request, {"rid": base, "n": n, "model": body.get("model")}, out)

    def _request(self, rid: str, body: Any, sp: dict[str, Any]) -> Req:
        return Req(
            rid,
            list(body["token_ids"]),
            int(sp.get("max_tokens") or 16),
            float(sp.get("temperature", 1.0)),
            set(sp.get("stop_token_ids") or []),
            bool(sp.get("ignore_eos")),
        )

    async def lora_route(self, request: web.Request) -> web.Response:
        body = await self.body(request) or {}
        if not self.lora.routes:  # ar:30-32: not mounted
            return self.answer(request, body, {"detail": "Not Found"}, 404)
        load = request.path == "/v1/load_lora_adapter"
        msg, status = (self.lora.load if load else self.lora.unload)(body)
        if status != 200:
            return self.answer(request, body, _error(msg, status), status)
        self.log_call(request, body, 200)
        return web.Response(status=200, text=msg)

    async def _stream(self, request: web.Request, body: Any, reqs: list[Req]) -> web.StreamResponse:
        """SSE as tito/serving.py:646-820 writes it: one chunk per output that brought tokens
        or finished, with that one choice and its ``index`` (:681-683, 690-698, 727-754); with
        ``n > 1`` the children's chunks interleave as they decode (DELTA outputs are passed on
        child by child, parallel_sampling.py:116-122; a finished child is not sent again);
        spans on a child's final chunk only (output_processor.py:528); ``data: [DONE]``."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        sent = [0] * len(reqs)
        done = [False] * len(reqs)
        while not all(done):
            for r in reqs:  # before reading their state: a change from here on wakes the wait
                r.changed.clear()
            for i, r in enumerate(reqs):
                final = r.finish is not None
                if done[i] or not (len(r.output) > sent[i] or final):
                    continue
                choice = self._choice(r, r.output[sent[i] :], r.logprobs[sent[i] :], final, i)
                sent[i], done[i] = len(r.output), final
                chunk = {"request_id": r.ext, "choices": [choice]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if not all(done):
                await _any_change([r for i, r in enumerate(reqs) if not done[i]])
        await resp.write(b"data: [DONE]\n\n")
        self.log_call(request, {"rid": reqs[0].rid, "stream": True, "n": len(reqs)}, 200)
        return resp

    async def _stream_error(self, request: web.Request, body: Any) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(f"data: {json.dumps(_error(PAUSED_MSG, 503))}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        self.log_call(request, {"stream": True}, 200, note="error 503 chunk")
        return resp

    def _abort(self, ids: list[str] | None) -> int:
        """``ids``: external ids (rl:118-120); a parent's aborts its children
        (output_processor.py:599-629); None: all."""
        n = 0
        for r in self.reqs.values():
            if r.finish is None and (ids is None or r.ext in ids):
                r.finish, n = "abort", n + 1
                r.changed.set()
        return n

    # -- pause ---------------------------------------------------------------------------
    async def pause_route(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")  # rl:34
        if mode not in ("abort", "wait", "keep"):  # core:966-967 ValueError -> rl:65-69 400
            return self.answer(
                request, {"mode": mode}, {"error": f"Invalid pause mode: {mode}"}, 400
            )
        self.pause, self.reject_new = mode, mode != "keep"
        async with self.stepping:  # keep/abort: the pause completes once the step ends
            pass  # (core:951-981: the returned future waits for the outputs in flight)
        if mode == "abort":
            self._abort(None)
        while mode == "wait" and any(r.finish is None for r in self.reqs.values()):
            await asyncio.sleep(0.01)  # the pause completes once drained
        return self.answer(request, {"mode": mode}, {"status": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        assert self.wake is not None
        self.pause, self.reject_new = "none", False
        self.wake.set()
        return self.answer(request, None, {"status": "resumed"})

    async def is_paused(self, request: web.Request) -> web.Response:
        return self.answer(request, None, {"is_paused": self.pause != "none"})

    async def abort_requests(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        ids = body.get("request_ids") or None
        async with self.stepping:  # the core takes aborts between steps (core.py:1621-1630)
            n = self._abort(ids)
        return self.answer(
            request, body, {"status": "aborted", "aborted": n if ids is None else len(ids)}
        )

    # -- weights -------------------------------------------------------------------------
    async def _ranks(self, op: str, **fields: Any) -> list[dict[str, Any]]:
        """``op`` on every TP rank at once (rank 0 here, in a thread); their answers."""
        for i, r in enumerate(self.ranks, start=1):
            r.send(op, tp_rank=i, **fields)
        try:
            first = {
                "ok": True,
                **await asyncio.to_thread(getattr(self.rank0, op), {"tp_rank": 0, **fields}),
            }
        except Exception as exc:  # answered as the worker's error
            first = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        return [first, *[await asyncio.to_thread(r.answer, 300) for r in self.ranks]]

    def _fail(self, request: web.Request, body: Any, msg: str, status: int = 500) -> web.Response:
        return self.answer(request, body, _error(msg, status), status)

    async def init_engine(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        info = body.get("init_info")
        if not isinstance(info, dict):
            return self._fail(request, body, "init_info: field required", 400)  # FastAPI 422
        if bad := sorted(set(info) - INIT_FIELDS) or sorted(
            {"rank_offset", "world_size"} - set(info)
        ):
            return self._fail(request, body, f"Invalid init_info for NCCL: {bad}", 500)
        async with self.lock:
            self.cap = int(info.get("packed_buffer_size_bytes", 1 << 30))
            self.last_meta, self.inited = None, True
            got = await self._ranks(
                "init",
                **{
                    k: info[k]
                    for k in ("master_address", "master_port", "rank_offset", "world_size")
                },
            )
        if bad := [g["error"] for g in got if not g["ok"]]:
            return self._fail(request, body, bad[0])
        return self.answer(request, body, {"message": "Weight transfer initialized"})

    async def start(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        if self.session:  # gw:1569-1573
            return self._fail(
                request,
                body,
                "start_weight_update called while a weight update is already active. "
                "Call finish_weight_update first.",
            )
        self.session, self.session_loaded = True, set()
        return self.answer(request, body, {"message": "Weight update started"})

    async def update(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        if not self.session:  # gw:1608-1611
            return self._fail(
                request, body, "start_weight_update must be called before update_weights."
            )
        info = body.get("update_info") or {}
        if set(info) - UPDATE_FIELDS or len({len(info.get(k, [])) for k in UPDATE_FIELDS}) != 1:
            self.session = False  # gw:1622-1626
            return self._fail(request, body, f"invalid update_info keys {sorted(info)}")
        if info["names"]:
            self.last_meta = info  # nccl:201-202, before the receive
        meta = info if info["names"] else (self.last_meta or info)
        async with self.lock:
            self.update_calls += 1
            failing = self.update_calls in self.fail_calls
            bad = self.tp - 1 if self.update_calls in self.corrupt_calls else -1
            got = await self._ranks(
                "recv",
                cap=self.cap,
                load=not failing,
                corrupt_rank=bad,
                truth=self.args.truth,
                **meta,
            )
            if failing or not all(g["ok"] for g in got):
                self.session = False  # the session ends, the model mid-reload (gw:1616-1631)
                self.truth = None
                msg = next((g["error"] for g in got if not g["ok"]), "injected load failure")
                return self._fail(request, body, f"update_weights failed: {msg}")
            for name in got[0]["sha256"]:  # layerwise reload: into the live model at once
                self.truth = None  # mid-update until the finish
                self.session_loaded.add(name)
                self.params[name].data.copy_(self.rank0.loaded[name])
        note = f"chunks={got[0]['chunks']}"
        return self.answer(request, body, {"message": "Weights updated"}, note=note)

    async def finish(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        if not self.session:  # gw:1638-1641
            return self._fail(
                request, body, "finish_weight_update called without a matching start_weight_update."
            )
        self.session = False
        version = body.get("weight_version") if isinstance(body, dict) else None
        if version is not None:  # async_llm.py:1432-1436
            self.label = str(version)
        if self.args.truth:  # --no-truth (a benchmark): no ground-truth hashing per push
            sums = await self._ranks("checksums")
            self.pushes[self.label] = {f"rank{i}": _digest(s["sha256"]) for i, s in enumerate(sums)}
        self._finalize()
        return self.answer(request, body, {"message": "Weight update finished"})

    def _finalize(self) -> None:
        """finalize_layerwise_reload (nccl:175-181): the live model is whole again; its
        version is the label's when every parameter came in this session."""
        whole = set(self.params) <= self.session_loaded
        try:
            self.truth = int(self.label) if whole else None
        except ValueError:
            self.truth = None

    async def update_version(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        self.label = str(body["new_version"])
        return self.answer(request, body, {"success": True, "new_version": self.label})

    async def weight_info(self, request: web.Request) -> web.Response:
        return self.answer(request, None, {"weight_version": self.label})

    async def world_size(self, request: web.Request) -> web.Response:
        return self.answer(request, None, {"world_size": self.tp})

    async def shutdown(self, request: web.Request) -> web.Response:
        if self.session:  # gw:1533-1537
            return self._fail(
                request, None, "Cannot release a trainer connection during a weight update"
            )
        await self._ranks("destroy")
        return self.answer(request, None, {"message": "Weight transfer shut down"})

    async def weight_checker(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        action = body.get("action")
        if action == "compare" and body.get("baseline") is None:  # rl:243-247
            return self._fail(request, body, "action='compare' requires a 'baseline' object", 400)
        held = {"model_path": self.args.model_path, "tp_size": self.tp, "dtype": self.args.dtype}
        sums = await self._ranks("held", **held)  # vLLM's parameters (model_layout.py)
        checks = {
            f"dp0:pp0:pcp0:tp{i}:{n}": d for i, s in enumerate(sums) for n, d in s["sha256"].items()
        }
        if action == "checksum":
            return self.answer(request, body, {"checksums": checks})
        base = body["baseline"]
        bad = sorted(k for k in checks.keys() | base.keys() if checks.get(k) != base.get(k))
        return self.answer(request, body, {"match": not bad, "mismatches": bad})

    async def health(self, request: web.Request) -> web.Response:
        self.log_call(request, None, 200)
        return web.Response(status=200)

    async def state(self, request: web.Request) -> web.Response:
        sums = await self._ranks("checksums")
        return web.json_response({
            "label": self.label, "truth": self.truth, "pushes": self.pushes,
            "update_calls": self.update_calls, "mixed_tokens": self.mixed_tokens,
            "label_errors": self.label_errors,
            "sha256": {f"rank{i}": s["sha256"] for i, s in enumerate(sums)},
            "reqs": {rid: {"truth": r.truth, "labels": r.labels, "finish": r.finish,
                           "output": r.output, "ext": r.ext,
                           "spans": r.spans(), "adapters": r.adapter_truth}
                     for rid, r in self.reqs.items()},
            "lora": self.lora.state(),
        })  # fmt: skip

    # -- HTTP plumbing -------------------------------------------------------------------
    async def body(self, request: web.Request) -> Any:
        raw = await request.read()
        return json.loads(raw) if raw else None

    def log_call(self, request: web.Request, body: Any, status: int, note: str = "") -> None:
        if self.calls_log is not None:
            small = body
            if isinstance(body, dict) and isinstance(body.get("update_info"), dict):
                u = body["update_info"]
                small = {"update_info": {"n_names": len(u.get("names", [])), "keys": sorted(u)}}
            line = {
                "t": time.time(),
                "method": request.method,
                "path": request.path,
                "query": dict(request.query),
                "status": status,
                "body": small,
                "note": note,
            }
            self.calls_log.write(json.dumps(line) + "\n")  # fmt: skip
            self.calls_log.flush()

    def answer(
        self, request: web.Request, body: Any, content: Any, status: int = 200, note: str = ""
    ) -> web.Response:
        self.log_call(request, body, status, note)
        return web.json_response(content, status=status)

    def app(self) -> web.Application:
        # register.py: --api-key's middleware (:32-36) is added before --middleware's
        # (:57-66), and Starlette runs the last added first (applications.py:107)
        mw = [_asgi_middleware(path) for path in self.args.middleware]
        mw += [_api_key_middleware(self.args.api_key)] if self.args.api_key else []
        app = web.Application(client_max_size=1 << 30, middlewares=mw)
        for path, fn in {
            "/inference/v1/generate": self.generate, "/pause": self.pause_route,
            "/resume": self.resume, "/abort_requests": self.abort_requests,
            "/init_weight_transfer_engine": self.init_engine, "/start_weight_update": self.start,
            "/update_weights": self.update, "/finish_weight_update": self.finish,
            "/update_weight_version": self.update_version, "/weight_checker": self.weight_checker,
            "/shutdown_weight_transfer_engine": self.shutdown,
            "/v1/load_lora_adapter": self.lora_route, "/v1/unload_lora_adapter": self.lora_route,
        }.items():  # fmt: skip
            app.router.add_post(path, fn)
        for path, fn in {
            "/is_paused": self.is_paused, "/weight_info": self.weight_info,
            "/get_world_size": self.world_size, "/health": self.health,
            "/standin/state": self.state,
        }.items():  # fmt: skip
            app.router.add_get(path, fn)

        async def begin(_: web.Application) -> None:
            self.wake = asyncio.Event()
            self._task = asyncio.ensure_future(self.scheduler())

        app.on_startup.append(begin)
        return app


async def _any_change(reqs: list[Req]) -> None:
    """Wait until one of ``reqs`` made a token or finished since its ``changed`` event was
    cleared."""
    waits = [asyncio.ensure_future(r.changed.wait()) for r in reqs]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


def _digest(sums: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(sorted(sums.items())).encode()).hexdigest()


GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")
"""vLLM 0.33 entrypoints/serve/middleware/authenticate.py:11: the only paths its key guards."""


def _api_key_middleware(api_key: str) -> Any:
    """vLLM's ``AuthenticationMiddleware`` (0.33 entrypoints/serve/middleware/authenticate.py,
    installed when ``--api-key`` or ``VLLM_API_KEY`` is set: register.py:32-36), on aiohttp
    (it imports starlette, absent here). OPTIONS passes (:51); a path under
    ``GUARDED_PREFIX`` needs ``Authorization: Bearer KEY`` (scheme case-insensitive,
    SHA-256 digests compared in constant time: :30-45), else 401 ``{"error":
    "Unauthorized"}`` (:59-61). Every other path, ``/pause``, ``/update_weights`` and
    ``/init_weight_transfer_engine`` included, is served WITHOUT the key."""
    want = hashlib.sha256(api_key.encode()).digest()

    def verify(header: str | None) -> bool:
        if not header:
            return False
        scheme, _, param = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        return secrets.compare_digest(hashlib.sha256(param.encode()).digest(), want)

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        guarded = request.method != "OPTIONS" and request.path.startswith(GUARDED_PREFIX)
        if guarded and not verify(request.headers.get("Authorization")):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return check


def _asgi_middleware(path: str) -> Any:
    """vLLM's ``--middleware path`` (register.py:57-66): the object imported by its dotted
    path; a class is built with the app as its only argument (``app.add_middleware(cls)``);
    a coroutine function (``app.middleware("http")``, FastAPI's) is not played here. The
    ASGI middleware then sees each request as an ASGI ``http`` scope (method, path,
    ``root_path`` "", query, headers); what it passes on reaches the aiohttp handler, what
    it answers itself (it never reaches the inner app) is sent back as it sent it."""
    module_path, name = path.rsplit(".", 1)
    imported = getattr(importlib.import_module(module_path), name)
    if not inspect.isclass(imported):
        raise SystemExit(f"stand-in: --middleware {path}: only a class is played here")

    async def inner(scope: dict[str, Any], receive: Any, send: Any) -> None:
        scope["standin.passed"] = True

    asgi = imported(inner)

    @web.middleware
    async def run(request: web.Request, handler: Any) -> web.StreamResponse:
        scope: dict[str, Any] = {
            "type": "http", "method": request.method, "path": request.path, "root_path": "",
            "query_string": request.query_string.encode(),
            "headers": [(k.lower().encode("latin-1"), v.encode("latin-1"))
                        for k, v in request.headers.items()],
        }  # fmt: skip
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await asgi(scope, receive, send)
        if scope.get("standin.passed"):
            return await handler(request)
        head = {k.decode(): v.decode() for k, v in sent[0]["headers"]}
        head.pop("content-length", None)
        body = b"".join(m.get("body", b"") for m in sent[1:])
        return web.Response(status=sent[0]["status"], body=body, headers=head)

    return run


def arg_parser() -> argparse.ArgumentParser:
    """The stand-in's flags: vLLM's where it plays one (cited), the test's own otherwise."""
    p = argparse.ArgumentParser()
    p.add_argument("--api-key", default=None, help="vLLM's --api-key (common/cli_args.py:335)")
    p.add_argument("--middleware", action="append", default=[], help="cli_args.py:361, :406")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model-path", required=True)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--dtype", default="auto", help="vLLM's --dtype (model_layout.served_dtype)")
    p.add_argument("--calls", default="", help="append every request here (JSON lines)")
    p.add_argument("--log", default="", help="the ranks' stderr")
    p.add_argument("--fail-calls", default="", help="update calls (1-based) whose load fails")
    p.add_argument(
        "--corrupt-calls",
        default="",
        help="update calls (1-based) that load one element wrong on the last TP rank, silently",
    )
    p.add_argument(
        "--no-truth",
        dest="truth",
        action="store_false",
        help="keep no ground truth per push (no hashing beyond /weight_checker): benchmarks",
    )
    p.add_argument("--step-s", type=float, default=0.0, help="sleep after each decode step")
    add_flags(p)
    return p


def main() -> None:
    args = arg_parser().parse_args()
    torch.set_num_threads(1)
    web.run_app(StandIn(args).app(), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
