"""The run secret: where it comes from, and how it reaches a child process unseen.

Real child processes (``procs.spawn``): each reports what it got (a digest of the secret,
never the secret), what its own /proc/self/cmdline and /proc/self/environ hold, and the
test checks that the secret is in neither, nor in its log.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from asyncrl import secret
from asyncrl.engines.rollout.launcher import KEYED
from asyncrl.entrypoints.keyed import Redactor
from asyncrl.procs import finish, python_env, spawn

PROBE = """
import hashlib, json, os, sys
from asyncrl import secret
key = secret.load()
print(json.dumps({
    "digest": hashlib.sha256(key.encode()).hexdigest(),
    "fd_env": os.environ.get(secret.ENV_FD), "env": os.environ.get(secret.ENV_SECRET),
    "in_cmdline": key.encode() in open("/proc/self/cmdline", "rb").read(),
    "in_environ": key.encode() in open("/proc/self/environ", "rb").read(),
}), flush=True)
"""


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _probe(tmp_path: Path, key: str | None = None, env: dict[str, str] | None = None) -> dict:
    log = tmp_path / "probe.log"
    proc = spawn(["-c", PROBE], log, env=env, secret=key)
    code, _ = finish(proc, 60)
    text = log.read_text()
    assert code == 0, text
    return json.loads(text.strip().splitlines()[-1])


def test_a_child_gets_the_secret_through_its_pipe_only(tmp_path: Path) -> None:
    key = secret.generate()
    got = _probe(tmp_path, key)
    assert got["digest"] == _digest(key)
    assert got["fd_env"] is None and got["env"] is None  # read once, dropped
    assert not got["in_cmdline"] and not got["in_environ"]
    assert key not in (tmp_path / "probe.log").read_text()


def test_a_users_env_secret_is_not_inherited(tmp_path: Path) -> None:
    """``ASYNCRL_SECRET`` set for a process never travels on to its children's environment:
    they get the process's secret through the pipe."""
    key = secret.generate()
    env = python_env({secret.ENV_SECRET: key})
    got = _probe(tmp_path, env=env)  # secret=None: this process's (the test session's)
    assert got["digest"] == _digest(secret.load()) and got["env"] is None
    assert not got["in_environ"]


ADOPT = """
import hashlib, json, sys
from asyncrl import secret
before = secret.source()
key = secret.adopt(sys.argv[1])
print(json.dumps({"before": before, "after": secret.source(),
                  "digest": hashlib.sha256(key.encode()).hexdigest(),
                  "refused": secret.refused("http://127.0.0.1:1")}), flush=True)
"""


def _key_file(path: Path) -> str:
    key = secret.generate()
    path.write_text(key + "\n")
    path.chmod(0o600)
    return key


def test_a_configs_secret_file_wins_and_errors_say_where_the_secret_came_from(
    tmp_path: Path,
) -> None:
    """``cluster.secret_file`` (``secret.adopt``) replaces the secret ASYNCRL_SECRET_FILE gave,
    and :func:`secret.refused` names the file the process's secret came from (never the
    secret); an environment without any source says so."""
    env_key, cfg_key = _key_file(tmp_path / "env.key"), _key_file(tmp_path / "cfg.key")
    env = {k: v for k, v in python_env().items() if not k.startswith("ASYNCRL_SECRET")}

    def probe(path: str, **extra: str) -> dict:  # started as a user would: no pipe
        out = subprocess.run([sys.executable, "-c", ADOPT, path], env={**env, **extra},
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert cfg_key not in out.stdout + out.stderr and env_key not in out.stdout + out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    got = probe(str(tmp_path / "cfg.key"), **{secret.ENV_FILE: str(tmp_path / "env.key")})
    assert got["before"] == f"from the file {tmp_path / 'env.key'} (ASYNCRL_SECRET_FILE)"
    assert got["after"] == f"from the file {tmp_path / 'cfg.key'} (cluster.secret_file)"
    assert got["digest"] == _digest(cfg_key) != _digest(env_key)
    assert "cfg.key (cluster.secret_file)" in got["refused"]
    assert probe("")["after"].startswith("a fresh one: no cluster.secret_file")


def test_secret_files_must_be_private(tmp_path: Path) -> None:
    f = tmp_path / "key"
    f.write_text(secret.generate() + "\n")
    f.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        secret.read_file(f)
    f.chmod(0o600)
    assert secret.read_file(f) == f.read_text().strip()
    f.write_text("short")
    with pytest.raises(ValueError, match="at least 16"):
        secret.read_file(f)
    with pytest.raises(ValueError, match="no-such"):
        secret.read_file(tmp_path / "no-such")


def test_bearer_check() -> None:
    key = secret.generate()
    assert secret.check_bearer(secret.auth_headers(key)["Authorization"], key)
    assert secret.check_bearer("bEaReR " + key, key)
    for bad in (None, "", key, "Basic " + key, "Bearer " + key + "x", "Bearer  " + key):
        assert not secret.check_bearer(bad, key)


def test_curve_keys_are_derived_and_distinct() -> None:
    import zmq

    a, b = secret.generate(), secret.generate()
    ka, kb = secret.curve_keys(a), secret.curve_keys(a)
    assert ka == kb and len(set(ka)) == 4
    assert zmq.curve_public(ka[1]) == ka[0] and zmq.curve_public(ka[3]) == ka[2]
    assert set(secret.curve_keys(b)).isdisjoint(ka)


def test_keyed_server_gets_the_key_in_argv_and_its_output_is_redacted(tmp_path: Path) -> None:
    """``asyncrl.entrypoints.keyed`` runs the server with ``--api-key=KEY`` (one word: a key
    may start with '-') appended to its ``sys.argv``; the command line has no key, and what
    the server prints (SGLang logs its ServerArgs, key included) reaches the log with the key
    masked — a child's output too."""
    key = secret.generate()
    code = (
        "import hashlib, subprocess, sys; flag, _, k = sys.argv[-1].partition('='); "
        "print('argv', sys.argv[1:-1] + [flag], hashlib.sha256(k.encode()).hexdigest(), "
        "flush=True); "
        "print('server_args=', sys.argv, file=sys.stderr, flush=True); "
        "subprocess.run([sys.executable, '-c', 'import sys; print(sys.argv[1])', k]); "
        "print('in cmdline', k.encode() in open('/proc/self/cmdline', 'rb').read())"
    )
    log = tmp_path / "server.log"
    proc = spawn(["-m", KEYED, "--api-key", "--", "-c", code, "serve", "--x"], log, secret=key)
    rc, _ = finish(proc, 60)
    text = log.read_text()
    assert rc == 0, text
    assert f"argv ['serve', '--x', '--api-key'] {_digest(key)}" in text
    assert "in cmdline False" in text
    assert key not in text and text.count("***") == 2, text  # stderr and the grandchild
    assert os.path.exists(log)


class _Collect(Redactor):
    """The redactor's copy loop on a pipe of the test's, collecting what it writes."""

    def __init__(self, key: str):  # no fd juggling: this process's stdout stays as it is
        self.key = key.encode()
        self.got = bytearray()
        self._r, self.w = os.pipe()

    def _write(self, data: bytes) -> None:
        self.got += data


@pytest.mark.parametrize("step", [1, 7, 41, 42, 43, 44, 85, 1000])
def test_redaction_whatever_the_reads_cut(step: int) -> None:
    """A key cut anywhere between two reads (with or without a newline near it) is masked."""
    key = secret.generate()
    k = key.encode()
    text = b"a" * 50 + k + b"b" * 3 + k + b"\n" + k + b"c" * 90 + k + b"\nend" + k
    r = _Collect(key)
    t = threading.Thread(target=r._copy)
    t.start()
    for i in range(0, len(text), step):
        os.write(r.w, text[i : i + step])
        time.sleep(0.0005)  # separate reads (mostly)
    os.close(r.w)
    t.join(10)
    os.close(r._r)
    assert bytes(r.got) == text.replace(k, b"***")
