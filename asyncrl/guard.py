"""The run's guardian: when ``asyncrl run`` dies, however it dies, its children die too.

``python -m asyncrl.guard --pids-file RUN/processes.json`` is started by the run
(:func:`start_guard`) in a session of its own, with a pipe as stdin whose only writer
is the run process. The guardian blocks reading it; end of file means the run
process is gone (a SIGKILL included: the kernel closes its pipe). It then ends every
process group named in the pids file (SIGTERM, ``grace_s``, SIGKILL; a pid is
signalled only while its start time still matches the one recorded, so a reused pid
is never hit), unlinks experience rings whose producer is dead and ``.ipc`` sockets
left in the run folder, and exits. A run that ends normally writes ``bye`` first;
the guardian then exits without touching anything.

The pids file maps a name to ``[pid, start_time]`` (``/proc/PID/stat`` field 22), or
to a bare pid (start time not checked).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from asyncrl.procs import proc_stat

__all__ = ["proc_start_time", "start_guard"]


def proc_start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot (-1 if it is gone or unknown)."""
    fields = proc_stat(pid)
    return int(fields[19]) if fields is not None else -1


def start_guard(pids_file: Path) -> subprocess.Popen:
    """Start the guardian of this process's children (listed in ``pids_file``).

    Keep the returned handle: its ``stdin`` is the pipe whose end-of-file wakes the guard.
    Call :func:`release_guard` on a normal exit."""
    from asyncrl.procs import python_env

    return subprocess.Popen(
        [sys.executable, "-m", "asyncrl.guard", "--pids-file", str(pids_file)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=None,
        env=python_env(),
        start_new_session=True,
    )


def release_guard(guard: subprocess.Popen, timeout_s: float = 5.0) -> None:
    """Normal exit: tell the guardian nothing needs cleaning, and reap it."""
    try:
        assert guard.stdin is not None
        guard.stdin.write(b"bye\n")
        guard.stdin.close()
    except (BrokenPipeError, OSError):
        pass
    try:
        guard.wait(timeout_s)
    except subprocess.TimeoutExpired:
        guard.kill()
        guard.wait(5)


def _pids(path: Path) -> list[tuple[int, int]]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    out = []
    for v in raw.values():
        pid, start = (v, -1) if isinstance(v, int) else (int(v[0]), int(v[1]))
        out.append((pid, start))
    return out


def _same(pid: int, start: int) -> bool:
    now = proc_start_time(pid)
    return now != -1 and (start == -1 or now == start)


def _kill_groups(pids: list[tuple[int, int]], grace_s: float) -> None:
    live = [(p, s) for p, s in pids if _same(p, s)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, _ in live:
            try:
                os.killpg(pid, sig)  # every child leads its own session: its whole tree
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 2.0)
        while live and time.monotonic() < deadline:
            live = [(p, s) for p, s in live if _same(p, s) and not _zombie(p)]
            time.sleep(0.05)
        if not live:
            return


def _zombie(pid: int) -> bool:
    fields = proc_stat(pid)
    return fields is None or fields[0] == "Z"


def cleanup(pids_file: Path, grace_s: float = 3.0) -> None:
    """End the run's children, then remove the rings and sockets they leave behind."""
    _kill_groups(_pids(pids_file), grace_s)
    from asyncrl.transports.experience.shm import sweep_orphans

    sweep_orphans()
    for sock in pids_file.parent.glob("*.ipc"):
        sock.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="asyncrl run guardian (started by asyncrl run)")
    p.add_argument("--pids-file", required=True)
    p.add_argument("--grace-s", type=float, default=3.0)
    args = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the run's to handle
    data = b""
    while chunk := os.read(0, 64):
        data += chunk
    if b"bye" in data:
        return
    cleanup(Path(args.pids_file), args.grace_s)


if __name__ == "__main__":
    main()
