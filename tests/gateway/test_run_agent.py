"""``asyncrl run --task.name=agent``: the agent function drives episodes through the gateway
and ``--logging.trajectories=true`` writes what was trained.

One real run for the module (``agent_run``), with ``tests.gateway.agents:flaky`` as its
agent: the weather agent, except that sample 1 raises and sample 2 hangs. While it runs, a
stranger (no key, a wrong key, another run's key) tries every route of its gateway. Then
the same run is resumed from its last checkpoint (a copy of it, ``resumed_run``)."""

from __future__ import annotations

import json
import re
import shutil
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from asyncrl.gateway.auth import gateway_key, session_key
from asyncrl.procs import python_env
from asyncrl.secret import generate
from tests.gateway.agents import RAISES_ON, SLEEPS_ON

STEPS = 3
G = 2
B = 2
TIMEOUT_S = 4


def _cli(log: Path, *args: str) -> subprocess.Popen:
    """``asyncrl run ARGS``, its output into the file ``log`` (a pipe nobody reads while it
    runs could fill and stall it)."""
    cmd = [sys.executable, "-m", "asyncrl.cli", "run", *args]
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=python_env())


def _wait(proc: subprocess.Popen, log: Path, timeout_s: float) -> tuple[int, str]:
    """The run's return code (killed after ``timeout_s``) and output."""
    try:
        rc = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()  # its guard process ends the run's children
        rc = proc.wait()
    return rc, log.read_text()


def _request(url: str, method: str, body: Any = None, key: str | None = None) -> int:
    """The status of one request (-1: no answer)."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data else {}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return int(r.status)
    except urllib.error.HTTPError as err:
        return int(err.code)
    except urllib.error.URLError:  # nothing listens (the run ended): not an answer
        return -1


CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
TEXT = {"model": "m", "prompt": "Hi", "max_tokens": 2}


def _routes(sid: str) -> list[tuple[str, str, Any]]:
    """Every route of the gateway (each session route for session ``sid``), and one it has
    not."""
    out: list[tuple[str, str, Any]] = [("GET", "/health", None), ("GET", "/stats", None)]
    for prefix in ("", f"/sessions/{sid}"):
        out += [
            ("POST", prefix + "/v1/chat/completions", CHAT),
            ("POST", prefix + "/v1/completions", TEXT),
            ("GET", prefix + "/v1/models", None),
            ("POST", prefix + "/v1/reward", {"reward": 1}),
        ]
    out += [("POST", f"/sessions/{sid}/reward", {"reward": 1}), ("GET", f"/sessions/{sid}", None)]
    return [*out, ("GET", "/no/such/route", None)]


@dataclass
class AgentRun:
    run: Path
    rc: int
    out: str
    stranger: dict[str, int] = field(default_factory=dict)  # "key method path" -> status
    with_key: int = 0  # GET /stats with the key from the run folder
    info: dict[str, Any] = field(default_factory=dict)  # gateway.json

    def metrics(self) -> list[dict[str, Any]]:
        return [json.loads(ln) for ln in (self.run / "metrics.jsonl").read_text().splitlines()]

    def trajectories(self) -> list[dict[str, Any]]:
        text = (self.run / "trajectories.jsonl").read_text()
        return [json.loads(ln) for ln in text.splitlines()]


def _gateway_info(run: Path, proc: subprocess.Popen, timeout_s: float = 240) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            return json.loads((run / "gateway.json").read_text())
        except (OSError, ValueError):
            time.sleep(0.05)
    raise AssertionError(f"no gateway.json within {timeout_s:.0f} s (rc {proc.poll()})")


@pytest.fixture(scope="module")
def agent_run(tmp_path_factory: pytest.TempPathFactory, chat_model_dir: Path) -> AgentRun:
    run = tmp_path_factory.mktemp("agent") / "run"
    log = run.with_name("run.log")
    proc = _cli(
        log,
        "--task.name=agent", "--task.agent=tests.gateway.agents:flaky",
        f"--controller.total_steps={STEPS}", f"--controller.batch_size={B}",
        f"--algo.group_size={G}", "--rollout.max_new_tokens=48",
        "--logging.trajectories=true", f"--gateway.session_timeout_s={TIMEOUT_S}",
        "--checkpoint.every_steps=1", "--checkpoint.keep=10",
        f"--run_dir={run}",
    )  # fmt: skip
    try:
        info = _gateway_info(run, proc)
        url = info["url"]
        stranger = {}
        others = {  # no key; a made-up one; the keys another run's secret would give
            "none": None,
            "made-up": "sk-asyncrl-" + generate(),
            "other run": gateway_key(generate()),
            "other run's session": session_key(gateway_key(generate()), "mygrp.0"),
        }
        for name, key in others.items():
            for method, path, body in _routes("mygrp.0"):
                stranger[f"{name} {method} {path}"] = _request(url + path, method, body, key)
        with_key = 0
        if "key_file" in info:
            key = Path(info["key_file"]).read_text().strip()
            with_key = _request(url + "/stats", "GET", key=key)
    except BaseException:
        _wait(proc, log, 0.1)
        raise
    rc, out = _wait(proc, log, 300)
    return AgentRun(run, rc, out, stranger, with_key, info)


def test_asyncrl_run_drives_an_agent(agent_run: AgentRun) -> None:
    assert agent_run.rc == 0, agent_run.out[-4000:]
    rows = agent_run.trajectories()
    assert len(rows) == STEPS * B * G and {r["step"] for r in rows} == set(range(STEPS))
    for r in rows:
        n = len(r["token_ids"])
        assert n == len(r["loss_mask"]) == len(r["logprobs"]) == len(r["versions"])
        assert r["session"] and 0 < sum(r["loss_mask"]) < n


def test_a_stranger_is_refused_on_every_route_and_trains_nothing(agent_run: AgentRun) -> None:
    """During the run, every route of the gateway answers 401 to a client without the key,
    with a made-up key or with another run's keys; nothing it sent was trained. The key is
    in the run folder (``gateway.json`` names ``gateway.key``, mode 0600) and opens
    ``/stats``. Before: the gateway answered anyone, and a stranger's sessions trained."""
    refused = {k: v for k, v in agent_run.stranger.items() if v != 401}
    assert not refused and len(agent_run.stranger) == 4 * len(_routes("x")), refused
    assert agent_run.with_key == 200, agent_run.info
    key_file = Path(agent_run.info["key_file"])
    assert key_file.parent == agent_run.run
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert agent_run.rc == 0, agent_run.out[-4000:]
    sessions = {r["session"] for r in agent_run.trajectories()}
    assert sessions and all(s.startswith("agent-") for s in sessions), sessions


def test_a_raising_agent_loses_its_sample_only(agent_run: AgentRun) -> None:
    """Sample 1's agent raises: that sample is rejected (both episodes of its group), its
    traceback is in the controller log once, each episode named by one line, and the run
    trains all its steps. Before: the run ended ("controller task failed: ValueError")."""
    assert agent_run.rc == 0, agent_run.out[-4000:]
    log = (agent_run.run / "controller.log").read_text()
    named = [ln for ln in log.splitlines() if "odd sample" in ln and f"id {RAISES_ON})" in ln]
    assert len(named) == G, log[-4000:]
    assert log.count("Traceback") == 1 and "ValueError: odd sample" in log
    ids = [i for row in agent_run.metrics() for i in row["sample_ids"]]
    assert RAISES_ON not in ids and len(ids) == STEPS * B


def test_a_hung_agent_is_rejected_after_the_timeout(agent_run: AgentRun) -> None:
    """Sample 2's agent makes one call and sleeps: after ``gateway.session_timeout_s`` (what
    ``agent_timeout_s`` defaults to) each of its episodes is cancelled and rejected, logged
    once with the sample id, and the run goes on to its end (step 1 must wait for that
    group: admitted at version 0, ``max_staleness = 1``). Before: nothing was logged and
    the run waited for it forever."""
    assert agent_run.rc == 0, agent_run.out[-4000:]
    log = (agent_run.run / "controller.log").read_text()
    timed = [ln for ln in log.splitlines() if f"session_timeout_s={TIMEOUT_S}s" in ln]
    assert len(timed) == G and all(f"sample id {SLEEPS_ON}:" in ln for ln in timed), log
    ids = [i for row in agent_run.metrics() for i in row["sample_ids"]]
    assert SLEEPS_ON not in ids


def test_resume_keeps_agent_sample_ids(agent_run: AgentRun, tmp_path: Path) -> None:
    """``--resume`` of the agent run (a copy of it, from its checkpoint of step 1, which holds
    groups still running or ready: 2 of the 4 admitted at version 0 were trained, and each
    rejected one let another in) trains on with every batch's sample ids recorded, those of
    the groups restored from the checkpoint too. Before: the restored groups' ids were
    ``None`` (their samples came back as plain dicts)."""
    assert agent_run.rc == 0, agent_run.out[-4000:]
    run = tmp_path / "run"
    shutil.copytree(agent_run.run, run)
    for later in range(2, STEPS + 1):  # resume from step 1
        shutil.rmtree(run / "checkpoints" / f"step-{later}")
    log = tmp_path / "resume.log"
    proc = _cli(log, "--resume", str(run), f"--controller.total_steps={STEPS + 1}")
    rc, out = _wait(proc, log, 300)
    assert rc == 0, out[-4000:]
    m = re.search(r"step 1, (\d+) ready and (\d+) running groups", out)
    assert m and int(m[1]) + int(m[2]) > 0, out[-2000:]  # the checkpoint held groups to go on
    rows = [r for r in json.loads(f"[{','.join(_lines(run))}]") if r["step"] >= 1]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), out[-2000:]
    ids = [i for r in rows for i in r["sample_ids"]]
    assert len(ids) == len(rows) * B and all(isinstance(i, int) for i in ids), ids
    assert len(set(ids)) == len(ids)


def _lines(run: Path) -> list[str]:
    return [ln for ln in (run / "metrics.jsonl").read_text().splitlines() if ln]


def test_agent_completions_get_a_budget(chat_model_dir: Path) -> None:
    """A completion that names no ``max_tokens`` gets ``task.max_new_tokens`` or 128 (it got
    0 when ``rollout.max_new_tokens`` was unset: nothing generated, every reward 0)."""
    from asyncrl.config import AgentTaskConfig, RunConfig
    from asyncrl.gateway.agent import agent_gateway

    agent = "examples.agents:weather_agent"
    for n, budget in ((0, 128), (20, 20)):
        task = AgentTaskConfig(agent=agent, max_new_tokens=n)
        assert agent_gateway(RunConfig(task=task), str(chat_model_dir)).max_tokens == budget
