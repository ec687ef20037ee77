"""``asyncrl run``: start the engines and the trainer, drive the controller, log every step.

Process layout of a run (every child in its own session, stopped by pid)::

    asyncrl run (this process: controller, asyncio/uvloop, no torch)
      ├─ engine i   python -m asyncrl.engines.rollout.local.server   (HTTP, SGLang protocol)
      └─ trainer r  python -m asyncrl.engines.train.worker           (FSDP2, weight sender on r=0)

Three supervised loops run until ``controller.total_steps`` steps are reported:
the dispatcher (``next_batch`` -> whole groups assigned to trainer ranks ->
ZeroMQ, credit flow control), the reporter (``StepDone`` -> ``set_version`` + one
metrics line; a lost trainer rank fails the run) and the watchdog (a child
that exits early fails the run with the tail of its log).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Coroutine, Iterable
from pathlib import Path
from typing import Any

import msgspec

from asyncrl.config import RunConfig, to_dict
from asyncrl.controllers import episode as episode_api
from asyncrl.controllers.controller import Batch, Controller
from asyncrl.controllers.episode import single_turn
from asyncrl.engines.rollout.sglang import SGLangClient
from asyncrl.launchers import Launcher, TrainerArgs, make_launcher
from asyncrl.procs import python_env
from asyncrl.tasks import make_task
from asyncrl.transports.experience.assign import make_assigner
from asyncrl.transports.experience.types import ConsumerLost, Shutdown, StepDone
from asyncrl.transports.experience.zmq import ExperienceSender, bind_endpoint

__all__ = ["new_run_dir", "run_job"]

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
    from asyncrl.tasks.tiny_model import default_model_dir

    path = default_model_dir()
    if not (path / "config.json").is_file():
        print(f"building the tiny default model in {path} ...", flush=True)
        subprocess.run(
            [sys.executable, "-m", "asyncrl.tasks.tiny_model", "--out", str(path)],
            check=True,
            stdout=subprocess.DEVNULL,
            env=python_env(),
        )
    return str(path)


class _Run:
    def __init__(self, cfg: RunConfig, run_dir: Path, quiet: bool, launcher: Launcher):
        self.cfg = cfg
        self.run_dir = run_dir
        self.quiet = quiet
        self.launcher = launcher
        self.batches: dict[int, Batch] = {}
        self.t0 = time.perf_counter()
        self.t_controller = self.t0
        self.rows: list[dict[str, Any]] = []

    def start_trainers(self, model_path: str, chan: ExperienceSender, urls: list[str]) -> None:
        args = TrainerArgs(
            config_path=self.run_dir / "config.json",
            model_path=model_path,
            world_size=self.cfg.trainer.world_size,
            batch_endpoint=chan.endpoint,
            engine_urls=tuple(urls),
        )
        self.launcher.start_trainers(args)

    async def dispatch(self, ctl: Controller, chan: ExperienceSender) -> None:
        for _ in range(self.cfg.controller.total_steps):
            batch = await ctl.next_batch()
            self.batches[batch.step] = batch
            await chan.send_groups(batch.groups, step=batch.step)  # a group never splits
        await asyncio.Future()  # all sent: the run ends when the reporter has every step

    async def report(self, ctl: Controller, chan: ExperienceSender) -> None:
        done = 0
        while done < self.cfg.controller.total_steps:
            msg = await chan.recv_report()
            if isinstance(msg, Shutdown):
                raise RuntimeError(f"trainer stopped the run: {msg.reason}")
            if isinstance(msg, ConsumerLost):
                raise RuntimeError(
                    f"trainer rank {msg.rank} went silent with {len(msg.seqs)} batch(es) "
                    f"unacknowledged (episodes {msg.episode_ids[:20]})"
                )
            if not isinstance(msg, StepDone):
                continue
            await ctl.set_version(msg.version)
            self.log_step(msg, ctl)
            done += 1

    def log_step(self, msg: StepDone, ctl: Controller) -> None:
        batch = self.batches.pop(msg.step)
        m = msg.metrics
        row = {
            "step": msg.step,
            "reward_mean": batch.reward_mean,
            "staleness_max": batch.staleness_max,
            "weight_version": msg.version,
            "num_samples": len(batch.trajectories),
            "wall_s": time.perf_counter() - self.t0,
            "controller_s": time.perf_counter() - self.t_controller,
            **{k: v for k, v in m.items() if k not in ("num_samples",)},
            **{f"ctl_{k}": v for k, v in ctl.stats().items()},
            **self.cpu_times(),
        }
        self.rows.append(row)
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        if not self.quiet:
            print(
                f"step {msg.step:4d} | reward {row['reward_mean']:.3f} | staleness "
                f"{row['staleness_max']} | version {msg.version} | train {m.get('train_s', 0):.2f}s"
                f" | sync {m.get('sync_s', 0):.3f}s | {row['wall_s']:.1f}s",
                flush=True,
            )

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

    async def watchdog(self) -> None:
        while True:
            dead = await asyncio.to_thread(self.launcher.deaths)  # remote calls on a cluster
            if dead:
                raise RuntimeError("; ".join(d.describe() for d in dead))
            await asyncio.sleep(0.5)


async def _first(*coros: Coroutine[Any, Any, Any]) -> None:
    """Run until the first coroutine finishes; re-raise its error; cancel the rest."""
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
) -> list[dict[str, Any]]:
    """Run a whole training job; returns the metrics rows (also in ``run_dir/metrics.jsonl``).

    ``episode`` and ``samples`` replace the built-in task's single-turn episode and prompt
    stream; ``pin`` maps ``"engine"`` / ``"trainer"`` to the CPU cores their processes get.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_bytes(msgspec.json.encode(to_dict(cfg)))
    model_path = resolve_model(cfg)
    launcher = make_launcher(cfg, run_dir, pin)
    job = _Run(cfg, run_dir, quiet, launcher)
    xc = cfg.experience
    chan = ExperienceSender(
        cfg.trainer.world_size,
        bind_endpoint(xc, run_dir, launcher.advertise_host()),
        max_message_bytes=xc.max_message_mb << 20,
        peer_timeout_s=xc.peer_timeout_s,
        assigner=make_assigner(xc.assignment),
        shm=xc.shm,
        shm_bytes=xc.shm_mb << 20,
    )
    clients: list[SGLangClient] = []
    try:
        urls = list(cfg.rollout.urls) or launcher.start_engines(model_path)
        job.start_trainers(model_path, chan, urls)
        placed = launcher.processes()
        (run_dir / "processes.json").write_text(json.dumps({n: p.pid for n, p in placed.items()}))
        (run_dir / "placement.json").write_text(
            json.dumps({n: p.address for n, p in placed.items()})
        )
        clients = [SGLangClient(u, timeout_s=cfg.rollout.request_timeout_s) for u in urls]
        await _first(
            asyncio.gather(*(c.wait_healthy(cfg.rollout.startup_timeout_s) for c in clients)),
            job.watchdog(),
        )
        sampling: dict[str, Any] = {}
        if episode is None:
            task = make_task(cfg.task, model_path)
            sampling = {"max_new_tokens": cfg.rollout.max_new_tokens or task.max_new_tokens}
            episode = single_turn(task.reward, cfg.controller.inline_reward_s)
            samples = task.samples()
        job.t_controller = time.perf_counter()
        async with Controller(cfg, episode, clients, samples, sampling) as ctl:
            await _first(job.report(ctl, chan), job.dispatch(ctl, chan), job.watchdog())
        return job.rows
    finally:
        told = False
        try:
            await asyncio.wait_for(chan.broadcast(Shutdown(reason="run finished")), 1.0)
            told = True
        except (asyncio.TimeoutError, OSError):
            pass
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
        # told: trainers leave the weight group while the engines still answer
        await asyncio.to_thread(launcher.stop, 10.0 if told else 0.0)
        await chan.close()
