"""The trainer process: receive batches over ZeroMQ, train, push weights, report.

``python -m asyncrl.entrypoints.trainer --config run/config.json ...`` — one
process per data-parallel rank, started by ``asyncrl run``. Rank 0 owns the
weight sender and reports ``StepDone(step, version=step + 1)`` once the new
weights are live on every engine. Training of step t+1 overlaps the push of
step t: ``push`` only takes references, and an optimizer-step pre-hook makes
the next optimizer step wait until the sender has read the weights (see
``asyncrl.transports.weights.base``).
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from asyncrl import secret, trace
from asyncrl.algorithms.base import make_algorithm
from asyncrl.config import RunConfig
from asyncrl.engines.rollout.factory import make_weight_transport
from asyncrl.engines.train.fsdp import FSDPEngine, init_process_group
from asyncrl.engines.train.run_state import RunState
from asyncrl.net import pin_socket_ifname, tcp_store
from asyncrl.procs import log_startup
from asyncrl.transports.experience.control import (
    Engines,
    EnginesSynced,
    Save,
    Shutdown,
    StepDone,
    Synced,
)
from asyncrl.transports.experience.wire import TrainBatch
from asyncrl.transports.experience.zmq_recv import ExperienceReceiver
from asyncrl.transports.weights.adapter_send import AdapterSpec
from asyncrl.transports.weights.base import (
    EnginesLeft,
    PushHandle,
    WeightsUndefined,
    WeightSyncError,
    WeightTransport,
)

log = logging.getLogger("asyncrl.trainer")


MAX_FAILED_PUSHES = 3
"""Failed weight pushes in a row the trainer survives (see ``_reporter``)."""


class _Stop(Exception):
    pass


def _on_signal(signum: int, _frame: object) -> None:
    raise _Stop(f"signal {signum}")


def _metrics(stats: dict[str, float], n_traj: int, train_s: float) -> dict[str, float]:
    out = {k: float(v) for k, v in stats.items()}
    out.update(train_s=train_s, num_samples=float(n_traj))
    return out


def _push_failed(chan: ExperienceReceiver, exc: WeightSyncError, fatal: threading.Event) -> None:
    """Tell the controller a push failed: restartable, or fatal when the engines' weights
    are undefined (then ``fatal`` is set and this rank trains and pushes no more)."""
    log.error("%s", exc)
    undefined = isinstance(exc, WeightsUndefined)
    if undefined:
        fatal.set()
    chan.report(Shutdown(reason=str(exc), error=True, fatal=undefined))


def _reporter(
    chan: ExperienceReceiver,
    step: int,
    metrics: dict[str, float],
    failed: list[int],
    fatal: threading.Event,
) -> Callable[[PushHandle], None]:
    """Report step ``step`` to the controller once its weights are live (or failed).

    A failed push (an engine died mid-push: the run restarts it and sends
    :class:`Engines`) is survived ``MAX_FAILED_PUSHES`` times in a row: the step is
    reported with ``push_failed = 1`` (the engines keep older weights, and every token
    says which version made it); one more is reported as this trainer's failure (the
    run restarts the trainer from its last checkpoint, ``trainer.max_restarts``). A push
    that leaves SGLang weights undefined is fatal at once (``WeightsUndefined``).
    """

    def report(handle: PushHandle) -> None:
        try:
            metrics.update(handle.wait())
            failed[0] = 0
        except WeightSyncError as exc:
            if isinstance(exc, WeightsUndefined):  # fatal: the run stops
                _push_failed(chan, exc, fatal)
                return
            failed[0] += 1
            log.error("push of version %d failed (%d in a row): %s", handle.version, failed[0], exc)
            if failed[0] > MAX_FAILED_PUSHES:  # not an engine death: the trainer restarts
                _push_failed(chan, exc, fatal)
                return
            metrics["push_failed"] = 1.0
        chan.report(StepDone(step=step, version=handle.version, metrics=metrics))

    return report


def _resync(
    chan: ExperienceReceiver,
    sender: WeightTransport | None,
    weights: Any,
    msg: Engines,
    version: int,
    fatal: threading.Event,
) -> None:
    """The engine set changed: re-form the weight group with it (``msg``'s, or a newer one
    the sender was told meanwhile) and push the current weights (``version``) to all of
    them; rank 0 answers :class:`EnginesSynced` (a push that leaves SGLang weights undefined
    is fatal, as in any push). An engine that leaves meanwhile is left out: pushed again to
    the others."""
    if sender is None:
        for _ in weights:  # collective under sharding: every rank takes part
            pass
        return
    urls = list(msg.urls)
    try:
        tensors = list(weights)  # kept for a push again (collective under sharding: once)
        sender.engines_changed(urls, msg.epoch)
        sender.connect()
        for tries_left in range(len(urls), -1, -1):  # each retry follows an engine leaving
            try:
                sender.push(tensors, version=version).wait()
                break
            except EnginesLeft as exc:
                if not tries_left:
                    raise
                log.warning("re-sync at version %d: %s; pushing again", version, exc)
    except WeightsUndefined as exc:
        _push_failed(chan, exc, fatal)
        return
    except (WeightSyncError, RuntimeError, ValueError, OSError) as exc:
        log.error("re-sync of engines %s failed: %s", urls, exc)
        chan.report(EnginesSynced(urls=urls, version=version, error=str(exc)))
        return
    log.info("engines %s re-synced at version %d", urls, version)
    chan.report(EnginesSynced(urls=urls, version=version))


def _notice_handler(sender: WeightTransport) -> Callable[[Engines], None]:
    """Rank 0: hand the controller's engine-set notices to the weight sender at once."""

    def handle(msg: Engines) -> None:
        sender.engines_changed(msg.urls, msg.epoch)  # the sender logs a change

    return handle


def _adapter_spec(cfg: RunConfig, config_path: str, model_path: str) -> AdapterSpec | None:
    """A LoRA run's adapters as engines that load them from a folder get them: written under
    ``lora.adapter_dir`` (default: ``adapters/`` in the run folder, beside ``config.json``)."""
    lc = cfg.lora
    if not lc.enabled:
        return None
    folder = lc.adapter_dir or str(Path(config_path).resolve().parent / "adapters")
    capacity = cfg.controller.max_staleness + 1
    return AdapterSpec(lc.name, lc.rank, lc.alpha, lc.dropout, capacity, folder, model_path)


def run(args: argparse.Namespace) -> None:
    """One trainer rank: join the process group, build the algorithm, serve the experience
    channel until the controller's ``Shutdown`` (or SIGTERM/SIGINT)."""
    cfg = msgspec.json.decode(open(args.config, "rb").read(), type=RunConfig)
    if args.host:  # this rank's routable address: the weight-sync master on rank 0
        cfg = msgspec.structs.replace(
            cfg, weights=msgspec.structs.replace(cfg.weights, master_address=args.host)
        )
    tracer = trace.configure_from_env(f"trainer{args.rank}")
    torch.manual_seed(cfg.seed + args.rank)
    torch.set_num_threads(cfg.trainer.threads)
    pin_socket_ifname(cfg.weights.master_address)  # Gloo/NCCL bind where this rank advertises
    # rank 0's store listens on its advertised address only (torch's own: every interface)
    store = tcp_store(args.dist_addr, args.dist_port, args.world_size, args.rank == 0, 600.0)
    log_startup(
        log,
        "asyncrl's modules imported (the model's classes load with the model)",
        f"rank {args.rank} ",
    )
    init_process_group(args.rank, args.world_size, device=cfg.trainer.device, store=store)
    log_startup(log, f"process group on {cfg.trainer.device} joined", f"rank {args.rank} ")
    rank = _Rank(args, cfg, tracer)
    log_startup(log, "model, optimizer and experience channel ready", f"rank {args.rank} ")
    try:
        rank.serve()
    except _Stop as exc:
        log.info("trainer rank %d stopping: %s", args.rank, exc)
    finally:
        rank.close()
        dist.destroy_process_group()
        tracer.close()


def _sender(
    args: argparse.Namespace, cfg: RunConfig, chan: ExperienceReceiver, urls: list[str]
) -> WeightTransport:
    """Rank 0's weight sender to the engines at ``urls`` (default: ``--engine-urls``),
    connected; engine-set notices on ``chan`` reach it, also mid-step."""
    urls = urls or [u for u in args.engine_urls.split(",") if u]
    wcfg = cfg.weights
    if cfg.lora.enabled:  # adapter pushes load beside the served versions: never pause
        wcfg = msgspec.structs.replace(wcfg, pause_scope="none")
    sender = make_weight_transport(
        wcfg, urls, cfg.trainer.device, cfg.rollout.pause_mode, cfg.rollout,
        _adapter_spec(cfg, args.config, args.model_path),
    )  # fmt: skip
    sender.connect()
    chan.on_notice = _notice_handler(sender)
    return sender


class _Rank:
    """A trainer rank's loop: batches in, one train step each, then (rank 0) the new
    weights pushed while the next step trains. Contract: the only place the trainer waits
    for weight sync is the optimizer-step pre-hook (the next step waits until the sender
    has read the previous push's weights); after a push that left the engines' weights
    undefined (``fatal``) the rank trains no more and waits for the controller's Shutdown."""

    def __init__(self, args: argparse.Namespace, cfg: RunConfig, tracer: Any):
        self.args, self.tracer = args, tracer
        model_path = args.model_path
        self.algorithm = make_algorithm(cfg, lambda role, c: FSDPEngine(model_path, c, role=role))
        self.engine = self.algorithm.actor  # only the actor's weights go to the engines
        xc = cfg.experience
        self.chan = ExperienceReceiver(
            [args.batch_endpoint],
            args.rank,
            args.world_size,
            credits=xc.credits,
            max_message_bytes=xc.max_message_mb << 20,
            heartbeat_s=xc.heartbeat_s,
            shm=xc.shm != "off",  # ring arrays stay valid until ack (after training)
        )
        resume_from, sync, now = _resume_from(args.resume_file)
        self.sender = _sender(args, cfg, self.chan, now) if args.rank == 0 else None
        self.state = RunState(self.algorithm, args.rank, self.chan.report)
        self.fatal = threading.Event()  # set once a push left engines undefined
        self.version = 0  # of the weights this rank holds (step + 1 of the last step trained)
        if sync:
            self.version = _resume(resume_from, self.state, self.sender, self.chan, self.fatal)
        self.pending: list[PushHandle] = []  # the last push, until the sender read the weights
        self.waits: list[float] = []
        self.failed = [0]  # failed pushes in a row
        self.engine.optimizer.register_step_pre_hook(self._before_step)
        self.t_free = time.perf_counter()  # since when the trainer has had nothing to do

    def _before_step(self, *_: object) -> None:
        if self.pending:
            with self.tracer.span("wait for weight snapshot", "trainer"):
                self.waits.append(self.pending[-1].wait_snapshot())
            self.pending.clear()

    def serve(self) -> None:
        """Until the controller's Shutdown: train each batch, save on ``Save``, re-sync on
        ``Engines``."""
        while True:
            got = self.chan.recv(timeout_s=0.1)
            if got is None:
                continue
            msg = got.msg
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, Save):
                with self.tracer.span("checkpoint", "trainer", {"step": msg.step}):
                    stall = self.state.save(msg)
                log.info("rank %d: step %d saved (stall %.3fs)", self.args.rank, msg.step, stall)
                self.t_free = time.perf_counter()  # saving is work, not idle time
            elif isinstance(msg, Engines):
                if not self.fatal.is_set():
                    weights = self.engine.named_weights()
                    _resync(self.chan, self.sender, weights, msg, self.version, self.fatal)
            elif isinstance(msg, TrainBatch) and not self.fatal.is_set():
                self._train(got, msg)  # after a fatal push: wait for the Shutdown

    def _train(self, got: Any, msg: TrainBatch) -> None:
        """Train step ``msg.step`` on ``got``'s trajectories, ack them, push the weights."""
        t0 = time.perf_counter()
        self.tracer.set_step(msg.step)
        self.tracer.complete("wait for batch", "trainer", trace.us_of(self.t_free), trace.us_of(t0))
        trajs = got.trajs
        with self.tracer.span("train step", "trainer", {"step": msg.step, "samples": len(trajs)}):
            stats = self.algorithm.train_step(msg.step, trajs)
        metrics = _metrics(stats, len(trajs), time.perf_counter() - t0)
        metrics["idle_s"] = t0 - self.t_free
        self.chan.ack(got, flush=True)  # trained on: the controller may send another batch
        self.version = msg.step + 1
        weights = self.engine.named_weights()
        if self.sender is not None and not self.fatal.is_set():
            t1 = time.perf_counter()
            with self.tracer.span("push weights", "trainer", {"version": self.version}):
                handle = self.sender.push(weights, version=self.version)
            metrics["push_call_s"] = time.perf_counter() - t1
            metrics["push_wait_before_step_s"] = self.waits.pop() if self.waits else 0.0
            self.pending.append(handle)
            handle.add_done_callback(
                _reporter(self.chan, msg.step, metrics, self.failed, self.fatal)
            )
        else:
            for _ in weights:  # collective under sharding: every rank takes part
                pass
        self.t_free = time.perf_counter()

    def close(self) -> None:
        """Wait for a checkpoint being written, close the sender and the channel."""
        self.state.wait()
        if self.sender is not None:
            self.sender.close()
        self.chan.close()


def _resume_from(path: str) -> tuple[str, bool, list[str]]:
    """The run's resume file ``{"trainer": DIR, "sync": bool, "engines": [URL, ...]}``: the
    checkpoint to restore ("": the model), whether to push the starting weights and
    announce them, and the engines' URLs now (empty: those on the command line)."""
    if not path:
        return "", False, []
    try:
        with open(path, "rb") as f:
            got = msgspec.json.decode(f.read())
    except FileNotFoundError:
        return "", False, []
    urls = [str(u) for u in got.get("engines", [])]
    return str(got.get("trainer", "")), bool(got.get("sync", False)), urls


def _resume(
    path: str, state: RunState, sender: Any, chan: ExperienceReceiver, fatal: threading.Event
) -> int:
    """Restore checkpoint ``path`` (or keep the model's weights: step 0), put the weights on
    the engines as that step's version, announce :class:`Synced` (or the push's failure);
    the step."""
    step = state.restore(path) if path else 0
    weights = state.engines["actor"].named_weights()
    if sender is None:
        for _ in weights:  # collective under sharding: every rank takes part
            pass
        return step
    t0 = time.perf_counter()
    try:
        sender.push(weights, version=step).wait()
    except WeightsUndefined as exc:  # fatal: reported; any other failure ends this rank
        _push_failed(chan, exc, fatal)
        return step
    log.info("restored step %d; engines hold its weights (%.2fs)", step, time.perf_counter() - t0)
    chan.report(Synced(step=step, version=step))
    return step


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="asyncrl trainer rank")
    p.add_argument("--config", required=True)
    p.add_argument("--model-path", required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--host", default="", help="address this rank advertises (default: config)")
    p.add_argument("--dist-addr", default="127.0.0.1", help="rank 0's rendezvous address")
    p.add_argument("--dist-port", type=int, required=True)
    p.add_argument("--batch-endpoint", required=True)
    p.add_argument("--engine-urls", default="")
    p.add_argument(
        "--resume-file",
        default="",
        help='JSON {"trainer": DIR}: start from that checkpoint (read at every (re)start)',
    )
    args = p.parse_args(argv)
    secret.load()  # the run's, from the pipe the launcher handed over (closed once read)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    run(args)


if __name__ == "__main__":
    main()
