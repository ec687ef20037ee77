"""The embedded generation engine: a transformers model behind a continuous-batching loop.

One scheduler thread owns the model. At every token boundary it admits waiting
requests into the running batch (up to ``max_batch_size``), runs one forward
pass over the running sequences, samples one token for each, and retires the
finished ones — so requests join and leave the batch between tokens. Weight
updates are applied under the same lock, between two decoding steps, so no
forward pass ever sees a half-loaded model.

Reported ``weight_version`` of a request is the *oldest* version that produced
any of its tokens (conservative for staleness accounting even when weights
change under an in-place pause).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["LocalEngine", "SamplingParams"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    """The SGLang sampling_params subset the embedded engine honours."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        known = {
            "max_new_tokens": int,
            "temperature": float,
            "top_p": float,
            "top_k": int,
            "ignore_eos": bool,
        }
        kwargs: dict[str, Any] = {}
        for key, conv in known.items():
            if d.get(key) is not None:
                kwargs[key] = conv(d[key])
        if d.get("stop_token_ids"):
            kwargs["stop_token_ids"] = tuple(int(t) for t in d["stop_token_ids"])
        sp = cls(**kwargs)
        if sp.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {sp.max_new_tokens}")
        if sp.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {sp.temperature}")
        if not 0 < sp.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {sp.top_p}")
        return sp


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


class LocalEngine:
    """Continuous-batching generator over a Hugging Face causal LM (CPU or CUDA)."""

    def __init__(
        self,
        model: torch.nn.Module,
        eos_token_ids: set[int],
        device: str = "cpu",
        max_batch_size: int = 256,
        seed: int = 0,
        weight_version: str = "0",
    ):
        self.model = model.to(device).eval()
        self.device = torch.device(device)
        self.eos_token_ids = eos_token_ids
        self.max_batch_size = max_batch_size
        self.weight_version = weight_version
        self._gen = torch.Generator(device=self.device).manual_seed(seed)
        self._cv = threading.Condition()
        self._model_lock = threading.Lock()
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._paused = False
        self._stopped = False
        self._params = dict(self.model.named_parameters())
        self._thread = threading.Thread(target=self._run, name="engine-scheduler", daemon=True)
        self._thread.start()

    # -- requests ------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        if req.sampling.max_new_tokens == 0:
            self._finish(req, {"type": "length", "length": 0})
            return
        with self._cv:
            self._waiting.append(req)
            self._cv.notify()

    def abort(self, rid: str = "", abort_all: bool = False) -> int:
        """Finish matching requests now with their partial output; returns how many.

        Waits for the decoding step in progress, so a returned output never grows.
        """
        with self._model_lock, self._cv:
            victims = [r for r in (*self._waiting, *self._running) if abort_all or r.rid == rid]
            self._waiting = deque(r for r in self._waiting if r not in victims)
            self._running = [r for r in self._running if r not in victims]
        for r in victims:
            self._finish(r, {"type": "abort", "message": "aborted by request"})
        return len(victims)

    def pause(self, mode: str) -> None:
        """Stop scheduling; ``abort`` also returns every in-flight request at once."""
        if mode not in ("abort", "in_place", "retract"):
            raise ValueError(f"pause mode must be abort, in_place or retract, got {mode!r}")
        with self._cv:
            self._paused = True
        with self._model_lock:  # wait out the step in progress
            pass
        if mode == "abort":
            self.abort(abort_all=True)

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout=10)
        self.abort(abort_all=True)

    @property
    def num_requests(self) -> int:
        return len(self._waiting) + len(self._running)

    # -- weights -------------------------------------------------------------------------
    def check_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Raise KeyError/ValueError unless every tensor names a parameter of its shape."""
        missing = [n for n, _ in named if n not in self._params]
        if missing:
            raise KeyError(f"unknown parameter names: {missing[:5]}")
        for n, t in named:
            if tuple(t.shape) != tuple(self._params[n].shape):
                raise ValueError(f"{n}: shape {tuple(t.shape)} != {tuple(self._params[n].shape)}")

    def load_weights(
        self, named: list[tuple[str, torch.Tensor]], version: str | None, zero_copy: bool = False
    ) -> None:
        """Switch to ``named`` between two steps, then the version (all or nothing).

        ``zero_copy``: parameters whose dtype and device match become the given
        tensors (the caller must not write them afterwards); others are copied.
        """
        self.check_weights(named)
        with self._model_lock, torch.no_grad():
            for n, t in named:
                p = self._params[n]
                if zero_copy and t.dtype == p.dtype and t.device == p.device:
                    p.data = t
                else:
                    p.copy_(t)
            if version is not None:
                self.weight_version = version

    # -- scheduler -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and (self._paused or not (self._waiting or self._running)):
                    self._cv.wait()
                if self._stopped:
                    return
                while self._waiting and len(self._running) < self.max_batch_size:
                    self._running.append(self._waiting.popleft())
                batch = list(self._running)
            try:
                with self._model_lock:
                    self._step(batch)
            except Exception as exc:  # a broken step must not hang its callers
                log.exception("decode step failed")
                for r in batch:
                    self._finish(r, {"type": "abort", "message": f"engine error: {exc}"})
                with self._cv:
                    self._running = [r for r in self._running if r not in batch]

    @torch.no_grad()
    def _step(self, batch: list[Request]) -> None:
        seqs = [r.input_ids + r.output_ids for r in batch]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):  # left padding: the last column is every sequence's tip
            ids[i, width - len(s) :] = torch.tensor(s)
            mask[i, width - len(s) :] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        ids, mask, pos = ids.to(self.device), mask.to(self.device), pos.to(self.device)
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1]
        tokens, logprobs = self._sample(logits.float(), batch)
        done: list[tuple[Request, dict[str, Any]]] = []
        for r, tok, lp in zip(batch, tokens.tolist(), logprobs.tolist(), strict=True):
            r.output_ids.append(tok)
            r.logprobs.append(lp)
            if r.min_version is None:
                r.min_version = self.weight_version
            stops = set(r.sampling.stop_token_ids)
            if not r.sampling.ignore_eos:
                stops |= self.eos_token_ids
            if tok in stops:
                done.append((r, {"type": "stop", "matched": tok}))
            elif len(r.output_ids) >= r.sampling.max_new_tokens:
                done.append((r, {"type": "length", "length": len(r.output_ids)}))
        if done:
            finished = {id(r) for r, _ in done}
            with self._cv:
                self._running = [r for r in self._running if id(r) not in finished]
            for r, reason in done:
                self._finish(r, reason)

    def _sample(self, logits: torch.Tensor, batch: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        temps = torch.tensor([max(r.sampling.temperature, 1e-5) for r in batch], device=logits.device)
        scaled = logits / temps[:, None]
        logp = torch.log_softmax(scaled, dim=-1)
        filtered = scaled.clone()
        for i, r in enumerate(batch):
            sp = r.sampling
            if sp.top_k > 0 and sp.top_k < filtered.shape[-1]:
                kth = torch.topk(filtered[i], sp.top_k).values[-1]
                filtered[i][filtered[i] < kth] = float("-inf")
            if sp.top_p < 1.0:
                sorted_l, idx = torch.sort(filtered[i], descending=True)
                cum = torch.softmax(sorted_l, -1).cumsum(-1)
                drop = cum - torch.softmax(sorted_l, -1) > sp.top_p
                filtered[i][idx[drop]] = float("-inf")
        probs = torch.softmax(filtered, dim=-1)
        greedy = torch.tensor([r.sampling.temperature == 0 for r in batch], device=logits.device)
        sampled = torch.multinomial(probs, 1, generator=self._gen).squeeze(-1)
        tokens = torch.where(greedy, logits.argmax(-1), sampled)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)

    def _finish(self, r: Request, reason: dict[str, Any]) -> None:
        if r.finish is not None:
            return
        r.finish = reason
        if r.min_version is None:
            r.min_version = self.weight_version

        def _set() -> None:
            if not r.future.done():
                r.future.set_result(r)

        r.loop.call_soon_threadsafe(_set)
