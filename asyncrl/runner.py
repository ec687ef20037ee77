"""``asyncrl run``: start the engines and the trainer, drive the controller, log every step.

Process layout of a run (every child in its own session, stopped by pid)::

    asyncrl run    asyncrl.entrypoints.run: this module drives it (controller, uvloop, no torch)
      ├─ engine i  python -m asyncrl.entrypoints.engine     (HTTP, SGLang protocol) or SGLang
      └─ trainer r python -m asyncrl.entrypoints.trainer    (FSDP2, weight sender on r=0)

Three supervised loops run until ``controller.total_steps`` steps are reported:
the dispatcher (``next_batch`` -> whole groups assigned to trainer ranks ->
ZeroMQ, credit flow control), the reporter (``StepDone`` -> ``set_version`` + one
metrics line; a lost trainer rank fails the run) and the watchdog (a child
that exits early fails the run with the tail of its log).
Checkpoints (``checkpoint.every_steps``, on a stop request, at the end): right after
the batch of step N-1 is sent, the dispatcher snapshots the controller (a consistent
cut: every step before N is with the trainer) into ``checkpoints/step-N`` and sends
``Save(N)`` behind that batch; every trainer rank saves after training step N-1;
when the trainer reports ``Saved`` the manifest commits the checkpoint and old ones
are pruned. ``resume=True`` starts from the newest complete checkpoint: the trainer
restores it and pushes its weights to the engines (``Synced``) before the controller
continues from its state. The final policy goes to ``RUN_DIR/final`` (HF format).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Awaitable, Iterable
from pathlib import Path
from typing import Any

import msgspec
import zmq

from asyncrl import secret, trace
from asyncrl.config import RunConfig, to_dict
from asyncrl.controllers import checkpoints as ckpts
from asyncrl.controllers import episode as episode_api
from asyncrl.controllers.controller import Controller
from asyncrl.controllers.evaluation import Evaluator
from asyncrl.controllers.membership import EngineSet
from asyncrl.controllers.restarts import RestartBudget
from asyncrl.controllers.state import ControllerState
from asyncrl.core import Batch, Sample
from asyncrl.engines.rollout.launcher import startup_timeout
from asyncrl.guard import proc_start_time, release_guard, start_guard
from asyncrl.launchers import Launcher, TrainerArgs, make_launcher
from asyncrl.preflight import preflight
from asyncrl.procs import python_env
from asyncrl.progress import Progress
from asyncrl.sinks import close_sinks, log_row, make_sinks, rewind_sinks
from asyncrl.task_factory import build_task, eval_samples
from asyncrl.transports.experience.assign import make_assigner
from asyncrl.transports.experience.control import (
    ConsumerLost,
    EnginesSynced,
    Save,
    Saved,
    Shutdown,
    StepDone,
    Synced,
)
from asyncrl.transports.experience.zmq_send import ExperienceSender, bind_endpoint

__all__ = ["RunStopped", "new_run_dir", "run_job"]

log = logging.getLogger("asyncrl.run")


def new_run_dir(base: str = "runs") -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i in range(1000):
        path = Path(base) / (stamp if i == 0 else f"{stamp}-{i}")
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"could not create a run folder under {base}")


def resolve_model(cfg: RunConfig) -> str:
    """The model directory: the user's, or the tiny default (built once in a child process)."""
    if cfg.model.path:
        if not (Path(cfg.model.path) / "config.json").is_file():
            raise ValueError(f"model.path {cfg.model.path!r} is not a Hugging Face model folder")
        return cfg.model.path
    from asyncrl.tasks.tiny_chat_model import default_chat_model_dir
    from asyncrl.tasks.tiny_model import default_model_dir

    chat = cfg.task.chat_model  # agents need a chat template: the tiny chat model
    path = default_chat_model_dir() if chat else default_model_dir()
    module = "asyncrl.tasks.tiny_chat_model" if chat else "asyncrl.tasks.tiny_model"
    if not (path / "config.json").is_file():
        print(f"building the tiny default model in {path} ...", flush=True)
        subprocess.run(
            [sys.executable, "-m", module, "--out", str(path)],
            check=True,
            stdout=subprocess.DEVNULL,
            env=python_env(),
        )
    return str(path)


class RunStopped(Exception):
    """The run stopped on request (a signal) after checkpointing step ``step`` (None: it
    stopped while starting, before any checkpoint of its own)."""

    def __init__(self, step: int | None):
        super().__init__(
            "stopped on request before the first step (nothing to checkpoint)"
            if step is None
            else f"stopped on request; checkpoint of step {step} written"
        )
        self.step = step


class _Run:
    def __init__(self, cfg: RunConfig, run_dir: Path, quiet: bool, launcher: Launcher):
        self.cfg = cfg
        self.run_dir = run_dir
        self.quiet = quiet
        self.launcher = launcher
        self.engines = EngineSet(cfg, launcher, [])
        self.batches: dict[int, Batch] = {}
        # set by dispatch once every step's batch is registered in ``batches`` and the final
        # checkpoint in ``saves``: not ``ctl.step``, which counts a batch the moment the
        # controller forms it, one scheduling turn before dispatch registers it
        self.all_sent = False
        self.t0 = time.perf_counter()
        self.t_controller = self.t0
        self.rows: list[dict[str, Any]] = []
        self.resume_from: Path | None = None  # the checkpoint a resumed run starts from
        self.resumed_step = -1
        self.saves: dict[int, tuple[Path, asyncio.Future]] = {}  # pending: step -> (dir, done)
        self.save_futures: dict[int, asyncio.Future] = {}  # every checkpoint asked for
        self.save_stats: list[dict[str, float]] = []
        self.sent: dict[int, Batch] = {}  # batches sent since the last committed checkpoint
        self.committed = 0  # step of the newest complete checkpoint
        # a recovery is choosing its checkpoint and re-sending from it: a commit meanwhile
        # (the dead trainer's last Saved, still queued) must not prune the batches or the
        # checkpoint it restores from
        self.recovering = False
        self.trainer_failed = asyncio.Event()
        self.trainer_restarts = 0
        tc = cfg.trainer
        self.trainer_budget = RestartBudget(tc.max_restarts, tc.restart_window_s)
        self.failed_at = 0.0
        self.synced: asyncio.Future | None = None  # a restarted trainer's Synced
        self.recoveries: list[dict[str, float]] = []
        self.sinks: list[Any] = []  # TensorBoard / W&B (asyncrl.sinks), when enabled
        self.progress = None if quiet else Progress(cfg.controller.total_steps)
        self.startup_s = cfg.rollout.startup_timeout_s or 120.0  # set from the model: run_job
        self.evaluator: Evaluator | None = None  # [eval] on: asyncrl.controllers.evaluation

    def record_pids(self) -> None:
        """processes.json (name -> pid), placement.json (name -> node address), engines.json
        (name -> URL of every engine, started by the run or given in ``rollout.urls``; a
        restarted engine's new one) and pids.json (this host's processes with their start
        times, for the guardian)."""
        placed = self.launcher.processes()
        pids = {n: p.pid for n, p in placed.items()}
        (self.run_dir / "processes.json").write_text(json.dumps(pids))
        urls = {n: c.url for n, c in self.engines.clients.items()}
        (self.run_dir / "engines.json").write_text(json.dumps(urls))
        (self.run_dir / "placement.json").write_text(
            json.dumps({n: p.address for n, p in placed.items()})
        )
        here = {n: p.pid for n, p in placed.items() if p.here}
        guarded = {name: [pid, proc_start_time(pid)] for name, pid in here.items()}
        ckpts.write_atomic(self.run_dir / "pids.json", json.dumps(guarded).encode())

    def write_resume_file(
        self, checkpoint: Path | None, sync: bool, engines: list[str] | None = None
    ) -> Path:
        """What a trainer rank restores when it (re)starts: ``checkpoint`` (None: the model);
        ``sync``: it pushes those weights to the engines and reports Synced first;
        ``engines``: the engine URLs now (default: the run's current set; an engine
        restarted on another Ray node has a new URL)."""
        path = self.run_dir / "resume.json"
        trainer = str(checkpoint / "trainer") if checkpoint is not None else ""
        urls = self.engines.urls() if engines is None else engines
        got = {"trainer": trainer, "sync": sync, "engines": urls}
        ckpts.write_atomic(path, json.dumps(got).encode())
        return path

    def start_trainers(self, model_path: str, chan: ExperienceSender, urls: list[str]) -> None:
        args = TrainerArgs(
            config_path=self.run_dir / "config.json",
            model_path=model_path,
            world_size=self.cfg.trainer.world_size,
            batch_endpoint=chan.endpoint,
            engine_urls=tuple(urls),
            resume_file=str(
                self.write_resume_file(self.resume_from, self.resume_from is not None, urls)
            ),
        )
        self.launcher.start_trainers(args)

    async def dispatch(
        self, ctl: Controller, chan: ExperienceSender, stop_event: asyncio.Event | None = None
    ) -> None:
        # a stop aborts the requests in flight at once, not when this loop next looks
        stopper = asyncio.ensure_future(self._interrupt_on(ctl, stop_event))
        try:
            await self._dispatch(ctl, chan, stop_event, stopper)
        finally:
            stopper.cancel()
            await asyncio.gather(stopper, return_exceptions=True)

    async def _interrupt_on(self, ctl: Controller, stop_event: asyncio.Event | None) -> bool:
        """When ``stop_event`` is set: :meth:`Controller.interrupt` (True: every request in
        flight answered the abort in time). Never returns without a stop event."""
        if stop_event is None:
            await asyncio.get_running_loop().create_future()
        assert stop_event is not None
        await stop_event.wait()
        return await ctl.interrupt(self.cfg.rollout.request_timeout_s)

    async def _dispatch(
        self,
        ctl: Controller,
        chan: ExperienceSender,
        stop_event: asyncio.Event | None,
        stopper: asyncio.Future[bool],
    ) -> None:
        total, every = self.cfg.controller.total_steps, self.cfg.checkpoint.every_steps
        failed = self.trainer_failed
        while ctl.step < total:
            batch = await _unless(ctl.next_batch(), stop_event, failed)
            if batch is None and failed.is_set() and not _is_set(stop_event):
                await self.recover(chan)
                continue
            if batch is None:  # stop requested: checkpoint what was handed out, then stop
                if failed.is_set():
                    raise RunStopped(self.committed)
                # tokens of requests in flight into their episodes' journals: kept on resume
                if not await stopper:
                    log.warning("stop: requests in flight did not answer the abort in time; "
                                "their tokens will be generated again on resume")  # fmt: skip
                await self.checkpoint(ctl, chan, wait=True)
                raise RunStopped(ctl.step)
            self.batches[batch.step] = self.sent[batch.step] = batch
            # a group never splits; a trainer failure meanwhile: recover() sends it again
            with trace.get().span("send batch", "controller", {"step": batch.step}):
                async with self.engines.send_lock:  # no Engines message inside one step's
                    sent = await _unless(chan.send_groups(batch.groups, step=batch.step), failed)
            if not sent:
                await self.recover(chan)
            if every and ctl.step % every == 0 and ctl.step < total:
                await self.checkpoint(ctl, chan)
        while failed.is_set():
            await self.recover(chan)
        self.all_sent = True  # checkpoint() registers the final save before its first await
        await self.checkpoint(ctl, chan, final=True)
        # all sent: the run ends when the reporter has every step (a stop waits for the end)
        while await _unless(asyncio.get_running_loop().create_future(), stop_event, failed) is None:
            if _is_set(stop_event):
                break
            await self.recover(chan)
        await asyncio.wait_for(self.save_futures[total], self.cfg.checkpoint.timeout_s)
        raise RunStopped(total)

    async def checkpoint(
        self, ctl: Controller, chan: ExperienceSender, wait: bool = False, final: bool = False
    ) -> None:
        """Checkpoint the run at ``ctl.step`` (every earlier step handed to the trainer)."""
        step = ctl.step
        if step in self.save_futures or step == self.resumed_step:
            if wait and step in self.save_futures:  # a stop right after a periodic checkpoint
                await asyncio.wait_for(
                    asyncio.shield(self.save_futures[step]), self.cfg.checkpoint.timeout_s
                )
            return
        folder = ckpts.checkpoint_dir(self.run_dir, step)
        data = msgspec.msgpack.encode(ctl.snapshot())  # one instant: no await before this
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        self.saves[step] = (folder, done)
        self.save_futures[step] = done
        if folder.exists():  # an unfinished checkpoint of a run that died: start clean
            await asyncio.to_thread(shutil.rmtree, folder)
        (folder / "trainer").mkdir(parents=True)
        await asyncio.to_thread(ckpts.write_atomic, folder / ckpts.CONTROLLER_FILE, data)
        export = ""
        if final:
            export = str(self.run_dir / "final")
        elif self.cfg.checkpoint.export_hf:
            export = str(folder / "hf")
        async with self.engines.send_lock:  # every rank sees Save and Engines in one order
            await chan.broadcast(Save(step=step, checkpoint=str(folder / "trainer"), export=export))
        if wait:
            await asyncio.wait_for(done, self.cfg.checkpoint.timeout_s)

    async def saved(self, msg: Saved) -> None:
        """The trainer's part of checkpoint ``msg.step`` is written: commit and prune."""
        if msg.step not in self.saves:
            return  # a report of a checkpoint already committed
        folder, done = self.saves.pop(msg.step)
        if msg.error:
            done.set_exception(RuntimeError(f"trainer failed checkpoint {folder}: {msg.error}"))
            raise RuntimeError(f"trainer failed to write checkpoint {folder}: {msg.error}")
        t0 = time.perf_counter()
        await asyncio.to_thread(ckpts.write_manifest, folder, msg.step)
        if not self.recovering:  # (else the restored checkpoint could go: pruned later)
            await asyncio.to_thread(ckpts.prune, self.run_dir, self.cfg.checkpoint.keep)
        self.committed = max(self.committed, msg.step)
        if not self.recovering:  # (looked at again: a recovery may have begun meanwhile)
            for step in [s for s in self.sent if s < self.committed]:
                del self.sent[step]  # never sent again: the checkpoint holds their training
        stats = {"step": msg.step, "stall_s": msg.stall_s, "save_s": msg.save_s}
        stats["manifest_s"] = time.perf_counter() - t0
        self.save_stats.append(stats)
        with open(self.run_dir / "checkpoints.jsonl", "a") as f:
            f.write(json.dumps(stats) + "\n")
        if not self.quiet:
            print(
                f"checkpoint {folder} (trainer stall {msg.stall_s:.3f}s, {msg.save_s:.2f}s)",
                flush=True,
            )
        done.set_result(stats)

    async def report(self, ctl: Controller, chan: ExperienceSender) -> None:
        while not self.all_sent or self.batches or self.saves:
            timeout = None
            if self.all_sent and not self.batches and not self.trainer_failed.is_set():
                timeout = self.cfg.checkpoint.timeout_s  # only checkpoints are awaited
            try:
                msg = await asyncio.wait_for(chan.recv_report(), timeout)
            except asyncio.TimeoutError:
                raise RuntimeError(
                    f"trainer did not report checkpoint(s) {sorted(self.saves)} within "
                    f"checkpoint.timeout_s={timeout}s"
                ) from None
            if isinstance(msg, Shutdown) and msg.fatal:  # no restart can repair it
                raise RuntimeError(f"trainer stopped the run: {msg.reason}")
            if isinstance(msg, Shutdown):
                self.trainer_failure(f"trainer stopped the run: {msg.reason}")
            elif isinstance(msg, ConsumerLost):
                self.trainer_failure(
                    f"trainer rank {msg.rank} went silent with {len(msg.seqs)} batch(es) "
                    f"unacknowledged (episodes {msg.episode_ids[:20]})"
                )
            elif isinstance(msg, Synced):
                if self.synced is not None and not self.synced.done():
                    self.synced.set_result(msg)
            elif isinstance(msg, Saved):
                await self.saved(msg)
            elif isinstance(msg, EnginesSynced):
                self.engines.synced(msg, ctl.router)
            elif isinstance(msg, StepDone) and msg.step in self.batches:
                trace.get().instant("step done", "controller", {"step": msg.step})
                if msg.version > ctl.staleness.version:  # a retrained step: already announced
                    await ctl.set_version(msg.version)
                    if self.evaluator is not None:
                        self.evaluator.version(msg.version)
                self.log_step(msg, ctl)

    def trainer_failure(self, why: str) -> None:
        """A trainer rank died or failed: recover (restart every rank from the last
        checkpoint) while restarts remain, else fail the run with ``why``."""
        if self.trainer_failed.is_set():
            return  # this failure's recovery is already asked for
        if not self.trainer_budget.take(time.monotonic()):
            tc = self.cfg.trainer
            raise RuntimeError(
                f"{why} (trainer.max_restarts={tc.max_restarts} per "
                f"trainer.restart_window_s={tc.restart_window_s:g} used up: "
                f"{self.trainer_budget.describe()})"
            )
        log.warning("%s: restarting the trainer from the last checkpoint", why)
        self.failed_at = time.perf_counter()
        self.trainer_failed.set()

    async def recover(self, chan: ExperienceSender) -> None:
        """Restart every trainer rank from the newest complete checkpoint (step n), then send
        again, in order, every batch from step n on (and the Save requests among them): what
        the lost steps had trained is trained once more from the restored state."""
        self.trainer_failed.clear()
        self.trainer_restarts += 1
        self.recovering = True  # until every batch from n on is sent again (below)
        t0 = time.perf_counter()
        found = await asyncio.to_thread(ckpts.latest_checkpoint, self.run_dir)
        n, folder = found if found is not None else (0, None)
        for r in range(self.cfg.trainer.world_size):
            chan.forget(r)
        self.write_resume_file(folder, sync=True)
        self.synced = asyncio.get_running_loop().create_future()
        for r in range(self.cfg.trainer.world_size):
            await asyncio.to_thread(self.launcher.restart, f"trainer{r}")
        self.record_pids()
        timeout = self.startup_s + self.cfg.weights.timeout_s
        if await _unless(asyncio.wait_for(self.synced, timeout), self.trainer_failed) is None:
            return  # it failed again: the caller recovers again (or gives up)
        await chan.wait_peers(timeout)
        self.committed = n
        redo = sorted(step for step in self.sent if step >= n)
        self.rows = [r for r in self.rows if r["step"] < n]
        await asyncio.to_thread(ckpts.truncate_metrics, self.run_dir / "metrics.jsonl", n)
        await asyncio.to_thread(ckpts.truncate_metrics, self.run_dir / "trajectories.jsonl", n)
        rewind_sinks(self.sinks, n)
        for step in redo:
            batch = self.batches[step] = self.sent[step]
            async with self.engines.send_lock:
                sent = await _unless(chan.send_groups(batch.groups, step=step), self.trainer_failed)
            if not sent:
                return
            if step + 1 in self.saves:
                await self.resave(chan, step + 1)
        self.recovering = False
        self.recoveries.append(
            {
                "restart": self.trainer_restarts,
                "from_step": n,
                "steps_redone": len(redo),
                "detect_to_sent_s": time.perf_counter() - self.failed_at,
                "restart_s": time.perf_counter() - t0,
            }
        )
        self.record_recovery(self.recoveries[-1])
        log.warning("trainer restarted from step %d; %d step(s) sent again", n, len(redo))

    def record_recovery(self, rec: dict[str, Any]) -> None:
        """One recovery (a trainer restart, an engine back in rotation): recoveries.jsonl."""
        with open(self.run_dir / "recoveries.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")

    async def resave(self, chan: ExperienceSender, step: int) -> None:
        """Ask the restarted trainer again for checkpoint ``step`` (its old attempt died)."""
        folder, _ = self.saves[step]
        await asyncio.to_thread(shutil.rmtree, folder / "trainer", True)
        (folder / "trainer").mkdir(parents=True)
        export = str(self.run_dir / "final") if step == self.cfg.controller.total_steps else ""
        async with self.engines.send_lock:  # every rank sees Save and Engines in one order
            await chan.broadcast(Save(step=step, checkpoint=str(folder / "trainer"), export=export))

    async def wait_synced(self, chan: ExperienceSender, step: int) -> None:
        """A resumed trainer restored ``step`` and put its weights on the engines."""
        timeout = self.startup_s + self.cfg.weights.timeout_s
        try:
            msg = await asyncio.wait_for(chan.recv_report(), timeout)
        except asyncio.TimeoutError:
            raise RuntimeError(
                f"trainer rank 0 did not restore checkpoint step {step} and sync the engines "
                f"within {timeout:.0f}s"
            ) from None
        if isinstance(msg, Shutdown):
            raise RuntimeError(f"trainer stopped the run while resuming: {msg.reason}")
        if not (isinstance(msg, Synced) and msg.step == step):
            raise RuntimeError(f"expected the trainer's Synced(step={step}), got {msg!r}")

    def log_step(self, msg: StepDone, ctl: Controller) -> None:
        batch = self.batches.pop(msg.step)  # the caller checked it is there
        m = msg.metrics
        stale = [batch.step - t.min_version for t in batch.trajectories]
        row = {
            "step": msg.step,
            "reward_mean": batch.reward_mean,
            "staleness_max": batch.staleness_max,
            "staleness_mean": sum(stale) / len(stale),
            "staleness_hist": [stale.count(k) for k in range(max(stale) + 1)],
            "response_tokens": sum(len(t.response_ids) for t in batch.trajectories),
            "weight_version": msg.version,
            "num_samples": len(batch.trajectories),
            "filtered_groups": batch.filtered,
            "sample_ids": [_sample_id(x) for x in batch.samples],
            "wall_s": time.perf_counter() - self.t0,
            "controller_s": time.perf_counter() - self.t_controller,
            **{k: v for k, v in m.items() if k not in ("num_samples",)},
            **{f"ctl_{k}": v for k, v in ctl.stats().items()},
            **self.cpu_times(),
        }
        self.rows.append(row)
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.cfg.logging.trajectories:
            write_trajectories(self.run_dir / "trajectories.jsonl", batch)
        log_row(self.sinks, row)
        if self.progress is not None:
            self.progress.update(row)

    def eval_row(self, row: dict[str, Any]) -> None:
        """An eval's metrics: one metrics.jsonl row (``step`` = the version asked for); the
        sinks get it at the newest step logged (W&B takes steps in order only)."""
        row["wall_s"] = time.perf_counter() - self.t0
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        newest = max([row["step"], *(r["step"] for r in self.rows[-1:])])
        log_row(self.sinks, {**row, "step": newest})
        if self.progress is not None:
            self.progress.eval(row)

    def cpu_times(self) -> dict[str, float]:
        """CPU seconds used so far by this process and each child (Linux /proc; else empty)."""
        out = {"cpu_controller_s": time.process_time()}
        tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        for name, placed in self.launcher.processes().items():
            if not placed.here:
                continue
            try:
                with open(f"/proc/{placed.pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[f"cpu_{name}_s"] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        return out

    async def watchdog(self, ctl: Controller | None = None, chan: Any = None) -> None:
        """Trainer deaths start a recovery; with a running controller, a dead engine is
        restarted and re-synced (``rollout.max_restarts``; see ``membership``); any other
        death fails the run."""
        while True:
            for d in await asyncio.to_thread(self.launcher.deaths):  # remote calls on a cluster
                if d.name.startswith("trainer"):
                    self.trainer_failure(d.describe())
                elif ctl is not None and d.name.startswith("engine"):
                    await self.engines.revive(d, ctl.router, chan)
                    self.record_pids()  # the guardian watches the new process
                else:
                    raise RuntimeError(d.describe())
            await asyncio.sleep(0.5)


def _sample_id(sample: Any) -> Any:
    """A sample's ``id`` (None if it has none): an attribute, or a key of a sample restored
    from a checkpoint as a plain dict (an agent run's: its queue holds two kinds)."""
    if isinstance(sample, dict):
        return sample.get("id")
    return getattr(sample, "id", None)


def write_gateway_info(run_dir: Path, gateway: Any) -> None:
    """``RUN_DIR/gateway.json``: the gateway's ``url`` and where its key is: ``key_file``
    (``RUN_DIR/gateway.key``, mode 0600, the key derived from the run secret; or the user's
    ``gateway.api_key_file``) or ``key_env`` (the user's ``gateway.api_key_env``)."""
    gc = gateway.cfg
    info: dict[str, str] = {"url": gateway.url}
    if gc.api_key_env:
        info["key_env"] = gc.api_key_env
    elif gc.api_key_file:
        info["key_file"] = str(Path(gc.api_key_file).expanduser().resolve())
    else:
        path = run_dir / "gateway.key"
        tmp = run_dir / f".gateway.key.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never readable by others
        with os.fdopen(fd, "w") as f:
            f.write(gateway.api_key + "\n")
        os.replace(tmp, path)
        info["key_file"] = str(path.resolve())
    (run_dir / "gateway.json").write_text(json.dumps(info))


def write_trajectories(path: Path, batch: Batch) -> None:
    """Every trajectory of ``batch`` as one JSON line: step, session (gateway sessions;
    else null), episode, reward, and per token (prompt then response, one length):
    token_ids, loss_mask, logprobs, versions (prompt tokens: mask 0, log-prob 0, the
    version of the first response token)."""
    with open(path, "a") as f:
        for t in batch.trajectories:
            n = len(t.prompt_ids)
            first = int(t.versions[0]) if len(t.versions) else 0
            row = {
                "step": batch.step,
                "session": t.metadata.get("session"),
                "episode": t.episode_id,
                "group": t.group_id,
                "reward": t.reward,
                "token_ids": [*t.prompt_ids.tolist(), *t.response_ids.tolist()],
                "loss_mask": [0] * n + t.loss_mask.tolist(),
                "logprobs": [0.0] * n + t.behav_logprobs.tolist(),
                "versions": [first] * n + t.versions.tolist(),
            }
            f.write(json.dumps(row) + "\n")


def _is_set(event: asyncio.Event | None) -> bool:
    return event is not None and event.is_set()


async def _unless(coro: Awaitable[Any], *events: asyncio.Event | None) -> Any:
    """``await coro``, unless one of ``events`` is set first (then the coroutine is cancelled
    and None returned; a result it produced meanwhile is still returned). A coroutine that
    returns None itself reads as True, so callers can tell "done" from "interrupted"."""
    watched = [e for e in events if e is not None]
    if any(e.is_set() for e in watched):
        if asyncio.iscoroutine(coro):
            coro.close()
        return None
    task = asyncio.ensure_future(coro)
    stoppers = [asyncio.ensure_future(e.wait()) for e in watched]
    try:
        await asyncio.wait({task, *stoppers}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in stoppers:
            t.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, *stoppers, return_exceptions=True)
    if task.cancelled():
        return None
    result = task.result()
    return True if result is None else result


async def _first(*coros: Awaitable[Any]) -> None:
    """Run until the first coroutine (or future) finishes; re-raise its error; cancel the rest."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            t.result()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run_job(
    cfg: RunConfig,
    run_dir: Path,
    quiet: bool = False,
    episode: episode_api.Episode | None = None,
    samples: Iterable[Any] | None = None,
    pin: dict[str, set[int]] | None = None,
    resume: bool = False,
    stop_event: asyncio.Event | None = None,
) -> list[dict[str, Any]]:
    """Run a whole training job; returns the metrics rows (also in ``run_dir/metrics.jsonl``).

    ``episode`` and ``samples`` replace the built-in task's single-turn episode and prompt
    stream (``samples`` must then be the same deterministic stream on resume); ``pin``
    maps ``"engine"`` / ``"trainer"`` to the CPU cores their processes get. ``resume``:
    continue from the newest complete checkpoint in ``run_dir``. ``stop_event`` set:
    checkpoint and raise :class:`RunStopped`.
    """
    preflight(cfg)
    if cfg.cluster.secret_file:
        secret.use(secret.read_file(cfg.cluster.secret_file))
    secret.load()  # the run secret: handed to every process the launcher starts
    run_dir.mkdir(parents=True, exist_ok=True)
    launcher = make_launcher(cfg, run_dir, pin)
    job = _Run(cfg, run_dir, quiet, launcher)
    state = _resume_state(job) if resume else None
    if state is None:  # a resume records its overrides only once it has started (below)
        (run_dir / "config.json").write_bytes(msgspec.json.encode(to_dict(cfg)))
    model_path = resolve_model(cfg)
    job.startup_s = startup_timeout(cfg.rollout, model_path)
    (run_dir / "pids.json").write_text("{}")
    guard = start_guard(run_dir / "pids.json")  # ends the children if this process dies
    launcher.prepare(model_path)  # the fork server imports while the rest is set up
    try:
        chan = _experience_sender(cfg, run_dir, launcher.advertise_host())
    except BaseException:
        await asyncio.to_thread(launcher.stop)
        await asyncio.to_thread(release_guard, guard)
        raise
    ctl_log = _controller_log(run_dir)  # warnings and errors with tracebacks, in the run folder
    tc = cfg.logging.trace
    trace.start_run(run_dir, tc.enabled, tc.every, tc.max_mb)  # children started below trace too
    job.sinks = make_sinks(cfg, run_dir, max(job.resumed_step, 0))
    gateway = None
    sample_type: Any = Sample
    try:
        sampling: dict[str, Any] = {}
        if episode is None:  # built before any process starts: a bad task fails fast
            built = build_task(cfg, model_path)
            episode, samples, sampling = built.episode, built.samples, built.sampling
            gateway, sample_type = built.gateway, built.sample_type
        held_out = eval_samples(cfg, model_path) if cfg.eval.enabled else None
        urls = list(cfg.rollout.urls) or launcher.start_engines(model_path)
        job.engines = EngineSet(cfg, launcher, urls, job.record_recovery)
        job.engines.startup_s = job.startup_s
        clients = list(job.engines.clients.values())
        if cfg.rollout.urls:  # engines running elsewhere: reachable before anything starts
            await _reachable(clients, job.startup_s)
        job.start_trainers(model_path, chan, urls)
        job.record_pids()
        started = await _unless(
            _first(
                asyncio.gather(*(c.wait_healthy(job.startup_s) for c in clients)),
                job.watchdog(),
            ),
            stop_event,
        )
        if started is not None and state is not None:
            started = await _unless(
                _first(job.wait_synced(chan, state.step), job.watchdog()), stop_event
            )
        if started is None:  # a stop while starting: nothing trained since the last checkpoint
            raise RunStopped(None if state is None else state.step)
        if state is not None:  # resumed and synced: from here on it is this config's run
            (run_dir / "config.json").write_bytes(msgspec.json.encode(to_dict(cfg)))
        job.t_controller = time.perf_counter()
        start = state.step if state is not None else 0
        ctl = Controller(cfg, episode, clients, samples, sampling, start, state, sample_type)
        if gateway is not None:
            gateway.attach(ctl)
            await gateway.start()
            write_gateway_info(run_dir, gateway)
        if held_out is not None:
            job.evaluator = Evaluator(cfg, ctl, *held_out, job.eval_row)
        async with ctl:
            if job.evaluator is not None and state is None:  # a resumed run: trained already
                job.evaluator.start()
            if state is not None:
                resumed = {"from_step": state.step, **ctl.resumed}
                (run_dir / "resumed.json").write_text(json.dumps(resumed))
                if not quiet:
                    print(f"resumed: {resumed}", flush=True)
            await _first(
                job.report(ctl, chan),
                job.dispatch(ctl, chan, stop_event),
                job.watchdog(ctl, chan),
            )
            if job.evaluator is not None:
                await job.evaluator.finish(ctl.staleness.version)
        return job.rows
    finally:
        if job.evaluator is not None:
            await job.evaluator.close()
        if gateway is not None:
            await gateway.close()
        told = False
        try:
            told = await asyncio.wait_for(chan.broadcast(Shutdown(reason="run finished")), 1.0) > 0
        except (asyncio.TimeoutError, OSError):
            pass
        await job.engines.close()
        # told: trainers leave the weight group while the engines still answer
        await asyncio.to_thread(launcher.stop, 10.0 if told else 0.0)
        await chan.close()
        trace.end_run(run_dir)  # every process has ended: RUN_DIR/trace.json
        close_sinks(job.sinks)
        if job.progress is not None:
            job.progress.close()
        await asyncio.to_thread(release_guard, guard)
        logging.getLogger("asyncrl").removeHandler(ctl_log)
        ctl_log.close()


def _controller_log(run_dir: Path) -> logging.Handler:
    """``RUN_DIR/controller.log``: what the controller process logs at WARNING and above
    (failed groups, at a bounded rate; a task's or reward function's traceback)."""
    handler = logging.FileHandler(run_dir / "controller.log")
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.getLogger("asyncrl").addHandler(handler)
    return handler


async def _reachable(clients: list[Any], timeout_s: float) -> None:
    """Every engine of ``rollout.urls`` answers within ``timeout_s`` (else ValueError naming
    the URLs that did not)."""
    got = await asyncio.gather(
        *(c.wait_healthy(timeout_s) for c in clients), return_exceptions=True
    )
    if bad := [str(e) for e in got if isinstance(e, BaseException)]:
        raise ValueError(
            f"rollout.urls (rollout.startup_timeout_s={timeout_s:g}): " + "; ".join(bad)
        )


def _experience_sender(cfg: RunConfig, run_dir: Path, host: str | None) -> ExperienceSender:
    """The controller's end of the experience channel, bound; a bind failure is a
    ValueError naming the key that chose the address."""
    xc = cfg.experience
    endpoint = bind_endpoint(xc, run_dir, host)
    try:
        return ExperienceSender(
            cfg.trainer.world_size,
            endpoint,
            max_message_bytes=xc.max_message_mb << 20,
            peer_timeout_s=xc.peer_timeout_s,
            assigner=make_assigner(xc.assignment),
            shm=xc.shm,
            shm_bytes=xc.shm_mb << 20,
        )
    except zmq.ZMQError as exc:
        key = "experience.endpoint" if xc.endpoint else f"experience.host ({endpoint})"
        raise ValueError(f"{key}: cannot bind the experience channel there: {exc}") from None


def _resume_state(job: _Run) -> ControllerState:
    """Find the newest complete checkpoint of the run; drop the metrics rows after it."""
    found = ckpts.latest_checkpoint(job.run_dir)
    if found is None:
        raise ValueError(f"--resume {job.run_dir}: no complete checkpoint in its checkpoints/")
    job.resumed_step, job.resume_from = found
    job.committed = job.resumed_step
    state = ckpts.load_controller_state(job.resume_from)
    total = job.cfg.controller.total_steps
    if total <= state.step:
        raise ValueError(
            f"--resume {job.run_dir}: nothing to do: its checkpoint is at step {state.step} and "
            f"controller.total_steps is {total} (pass --controller.total_steps=N, N > "
            f"{state.step}, to train further)"
        )
    dropped = ckpts.truncate_metrics(job.run_dir / "metrics.jsonl", state.step)
    ckpts.truncate_metrics(job.run_dir / "trajectories.jsonl", state.step)  # retrained: again
    if not job.quiet:
        print(
            f"resuming from {job.resume_from}: step {state.step}, {len(state.ready)} ready "
            f"and {len(state.running)} running groups ({state.kept_tokens} tokens kept); "
            f"{dropped} metrics rows after it dropped",
            flush=True,
        )
    return state
