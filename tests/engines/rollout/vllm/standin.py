"""The engine core of the vLLM 0.33.0 test server: what vLLM runs behind ``AsyncLLM``
(scheduler, pause states, workers, weight transfer), imitated — it needs a GPU — and
written from vLLM's source. The HTTP layer in front of it is vLLM's own (``app.py``:
its CLI parser, app, routers, request models, error handlers, middleware and
``AsyncLLM``'s methods, which call this through ``app.CoreClient``). Citations are vLLM
0.33.0 files (``rl`` = ``vllm/entrypoints/rl/online/api_router.py``, ``tito`` =
``vllm/entrypoints/scale_out/token_in_token_out/``, ``gw`` = ``vllm/v1/worker/
gpu_worker.py``, ``core`` = ``vllm/v1/engine/core.py``, ``nccl`` =
``vllm/distributed/weight_transfer/nccl_engine.py``):

- receiving ranks: TP rank 0 in this process (its tensors are the live model's), ranks
  1.. in ``rank.py`` processes, each joined through vLLM's own
  ``StatelessProcessGroup`` as ``rank_offset + rank`` (nccl_common.py:239-244), chunks
  cut by vLLM's rule and rebuilt with vLLM's own ``unpack_tensor``; Gloo in place of NCCL
  (NCCL cannot run on a CPU).
- generation: one decode step over every running request at a time; ``weight_versions``
  spans: a span starts when a new token comes under another label
  (v1/engine/output_processor.py:531-545); the first label is ``"default"`` (core:147).
  The engine's id of a request is ``generate-tokens-{request_id}`` (tito/serving.py:
  202-204); ``n > 1``: children ``{i}_{request_id}`` (v1/engine/parallel_sampling.py:84-96).
- pause (``pause_engine``, core:2181-2233): ``abort`` finishes every request and rejects
  new ones; ``wait`` drains, rejects new ones; ``keep`` freezes everything, new requests
  queue; ``clear_cache`` then resets running requests (core:930-953: re-prefilled,
  counted). A rejected request: ``RetryableRequestError`` (core:1796-1815), 503 by vLLM's
  handlers.
- workers (``worker_rpc``): ``init_weight_transfer_engine`` (unknown or missing fields
  refused, nccl_common.py:75-107; answers once every rank joined; clears the metadata
  cache, nccl:159-165); sessions: start during a session fails (gw:1569-1573), update and
  finish without one fail (gw:1608-1611, 1638-1641), a failed update ends the session with
  the model mid-reload while ``/health`` stays 200 (gw:1616-1631), shutdown during a
  session fails (gw:1533-1537): RuntimeErrors, 500 by vLLM's handlers. ``update_weights``:
  names, dtype_names, shapes of equal length (nccl:102-114), empty lists reuse the last
  call's (nccl:201-204; cached even if that call then failed), every rank receives;
  ``--fail-calls`` makes a call's load fail after the receive; ``--corrupt-calls`` makes a
  call load one element wrong on the last TP rank and answer 200 (a silent fault,
  test-only: what ``weights.verify`` must find through ``/weight_checker``). Checksums per
  worker keyed ``dp0:pp0:pcp0:tp{i}:{name}``.

Test-only: ``GET /standin/state`` (``ground_truth``: per request the version of the
weights that made each token, its label, its prefills; per push and rank the sha256 of
every tensor; cache resets).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import torch

from tests.engines.rollout.standin_model import last_logits
from tests.engines.rollout.vllm.lora import VLLMLora
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
    prefills: int = 1  # 1 + the times its KV was dropped and recomputed (a cache reset)
    hung_up: bool = False  # aborted because its client went away (not by a pause)

    def spans(self) -> list[dict[str, Any]]:
        """output_processor.py:538-545."""
        ends = [s for _, s in self.starts[1:]] + [len(self.output)]
        return [
            {"version": v, "start": s, "end": e}
            for (v, s), e in zip(self.starts, ends, strict=False)
        ]


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
        self.cache_resets = 0
        self.finishing = False
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
        self.lora.rows = [r.adapter for r in batch]
        logits = last_logits(self.model, [r.ids + r.output for r in batch])
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

    def _abort(self, ids: list[str] | None) -> int:
        """``ids``: external ids (rl:118-120); a parent's aborts its children
        (output_processor.py:599-629); None: all."""
        n = 0
        for r in self.reqs.values():
            if r.finish is None and (ids is None or r.ext in ids):
                r.finish, n = "abort", n + 1
                r.changed.set()
        return n

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

    def _finalize(self) -> None:
        """finalize_layerwise_reload (nccl:175-181): the live model is whole again; its
        version is the label's when every parameter came in this session."""
        whole = set(self.params) <= self.session_loaded
        try:
            self.truth = int(self.label) if whole else None
        except ValueError:
            self.truth = None

    # -- the engine core's side of AsyncLLM (app.py's CoreClient) ------------------------
    def start(self) -> None:
        """The scheduler loop, on the running event loop."""
        self.wake = asyncio.Event()
        self._task = asyncio.ensure_future(self.scheduler())

    def add_request(
        self,
        rid: str,
        ids: list[int],
        max_new: int,
        temperature: float,
        stop: set[int],
        ignore_eos: bool,
        adapter: Any,
        adapter_name: str | None,
        ext: str,
    ) -> Req:
        """A request in the scheduler (parallel_sampling.py:84-96: children ``{i}_{id}``
        share the parent's external id)."""
        assert self.wake is not None
        r = Req(rid, ids, max_new, temperature, stop, ignore_eos)
        r.adapter, r.adapter_name, r.ext = adapter, adapter_name, ext
        self.reqs[rid] = r
        self.wake.set()
        return r

    async def pause_engine(self, mode: str, clear_cache: bool) -> None:
        """``EngineCoreProc.pause_generation`` (core:2181-2233): an unknown mode is a
        ValueError (:2197-2198, the route's 400); ``abort`` finishes every request, ``wait``
        drains, ``keep`` freezes (PAUSED_ALL); ``abort``/``wait`` reject new requests. Once
        the pause completed, ``clear_cache`` resets the prefix cache with
        ``reset_running_requests=True`` in every mode (``_finish_pause``, core:948-953,
        930-946): each request still running is preempted and re-prefilled on resume
        (scheduler.py:3185-3206) — counted in its ``prefills``."""
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"Invalid pause mode: {mode}")
        self.pause, self.reject_new = mode, mode != "keep"
        async with self.stepping:  # keep/abort: complete once the step under way ended
            pass
        if mode == "abort":
            self._abort(None)
        while mode == "wait" and any(r.finish is None for r in self.reqs.values()):
            await asyncio.sleep(0.01)  # the pause completes once drained
        if clear_cache:
            self.cache_resets += 1
            for r in self.reqs.values():
                if r.finish is None:
                    r.prefills += 1

    def resume_engine(self) -> None:
        assert self.wake is not None
        self.pause, self.reject_new = "none", False
        self.wake.set()

    async def abort_internal(self, rids: list[str], hung_up: bool = False) -> None:
        """``abort_requests`` by internal ids (the core takes aborts between steps,
        core.py:1621-1630); ``hung_up``: because the client went away (the tests tell
        those from aborts by a pause)."""
        async with self.stepping:
            for rid in rids:
                r = self.reqs.get(rid)
                if r is not None and r.finish is None:
                    r.finish = "abort"
                    r.hung_up = hung_up
                    r.changed.set()

    async def set_label(self, version: str) -> None:
        """``set_weight_version`` (async_llm.py:1438-1440): the label of tokens from now.
        Right after a ``finish_weight_update`` (which sends it, :1432-1436): the push's
        ground truth (per rank the digest of every tensor) under that label."""
        self.label = str(version)
        if self.finishing:
            self.finishing = False
            if self.args.truth:  # --no-truth (a benchmark): no hashing per push
                sums = await self._ranks("checksums")
                self.pushes[self.label] = {
                    f"rank{i}": _digest(s["sha256"]) for i, s in enumerate(sums)
                }
            self._finalize()

    async def worker_rpc(self, method: str, **kwargs: Any) -> list[Any]:
        """``collective_rpc`` to the workers (gpu_worker.py), one answer per worker; a
        worker's error raised as the RuntimeError vLLM's collective RPC raises."""
        fn = {
            "init_weight_transfer_engine": self._w_init,
            "start_weight_update": self._w_start,
            "update_weights": self._w_update,
            "finish_weight_update": self._w_finish,
            "shutdown_weight_transfer_engine": self._w_shutdown,
        }.get(method)
        if fn is None:
            raise RuntimeError(f"stand-in: worker method {method!r} is not played")
        await fn(**kwargs)
        return [None] * self.tp

    async def worker_checksums(self) -> list[dict[str, str]]:
        """``compute_weight_checksums``: per worker, sha256 per parameter vLLM's loader made of
        what it received (fused, padded, sharded, in the served dtype: ``model_layout.py``),
        keyed ``dp0:pp0:pcp0:tp{i}:{name}`` (rl:232-266 merges them)."""
        held = {"model_path": self.args.model_path, "tp_size": self.tp, "dtype": self.args.dtype}
        sums = await self._ranks("held", **held)  # vLLM's parameters (model_layout.py)
        return [{f"dp0:pp0:pcp0:tp{i}:{n}": d for n, d in s["sha256"].items()}
                for i, s in enumerate(sums)]  # fmt: skip

    async def _w_init(self, init_info: dict[str, Any]) -> None:
        """nccl_common.py:75-107 (unknown or missing fields refused); answers once every rank
        joined; clears the metadata cache (nccl:159-165)."""
        if bad := sorted(set(init_info) - INIT_FIELDS) or sorted(
            {"rank_offset", "world_size"} - set(init_info)
        ):
            raise RuntimeError(f"Invalid init_info for NCCL: {bad}")
        async with self.lock:
            self.cap = int(init_info.get("packed_buffer_size_bytes", 1 << 30))
            self.last_meta, self.inited = None, True
            keys = ("master_address", "master_port", "rank_offset", "world_size")
            got = await self._ranks("init", **{k: init_info[k] for k in keys})
        if bad := [g["error"] for g in got if not g["ok"]]:
            raise RuntimeError(bad[0])

    async def _w_start(self) -> None:
        if self.session:  # gw:1569-1573
            raise RuntimeError(
                "start_weight_update called while a weight update is already active. "
                "Call finish_weight_update first."
            )
        self.session, self.session_loaded = True, set()

    async def _w_update(self, update_info: Any) -> None:
        if not self.session:  # gw:1608-1611
            raise RuntimeError("start_weight_update must be called before update_weights.")
        info = update_info if isinstance(update_info, dict) else {}
        if set(info) - UPDATE_FIELDS or len({len(info.get(k, [])) for k in UPDATE_FIELDS}) != 1:
            self.session = False  # gw:1622-1626
            raise RuntimeError(f"invalid update_info keys {sorted(info)}")
        if info["names"]:
            self.last_meta = info  # nccl:201-202, before the receive
        meta = info if info["names"] else (self.last_meta or info)
        async with self.lock:
            self.update_calls += 1
            failing = self.update_calls in self.fail_calls
            bad = self.tp - 1 if self.update_calls in self.corrupt_calls else -1
            got = await self._ranks(
                "recv", cap=self.cap, load=not failing, corrupt_rank=bad,
                truth=self.args.truth, **meta,
            )  # fmt: skip
            if failing or not all(g["ok"] for g in got):
                self.session = False  # the session ends, the model mid-reload (gw:1616-1631)
                self.truth = None
                msg = next((g["error"] for g in got if not g["ok"]), "injected load failure")
                raise RuntimeError(f"update_weights failed: {msg}")
            for name in got[0]["sha256"]:  # layerwise reload: into the live model at once
                self.truth = None  # mid-update until the finish
                self.session_loaded.add(name)
                self.params[name].data.copy_(self.rank0.loaded[name])

    async def _w_finish(self) -> None:
        if not self.session:  # gw:1638-1641
            raise RuntimeError(
                "finish_weight_update called without a matching start_weight_update."
            )
        self.session = False
        self.finishing = True  # the label comes next (async_llm.py:1432-1436)
        self._finalize()

    async def _w_shutdown(self) -> None:
        if self.session:  # gw:1533-1537
            raise RuntimeError("Cannot release a trainer connection during a weight update")
        await self._ranks("destroy")

    async def ground_truth(self) -> dict[str, Any]:
        sums = await self._ranks("checksums")
        return {
            "label": self.label, "truth": self.truth, "pushes": self.pushes,
            "update_calls": self.update_calls, "mixed_tokens": self.mixed_tokens,
            "label_errors": self.label_errors, "cache_resets": self.cache_resets,
            "sha256": {f"rank{i}": s["sha256"] for i, s in enumerate(sums)},
            "reqs": {rid: {"truth": r.truth, "labels": r.labels, "finish": r.finish,
                           "output": r.output, "ext": r.ext, "prefills": r.prefills,
                           "spans": r.spans(), "adapters": r.adapter_truth,
                           "hung_up": r.hung_up}
                     for rid, r in self.reqs.items()},
            "lora": self.lora.state(),
            "rank_pids": [r.proc.pid for r in self.ranks],  # TP ranks 1.. (rank.py)
        }  # fmt: skip


def _digest(sums: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(sorted(sums.items())).encode()).hexdigest()


def arg_parser() -> argparse.ArgumentParser:
    """The stand-in's own options (``app.py`` takes them from ``ASYNCRL_VLLM_STANDIN``); the
    model, TP size, LoRA limits, ``--api-key`` and ``--middleware`` are vLLM's flags."""
    p = argparse.ArgumentParser(prog="vllm-standin")
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
    return p
