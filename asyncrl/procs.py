"""Child processes and ports: start, health-wait and stop the processes of a run by pid.

Every child starts in its own session (process group), so stopping it ends
its whole tree. ``stop`` sends SIGTERM, waits, then SIGKILLs what is left.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import random
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

__all__ = [
    "PORT_HOLD_S",
    "Proc",
    "Spawner",
    "cpu_seconds",
    "descendants",
    "die_with_parent_fn",
    "finish",
    "free_port",
    "log_startup",
    "pid_alive",
    "private_folder",
    "proc_stat",
    "process_age_s",
    "python_env",
    "rss_bytes",
    "spawn",
    "stop",
]


class Proc(Protocol):
    """What the launchers use of a started process: ``subprocess.Popen`` or a process forked
    by the run's fork server (:class:`asyncrl.forkserver.Forked`)."""

    pid: int

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


Spawner = Callable[[Sequence[str], "Path | None", dict[str, str]], Proc]
"""Starts ``python ARGS`` with its output to a log file and the given environment (the
launchers' seam: :func:`spawn`, or the run's fork server)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago, drawn at random below the kernel's
    ephemeral range (``net.ipv4.ip_local_port_range``) where there is room: the ports the
    kernel hands out itself — a ``bind`` to port 0 (ZeroMQ's and Gloo's random binds, this
    process's neighbours') and every outgoing connection's own end — all come from that
    range, so none of them can take the port between this call and the caller's bind (a
    server that starts slowly, e.g. an engine loading its model). Falls back to a port from
    the kernel when nothing below the range is free.

    A port handed out is *reserved* for :data:`PORT_HOLD_S` in this user's registry
    (:func:`private_folder` ``/ports``, under ``flock``): no other ``free_port`` call on this
    host, in any process of this user, hands it out again meanwhile, so two runs (or two
    servers of one test session) starting side by side cannot both be given a port that
    neither has bound yet — the loser would fail to bind, or its health check be answered by
    the other's server. Without a usable registry (no private temp folder) ports are drawn
    as before, unreserved."""
    low = _ephemeral_low()
    with _PortRegistry.open() as held:
        for _ in range(64 if low > _FIXED_FLOOR + 1024 else 0):
            port = random.randrange(_FIXED_FLOOR, low)
            if port in held:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            held.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


PORT_HOLD_S = 300.0
"""How long a port handed out by :func:`free_port` stays reserved (its server has bound it by
then, or given up: a bound port is refused by the bind check anyway)."""


def private_folder() -> Path:
    """This user's folder on this host for asyncrl's sockets and registries
    (``$TMPDIR/asyncrl-UID``, created mode 0700); ValueError when it exists but is not this
    user's alone (someone else's, a link, open to others)."""
    folder = Path(tempfile.gettempdir()) / f"asyncrl-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    st = folder.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ValueError(f"{folder} is not a folder of this user's alone (mode 0700)")
    return folder


class _PortRegistry:
    """Ports reserved by :func:`free_port` on this host: ``PORT EXPIRY`` lines in
    ``private_folder()/ports``, read and rewritten under an exclusive ``flock`` (held from
    :meth:`open` to the end of the ``with``), expired lines dropped on each rewrite."""

    def __init__(self, fd: int | None):
        self.fd = fd
        self.held: dict[int, float] = {}
        self.changed = False
        if fd is not None:
            now = time.time()
            text = os.pread(fd, 1 << 20, 0).decode(errors="replace")
            for line in text.splitlines():
                parts = line.split()
                with contextlib.suppress(ValueError, IndexError):
                    if float(parts[1]) > now:
                        self.held[int(parts[0])] = float(parts[1])

    @classmethod
    @contextlib.contextmanager
    def open(cls) -> Iterator[_PortRegistry]:
        try:
            fd: int | None = os.open(private_folder() / "ports", os.O_RDWR | os.O_CREAT, 0o600)
        except (OSError, ValueError):
            fd = None  # no private folder here: ports unreserved
        try:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            registry = cls(fd)
            yield registry
            registry._write()
        finally:
            if fd is not None:
                os.close(fd)  # releases the lock

    def __contains__(self, port: int) -> bool:
        return port in self.held

    def add(self, port: int) -> None:
        self.held[port] = time.time() + PORT_HOLD_S
        self.changed = True

    def _write(self) -> None:
        if self.fd is None or not self.changed:
            return
        data = "".join(f"{p} {t:.0f}\n" for p, t in self.held.items()).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)


_FIXED_FLOOR = 20_000  # below: ports services claim by default (Ray's workers: 10002-19999)


def _ephemeral_low() -> int:
    """The low end of the kernel's ephemeral port range (32768 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def python_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a child Python that imports this very copy of asyncrl."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")  # models load from local folders only
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if extra:
        env.update(extra)
    return env


def spawn(
    args: Sequence[str],
    log_path: Path | None = None,
    env: dict[str, str] | None = None,
    die_with_parent: bool = False,
    secret: str | None = None,
    pass_fds: Sequence[int] = (),
) -> subprocess.Popen:
    """Start ``python -m ...``-style args in a new session; output to ``log_path`` (or inherit).

    The child gets the run secret (``secret``, default this process's: :func:`asyncrl.secret.load`)
    through an inherited pipe (:func:`asyncrl.secret.handoff`): never on its command line
    or in an inherited environment value.

    ``die_with_parent`` (Linux): the child is SIGKILLed when this process dies, however it
    dies (a SIGKILL, the OOM killer; a Ray actor killed with its node's raylet), see
    :func:`die_with_parent_fn`. Only the child itself: a child that starts processes of its
    own ends them itself (as ``asyncrl run`` does with its guardian). ``pass_fds``: more
    descriptors the child inherits (``subprocess.Popen``'s).
    """
    from asyncrl.secret import ENV_SECRET, handoff

    out = open(log_path, "ab") if log_path is not None else None
    try:
        with handoff(secret) as (fd_env, fds):
            return subprocess.Popen(
                [sys.executable, *args],
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                stdin=subprocess.DEVNULL,
                env={k: v for k, v in (env or python_env()).items() if k != ENV_SECRET} | fd_env,
                start_new_session=True,
                preexec_fn=die_with_parent_fn() if die_with_parent else None,
                pass_fds=(*fds, *pass_fds),
            )
    finally:
        if out is not None:
            out.close()


def die_with_parent_fn() -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets SIGKILL when this process
    dies (Linux ``PR_SET_PDEATHSIG``; None elsewhere).

    Linux sends the signal when the *thread* that started the child exits, so start such
    children from a thread that lives as long as the process (the main thread; not a pool
    thread that may be retired). A parent that died before the child set the signal up
    (a race of the fork) makes the child exit at once.
    """
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None).prctl  # resolved here: the child may not import after fork
    parent = os.getpid()

    def arm() -> None:
        prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)

    return arm


def wait_exit(procs: Sequence[Proc], timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for every process to exit on its own; True when all did."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
    return True


def proc_stat(pid: int | str) -> list[str] | None:
    """``/proc/PID/stat``'s fields after the command name (``pid`` may be ``"self"``): index
    0 is the state, 1 the parent, 11/12 user/system clock ticks, 19 the start time in
    ticks since boot (proc(5)'s fields 3, 4, 14, 15, 22); None when it cannot be read (the
    process is gone, or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds ``pid`` has used so far (None: unreadable, see
    :func:`proc_stat`)."""
    fields = proc_stat(pid)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (Linux: read from /proc)."""
    fields = proc_stat(pid)
    return fields is not None and fields[0] != "Z"


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, grandchildren, ...), read from /proc
    (Linux; empty elsewhere). A process that outlived its parent is no descendant any more:
    it was re-parented."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        fields = proc_stat(name) if name.isdigit() else None
        if fields is not None and fields[1].isdigit():
            children.setdefault(int(fields[1]), []).append(int(name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def process_age_s(pid: int | None = None) -> float | None:
    """Seconds since ``pid`` (default: this process) started -- for a forked process, since
    its fork -- at the kernel's clock-tick resolution; None where /proc does not say."""
    fields = proc_stat(pid or "self")
    if fields is None:
        return None
    try:
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))


def log_startup(log: logging.Logger, what: str, who: str = "") -> None:
    """Log ``{who}start-up: {what} N s after the process started`` (its fork, when forked):
    a process's milestones in its own log show where a slow start went."""
    age = process_age_s()
    if age is not None:
        log.info("%sstart-up: %s %.2f s after the process started", who, what, age)


def rss_bytes(pid: int, peak: bool = False) -> int:
    """Resident memory of ``pid`` now (``VmRSS``), or (``peak``) its high-water mark so far
    (``VmHWM``); 0 when it is gone or unknown (Linux /proc)."""
    key = "VmHWM:" if peak else "VmRSS:"
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def finish(proc: Proc, timeout_s: float) -> tuple[int, str]:
    """Wait up to ``timeout_s`` for ``proc`` to exit; its return code and output as text
    (a ``Popen`` with pipes; "" for any other, whose output went to its log).

    The process is killed if it is still running when the time is up (or on any error):
    ``subprocess.TimeoutExpired`` then.
    """
    if not isinstance(proc, subprocess.Popen):  # e.g. forked by a fork server
        try:
            return proc.wait(timeout_s), ""
        finally:
            if proc.poll() is None:
                stop([proc], 0.0)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = out.decode(errors="replace") if isinstance(out, bytes) else (out or "")
    return proc.returncode, text


def stop(procs: Sequence[Proc], timeout_s: float = 5.0) -> None:
    """SIGTERM each process group, wait up to ``timeout_s``, then SIGKILL the rest."""
    for p in procs:
        if p.poll() is None:
            _signal_group(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        _signal_group(p.pid, signal.SIGKILL)  # the group may hold grandchildren
        if p.poll() is None:
            p.wait(5)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
