"""User mistakes on the command line fail fast, with one line naming the key, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.preflight import cuda_devices


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("--weights.timeout_s=nan", "weights.timeout_s"),
        ("--rollout.temperature=NaN", "rollout.temperature"),
        ("--rollout.request_timeout_s=-1", "rollout.request_timeout_s"),
        ("--controller.health_interval_s=0", "controller.health_interval_s"),
    ],
)
def test_non_finite_floats_and_non_positive_timeouts_are_refused(override: str, key: str) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_top_level_override_with_equals_sign() -> None:
    out = _cli("run", "--seed=abc")
    assert out.returncode == 2 and "seed" in out.stderr and "Traceback" not in out.stderr
    assert "unrecognized arguments" not in out.stderr


def test_serve_takes_the_engine_arguments() -> None:
    out = _cli("serve", "--model-path", "/nonexistent", "--port", "1", "--help")
    assert out.returncode == 0 and "--model-path" in out.stdout and "--port" in out.stdout


def _timed_run(tmp_path: Path, *overrides: str) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    out = _cli("run", "--run-dir", str(tmp_path / "run"), "--quiet", *overrides)
    return out, time.monotonic() - t0


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("--task.name=math", "task.path"),  # and no file
        ("--rollout.device=cuda", "rollout.device"),
        ("--trainer.device=cuda:0", "trainer.device"),
        ("--weights.backend=nccl", "weights.backend"),
    ],
)
def test_what_this_host_lacks_is_refused_before_anything_starts(
    tmp_path: Path, override: str, key: str
) -> None:
    if "cuda" in override or "nccl" in override:
        if cuda_devices()[0]:
            pytest.skip("this machine has CUDA")
    out, took = _timed_run(tmp_path, override, f"--task.path={tmp_path / 'missing.jsonl'}")
    assert out.returncode == 2, out.stderr
    assert key in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()  # nothing started, nothing written
    assert took < 10  # interpreter + imports; the check itself is < 1 ms


def test_unreachable_rollout_urls_reported_within_the_startup_timeout(
    tmp_path: Path, free_port: int
) -> None:
    url = f"http://127.0.0.1:{free_port}"  # nothing listens there
    out, took = _timed_run(tmp_path, f"--rollout.urls={url}", "--rollout.startup_timeout_s=3")
    assert out.returncode == 1, out.stderr
    assert url in out.stderr and "rollout.urls" in out.stderr and "Traceback" not in out.stderr
    assert 3 <= took < 20
    pids = tmp_path / "run" / "processes.json"
    assert not pids.exists() or json.loads(pids.read_text()) == {}  # no trainer was started


def test_unbindable_experience_endpoint_is_one_line(tmp_path: Path) -> None:
    # 192.0.2.1 (TEST-NET-1, RFC 5737) is no address of this host: bind fails at once
    out, took = _timed_run(tmp_path, "--experience.endpoint=tcp://192.0.2.1:5555")
    assert out.returncode == 1, out.stderr
    assert "experience.endpoint" in out.stderr and "Traceback" not in out.stderr
    assert took < 20
