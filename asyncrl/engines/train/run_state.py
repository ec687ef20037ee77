"""The trainer's side of run checkpoints: save on request, restore on (re)start.

A :class:`~asyncrl.transports.experience.control.Save` arrives on every rank in order
after the batch of step ``step - 1``; every rank then holds the state "steps
``0 .. step-1`` trained". :meth:`RunState.save` writes, under ``checkpoint``::

    actor/    the actor engine's DCP checkpoint (model, optimizer, LR step, RNG per rank)
    critic/   the critic's (PPO only)
    trainer.json   {"step": next step to train, "roles": [...], "world_size": ...}

The shards are staged into CPU memory while training stands still (``stall_s``) and
written by DCP's background thread over a Gloo group kept for checkpoints only; rank 0
reports :class:`Saved` when every rank's files are complete. ``export`` writes the
actor as a Hugging Face folder (the critic into ``export/critic``), synchronously.
Every method is collective: call it on every rank in the same order.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist

from asyncrl.engines.train.base import EngineState
from asyncrl.transports.experience.control import Save, Saved
from asyncrl.transports.experience.wire import Message

__all__ = ["TRAINER_META", "RunState"]

log = logging.getLogger("asyncrl.trainer")

TRAINER_META = "trainer.json"


class RunState:
    """Saves and restores every engine of an algorithm (``actor``, and ``critic`` if any)."""

    def __init__(self, algorithm: Any, rank: int, report: Callable[[Message], None]):
        self.engines: dict[str, EngineState] = {"actor": algorithm.actor}
        if getattr(algorithm, "critic", None) is not None:
            self.engines["critic"] = algorithm.critic
        self.rank = rank
        self._report = report
        # collective: every rank creates it at the same point; used by DCP's writer thread only
        self._group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._writing: threading.Thread | None = None

    def save(self, msg: Save) -> float:
        """Handle a Save request; returns the stall (seconds training stood still)."""
        t0 = time.perf_counter()
        self.wait()  # one checkpoint in the background at a time
        futures: list[Future] = []
        if msg.checkpoint:
            base = Path(msg.checkpoint)
            for role, engine in self.engines.items():
                fut = engine.save(str(base / role), self._group)
                if fut is not None:
                    futures.append(fut)
            if self.rank == 0:
                meta = {
                    "step": msg.step,
                    "roles": list(self.engines),
                    "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                }
                (base / TRAINER_META).write_text(json.dumps(meta))
        if msg.export:
            self.engines["actor"].export_hf(msg.export)
            if "critic" in self.engines:
                self.engines["critic"].export_hf(str(Path(msg.export) / "critic"))
        stall = time.perf_counter() - t0
        self._writing = threading.Thread(
            target=self._finish, args=(msg.step, futures, t0, stall), daemon=True
        )
        self._writing.start()
        return stall

    def _finish(self, step: int, futures: list[Future], t0: float, stall: float) -> None:
        error = ""
        for fut in futures:
            try:
                fut.result()
            except Exception as exc:
                log.error("checkpoint of step %d failed: %r", step, exc)
                error = repr(exc)
        if self.rank == 0:
            save_s = time.perf_counter() - t0
            self._report(Saved(step=step, stall_s=stall, save_s=save_s, error=error))

    def wait(self, timeout_s: float = 600.0) -> None:
        """Wait for the checkpoint being written in the background (if any)."""
        if self._writing is not None:
            self._writing.join(timeout_s)
            if self._writing.is_alive():
                raise TimeoutError(f"checkpoint writer thread still running after {timeout_s}s")
            self._writing = None

    def restore(self, path: str) -> int:
        """Load every engine from the checkpoint folder ``path``; returns the next step."""
        base = Path(path)
        meta_path = base / TRAINER_META
        if not meta_path.is_file():
            raise ValueError(f"{base} is not a trainer checkpoint (no {TRAINER_META})")
        meta = json.loads(meta_path.read_text())
        missing = set(self.engines) - set(meta["roles"])
        if missing:
            raise ValueError(f"{base} holds no state for {sorted(missing)} (roles {meta['roles']})")
        for role, engine in self.engines.items():
            engine.load(str(base / role))
        return int(meta["step"])
