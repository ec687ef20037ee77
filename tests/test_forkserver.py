"""The fork server (asyncrl/forkserver.py): a forked child is what ``python -m MODULE ARGS``
would be (argv, environment, session, log, cores, the run secret in memory only), its exit
codes are Popen's, and nothing it started outlives it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl import secret
from asyncrl.forkserver import ENV_SHARED, ForkServer, model_module
from asyncrl.procs import finish, pid_alive, python_env, spawn, stop

CHILD = "tests.forkserver_child"


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    fs = ForkServer.start(["xml.dom.minidom", "torch", CHILD], timeout_s=60)
    yield fs
    fs.close()


def _seen(path: Path, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"the forked child wrote no {path} in {timeout_s} s"
        time.sleep(0.02)
    return json.loads(path.read_text())


def test_a_fork_is_what_python_dash_m_would_be(server: ForkServer, tmp_path: Path) -> None:
    out, log = tmp_path / "seen.json", tmp_path / "child.log"
    env = python_env({"MARK_FOR_TEST": "yes"})
    proc = server.spawn(["-m", CHILD, str(out), "0"], log, env, cores={0})
    assert proc.wait(30) == 0 and proc.poll() == 0
    seen = _seen(out)
    assert seen["argv"][1:] == [str(out), "0"] and seen["argv"][0].endswith("forkserver_child.py")
    assert seen["env"]["MARK_FOR_TEST"] == "yes" and seen["env"]["PYTHONPATH"] == env["PYTHONPATH"]
    assert not {secret.ENV_FD, secret.ENV_SECRET} & set(seen["env"])  # never in its environment
    assert seen["secret"] == secret.load()  # ... but in memory
    assert seen["sid"] == seen["pid"] == proc.pid  # its own session: stopped by pid
    # what ps shows: the command line it would have had, and its short name
    assert seen["cmdline"][:5] == [sys.executable, "-m", CHILD, str(out), "0"], seen["cmdline"]
    assert seen["comm"] == "forkserver_chil"  # 15 characters: the kernel's limit
    assert seen["cores"] == [0] and seen["preloaded"]
    assert seen["threads"] == 1  # torch's pool sized for its one core, as a fresh process's
    # the server preloaded the child's module (the fixture's list): the fork runs its code as
    # __main__ without that copy, as python -m would, and runpy has nothing to warn about
    assert not seen["itself_imported"]
    assert log.read_text() == f"child {proc.pid} says hello\n"


def test_a_preloaded_package_runs_its_main_and_stays_imported(tmp_path: Path) -> None:
    """``-m PACKAGE`` (its ``__main__``): python -m imports the package too, so the fork keeps
    the server's copy (only a preloaded plain module is forgotten before it runs)."""
    fs = ForkServer.start(["tests.forkserver_pkg"], timeout_s=60)
    try:
        out, log = tmp_path / "seen.json", tmp_path / "child.log"
        proc = fs.spawn(["-m", "tests.forkserver_pkg", str(out)], log, python_env())
        assert proc.wait(30) == 0, log.read_text()
        seen = json.loads(out.read_text())
        assert seen["imported_by"] == fs.proc.pid != seen["pid"]
        assert log.read_text() == ""  # no warning
    finally:
        fs.close()


def test_a_relative_log_is_the_clients(
    server: ForkServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``asyncrl run`` without ``--run-dir`` logs to ``runs/STAMP/...`` of its working folder,
    which is not the server's: the log lands there, and the child is forked (it was refused,
    "cannot open log", and the run started its processes afresh)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    proc = server.spawn(["-m", CHILD, "seen.json", "0"], Path("runs/child.log"), python_env())
    assert proc.wait(30) == 0
    assert f"child {proc.pid} says hello" in (tmp_path / "runs" / "child.log").read_text()


@pytest.mark.parametrize(("mode", "code"), [("3", 3), ("raise", 1)])
def test_exit_codes_are_popens(server: ForkServer, tmp_path: Path, mode: str, code: int) -> None:
    log = tmp_path / "child.log"
    proc = server.spawn(["-m", CHILD, str(tmp_path / "seen.json"), mode], log, python_env())
    assert proc.wait(30) == code
    if mode == "raise":
        assert "ValueError: the child raised" in log.read_text()


def test_a_killed_child_and_waits_that_time_out(server: ForkServer, tmp_path: Path) -> None:
    out = tmp_path / "seen.json"
    proc = server.spawn(["-m", CHILD, str(out), "sleep"], None, python_env())
    _seen(out)
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL


def test_closing_the_server_ends_what_it_started(tmp_path: Path) -> None:
    fs = ForkServer.start([CHILD], timeout_s=60)
    out = tmp_path / "seen.json"
    proc = fs.spawn(["-m", CHILD, str(out), "sleep"], None, python_env())
    _seen(out)
    fs.close()
    deadline = time.monotonic() + 10
    while pid_alive(proc.pid):
        assert time.monotonic() < deadline, "the fork server's child outlived it"
        time.sleep(0.05)
    assert not pid_alive(fs.proc.pid)
    assert fs.proc.returncode == 0  # an orderly end (it leaves without the interpreter's teardown)


def test_a_failed_preload_is_named(tmp_path: Path) -> None:
    fs = ForkServer.start(["no_such_module_here"], timeout_s=60)
    try:
        with pytest.raises(RuntimeError, match="no_such_module_here"):
            fs.spawn(["-m", CHILD, str(tmp_path / "x"), "0"], None, python_env())
        assert not fs.alive()
        with pytest.raises(ValueError, match="-m MODULE"):
            fs.spawn(["-c", "pass"], None, python_env())
    finally:
        fs.close()


def test_model_module_names_the_class_module(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert model_module(str(tiny_model_dir)) == "transformers.models.qwen2.modeling_qwen2"
    assert model_module(str(tmp_path)) is None
    (tmp_path / "config.json").write_text('{"model_type": "../evil"}')
    assert model_module(str(tmp_path)) is None


@pytest.fixture
def shared(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    """A shared server on a unix socket, as a user starts one (``--listen``)."""
    path = str(tmp_path / "fs.sock")
    args = ["-m", "asyncrl.entrypoints.forkserver", "--listen", path]
    proc = spawn([*args, "--preload", CHILD, "--title-room", " " * 512], tmp_path / "fs.log")
    deadline = time.monotonic() + 60
    while not Path(path).exists():
        assert proc.poll() is None, (tmp_path / "fs.log").read_text()
        assert time.monotonic() < deadline, "the shared fork server made no socket in 60 s"
        time.sleep(0.05)
    yield proc, path
    stop([proc])


def test_a_shared_server_keeps_each_runs_children_apart(
    shared: tuple[subprocess.Popen, str], tmp_path: Path
) -> None:
    proc, path = shared
    assert os.stat(path).st_mode & 0o777 == 0o600  # this user only
    a, b = ForkServer.connect(path), ForkServer.connect(path)
    try:
        outs = [tmp_path / "a.json", tmp_path / "b.json"]
        ka = a.spawn(["-m", CHILD, str(outs[0]), "sleep"], None, python_env())
        kb = b.spawn(["-m", CHILD, str(outs[1]), "sleep"], None, python_env())
        seen = [_seen(o) for o in outs]
        assert {s["ppid"] for s in seen} == {proc.pid} and seen[0]["cwd"] == os.getcwd()
        assert seen[0]["secret"] == secret.load()  # handed over the socket, not inherited
        assert not {secret.ENV_FD, secret.ENV_SECRET} & set(seen[0]["env"])
        a.close()  # a run's connection closes: its children end, the other run's do not
        deadline = time.monotonic() + 10
        while pid_alive(ka.pid):
            assert time.monotonic() < deadline, "a closed connection's child outlived it"
            time.sleep(0.05)
        assert kb.poll() is None and pid_alive(kb.pid)
    finally:
        a.close()
        b.close()
    with pytest.raises(OSError, match="no fork server answers"):
        ForkServer.connect(str(tmp_path / "nothing.sock"))


def test_a_run_forks_from_the_shared_server(
    shared: tuple[subprocess.Popen, str], tmp_path: Path, tiny_model_dir: Path
) -> None:
    """ASYNCRL_FORK_SERVER set: the run's trainer and engine are the shared server's
    children; the server is not the run's (not in processes.json) and outlives it."""
    proc, path = shared
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "asyncrl.cli", "run", "--run-dir", str(run), "--quiet"]
    cmd += [f"--model.path={tiny_model_dir}", "--controller.total_steps=2"]
    cmd += ["--controller.batch_size=2"]
    env = python_env({ENV_SHARED: path})
    run_proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    parents = {}
    try:
        deadline = time.monotonic() + 120
        while run_proc.poll() is None and not parents:
            assert time.monotonic() < deadline, "the run started no process in 120 s"
            if (run / "processes.json").is_file():
                for name, pid in json.loads((run / "processes.json").read_text()).items():
                    parents[name] = Path(f"/proc/{pid}/stat").read_text().rsplit(")")[1].split()[1]
            time.sleep(0.05)
    finally:
        rc, out = finish(run_proc, 180)
    assert rc == 0, out[-3000:]
    assert set(parents) == {"engine0", "trainer0"}  # no forkserver of its own
    assert set(parents.values()) == {str(proc.pid)}
    assert proc.poll() is None


def test_children_die_with_a_server_told_so_and_take_the_secret_they_are_given(
    tmp_path: Path,
) -> None:
    """``--children-die-with-server`` (the Ray launcher's node servers, whose Ray worker
    SIGKILLs them as it exits): the server SIGKILLed, its children die too, where it could
    not kill them itself. A child gets the secret its client hands it (a Ray actor's: the
    run's, which came as a call argument), not the client's own."""
    path = str(tmp_path / "fs.sock")
    args = ["-m", "asyncrl.entrypoints.forkserver", "--listen", path, "--preload", CHILD]
    proc = spawn([*args, "--children-die-with-server"], tmp_path / "fs.log")
    try:
        deadline = time.monotonic() + 60
        while not Path(path).exists():
            assert proc.poll() is None, (tmp_path / "fs.log").read_text()
            assert time.monotonic() < deadline, "the fork server made no socket in 60 s"
            time.sleep(0.05)
        conn = ForkServer.connect(path)
        key = secret.generate()
        child = conn.spawn(["-m", CHILD, str(tmp_path / "c.json"), "sleep"], None, python_env(),
                           secret=key)  # fmt: skip
        seen = _seen(tmp_path / "c.json")
        assert seen["secret"] == key != secret.load() and seen["ppid"] == proc.pid
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while pid_alive(child.pid):
            assert time.monotonic() < deadline, "a child outlived its SIGKILLed server by 30 s"
            time.sleep(0.05)
        conn.close()
    finally:
        stop([proc])


_WORKER = """
import json, os, sys, time
from pathlib import Path
from asyncrl.forkserver import ForkServer
from asyncrl.procs import python_env, spawn
folder = Path(sys.argv[1])
path = str(folder / "fs.sock")
args = ["-m", "asyncrl.entrypoints.forkserver", "--listen", path, "--preload", sys.argv[2]]
server = spawn([*args, "--exit-with", str(os.getpid())], folder / "fs.log")
deadline = time.monotonic() + 60
while not os.path.exists(path):
    assert time.monotonic() < deadline and server.poll() is None, "no socket"
    time.sleep(0.05)
conn = ForkServer.connect(path)
child = conn.spawn(["-m", sys.argv[2], str(folder / "child.json"), "sleep"], None, python_env())
(folder / "pids.json").write_text(json.dumps({"server": server.pid, "child": child.pid}))
time.sleep(600)
"""


def test_a_shared_server_ends_with_the_process_it_was_told_to_exit_with(tmp_path: Path) -> None:
    """``--exit-with PID`` (what each test worker passes for its shared server): the worker
    SIGKILLed, its server and the server's children end (a crashed xdist worker left its
    ~460 MB server running for 90 minutes before)."""
    worker = spawn(["-c", _WORKER, str(tmp_path), CHILD], tmp_path / "worker.log")
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "pids.json").exists():
            assert worker.poll() is None, (tmp_path / "worker.log").read_text()
            assert time.monotonic() < deadline, "the worker forked no child in 90 s"
            time.sleep(0.05)
        pids = json.loads((tmp_path / "pids.json").read_text())
        _seen(tmp_path / "child.json")
        assert pid_alive(pids["server"]) and pid_alive(pids["child"])
        os.kill(worker.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while pid_alive(pids["server"]) or pid_alive(pids["child"]):
            assert time.monotonic() < deadline, f"still running 30 s after the worker died: {pids}"
            time.sleep(0.05)
        assert not (tmp_path / "fs.sock").exists()  # removed on the way out
    finally:
        stop([worker])


def test_a_sigkilled_test_process_leaves_no_child_it_started(tmp_path: Path) -> None:
    """tests/conftest.py arms every child a test starts with subprocess.Popen to die with the
    test process: a pytest session (its shared fork server off: the test above covers it)
    SIGKILLed while its test's child runs leaves no child behind."""
    out = tmp_path / "pids.json"
    env = {**python_env(), "ASYNCRL_TEST_WORKER_OUT": str(out)}
    env["ASYNCRL_TEST_SHARED_FORK_SERVER"] = "0"
    args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    session = spawn(
        [*args, str(Path(__file__).with_name("worker_child.py"))], tmp_path / "log", env
    )
    try:
        deadline = time.monotonic() + 120
        while not out.exists():
            assert session.poll() is None, (tmp_path / "log").read_text()
            assert time.monotonic() < deadline, "the test started no child in 120 s"
            time.sleep(0.05)
        pids = json.loads(out.read_text())
        assert pids["worker"] == session.pid and pid_alive(pids["child"])
        os.kill(session.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while pid_alive(pids["child"]):
            assert time.monotonic() < deadline, f"the child outlived its test process: {pids}"
            time.sleep(0.05)
    finally:
        stop([session])
