"""``asyncrl.procs.free_port``: a port the kernel's own random choices cannot take."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import zmq

import asyncrl.procs as procs_module
from asyncrl.procs import PORT_HOLD_S, _ephemeral_low, free_port, private_folder, python_env


def test_free_ports_lie_below_the_ephemeral_range_and_bind() -> None:
    low = _ephemeral_low()
    ports = [free_port() for _ in range(50)]
    assert all(20_000 <= p < low for p in ports), (low, ports)  # Ray's workers: <= 19999
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))  # it was free


def test_the_kernels_random_binds_never_land_on_a_free_port() -> None:
    """What raced before: a port from ``free_port`` (the engine still loading its model)
    taken by a neighbour's ``tcp://127.0.0.1:*`` bind, so the health probe met a ZeroMQ
    greeting. Such binds and outgoing connections draw from the ephemeral range only."""
    low = _ephemeral_low()
    ctx = zmq.Context()
    socks = []
    try:
        for _ in range(200):
            sock = ctx.socket(zmq.ROUTER)
            sock.bind("tcp://127.0.0.1:*")
            socks.append(sock)
            port = int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
            assert port >= low
        assert all(free_port() < low for _ in range(20))
    finally:
        for sock in socks:
            sock.close(0)
        ctx.term()


_DRAW = """
import json, random, sys
import asyncrl.procs as procs
pool = list(range(int(sys.argv[1]), int(sys.argv[1]) + 200))
procs.random.randrange = lambda a, b: random.choice(pool)
print(json.dumps([procs.free_port() for _ in range(40)]))
"""


def test_a_port_handed_out_is_not_handed_out_again_by_another_process(tmp_path: Path) -> None:
    """Two processes drawing from the same 200 ports (their ``TMPDIR``: one registry): none
    of the 80 ports handed out is handed out twice, though none was bound meanwhile — without
    the registry the second process draws the first one's ports again (what let a test's
    health probe be answered by another test's server on the same port)."""
    low = _ephemeral_low()
    base = random.randrange(20_000, low - 200)
    env = python_env({"TMPDIR": str(tmp_path)})
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _DRAW, str(base)], env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    got = []
    for p in procs:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0
        got += json.loads(out)
    assert len(got) == 80 and len(set(got)) == 80, sorted(got)
    assert all(base <= p < base + 200 for p in got)
    held = (tmp_path / f"asyncrl-{os.getuid()}" / "ports").read_text().split()
    assert set(got) <= {int(x) for x in held[::2]}


def test_a_reservation_expires(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A port whose reservation has expired is handed out again (and held anew); one still
    held is skipped; expired lines are dropped from the registry."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    registry = private_folder() / "ports"
    now = time.time()
    low = _ephemeral_low()
    expired, held, gone = (random.randrange(20_000, low) for _ in range(3))
    registry.write_text(f"{expired} {now - 1:.0f}\n{held} {now + 100:.0f}\n{gone} {now - 5:.0f}\n")
    draws = iter([held, expired])
    monkeypatch.setattr(procs_module.random, "randrange", lambda a, b: next(draws))
    assert free_port() == expired
    lines = dict(line.split() for line in registry.read_text().splitlines())
    assert set(lines) == {str(expired), str(held)}
    assert float(lines[str(expired)]) > now + PORT_HOLD_S - 5


def test_without_a_private_folder_ports_are_drawn_unreserved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``$TMPDIR/asyncrl-UID`` open to others is not used (ValueError from
    ``private_folder``); ``free_port`` still hands out a port that binds."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folder = tmp_path / f"asyncrl-{os.getuid()}"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    with pytest.raises(ValueError, match="0700"):
        private_folder()
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    assert not (folder / "ports").exists()
