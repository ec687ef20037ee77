"""User mistakes on the command line fail fast, with one line naming the key, no traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from asyncrl.config import load_config


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
