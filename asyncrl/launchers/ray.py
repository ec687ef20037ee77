"""``cluster.backend = "ray"``: the run's processes inside thin Ray actors on a Ray cluster.

The driver (``asyncrl run``: the controller, no torch) joins the cluster and places
one :class:`~asyncrl.launchers.ray_actor.ProcActor` per process; each actor starts
the very ``python -m`` command a local run uses, on its node, so logs, signals and
data paths (HTTP to engines, ZeroMQ to trainers, the weight-sync group) are the
same. How it starts there follows ``cluster.fork_server`` as for local runs
(:func:`~asyncrl.launchers.local.fork_server_wanted`; SGLang and vLLM are always
started fresh): trainer ranks and embedded engines are forked from a fork server on
their node — the one the driver's ``ASYNCRL_FORK_SERVER`` names when that socket is
on the node, else the run's own server there (one per node, started with the first
such process placed on it: :mod:`asyncrl.launchers.ray_forks`); others are fresh
interpreters. Ray is used for placement and for finding addresses:

- engines: one placement group per engine with ``rollout.tp_size`` GPUs (CPU
  engines: ``cluster.cpus_per_engine`` CPUs), plus ``cluster.engine_resources``;
- trainers: one placement group of ``trainer.world_size`` bundles, packed per node
  (``PACK``); ranks are given in the order of (node address, GPU id), so rank 0 and
  neighbouring ranks share a node;
- ``cluster.colocate``: engine i shares trainer bundle i (and its GPU);
- every address is discovered: each actor reports its node's address and binds
  free ports there. Trainer rank 0's address is the rendezvous and the weight-sync
  master; engines bind their node's address; the driver binds the experience
  channel on its own node's address. Nothing binds ``0.0.0.0``. The trainer ranks'
  actors are placed before the engines start, so each engine accepts weight groups
  only from trainer rank 0's node (``--weight-masters``, plus its own loopback);
- tracing: the driver's ``logging.trace`` settings travel to every process (its
  environment), each writes ``RUN_DIR/trace/`` on its node, and :meth:`stop` copies
  the files of other nodes to the driver's run folder before the trace is merged;
- the run secret travels to each actor as an argument of its ``start`` call (Ray's own,
  token-authenticated channel; never in the actor's command line or runtime environment),
  and from the actor to its process through a pipe (``asyncrl.secret``).

Restarts are asyncrl's decision, never Ray's: actors are created with
``max_restarts=0``; a process that exits, or an actor lost with its node, is a
:class:`~asyncrl.launchers.base.Death` for the driver, and ``restart`` starts the
process again in its actor (same node, same port) or, when the actor is gone, in
a new actor wherever the cluster places it (a new URL).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl import secret
from asyncrl.config import RunConfig
from asyncrl.engines.rollout.factory import family
from asyncrl.engines.rollout.launcher import engine_spec, launch_command, lora_engine_args
from asyncrl.forkserver import ENV_SHARED
from asyncrl.launchers.base import Death, Placed, TrainerArgs, trainer_command
from asyncrl.launchers.local import fork_server_wanted
from asyncrl.trace import ENV_DIR, ENV_EVERY, ENV_MAX_MB

try:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as exc:  # pragma: no cover - the extra is installed for the tests
    raise ValueError(
        "cluster.backend='ray' needs Ray on the driver and every node: pip install 'asyncrl[ray]'"
    ) from exc

from asyncrl.launchers.ray_actor import ProcActor
from asyncrl.launchers.ray_forks import NodeForks

__all__ = ["RayLauncher"]

log = logging.getLogger("asyncrl.launchers.ray")

_CALL_TIMEOUT_S = 60.0  # one control call to an actor (start, poll, stop)
TRACE_ENV = (ENV_DIR, ENV_EVERY, ENV_MAX_MB)


@dataclass
class _Proc:
    """One process of the run: its actor, placement and command line."""

    name: str
    actor: Any
    pg: Any  # the placement group it was placed in (owned when ``owns_pg``)
    bundle: int
    options: dict[str, Any]
    address: str = ""
    node_id: str = ""
    shared: bool = False  # the shared fork server's socket (ASYNCRL_FORK_SERVER) is there
    gpus: list[str] = field(default_factory=list)
    args: list[str] = field(default_factory=list)
    files: dict[str, bytes] = field(default_factory=dict)
    url: str = ""
    pid: int | None = None
    owns_pg: bool = True
    dead: bool = False


class RayLauncher:
    """The :class:`~asyncrl.launchers.base.Launcher` of Ray actors (see module docstring)."""

    def __init__(self, cfg: RunConfig, run_dir: Path):
        self.cfg = cfg
        self.run_dir = Path(run_dir).resolve()
        cc = cfg.cluster
        address = cc.address or os.environ.get("RAY_ADDRESS") or "auto"
        try:
            ray.init(
                address=address,
                _node_ip_address=cc.node_address or None,
                namespace="asyncrl",
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
        except ConnectionError as exc:
            raise ValueError(
                f"cluster.backend='ray': no Ray cluster at {address!r} ({exc}); start one "
                "(`ray start --head`) or set cluster.address / RAY_ADDRESS"
            ) from None
        self._driver = ray.util.get_node_ip_address()
        self._remote = ray.remote(ProcActor)
        self.procs: dict[str, _Proc] = {}
        self._trainer_pg: Any = None
        self._models: dict[str, str] = {}  # node address -> model folder there
        self._reported: set[str] = set()
        self._dist: tuple[str, int] | None = None  # trainer rank 0's rendezvous
        self._master = ""  # trainer rank 0's node: the engines' only weight-sync master
        self._shared = os.environ.get(ENV_SHARED, "")  # a fork server shared by runs
        self._forks: NodeForks | None = None  # the run's fork server on each node
        if fork_server_wanted(cfg):
            preload = ["asyncrl.entrypoints.trainer"]
            if not cfg.rollout.urls:  # the servers' modules (the embedded engine's)
                preload += family(cfg.rollout).preload
            self._forks = NodeForks(self.run_dir, preload, self._call)

    # -- placement -----------------------------------------------------------------------
    def _gpu(self, device: str) -> bool:
        return device.startswith("cuda")

    def _place(self, bundles: list[dict[str, float]], strategy: str, what: str) -> Any:
        pg = placement_group(bundles, strategy=strategy)
        timeout = self.cfg.cluster.start_timeout_s
        try:
            ray.get(pg.ready(), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)
            raise RuntimeError(
                f"the Ray cluster could not place {what} (bundles {bundles}) within "
                f"{timeout:.0f}s; `ray status` shows what the nodes offer"
            ) from None
        return pg

    def _actor(self, pg: Any, bundle: int, options: dict[str, Any]) -> Any:
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=bundle
        )
        return self._remote.options(
            scheduling_strategy=strategy, max_restarts=0, max_concurrency=1, **options
        ).remote(str(self.run_dir))

    def _call(self, ref: Any, what: str, timeout_s: float = _CALL_TIMEOUT_S) -> Any:
        try:
            return ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"Ray actor did not answer {what} within {timeout_s:.0f}s") from None

    def _locate(self, proc: _Proc) -> None:
        info = self._call(proc.actor.node.remote(self._shared), f"{proc.name}.node()")
        proc.address, proc.gpus = info["address"], info["gpus"]
        proc.node_id, proc.shared = info["node_id"], info["shared"]

    def _model_on(self, proc: _Proc) -> str:
        """The model folder on ``proc``'s node (``model.path``; empty: the tiny default,
        built once on each node)."""
        if proc.address not in self._models:
            ref = proc.actor.model.remote(self.cfg.model.path)
            self._models[proc.address] = self._call(ref, f"{proc.name}.model()", 600.0)
        return self._models[proc.address]

    def _warm(self, proc: _Proc) -> None:
        """Start the fork server on ``proc``'s node if ``proc`` will fork from it (once per
        node; it imports while the run goes on placing and starting)."""
        if self._forks is not None and self._forked(proc.name) and not proc.shared:
            self._forks.start(proc.node_id, self._model_on(proc))

    def _forked(self, name: str) -> bool:
        """Whether process ``name`` is forked from a fork server (``cluster.fork_server``):
        trainer ranks and embedded engines; never another program (SGLang, vLLM)."""
        return self._forks is not None and (
            name.startswith("trainer") or bool(family(self.cfg.rollout).preload)
        )

    def _fork_socket(self, proc: _Proc) -> str:
        """The socket of the fork server ``proc`` forks from on its node, or "": fresh."""
        if not self._forked(proc.name):
            return ""
        if proc.shared:
            return self._shared
        assert self._forks is not None
        self._warm(proc)
        return self._forks.socket(proc.node_id, proc.address)

    def _start(self, proc: _Proc) -> None:
        for path in proc.files:  # the driver's current copy (resume.json changes per restart)
            with contextlib.suppress(OSError):
                proc.files[path] = Path(path).read_bytes()
        env = {k: os.environ[k] for k in TRACE_ENV if k in os.environ}  # trace.start_run's
        fork = self._fork_socket(proc)
        ref = proc.actor.start.remote(proc.name, proc.args, proc.files, env, secret.load(), fork)
        proc.pid = self._call(ref, f"{proc.name}.start()")
        proc.dead = False
        self._reported.discard(proc.name)

    # -- Launcher ------------------------------------------------------------------------
    def advertise_host(self) -> str:
        return self._driver

    def prepare(self, model_path: str) -> None:
        pass  # every process is a Ray actor: nothing to start ahead

    def start_engines(self, model_path: str) -> list[str]:
        del model_path  # the model is found (or built) on each node: see _model_on
        cc, rc = self.cfg.cluster, self.cfg.rollout
        self._place_trainers()  # rank 0's address: the only weight-sync master engines accept
        gpus = family(rc).gpus(rc)  # per engine
        for i in range(rc.num_engines):
            name = f"engine{i}"
            if cc.colocate:
                pg, bundle, owns = self._trainers_pg(), i % self.cfg.trainer.world_size, False
                opts: dict[str, Any] = {
                    "num_cpus": cc.cpus_per_engine,
                    "num_gpus": 0.5 if gpus else 0,
                }
            else:
                b = {"CPU": cc.cpus_per_engine, **cc.engine_resources}
                if gpus:
                    b["GPU"] = float(gpus)
                pg, bundle, owns = self._place([b], "STRICT_PACK", name), 0, True
                opts = {"num_cpus": cc.cpus_per_engine, "num_gpus": b.get("GPU", 0)}
                opts["resources"] = dict(cc.engine_resources)
            proc = _Proc(name, self._actor(pg, bundle, opts), pg, bundle, opts, owns_pg=owns)
            self.procs[name] = proc
            self._launch_engine(i, proc)
        return [self.procs[f"engine{i}"].url for i in range(rc.num_engines)]

    def _launch_engine(self, i: int, proc: _Proc) -> None:
        cfg = self.cfg
        self._locate(proc)
        port = self._call(proc.actor.free_port.remote(), f"{proc.name}.free_port()")
        path = self._model_on(proc)
        spec = engine_spec(
            cfg.rollout,
            path,
            i,
            cfg.model.dtype,
            cfg.seed,
            proc.address,
            port,
            base_gpu=0,
            weight_master=self.procs["trainer0"].address,
            lora=lora_engine_args(cfg),
        )
        proc.args, proc.url = launch_command(spec), spec.url
        self._start(proc)
        log.info("%s on %s (%s)", proc.name, proc.address, proc.url)

    def _trainers_pg(self) -> Any:
        if self._trainer_pg is None:
            cc, tc = self.cfg.cluster, self.cfg.trainer
            b = {"CPU": cc.cpus_per_trainer + (cc.cpus_per_engine if cc.colocate else 0.0)}
            b.update(cc.trainer_resources)
            if self._gpu(tc.device):
                b["GPU"] = 1.0
            self._trainer_pg = self._place([dict(b)] * tc.world_size, "PACK", "the trainer ranks")
        return self._trainer_pg

    def _place_trainers(self) -> None:
        """Create the trainer ranks' actors (once) and name them by rank: (node, GPU) order."""
        if "trainer0" in self.procs:
            return
        cc, tc = self.cfg.cluster, self.cfg.trainer
        pg = self._trainers_pg()
        gpu = 1.0 if self._gpu(tc.device) else 0.0
        opts: dict[str, Any] = {
            "num_cpus": cc.cpus_per_trainer,
            "num_gpus": gpu / 2 if cc.colocate and gpu else gpu,
        }
        if cc.trainer_resources:
            opts["resources"] = dict(cc.trainer_resources)
        placed = [
            _Proc(f"bundle{b}", self._actor(pg, b, opts), pg, b, opts, owns_pg=False)
            for b in range(tc.world_size)
        ]
        for p in placed:
            self._locate(p)
        placed.sort(key=lambda p: (p.address, [int(g) for g in p.gpus if g.isdigit()], p.bundle))
        for rank, p in enumerate(placed):  # ranks in (node, GPU) order: rank 0 first
            p.name = f"trainer{rank}"
            self.procs[p.name] = p
            self._warm(p)  # their nodes' fork servers import while the engines start
        self._master = placed[0].address

    def start_trainers(self, args: TrainerArgs) -> None:
        self._place_trainers()
        rank0 = self.procs["trainer0"]
        port = self._call(rank0.actor.free_port.remote(), "trainer0.free_port()")
        self._dist = (rank0.address, port)
        config = Path(args.config_path).resolve()
        files = {str(config): config.read_bytes()}
        resume = Path(args.resume_file).resolve() if args.resume_file else None
        if resume is not None:  # rewritten before each trainer restart: sent again then
            files[str(resume)] = resume.read_bytes()
        for rank in range(args.world_size):
            p = self.procs[f"trainer{rank}"]
            path = self._model_on(p)
            a = TrainerArgs(
                config,
                path,
                args.world_size,
                args.batch_endpoint,
                args.engine_urls,
                str(resume or ""),
            )
            p.args = trainer_command(a, rank, p.address, rank0.address, port)
            p.files = files
            self._start(p)
            log.info("%s on %s", p.name, p.address)

    def deaths(self) -> list[Death]:
        live = [p for p in self.procs.values() if not p.dead and p.name not in self._reported]
        refs = [p.actor.poll.remote() for p in live]
        out = []
        for p, ref in zip(live, refs, strict=True):
            try:
                code = ray.get(ref, timeout=_CALL_TIMEOUT_S)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                p.dead = True
                self._reported.add(p.name)
                out.append(Death(p.name, None, f"its Ray actor on {p.address} is lost: {exc}"))
                continue
            if code is not None:
                p.dead = True
                self._reported.add(p.name)
                tail = self._tail(p)
                out.append(Death(p.name, code, tail))
        return out

    def _tail(self, p: _Proc) -> str:
        try:
            return ray.get(p.actor.log_tail.remote(), timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return "(log unreachable)"

    def restart(self, name: str) -> str:
        proc = self.procs.get(name)
        if proc is None:
            raise ValueError(f"no process named {name!r} in this run ({sorted(self.procs)})")
        try:
            self._start(proc)  # the actor is alive: same node, same command, same URL
            return proc.url
        except ray.exceptions.RayActorError:
            log.warning("%s: its actor is gone; placing a new one", name)
        if proc.owns_pg:  # let the cluster place a replacement (maybe on another node)
            remove_placement_group(proc.pg)
            b = [self._bundle(proc)]
            proc.pg = self._place(b, "STRICT_PACK", name)
        proc.actor = self._actor(proc.pg, proc.bundle, proc.options)
        if name.startswith("engine"):
            self._launch_engine(int(name.removeprefix("engine")), proc)
            return proc.url
        self._locate(proc)
        self._relaunch_trainer(proc)
        return ""

    def _bundle(self, proc: _Proc) -> dict[str, float]:
        b = {"CPU": float(proc.options.get("num_cpus", 1))}
        if proc.options.get("num_gpus"):
            b["GPU"] = float(proc.options["num_gpus"])
        b.update(proc.options.get("resources", {}))
        return b

    def _relaunch_trainer(self, proc: _Proc) -> None:
        """A trainer rank in a new actor: its own address is new (rank 0's too, if it is 0)."""
        assert self._dist is not None
        args = proc.args
        i = args.index("--host")
        args[i + 1] = proc.address
        if proc.name == "trainer0":
            if proc.address != self._master:
                raise RuntimeError(
                    f"trainer rank 0 was placed again on {proc.address} (its node "
                    f"{self._master} is lost); the engines accept weight groups only from "
                    f"{self._master}: resume the run (asyncrl run --resume RUN_DIR)"
                )
            port = self._call(proc.actor.free_port.remote(), "trainer0.free_port()")
            self._dist = (proc.address, port)
            for p in self.procs.values():  # every rank meets rank 0 at its new address
                if p.name.startswith("trainer"):
                    j = p.args.index("--dist-addr")
                    p.args[j + 1], p.args[j + 3] = proc.address, str(port)
        self._start(proc)

    def _collect_traces(self) -> None:
        """Copy the trace files the run's processes wrote on other nodes into the driver's
        ``RUN_DIR/trace/`` (a file already here with the same size is the same file: a
        shared folder, or simulated nodes on one host)."""
        folder = os.environ.get(ENV_DIR)
        if not folder:
            return
        here = Path(folder) / "trace"
        refs = [p.actor.trace_files.remote() for p in self.procs.values()]
        for ref in refs:
            try:
                files = ray.get(ref, timeout=_CALL_TIMEOUT_S)
            except (ray.exceptions.RayError, ValueError) as exc:
                log.warning("trace files of an actor not collected: %s", exc)
                continue
            for name, data in files.items():
                out = here / Path(name).name
                if out.is_file() and out.stat().st_size == len(data):
                    continue
                here.mkdir(parents=True, exist_ok=True)
                tmp = out.with_suffix(".part")
                tmp.write_bytes(data)
                tmp.replace(out)

    def processes(self) -> dict[str, Placed]:
        """``here``: on the driver's node (simulated nodes on one host count as apart)."""
        return {
            n: Placed(p.pid, p.address, p.address == self._driver)
            for n, p in self.procs.items()
            if p.pid is not None and not p.dead
        }

    def stop(self, trainer_grace_s: float = 0.0) -> None:
        self._reported.update(self.procs)
        trainers = [p for n, p in self.procs.items() if n.startswith("trainer") and not p.dead]
        if trainer_grace_s > 0 and trainers:
            _wait([p.actor.wait.remote(trainer_grace_s) for p in trainers], trainer_grace_s + 5)
        _wait([p.actor.stop.remote(5.0) for p in self.procs.values()], 15.0)
        self._collect_traces()
        for p in self.procs.values():
            with contextlib.suppress(ray.exceptions.RayError, ValueError):
                ray.kill(p.actor, no_restart=True)  # its process dies with it (module docstring)
        if self._forks is not None:
            self._forks.stop()
        pgs = {id(p.pg): p.pg for p in self.procs.values() if p.owns_pg}
        if self._trainer_pg is not None:
            pgs[id(self._trainer_pg)] = self._trainer_pg
        for pg in pgs.values():
            remove_placement_group(pg)
        self.procs.clear()
        ray.shutdown()


def _wait(refs: list[Any], timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for every call in ``refs`` (their errors are ignored)."""
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)


class NodeProcess:
    """One ``python -m`` process on the Ray node whose address is ``address`` (placed with
    Ray's built-in ``node:<address>`` resource), for tools that measure a link between two
    nodes (``asyncrl bench weight-sync --ray``); forked from the fork server this process's
    ``ASYNCRL_FORK_SERVER`` names when that socket is on the node (as
    :func:`asyncrl.forkserver.spawn_shared` does on one host). Ray must be initialised by
    the caller."""

    def __init__(self, address: str, log_dir: Path):
        self.address = address
        self.pid: int | None = None  # on that node
        # a Ray actor handle, as _Proc.actor: Ray adds each method's .remote at runtime
        self._actor: Any = (
            ray.remote(ProcActor)
            .options(resources={f"node:{address}": 0.001}, num_cpus=0, max_restarts=0)
            .remote(str(Path(log_dir).resolve()))
        )

    def free_port(self) -> int:
        """A port free on the node's address a moment ago."""
        return ray.get(self._actor.free_port.remote(), timeout=_CALL_TIMEOUT_S)

    def start(self, name: str, args: list[str]) -> None:
        """Start ``python args`` there (output in ``log_dir/name.log`` on that node)."""
        shared = os.environ.get(ENV_SHARED, "")  # forked there when it is on that node
        ref = self._actor.start.remote(name, args, {}, {}, secret.load(), shared)
        self.pid = ray.get(ref, timeout=_CALL_TIMEOUT_S)

    def stop(self) -> None:
        """End the process and its actor."""
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(self._actor.stop.remote(5.0), timeout=15)
        with contextlib.suppress(ray.exceptions.RayError, ValueError):
            ray.kill(self._actor, no_restart=True)
