"""The embedded generation engine: a transformers model behind a continuous-batching loop.

One scheduler thread owns the model and a per-sequence KV cache
(:class:`~asyncrl.engines.rollout.local.kv.BatchCache`). Each iteration is a
token boundary: if requests are waiting it *prefills* them (up to
``max_batch_size`` running and ``max_prefill_tokens`` per prefill), samples
their first token and appends their cache rows to the running batch;
otherwise it runs one *decode* step — one new token per running sequence
against the cached past (for Llama/Mistral/Qwen2/Qwen3 models as plain tensor ops on
the model's parameters, :mod:`~asyncrl.engines.rollout.local.decode`; else the model's
forward). Finished sequences leave at once and their rows are dropped. Abort,
pause and weight updates take the model lock, so they happen between two steps
and never see a half-updated batch or model. Steps run under
``torch.inference_mode`` (less work per op than ``no_grad``), so the cache's
tensors are inference tensors: what changes them between steps enters it too.

Pause modes (SGLang's): ``abort`` returns every request (running and waiting)
at once with its partial output; ``in_place`` keeps them and their cache;
``retract`` moves running requests back to the queue and frees their cache
(recomputed on continue). Weights loaded while requests are in flight make
their cache stale: with ``kv_after_update="recompute"`` (this class's default) they
are re-prefilled under the new weights before their next token; with ``"keep"``
(``asyncrl run``'s default, ``rollout.kv_after_update``) they go on with the old
weights' keys/values for their prefix (no re-prefill). Either way each token's entry
in ``Request.versions`` is the version whose weights ran its step.

Reported ``weight_version`` of a request is the *oldest* version that produced
any of its tokens (conservative for staleness accounting).

Every queued request is answered: whatever fails in a step (a prefill out of
memory, a model error) finishes the requests of that step with an ``abort``
finish reason naming the error; a prefill failure leaves the running batch
alone. Aborting every request of a prefill in progress (a client hung up, an
abort-all pause, ``stop``) cancels the prefill at the next decoder layer
instead of waiting for it. :meth:`LocalEngine.health` reports a scheduler
whose step has run longer than ``stall_s``, or whose thread died.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from asyncrl.config import PAUSE_MODES
from asyncrl.engines.rollout.local import attention
from asyncrl.engines.rollout.local.decode import LeanDecoder
from asyncrl.engines.rollout.local.kv import BatchCache
from asyncrl.engines.rollout.local.lora import AdapterRing, LoraSpec
from asyncrl.engines.rollout.local.sampling import SamplingParams, sample

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["LocalEngine", "Request", "SamplingParams"]

log = logging.getLogger(__name__)


class _Cancelled(Exception):
    """Raised inside the model by a decoder-layer hook: every joiner of the prefill aborted."""


_HALF_OR_FULL = (torch.float32, torch.bfloat16, torch.float16)
"""Dtypes a pushed tensor may have for a parameter of another of them (converted on load)."""
STATS = (
    "prefill_steps",
    "decode_steps",
    "tokens",
    "prefill_tokens",
    "prefill_shared",
    "prefill_s",
    "decode_s",
    "decode_rows",
    "decode_cells",
    "leave_s",
    "retracted",
    "sorts",
    "bucketed_steps",
    "kv_bytes_peak",
    "pauses",
    "aborted",
)


@dataclass(eq=False)
class Request:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    min_version: str | None = None
    finish: dict[str, Any] | None = None
    versions: list[str] = field(default_factory=list)
    """The weight version that produced each output token (appended before its log-prob:
    ``len(logprobs)`` tokens are complete in every list)."""
    progress: asyncio.Event | None = None
    """Set (on ``loop``) after every token and at the end: a streaming reader waits on it."""
    lora_slot: int = -1  # the adapter ring's slot this request is pinned to (-1: none)


class LocalEngine:
    """Continuous-batching generator over a Hugging Face causal LM (CPU or CUDA)."""

    def __init__(
        self,
        model: PreTrainedModel,
        eos_token_ids: set[int],
        device: str = "cpu",
        max_batch_size: int = 256,
        seed: int = 0,
        weight_version: str = "0",
        max_prefill_tokens: int = 8192,
        kv_after_update: str = "recompute",
        stall_s: float = 60.0,
        context_length: int | None = None,
        max_prompt_tokens: int | None = None,
        lean_decode: bool = True,
    ):
        """``lean_decode``: decode steps of a supported model run as plain tensor ops on its
        parameters (:mod:`~asyncrl.engines.rollout.local.decode`), not its forward."""
        if kv_after_update not in ("recompute", "keep"):
            raise ValueError(
                f"kv_after_update must be 'recompute' or 'keep', got {kv_after_update!r}"
            )
        # PreTrainedModel.to is @functools.wraps(nn.Module.to): typeshed types it unbound
        self.model = model.to(device).eval()  # type: ignore[arg-type]
        self.device = torch.device(device)
        self.eos_token_ids = set(eos_token_ids)
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.recompute_kv = kv_after_update == "recompute"
        self.weight_version = weight_version
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.context_length, self.max_prompt_tokens = _limits(
            model, context_length, max_prompt_tokens
        )
        self._gen = torch.Generator(device=self.device).manual_seed(seed)
        self._cv = threading.Condition()
        self._model_lock = threading.Lock()  # order: _model_lock, then _cv
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # row i of self._kv is self._running[i]
        self._kv: BatchCache | None = None
        self._spare: BatchCache | None = None  # the last emptied batch's cache: its buffers
        self._stale = False
        self._paused = False
        self._stopped = False
        # counters; *_s: seconds of the scheduler thread; decode_rows / decode_cells: rows and
        # cache columns attention read (rows x width, less with buckets) summed over steps
        self.stats: dict[str, float] = dict.fromkeys(STATS, 0)
        self.stall_s = stall_s
        self._step_t0: float | None = None  # start of the step in progress
        self._joining: list[Request] = []  # the prefill in progress
        self._cancel = False  # set when every joiner of the prefill in progress aborted
        self._hooks = _on_each_layer(self.model, self._check_cancel)  # a prefill's cancel point
        self._params = dict(self.model.named_parameters())
        self._bucketed = attention.enable(self.model)  # switches the model's attention function
        self._lean = LeanDecoder.build(self.model) if lean_decode else None
        self.lora: AdapterRing | None = None  # LoRA serving (enable_lora)
        self._thread = threading.Thread(target=self._run, name="engine-scheduler", daemon=True)
        self._thread.start()

    def enable_lora(self, spec: LoraSpec) -> AdapterRing:
        """Serve LoRA adapters (see ``local.lora``): call once, before the first request. The
        current version becomes the ring's first, the zero adapter (the base model)."""
        with self._model_lock:
            assert self.lora is None and not self.num_requests, "enable_lora before serving"
            self.lora = AdapterRing(self.model, spec, self.weight_version)
            self._lean = None  # adapters wrap the linear layers: the model's forward runs them
        return self.lora

    def load_adapter(
        self, version: str, named: list[tuple[str, torch.Tensor]], timeout_s: float
    ) -> None:
        """Load adapter ``version`` beside the served ones (no pause, no abort, no KV
        recompute: running requests keep theirs) and make it the newest."""
        assert self.lora is not None, "enable_lora first"
        self.lora.load(version, named, timeout_s)
        self.weight_version = version

    # -- requests ------------------------------------------------------------------------
    def admit(
        self, prompt_len: int, sampling: SamplingParams, max_new_given: bool
    ) -> SamplingParams:
        """The sampling of a ``prompt_len``-token request, checked against the limits before
        it is queued: ValueError (HTTP 400) when the prompt is over ``max_prompt_tokens`` or
        prompt + ``max_new_tokens`` over ``context_length``. A ``max_new_tokens`` the client
        did not give is clipped to the room the context leaves (SGLang does the same)."""
        if prompt_len > self.max_prompt_tokens:
            raise ValueError(
                f"the prompt has {prompt_len} tokens, over this engine's max_prompt_tokens "
                f"({self.max_prompt_tokens})"
            )
        room = self.context_length - prompt_len
        if not max_new_given:
            return replace(sampling, max_new_tokens=max(0, min(sampling.max_new_tokens, room)))
        if sampling.max_new_tokens > room:
            raise ValueError(
                f"requested {prompt_len} prompt + {sampling.max_new_tokens} new tokens, over the "
                f"model's context length of {self.context_length} tokens: reduce max_new_tokens "
                "or the prompt"
            )
        return sampling

    def submit(self, req: Request) -> None:
        """Queue ``req``; its future resolves (to ``req``) when it finishes or is aborted."""
        self.submit_all([req])

    def submit_all(self, reqs: list[Request]) -> None:
        """Queue ``reqs`` at once: they join the running batch in the same prefill (so
        identical sequences among them are prefilled once) unless it is full."""
        queued = []
        for req in reqs:
            if req.sampling.max_new_tokens == 0:
                self._finish(req, {"type": "length", "length": 0})
            else:
                queued.append(req)
        with self._cv:
            if self._stopped:
                for req in queued:
                    self._finish(req, {"type": "abort", "message": "engine stopped"})
                return
            self._waiting.extend(queued)
            self._cv.notify()

    def abort(self, rid: str = "", abort_all: bool = False) -> int:
        """Finish matching requests now with their partial output; returns how many.

        Waits for the step in progress, so a returned output never grows afterwards; a
        prefill whose every request is aborted is cancelled at its next decoder layer.
        """
        cancelled = self._cancel_prefill(lambda r: abort_all or r.rid == rid)
        with self._model_lock, self._cv:
            victims = [r for r in (*self._waiting, *self._running) if abort_all or r.rid == rid]
            if not victims:
                return cancelled
            gone = {id(r) for r in victims}
            self._waiting = deque(r for r in self._waiting if id(r) not in gone)
            self._keep_running([i for i, r in enumerate(self._running) if id(r) not in gone])
        self._finish_all([(r, {"type": "abort", "message": "aborted by request"}) for r in victims])
        return len(victims) + cancelled

    def _cancel_prefill(self, match: Any) -> int:
        """Cancel the prefill in progress when ``match`` holds for each of its requests."""
        with self._cv:
            if self._joining and all(match(r) for r in self._joining):
                self._cancel = True
                return len(self._joining)
        return 0

    def _check_cancel(self, *_: Any) -> None:
        if self._cancel:
            raise _Cancelled

    def pause(self, mode: str) -> None:
        """Stop scheduling between two steps (see the module docstring for the modes)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        if mode == "abort":
            self._cancel_prefill(lambda r: True)
        with self._model_lock, self._cv:
            self._paused = True
            self.stats["pauses"] += 1
            if mode == "retract":
                self._retract()
        if mode == "abort":
            self.stats["aborted"] += self.abort(abort_all=True)

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify()

    @property
    def paused(self) -> bool:
        return self._paused

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cancel = bool(self._joining)
            self._cv.notify()
        self._thread.join(timeout=10)
        self.abort(abort_all=True)

    @property
    def num_requests(self) -> int:
        return len(self._waiting) + len(self._running) + len(self._joining)

    def health(self) -> str | None:
        """None when the scheduler is alive and no step has run longer than ``stall_s``; else
        the reason (the server answers ``/health`` with 503 and it)."""
        if not self._thread.is_alive():
            return "the engine's scheduler thread is not running"
        t0 = self._step_t0
        if t0 is not None and time.monotonic() - t0 > self.stall_s:
            return (
                f"one scheduler step has run {time.monotonic() - t0:.0f} s "
                f"(longer than stall_s={self.stall_s:g}) with {self.num_requests} requests"
            )
        return None

    # -- weights -------------------------------------------------------------------------
    def check_weights(self, named: list[tuple[str, torch.Tensor]], complete: bool = False) -> None:
        """Raise KeyError/ValueError unless every tensor names a parameter of its shape, once,
        in a dtype that converts to the parameter's without changing its kind (the same
        dtype, or among float32/bfloat16/float16: never integers or float64 into floats).
        ``complete``: every parameter must be there (a push replaces the whole model)."""
        names = [n for n, _ in named]
        missing = [n for n in names if n not in self._params]
        if missing:
            raise KeyError(f"unknown parameter names: {missing[:5]}")
        if len(set(names)) != len(names):
            raise ValueError(
                f"a parameter sent twice: {sorted({n for n in names if names.count(n) > 1})[:5]}"
            )
        for n, t in named:
            p = self._params[n]
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"{n}: shape {tuple(t.shape)} != {tuple(p.shape)}")
            if t.dtype != p.dtype and not (t.dtype in _HALF_OR_FULL and p.dtype in _HALF_OR_FULL):
                raise ValueError(
                    f"{n}: dtype {str(t.dtype).removeprefix('torch.')} cannot be loaded into a "
                    f"{str(p.dtype).removeprefix('torch.')} parameter (send "
                    f"{', '.join(sorted(str(d).removeprefix('torch.') for d in _HALF_OR_FULL))})"
                )
        if complete and len(names) != len(self._params):
            absent = [n for n in self._params if n not in set(names)]
            raise ValueError(
                f"a push must hold every parameter: {len(absent)} of {len(self._params)} "
                f"missing ({', '.join(absent[:5])})"
            )

    def load_weights(
        self, named: list[tuple[str, torch.Tensor]], version: str | None, zero_copy: bool = False
    ) -> None:
        """Switch to ``named`` between two steps, then the version (all or nothing).

        ``zero_copy``: parameters whose dtype and device match become the given
        tensors (the caller must not write them afterwards); the others get memory of
        their own (a converted copy), so no parameter keeps pointing into memory that
        the caller owned before (a receive buffer it may reuse). Without ``zero_copy``
        the values are copied into the parameters' current memory.
        Sequences in flight keep their tokens; their KV cache, computed by the old
        weights, is recomputed under the new ones before their next token (unless the
        engine keeps it: ``kv_after_update="keep"``).
        """
        self.check_weights(named)
        with self._model_lock, torch.no_grad():
            for n, t in named:
                p = self._params[n]
                if not zero_copy:
                    p.copy_(t)
                elif t.dtype == p.dtype and t.device == p.device:
                    p.data = t
                else:
                    p.data = t.to(device=p.device, dtype=p.dtype, copy=True)
            if version is not None:
                self.weight_version = version
            self._stale = self._kv is not None and self.recompute_kv

    # -- scheduler -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and (self._paused or not (self._waiting or self._running)):
                    self._cv.wait()
                if self._stopped:
                    return
            with self._model_lock:
                self._step_t0 = time.monotonic()
                try:
                    self._iteration()
                except Exception as exc:  # a broken step must not hang its callers
                    log.exception("engine step failed")
                    self._fail_all(exc)
                finally:
                    self._step_t0 = None

    def _iteration(self) -> None:
        """One token boundary: prefill the joiners, or one decode step of the batch."""
        with self._cv:
            if self._paused or self._stopped:
                return
            if self._stale:
                self._retract()
            joining: list[Request] = []
            budget = self.max_prefill_tokens
            while self._waiting and len(self._running) + len(joining) < self.max_batch_size:
                n = len(self._waiting[0].input_ids) + len(self._waiting[0].output_ids)
                if joining and n > budget:
                    break
                if not self._pin(self._waiting[0]):
                    break  # a one-version ring replaces its adapter: join after the load
                joining.append(self._waiting.popleft())
                budget -= n
            self._joining, self._cancel = joining, False
        with torch.inference_mode():  # cheaper per op than no_grad (no version counters)
            if joining:
                try:
                    self._prefill(joining)
                finally:
                    with self._cv:
                        self._joining, self._cancel = [], False
            elif self._running:
                self._decode()

    def _pin(self, r: Request) -> bool:
        """Pin a joiner to the newest adapter version unless pinned (LoRA); False: not now."""
        if self.lora is None or r.lora_slot >= 0:
            return True
        got = self.lora.pin_newest()
        if got is None:
            return False
        r.min_version, r.lora_slot = got
        return True

    def _rows(self, reqs: list[Request]) -> None:
        """Tell the adapter ring each row's version before a forward (LoRA)."""
        if self.lora is not None:
            self.lora.set_rows([r.lora_slot for r in reqs])

    def _retract(self) -> None:
        """Running requests back to the head of the queue; their cache is dropped."""
        self.stats["retracted"] += len(self._running)
        self._waiting.extendleft(reversed(self._running))
        self._running = []
        self._spare, self._kv = self._kv or self._spare, None
        self._stale = False

    def _keep_running(self, rows: list[int]) -> None:
        """Keep running rows ``rows``; the cache may reorder them (row i is _running[i])."""
        if len(rows) == len(self._running):
            return
        if not rows:
            self._running, self._spare, self._kv = [], self._kv or self._spare, None
            return
        order = rows
        if self._kv is not None:
            keep = set(rows)
            with torch.inference_mode():  # the cache's tensors are inference tensors
                order = self._kv.drop([i for i in range(len(self._running)) if i not in keep])
        self._running = [self._running[i] for i in order]

    def _prefill(self, reqs: list[Request]) -> None:
        """Prefill the joiners as new rows of the running batch and sample their first token.

        Joiners with identical token sequences (a GRPO group's ``n`` samples of one prompt
        arrive together) are computed once and their keys/values and logits copied to every
        one of them: each row's cache and first-token distribution are exactly what its own
        prefill would give, only the prefill's work is not repeated.
        """
        t0 = time.perf_counter()
        unique: dict[tuple[int, ...], int] = {}  # (adapter slot, *tokens): one computed row
        index = [
            unique.setdefault((r.lora_slot, *r.input_ids, *r.output_ids), len(unique)) for r in reqs
        ]
        seqs = [list(k[1:]) for k in unique]
        if self.lora is not None:
            self.lora.set_rows([k[0] for k in unique])
        out = self._prefill_forward(reqs, seqs)
        if out is None:
            return
        logits = out.logits[:, -1].float()
        if len(seqs) < len(reqs):  # shared sequences: one computed row per distinct one
            rows = torch.tensor(index, device=self.device)
            for layer in out.past_key_values.layers:
                layer.keys = layer.keys.index_select(0, rows)
                layer.values = layer.values.index_select(0, rows)
            logits = logits.index_select(0, rows)
            self.stats["prefill_shared"] += len(reqs) - len(seqs)
        self._join(out.past_key_values, [len(seqs[i]) for i in index])
        with self._cv:
            self._running += reqs
        self.stats["prefill_steps"] += 1
        self.stats["prefill_tokens"] += sum(len(s) for s in seqs)
        self.stats["prefill_s"] += time.perf_counter() - t0
        self._emit(len(self._running) - len(reqs), logits)

    def _prefill_forward(self, reqs: list[Request], seqs: list[list[int]]) -> Any:
        """The model's forward over ``seqs`` left-padded into one batch, keeping the cache and
        the last position's logits; None when it was cancelled or failed, every joiner in
        ``reqs`` then finished with the reason (a failure is the joiners' alone)."""
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):  # left padding: the last column is every sequence's tip
            ids[i, width - len(s) :] = torch.tensor(s)
            mask[i, width - len(s) :] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        try:
            return self.model(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=pos.to(self.device),
                use_cache=True,
                logits_to_keep=1,
            )
        except _Cancelled:
            for r in reqs:
                self._finish(r, {"type": "abort", "message": "aborted by request"})
        except Exception as exc:  # out of memory on a long prompt: the joiners fail, alone
            log.exception("prefill of %d requests failed", len(reqs))
            for r in reqs:
                self._finish(r, {"type": "abort", "message": f"engine error in prefill: {exc}"})
        return None

    def _join(self, cache: Any, lens: list[int]) -> None:
        """New rows of cached lengths ``lens`` (``cache``: their prefill's) below the running
        batch's (the batch's cache made from them when none runs)."""
        if self._kv is None:
            spare, self._spare = self._spare, None
            self._kv = BatchCache(cache, lens, self.max_batch_size, self.context_length, spare)
        else:
            self._kv.extend(cache, lens)
        self.stats["kv_bytes_peak"] = max(self.stats["kv_bytes_peak"], self._kv.nbytes)

    def _decode(self) -> None:
        t0 = time.perf_counter()
        kv = self._kv
        assert kv is not None and kv.rows == len(self._running)
        plan: attention.Plan | None = None
        cells = kv.rows * (kv.width + 1)
        if self._bucketed or self._lean is not None:
            plan, cells = self._plan(kv)
            self.stats["bucketed_steps"] += plan is not None
        self.stats["decode_rows"] += kv.rows
        self.stats["decode_cells"] += cells
        kv.clean_for(plan or [(0, kv.rows, kv.width + 1)])  # what attention reads: see kv
        ids = torch.tensor([r.output_ids[-1] for r in self._running], device=self.device)
        if self._lean is not None:
            bias = kv.decode_bias(self.device, self._lean.dtype)
            pos = torch.tensor(kv.lens, device=self.device)
            logits = self._lean(ids, pos, max(kv.lens), bias, kv.layers, plan)
        else:
            self._rows(self._running)
            extra = {"decode_plan": plan} if self._bucketed else {}
            out = self.model(
                input_ids=ids[:, None],
                attention_mask=kv.decode_mask(self.device, sdpa=self._bucketed),
                position_ids=kv.positions(self.device),
                past_key_values=kv.cache,
                use_cache=True,
                **extra,
            )
            kv.cache = out.past_key_values
            logits = out.logits[:, -1]
        kv.advance()
        self.stats["kv_bytes_peak"] = max(self.stats["kv_bytes_peak"], kv.nbytes)
        self.stats["decode_steps"] += 1
        self.stats["decode_s"] += time.perf_counter() - t0
        self._emit(0, logits.float())

    def _plan(self, kv: BatchCache) -> tuple[attention.Plan | None, int]:
        """Decode attention buckets; the rows are re-sorted longest first when joins and
        leaves have shuffled them enough to read a quarter more columns than sorted rows."""
        plan, cells = attention.plan(kv.lens, kv.width)
        ideal = sorted(kv.lens, reverse=True)
        if ideal != kv.lens:
            best, best_cells = attention.plan(ideal, kv.width)
            if best_cells * 4 < cells * 3:
                order = kv.sort()
                with self._cv:
                    self._running = [self._running[i] for i in order]
                self.stats["sorts"] += 1
                return best, best_cells
        return plan, cells

    def _emit(self, first: int, logits: torch.Tensor) -> None:
        """Sample the next token of running rows ``first:``; finished rows leave the batch."""
        rows = self._running[first:]
        tokens, logprobs = sample(logits, [r.sampling for r in rows], self._gen)
        done: list[tuple[Request, dict[str, Any]]] = []
        for r, tok, lp in zip(rows, tokens.tolist(), logprobs.tolist(), strict=True):
            r.output_ids.append(tok)
            r.versions.append(self.weight_version)
            r.logprobs.append(lp)
            if r.min_version is None:
                r.min_version = self.weight_version
            if r.progress is not None:
                r.loop.call_soon_threadsafe(r.progress.set)
            if tok in r.sampling.stop_token_ids or (
                not r.sampling.ignore_eos and tok in self.eos_token_ids
            ):
                done.append((r, {"type": "stop", "matched": tok}))
            elif len(r.output_ids) >= r.sampling.max_new_tokens:
                done.append((r, {"type": "length", "length": len(r.output_ids)}))
        self.stats["tokens"] += len(rows)
        if not done:
            return
        finished = {id(r) for r, _ in done}
        t0 = time.perf_counter()
        with self._cv:
            self._keep_running([i for i, r in enumerate(self._running) if id(r) not in finished])
        self.stats["leave_s"] += time.perf_counter() - t0
        self._finish_all(done)

    def _fail_all(self, exc: Exception) -> None:
        with self._cv:
            victims = [*self._running, *self._joining]
            self._running, self._kv, self._spare = [], None, None
        reason = {"type": "abort", "message": f"engine error: {exc}"}
        self._finish_all([(r, reason) for r in victims])

    def _finish(self, r: Request, reason: dict[str, Any]) -> None:
        self._finish_all([(r, reason)])

    def _finish_all(self, done: list[tuple[Request, dict[str, Any]]]) -> None:
        """Finish each request (once: a finished one stays as it is); their futures resolve
        on their own loops, one callback per loop for all of them."""
        by_loop: dict[asyncio.AbstractEventLoop, list[Request]] = {}
        for r, reason in done:
            if r.finish is not None:
                continue
            r.finish = reason
            if r.lora_slot >= 0 and self.lora is not None:
                self.lora.unpin(r.lora_slot)
            if r.min_version is None:
                r.min_version = self.weight_version
            by_loop.setdefault(r.loop, []).append(r)
        for loop, reqs in by_loop.items():
            loop.call_soon_threadsafe(_resolve, reqs)


def _on_each_layer(model: PreTrainedModel, hook: Any) -> list[Any]:
    """``hook`` as a forward pre-hook of each decoder layer of ``model`` (their handles)."""
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    return [m.register_forward_pre_hook(hook) for m in layers]


def _limits(
    model: PreTrainedModel, context_length: int | None, max_prompt_tokens: int | None
) -> tuple[int, int]:
    """(context length, longest prompt): as given, else the model's
    ``max_position_embeddings`` (else unbounded) and the context length."""
    model_ctx = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    context = int(context_length or model_ctx or 1 << 62)
    prompt = int(max_prompt_tokens or context)
    if context < 1 or prompt < 1:
        raise ValueError("context_length and max_prompt_tokens must be >= 1")
    return context, prompt


def _resolve(reqs: list[Request]) -> None:
    """On the requests' loop: their futures get their results, their readers a wake-up."""
    for r in reqs:
        if not r.future.done():
            r.future.set_result(r)
        if r.progress is not None:
            r.progress.set()
