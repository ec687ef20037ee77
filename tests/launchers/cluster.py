"""A local Ray cluster of two simulated nodes, and who listens where (Linux /proc).

The head node is 127.0.0.2 and the worker 127.0.0.3 (Ray rewrites 127.0.0.1 to the
host's address, so other loopback addresses stand for two hosts). Each node offers
one custom resource, so a test decides which process lands where: ``engine`` on the
head, ``trainer`` on the worker — the experience channel and the weight push then
cross nodes. Token authentication is on. Every process is started by this module
in its own session and ended by pid; teardown checks none is left.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from asyncrl.forkserver import ENV_SHARED

HEAD, WORKER = "127.0.0.2", "127.0.0.3"


@dataclass
class Cluster:
    address: str
    temp_dir: Path
    env: dict[str, str]

    def run_flags(self) -> list[str]:
        """``asyncrl run`` flags that put the run on this cluster, engines on the head."""
        return [
            "--cluster.backend=ray",
            f"--cluster.address={self.address}",
            f"--cluster.node_address={HEAD}",
            '--cluster.engine_resources={"engine": 1}',
            '--cluster.trainer_resources={"trainer": 1}',
            "--cluster.start_timeout_s=60",
        ]

    def ray_ports(self, pid: int) -> set[int]:
        """Ports Ray's own gRPC server in process ``pid`` listens on (from Ray's logs)."""
        ports = set()
        for log in (self.temp_dir / "session_latest" / "logs").glob(f"python-core-*_{pid}.log"):
            ports |= {
                int(p)
                for p in re.findall(r"server started, listening on port (\d+)", log.read_text())
            }
        return ports


def _ray() -> str:
    return str(Path(sys.executable).with_name("ray"))


def _wait_port(host: str, port: int, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"ray start exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            )
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(
        f"Ray head {host}:{port} not up after {timeout_s}s:\n{log.read_text()[-3000:]}"
    )


def _wait_nodes(address: str, env: dict[str, str], n: int, timeout_s: float) -> None:
    code = (
        "import ray, time, sys\n"
        f"ray.init(address={address!r}, _node_ip_address={HEAD!r}, log_to_driver=False)\n"
        f"deadline = time.monotonic() + {timeout_s}\n"
        f"while sum(x['Alive'] for x in ray.nodes()) < {n}:\n"
        "    if time.monotonic() > deadline: sys.exit('nodes missing: ' + str(ray.nodes()))\n"
        "    time.sleep(0.2)\n"
    )
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=timeout_s + 60)


def start_cluster(free_port: int) -> tuple[Cluster, list[subprocess.Popen]]:
    tmp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray's socket paths
    env = dict(os.environ)
    env.update(
        RAY_USAGE_STATS_ENABLED="0",
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(16),
    )
    env.pop("RAY_ADDRESS", None)
    # Ray's workers inherit the daemons' environment: a run's shared fork server is the
    # driver's to name (its ASYNCRL_FORK_SERVER, passed to each actor), not the daemons'
    env.pop(ENV_SHARED, None)
    address = f"{HEAD}:{free_port}"
    common = ["--num-cpus=2", f"--temp-dir={tmp}", "--disable-usage-stats", "--block"]
    procs: list[subprocess.Popen] = []
    try:
        head_log = tmp / "head.out"
        head = [_ray(), "start", "--head", f"--node-ip-address={HEAD}", f"--port={free_port}"]
        head += ["--include-dashboard=false", '--resources={"engine": 1}', *common]
        procs.append(_popen(head, env, head_log))
        _wait_port(HEAD, free_port, procs[0], head_log, 90)
        worker = [_ray(), "start", f"--address={address}", f"--node-ip-address={WORKER}"]
        worker += ['--resources={"trainer": 1}', *common]
        procs.append(_popen(worker, env, tmp / "worker.out"))
        _wait_nodes(address, env, 2, 90)
    except BaseException:
        stop_cluster(procs, tmp)
        raise
    return Cluster(address, tmp, env), procs


def _popen(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(
            cmd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def cluster_pids(tmp: Path) -> list[int]:
    """Live processes whose command line names this cluster's temp dir (its daemons)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if str(tmp) in (d / "cmdline").read_bytes().decode(errors="replace"):
                    out.append(int(d.name))
            except OSError:
                continue
    return out


def stop_cluster(procs: list[subprocess.Popen], tmp: Path) -> None:
    """SIGTERM each ``ray start --block`` session (it ends its node), then SIGKILL what is left
    of it after 5 s (Ray's graceful stop took ~30 s here, all of it in the suite's time), and
    of the daemons it started (found by the cluster's temp dir), by pid."""
    for p in reversed(procs):
        _killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    for p in reversed(procs):
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _killpg(p.pid, signal.SIGKILL)
            p.wait(10)
    deadline = time.monotonic() + 15
    while cluster_pids(tmp) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in cluster_pids(tmp):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(tmp, ignore_errors=True)


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# -- who listens where -------------------------------------------------------------------------
def listeners() -> dict[str, tuple[str, int]]:
    """Every listening TCP socket of this host: inode -> (address, port)."""
    out: dict[str, tuple[str, int]] = {}
    for path, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            lines = Path(path).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != "0A":  # LISTEN
                continue
            ip, port = f[1].split(":")
            raw = bytes.fromhex(ip)
            if v6:
                words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]
                addr = socket.inet_ntop(socket.AF_INET6, b"".join(words))
            else:
                addr = socket.inet_ntoa(raw[::-1])
            out[f[9]] = (addr, int(port, 16))
    return out


def listening(pid: int, table: dict[str, tuple[str, int]]) -> set[tuple[str, int]]:
    """The (address, port) pairs process ``pid`` listens on."""
    found = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in table:
            found.add(table[link[8:-1]])
    return found


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def parent(pid: int) -> int | None:
    """``pid``'s parent process, None once it is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def node_fork_servers(tmp: Path) -> set[int]:
    """The fork servers the Ray launcher started on the cluster's nodes (children of its
    Ray workers) that still run."""
    ray_side = {c for p in cluster_pids(tmp) for c in descendants(p)}
    return {p for p in ray_side if "-m asyncrl.entrypoints.forkserver --listen" in cmdline(p)}


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())
