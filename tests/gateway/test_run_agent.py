"""``asyncrl run --task.name=agent``: the agent function drives episodes through the gateway
and ``--logging.trajectories=true`` writes what was trained."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from asyncrl.procs import python_env


def test_asyncrl_run_drives_an_agent(tmp_path: Path, chat_model_dir: Path) -> None:
    run = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "asyncrl.cli", "run",
        "--task.name=agent", "--task.agent=asyncrl.gateway.agent:weather_agent",
        "--controller.total_steps=2", "--controller.batch_size=2", "--algo.group_size=2",
        "--rollout.max_new_tokens=48", "--logging.trajectories=true", f"--run_dir={run}",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=python_env())
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = [json.loads(line) for line in (run / "trajectories.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 2 * 2 and {r["step"] for r in rows} == {0, 1}
    for r in rows:
        n = len(r["token_ids"])
        assert n == len(r["loss_mask"]) == len(r["logprobs"]) == len(r["versions"])
        assert r["session"] and 0 < sum(r["loss_mask"]) < n


def test_agent_completions_get_a_budget(chat_model_dir: Path) -> None:
    """A completion that names no ``max_tokens`` gets ``task.max_new_tokens`` or 128 (it got
    0 when ``rollout.max_new_tokens`` was unset: nothing generated, every reward 0)."""
    from asyncrl.config import RunConfig, TaskConfig
    from asyncrl.gateway.agent import agent_gateway

    agent = "asyncrl.gateway.agent:weather_agent"
    for n, budget in ((0, 128), (20, 20)):
        task = TaskConfig(name="agent", agent=agent, max_new_tokens=n)
        assert agent_gateway(RunConfig(task=task), str(chat_model_dir)).max_tokens == budget
