"""``asyncrl run``: start the engines and the trainer, drive the controller, log every step.

Process layout of a run (every child in its own session, stopped by pid)::

    asyncrl run    asyncrl.entrypoints.run: this module drives it (controller, uvloop, no torch)
      ├─ engine i  python -m asyncrl.entrypoints.engine     (HTTP, SGLang protocol) or SGLang
      └─ trainer r python -m asyncrl.entrypoints.trainer    (FSDP2, weight sender on r=0)

Three supervised loops run until ``controller.total_steps`` steps are reported:
the dispatcher and the reporter (``run_loops``: batches and ``Save`` requests to the
trainer ranks over ZeroMQ with credit flow control; ``StepDone`` -> ``set_version`` + one
metrics line, ``Saved`` -> commit) and the watchdog below (a trainer death starts a
recovery, a dead engine is restarted, any other death fails the run with the tail of its
log). Their state is in three pieces, each testable without processes: the checkpoint
ledger (``run_ledger``: what is sent, reported, committed, and what a recovery sends
again), the trainer supervisor (``run_supervisor``: failure, restart budget, recovery) and
the step log (``run_steplog``: metrics rows, sinks, CPU times). This module is the wiring:
it starts the processes and builds the pieces.
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
import functools
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterable
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
from asyncrl.controllers.state import ControllerState
from asyncrl.core import Batch
from asyncrl.engines.rollout.launcher import startup_timeout
from asyncrl.guard import proc_start_time, release_guard, start_guard
from asyncrl.launchers import Launcher, TrainerArgs, make_launcher
from asyncrl.preflight import preflight
from asyncrl.procs import python_env
from asyncrl.progress import Progress
from asyncrl.run_ledger import CheckpointLedger
from asyncrl.run_loops import Pipeline, RunStopped
from asyncrl.run_loops import first as _first
from asyncrl.run_steplog import StepLog
from asyncrl.run_supervisor import DiskCheckpoints, TrainerSupervisor
from asyncrl.run_supervisor import unless as _unless
from asyncrl.sinks import close_sinks, make_sinks
from asyncrl.task_factory import BuiltTask, build_task, eval_samples
from asyncrl.transports.experience.assign import make_assigner
from asyncrl.transports.experience.control import Shutdown, StepDone, Synced
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


class _Run:
    """One run's processes and pieces: the launcher and engine set, the checkpoint ledger
    (``run_ledger``), the trainer supervisor (``run_supervisor``) once the experience
    channel is bound, the step log (``run_steplog``); the dispatcher and reporter
    (``run_loops``) once the controller runs."""

    def __init__(self, cfg: RunConfig, run_dir: Path, quiet: bool, launcher: Launcher):
        self.cfg = cfg
        self.run_dir = run_dir
        self.quiet = quiet
        self.launcher = launcher
        self.engines = EngineSet(cfg, launcher, [])
        self.ledger = CheckpointLedger(cfg.controller.total_steps)
        self.resume_from: Path | None = None  # the checkpoint a resumed run starts from
        progress = None if quiet else Progress(cfg.controller.total_steps)
        self.steplog = StepLog(
            run_dir, launcher.processes, cfg.logging.trajectories, progress, quiet
        )
        self.store = DiskCheckpoints(run_dir, cfg.checkpoint.keep)
        self.sup: TrainerSupervisor | None = None  # supervise(): once the channel is bound
        self.startup_s = cfg.rollout.startup_timeout_s or 120.0  # set from the model: run_job
        self.evaluator: Evaluator | None = None  # [eval] on: asyncrl.controllers.evaluation
        self.task: BuiltTask | None = None  # run_job: built before any process starts

    def supervise(self, chan: ExperienceSender) -> TrainerSupervisor:
        """The trainer supervisor, on the bound channel (trainer deaths while starting too)."""
        final = str(self.run_dir / "final")
        self.sup = TrainerSupervisor(
            self.cfg, self.ledger, chan, self.store, self, self.steplog,
            self.engines.send_lock, final,
        )  # fmt: skip
        return self.sup

    def record_pids(self) -> None:
        """processes.json (name -> pid), placement.json (name -> node address), engines.json
        (name -> URL of every engine, started by the run or given in ``rollout.urls``; a
        restarted engine's new one) and pids.json (this host's processes with their start
        times, for the guardian). Each is replaced whole (benches and tests read them while
        an engine restarts)."""
        placed = self.launcher.processes()
        urls = {n: c.url for n, c in self.engines.clients.items()}
        for name, value in (
            ("processes.json", {n: p.pid for n, p in placed.items()}),
            ("engines.json", urls),
            ("placement.json", {n: p.address for n, p in placed.items()}),
        ):
            ckpts.write_atomic(self.run_dir / name, json.dumps(value).encode())
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

    async def restart(self, checkpoint: Path | None) -> None:
        """:class:`TrainerHost`: restart every trainer rank to restore ``checkpoint`` and sync."""
        self.write_resume_file(checkpoint, sync=True)
        for r in range(self.cfg.trainer.world_size):
            await asyncio.to_thread(self.launcher.restart, f"trainer{r}")
        self.record_pids()

    def pipeline(self, ctl: Controller, chan: ExperienceSender) -> Pipeline:
        """The dispatcher and the reporter of the running controller."""
        assert self.sup is not None
        self.sup.send_lock = self.engines.send_lock  # the engine set of the started run
        self.sup.startup_s = self.startup_s
        return Pipeline(
            self.cfg, ctl, chan, self.store, self.sup, self.steplog,
            functools.partial(self.step_done, ctl),
            functools.partial(self.engines.synced, router=ctl.router),
        )  # fmt: skip

    async def step_done(self, ctl: Controller, msg: StepDone, batch: Batch) -> None:
        """Step ``msg.step`` is trained: announce its version, log its row."""
        if msg.version > ctl.staleness.version:  # a retrained step: already announced
            await ctl.set_version(msg.version)
            if self.evaluator is not None:
                self.evaluator.version(msg.version)
        self.steplog.step(msg, batch, ctl.stats())

    def record_recovery(self, rec: dict[str, Any]) -> None:
        """One recovery (an engine back in rotation): recoveries.jsonl."""
        self.steplog.recovery(rec)

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

    async def watchdog(self, ctl: Controller | None = None, chan: Any = None) -> None:
        """Trainer deaths start a recovery; with a running controller, a dead engine is
        restarted and re-synced (``rollout.max_restarts``; see ``membership``); any other
        death fails the run."""
        assert self.sup is not None
        while True:
            for d in await asyncio.to_thread(self.launcher.deaths):  # remote calls on a cluster
                if d.name.startswith("trainer"):
                    self.sup.failure(d.describe())
                elif ctl is not None and d.name.startswith("engine"):
                    await self.engines.revive(d, ctl.router, chan)
                    self.record_pids()  # the guardian watches the new process
                else:
                    raise RuntimeError(d.describe())
            await asyncio.sleep(0.5)


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
    if state is None:  # a resume records its overrides only once it has started (_start)
        _write_config(cfg, run_dir)
    model_path = resolve_model(cfg)
    job.startup_s = startup_timeout(cfg.rollout, model_path)
    ckpts.write_atomic(run_dir / "pids.json", b"{}")  # never seen half-written
    guard = start_guard(run_dir / "pids.json")  # ends the children if this process dies
    launcher.prepare(model_path)  # the fork server imports while the rest is set up
    chan = await _open_channel(cfg, run_dir, launcher, guard)
    job.supervise(chan)
    ctl_log = _controller_log(run_dir)  # warnings and errors with tracebacks, in the run folder
    tc = cfg.logging.trace
    trace.start_run(run_dir, tc.enabled, tc.every, tc.max_mb)  # children started below trace too
    job.steplog.sinks = make_sinks(cfg, run_dir, max(job.ledger.resumed_step, 0))
    try:
        return await _drive(job, chan, model_path, state, stop_event, episode, samples)
    finally:
        await _teardown(job, chan, guard, ctl_log)


async def _open_channel(
    cfg: RunConfig, run_dir: Path, launcher: Any, guard: Any
) -> ExperienceSender:
    """The run's experience channel; if it cannot open, the launcher's processes and the
    guardian are ended before the error propagates."""
    try:
        return _experience_sender(cfg, run_dir, launcher.advertise_host())
    except BaseException:
        await asyncio.to_thread(launcher.stop)
        await asyncio.to_thread(release_guard, guard)
        raise


async def _drive(
    job: _Run,
    chan: ExperienceSender,
    model_path: str,
    state: ControllerState | None,
    stop_event: asyncio.Event | None,
    episode: episode_api.Episode | None,
    samples: Iterable[Any] | None,
) -> list[dict[str, Any]]:
    """:func:`run_job` once its channel is open: build the task, start the processes, run
    the controller (and evals) to the end; returns the metrics rows. Ending what it started
    is the caller's (:func:`_teardown`)."""
    cfg = job.cfg
    if episode is None:  # built before any process starts: a bad task fails fast
        job.task = build_task(cfg, model_path)
    else:
        job.task = BuiltTask(None, episode, samples)
    held_out = eval_samples(cfg, model_path) if cfg.eval.enabled else None
    clients = await _start(job, chan, model_path, state, stop_event)
    job.steplog.t_controller = time.perf_counter()
    t = job.task
    start = state.step if state is not None else 0
    ctl = Controller(cfg, t.episode, clients, t.samples, t.sampling, start, state, t.sample_type)
    if held_out is not None:
        job.evaluator = Evaluator(cfg, ctl, *held_out, job.steplog.eval_row)
    await _train(job, ctl, chan, state, stop_event)
    return job.steplog.rows


def _write_config(cfg: RunConfig, run_dir: Path) -> None:
    """``RUN_DIR/config.json``: the run's whole config (what the trainer ranks read)."""
    (run_dir / "config.json").write_bytes(msgspec.json.encode(to_dict(cfg)))


async def _start(
    job: _Run,
    chan: ExperienceSender,
    model_path: str,
    state: ControllerState | None,
    stop_event: asyncio.Event | None,
) -> list[Any]:
    """Start (or reach, for ``rollout.urls``) the engines and start the trainer ranks; wait
    until every engine is healthy and, on a resume, the trainer has restored ``state``'s
    step and synced the engines. Returns the engine clients. A trainer death while starting
    is the supervisor's (watchdog); a stop while starting raises :class:`RunStopped`."""
    cfg = job.cfg
    urls = list(cfg.rollout.urls) or job.launcher.start_engines(model_path)
    job.engines = EngineSet(cfg, job.launcher, urls, job.record_recovery)
    job.engines.startup_s = job.startup_s
    clients = list(job.engines.clients.values())
    if cfg.rollout.urls:  # engines running elsewhere: reachable before anything starts
        if await _unless(_reachable(clients, job.startup_s), stop_event) is None:
            raise RunStopped(None if state is None else state.step)  # a stop while waiting
    job.start_trainers(model_path, chan, urls)
    job.record_pids()
    healthy = asyncio.gather(*(c.wait_healthy(job.startup_s) for c in clients))
    started = await _unless(_first(healthy, job.watchdog()), stop_event)
    if started is not None and state is not None:
        synced = job.wait_synced(chan, state.step)
        started = await _unless(_first(synced, job.watchdog()), stop_event)
    if started is None:  # a stop while starting: nothing trained since the last checkpoint
        raise RunStopped(None if state is None else state.step)
    if state is not None:  # resumed and synced: from here on it is this config's run
        _write_config(cfg, job.run_dir)
    return clients


async def _train(
    job: _Run,
    ctl: Controller,
    chan: ExperienceSender,
    state: ControllerState | None,
    stop_event: asyncio.Event | None,
) -> None:
    """Drive the controller until every step is reported (or a stop): the dispatcher, the
    reporter and the watchdog, the gateway of an agent task served meanwhile, evals."""
    gateway = job.task.gateway if job.task is not None else None
    if gateway is not None:
        gateway.attach(ctl)
        await gateway.start()
        write_gateway_info(job.run_dir, gateway)
    async with ctl:
        if job.evaluator is not None and state is None:  # a resumed run: trained already
            job.evaluator.start()
        if state is not None:
            resumed = {"from_step": state.step, **ctl.resumed}
            (job.run_dir / "resumed.json").write_text(json.dumps(resumed))
            if not job.quiet:
                print(f"resumed: {resumed}", flush=True)
        pipeline = job.pipeline(ctl, chan)
        await _first(pipeline.report(), pipeline.dispatch(stop_event), job.watchdog(ctl, chan))
        if job.evaluator is not None:
            await job.evaluator.finish(ctl.staleness.version)


async def _teardown(
    job: _Run, chan: ExperienceSender, guard: Any, ctl_log: logging.Handler
) -> None:
    """End everything the run started, however it ends: evals, the gateway, the trainers
    (told to leave the weight group while the engines still answer), the engines, the
    channel, the trace, the sinks, the guardian and the run's log handler."""
    if job.evaluator is not None:
        await job.evaluator.close()
    if job.task is not None and job.task.gateway is not None:
        await job.task.gateway.close()
    told = False
    try:
        told = await asyncio.wait_for(chan.broadcast(Shutdown(reason="run finished")), 1.0) > 0
    except (asyncio.TimeoutError, OSError):
        pass
    await job.engines.close()
    await asyncio.to_thread(job.launcher.stop, 10.0 if told else 0.0)
    await chan.close()
    trace.end_run(job.run_dir)  # every process has ended: RUN_DIR/trace.json
    close_sinks(job.steplog.sinks)
    job.steplog.close()
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
    step, job.resume_from = found
    job.ledger.resumed_step = job.ledger.committed = step
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
