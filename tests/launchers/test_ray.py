"""``cluster.backend = "ray"`` on a two-node local Ray cluster (head 127.0.0.2, worker 127.0.0.3).

Every process binds only its own node's address, so an address mix-up fails with
"connection refused". The engine lives on the head (with the driver), the trainer
on the worker: the experience channel (frames, ``shm = "off"``) and the weight push
cross nodes.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from asyncrl import secret
from asyncrl.forkserver import ENV_SHARED, spawn_shared
from asyncrl.procs import finish, pid_alive, python_env, stop
from tests import runs
from tests.launchers.cluster import (
    HEAD,
    WORKER,
    Cluster,
    cluster_pids,
    cmdline,
    descendants,
    listeners,
    listening,
    node_fork_servers,
    parent,
    read_json,
)
from tests.runs import kill_when_rows, leaks, metrics_rows, wait_checkpoint, wait_rows

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")


def _wildcard(addr: str) -> bool:
    return ipaddress.ip_address(addr).is_unspecified


def _sockets(cluster: Cluster, run: Path, driver: int) -> dict[str, set[tuple[str, int]]]:
    """Who of the run listens where, asyncrl's sockets only (Ray's own gRPC server in the
    driver, which Ray binds to every interface, is named by Ray's log and left out)."""
    table = listeners()
    out = {
        "driver": listening(driver, table)
        - {(a, p) for a, p in listening(driver, table) if p in cluster.ray_ports(driver)}
    }
    for name, pid in read_json(run / "processes.json").items():
        out[name] = set().union(*(listening(p, table) for p in descendants(pid)))
    return out


def _forked_by(cluster: Cluster, pids: Iterable[int]) -> set[int]:
    """The fork servers that forked ``pids``: each one must be the session's shared server
    when it runs (the driver's ``ASYNCRL_FORK_SERVER``, which is on both nodes here), else
    a server the launcher started on its node."""
    shared = runs.shared_server_pid
    servers = {shared} if shared is not None else node_fork_servers(cluster.temp_dir)
    got = {parent(p) for p in pids}
    assert got and got <= servers, {p: (parent(p), cmdline(p)) for p in pids}
    return {p for p in got if p is not None}


def _gone(pids: Iterable[int], timeout_s: float) -> list[int]:
    """Poll until none of ``pids`` runs (up to ``timeout_s``); those still running."""
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if pid_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_default_job_runs_across_two_nodes_and_learns(
    ray_cluster: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "asyncrl.cli", "run", "--run-dir", str(run), "--quiet"]
    cmd += [f"--model.path={tiny_model_dir}", "--controller.total_steps=30"]
    cmd += ["--experience.shm=off", *ray_cluster.run_flags()]
    proc = subprocess.Popen(
        cmd, env=python_env(ray_cluster.env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        wait_rows(run, proc, 3, timeout_s=300)
        seen = _sockets(ray_cluster, run, proc.pid)  # mid-run: every socket is open
        engine = read_json(run / "processes.json")["engine0"]
        argv = Path(f"/proc/{engine}/cmdline").read_bytes().split(b"\0")
        masters = argv[argv.index(b"--weight-masters") + 1].decode()
        # the run secret (handed to the actors through Ray's calls) in no command line or
        # environment of the driver, Ray's daemons and workers (the actors), their children
        ray_side = cluster_pids(ray_cluster.temp_dir)
        procs = {proc.pid, *descendants(proc.pid), *ray_side}
        procs |= {c for p in ray_side for c in descendants(p)}
        ours = set(read_json(run / "processes.json").values())  # engine0, trainer0
        _forked_by(ray_cluster, ours)  # fork_server "auto": no process uses CUDA
        mid_run = leaks(secret.load(), run, sorted(procs | ours))
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    rc, text = finish(proc, 300)
    assert rc == 0, text
    assert mid_run == []
    assert leaks(secret.load(), run, []) == []  # nor in the run folder, nor in Ray's logs
    assert leaks(secret.load(), ray_cluster.temp_dir, []) == []
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(30))
    first = sum(r["reward_mean"] for r in rows[:10]) / 10
    last = sum(r["reward_mean"] for r in rows[-10:]) / 10
    # it learns (README: 0.085 in steps 0-9, 0.21 in 20-29; a 10-step mean's sd ~0.006)
    assert last > first + 0.08, (first, last)
    assert rows[-1]["weight_version"] == 30

    assert read_json(run / "placement.json") == {"engine0": HEAD, "trainer0": WORKER}
    assert not [s for ss in seen.values() for s in ss if _wildcard(s[0])], seen
    assert {a for a, _ in seen["driver"]} == {HEAD}  # the experience channel
    assert {a for a, _ in seen["engine0"]} == {HEAD}  # HTTP and its weight-group rank
    # the trainer's weight-group store and rank, its rendezvous store; its own Gloo group
    # binds lo's address (an interface name cannot tell loopback aliases apart)
    assert {a for a, _ in seen["trainer0"]} <= {WORKER, "127.0.0.1"}
    assert WORKER in {a for a, _ in seen["trainer0"]}
    assert masters == f"loopback,{WORKER}"  # weight groups only from trainer rank 0's node
    # every process traced (the actors got the run's trace settings) and the files merged
    events = json.loads((run / "trace.json").read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert {"controller", "trainer0"} <= names and any(n.startswith("engine") for n in names)


def test_engine_killed_on_its_node_is_restarted_resynced_and_back_in_rotation(
    ray_cluster: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from tests.launchers.test_local import _kill_engine_mid_run

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "asyncrl.cli", "run", "--run-dir", str(run), "--quiet"]
    cmd += [f"--model.path={tiny_model_dir}", "--controller.total_steps=14"]
    cmd += ["--controller.batch_size=4", *ray_cluster.run_flags()]
    out = _kill_engine_mid_run(cmd, python_env(ray_cluster.env), run, after_rows=3)
    assert "engine0 exited with -9; restart 1 of 3" in out, out
    assert "back in rotation at weight version" in out, out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(14))
    assert all(r["staleness_max"] <= 1 for r in rows)
    assert rows[-1]["ctl_engines_out"] == 0
    assert read_json(run / "placement.json")["engine0"] == HEAD


def _both_layouts(ray_cluster: Cluster, tmp_path: Path, args: list[str]) -> dict[str, Any]:
    """``asyncrl ARGS`` on one host and across the two nodes, both at once (their results
    are compared, not timed); layout -> its JSON."""
    layouts = {
        "one-host": [],
        "two-node": ["--send-host", WORKER, "--recv-host", HEAD, "--ray", ray_cluster.address],
    }
    procs = {}
    try:
        for layout, extra in layouts.items():
            cmd = ["-m", "asyncrl.cli", *args, "--json", str(tmp_path / f"{layout}.json")]
            log = tmp_path / f"{layout}.log"
            procs[layout] = spawn_shared([*cmd, *extra], log, python_env(ray_cluster.env))
        for layout, proc in procs.items():
            code = proc.wait(240)
            assert code == 0, (tmp_path / f"{layout}.log").read_text(errors="replace")[-4000:]
    finally:
        stop(list(procs.values()))
    return {layout: json.loads((tmp_path / f"{layout}.json").read_text()) for layout in layouts}


def test_bench_weight_sync_measures_the_link_between_two_nodes(
    ray_cluster: Cluster, tmp_path: Path
) -> None:
    """The engines and the floor's peer run on the head (via Ray), the sender on the worker's
    address; the rows have the same columns as a one-host run and the push is bit-exact."""
    cmd = ["bench", "weight-sync", "--model", "tiny", "--dtype", "float32", "--repeats", "1"]
    rows = _both_layouts(ray_cluster, tmp_path, [*cmd, "--modes", "overlap", "--no-naive"])
    (local,), (remote,) = rows["one-host"], rows["two-node"]
    assert set(local) == set(remote)
    assert remote["verified"] is True and local["verified"] is True
    assert (remote["send_host"], remote["recv_host"]) == (WORKER, HEAD)
    assert remote["floor_s"] > 0 and remote["total_s"] > 0


def test_bench_transport_measures_the_link_between_two_nodes(
    ray_cluster: Cluster, tmp_path: Path
) -> None:
    """The consumer runs on the head (via Ray), the producer binds the worker's address."""
    cmd = ["bench", "transport", "--transport", "tcp", "--trajectories", "400"]
    results = _both_layouts(ray_cluster, tmp_path, [*cmd, "--group-sizes", "8", "--repeats", "1"])
    local, remote = results["one-host"], results["two-node"]
    assert set(local) == set(remote)
    assert [set(r) for r in local["runs"]] == [set(r) for r in remote["runs"]]
    assert (remote["send_host"], remote["recv_host"]) == (WORKER, HEAD)
    assert all(r["eps"] > 0 for r in remote["runs"])


@pytest.mark.own_fork_server
def test_trainer_killed_on_its_node_restarts_from_the_checkpoint(
    ray_cluster: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Trainer rank 0 SIGKILLed on the worker node: restarted in its actor from the last
    checkpoint (resume.json shipped to its node), the run finishes, each sample once. No
    shared fork server: the launcher forks each process from a server of the run's own on
    its node (one per node), and ends them with the run."""
    assert ENV_SHARED not in os.environ
    run = tmp_path / "run"
    steps = 14
    cmd = [sys.executable, "-m", "asyncrl.cli", "run", "--run-dir", str(run), "--quiet"]
    cmd += [f"--model.path={tiny_model_dir}", f"--controller.total_steps={steps}"]
    cmd += ["--controller.batch_size=4", "--checkpoint.every_steps=4", *ray_cluster.run_flags()]
    proc = subprocess.Popen(
        cmd, env=python_env(ray_cluster.env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        wait_rows(run, proc, 1)
        pids = read_json(run / "processes.json")
        servers = node_fork_servers(ray_cluster.temp_dir)
        assert {parent(pids["engine0"]), parent(pids["trainer0"])} == servers, pids
        assert len(servers) == 2  # one per node
        logs = {f"forkserver-{HEAD}.log", f"forkserver-{WORKER}.log"}
        assert logs <= {p.name for p in run.iterdir()}
        sockets = [cmdline(s).split("--listen ")[1].split()[0] for s in servers]
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    _, rc, text = kill_when_rows(proc, run, "trainer0", after_rows=6, checkpointed=True)
    assert rc == 0, text
    assert _gone(servers, 30) == []  # the stop path ends them, and they remove their sockets
    assert not [s for s in sockets if Path(s).exists()]
    recs = [json.loads(line) for line in (run / "recoveries.jsonl").read_text().splitlines()]
    assert [r["restart"] for r in recs] == [1] and recs[0]["from_step"] >= 4, recs
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps))
    ids = [i for r in rows for i in r["sample_ids"]]
    assert len(ids) == len(set(ids))  # each sample trained once in the final history
    urls = read_json(run / "resume.json")["engines"]  # what the restarted rank pushed to
    assert len(urls) == 1 and urls[0].startswith(f"http://{HEAD}:"), urls


def test_driver_sigkilled_leaves_no_process_on_either_node_and_resumes(
    ray_cluster: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The driver (`asyncrl run`) SIGKILLed mid-run: Ray reclaims its job's actors and their
    processes die with them (parent-death signal), on both nodes; `--resume` on the cluster
    continues from the newest checkpoint, each step once."""
    from asyncrl.controllers import checkpoints as ckpts
    from tests.test_resume import _check_exactly_once

    run = tmp_path / "run"
    cli = [sys.executable, "-m", "asyncrl.cli", "run", "--quiet"]

    def start(*args: str) -> subprocess.Popen:
        env = python_env(ray_cluster.env)
        return subprocess.Popen(
            [*cli, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

    proc = start(
        "--run-dir", str(run), f"--model.path={tiny_model_dir}", "--controller.batch_size=4",
        "--controller.total_steps=1000", "--checkpoint.every_steps=3", *ray_cluster.run_flags(),
    )  # fmt: skip
    wait_rows(run, proc, 5)
    wait_checkpoint(run, proc)
    pids = read_json(run / "processes.json")
    assert set(pids) == {"engine0", "trainer0"}
    servers = _forked_by(ray_cluster, pids.values())
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # the actors' connections to the fork server close with them: it kills what it forked
    # for them (a shared server lives on; a node's server ends with its own actor)
    left = _gone(pids.values(), 60)
    assert not left, f"alive 60 s after the driver's death: {left} of {pids}"
    if runs.shared_server_pid is None:
        assert _gone(servers, 60) == []
    else:
        assert servers == {runs.shared_server_pid} and pid_alive(runs.shared_server_pid)
    resumed_from, _ = ckpts.latest_checkpoint(run)
    steps = resumed_from + 3
    rc, out = finish(start("--resume", str(run), f"--controller.total_steps={steps}"), 240)
    assert rc == 0, out[-3000:]
    _check_exactly_once(metrics_rows(run), steps, 4)


def test_each_actor_forks_from_its_nodes_fork_server_and_nothing_outlives_the_driver(
    ray_cluster: Cluster, tmp_path: Path
) -> None:
    """ProcActors on both nodes fork their processes from their node's fork server (one per
    node, started by a Ray actor there; socket mode 0600 in a folder of mode 0700); a restart
    in the same actor forks again there; an actor killed takes its forked process with it
    while the server lives on; the driver SIGKILLed leaves no process and no socket."""
    from asyncrl.launchers.ray_forks import sweep

    shared = os.environ.get(ENV_SHARED, "")
    cmd = [sys.executable, "-m", "tests.launchers.ray_forks_driver", ray_cluster.address]
    cmd += [str(tmp_path / "run"), *([shared] if shared else [])]
    with open(tmp_path / "driver.log", "wb") as err:
        driver = subprocess.Popen(
            cmd, env=python_env(ray_cluster.env), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=err, text=True,
        )  # fmt: skip

    def ask(command: str = "") -> Any:
        assert driver.stdin is not None and driver.stdout is not None
        if command:
            driver.stdin.write(command + "\n")
            driver.stdin.flush()
        line = driver.stdout.readline()  # the driver's own calls time out within 60 s
        assert line, (tmp_path / "driver.log").read_text()[-3000:]
        return json.loads(line)

    try:
        got = ask()
        servers = {node: parent(got[node]["child"]) for node in (HEAD, WORKER)}
        ray_side = {c for p in cluster_pids(ray_cluster.temp_dir) for c in descendants(p)}
        for node, server in servers.items():
            sock = got[node]["socket"]
            assert server in ray_side, cmdline(server)  # started by the node's actor
            assert f"-m asyncrl.entrypoints.forkserver --listen {sock} " in cmdline(server)
            assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
            assert stat.S_IMODE(os.stat(Path(sock).parent).st_mode) == 0o700
        assert servers[HEAD] != servers[WORKER]
        assert got[HEAD]["node_id"] != got[WORKER]["node_id"]
        new = ask("restart")
        assert parent(new) == servers[HEAD]
        assert _gone([got[HEAD]["child"]], 30) == []
        if shared:
            assert parent(got["shared"]["child"]) == runs.shared_server_pid
            assert ask("kill-shared") == "killed"
            assert _gone([got["shared"]["child"]], 60) == []
            assert runs.shared_server_pid is not None and pid_alive(runs.shared_server_pid)
        driver.kill()
        driver.wait()
        left = _gone([new, got[WORKER]["child"], *servers.values()], 60)
        assert left == [], [(p, parent(p), cmdline(p)[:80]) for p in left]
        # a server SIGKILLed by its exiting Ray worker leaves its socket file: nothing listens
        # there, and the next node server's sweep removes it
        sockets = [Path(got[n]["socket"]) for n in (HEAD, WORKER)]
        sweep(sockets[0].parent)
        assert not [s for s in sockets if s.exists()]
    finally:
        driver.kill()
        driver.wait()
