"""Config: defaults, TOML, dotted overrides, and errors that name the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from asyncrl.config import RunConfig, load_config


def test_defaults_are_the_embedded_job() -> None:
    cfg = load_config()
    assert cfg == RunConfig()
    assert cfg.rollout.backend == "local" and cfg.controller.max_staleness == 1
    with pytest.raises(AttributeError):
        cfg.seed = 3  # type: ignore[misc]  # frozen


def test_toml_then_overrides(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('seed = 7\n[controller]\nbatch_size = 4\n[rollout]\nurls = ["http://h:1"]\n')
    cfg = load_config(
        f, ["--controller.batch_size=2", "--weights.backend=gloo", "--algo.clip_eps=0.3"]
    )
    assert cfg.seed == 7
    assert cfg.controller.batch_size == 2
    assert cfg.weights.backend == "gloo"
    assert cfg.algo.clip_eps == 0.3
    assert cfg.rollout.urls == ("http://h:1",)
    assert msgspec.convert(msgspec.to_builtins(cfg), RunConfig) == cfg


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("--controller.nope=1", "controller.nope"),
        ("--weights.backend=tcp", "allowed values: 'auto', 'gloo', 'nccl', 'hccl', 'cuda-ipc'"),
        ("--controller.batch_size=many", "controller.batch_size"),
        ("--controller.batch_size=0", "controller.batch_size must be > 0"),
        ("--controller.max_staleness=-1", "controller.max_staleness"),
        ("--bogus.key=1", "allowed keys"),
        ("controller.batch_size", "--section.key=value"),
    ],
)
def test_errors_name_the_key(override: str, needle: str) -> None:
    with pytest.raises(ValueError, match=None) as info:
        load_config(None, [override])
    assert needle in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["--weights.ipc_copy=foreach"], "weights.ipc_copy='foreach' applies to weights.backend = "
         "'cuda-ipc' only; this run has weights.backend='auto'"),
        (["--weights.backend=gloo", "--weights.ipc_verify=true"], "'cuda-ipc' only"),
        (["--weights.backend=cuda-ipc", "--weights.delta=auto"],
         "weights.delta='auto' applies to weights.backend = 'auto' | 'gloo' | 'nccl' | 'hccl'"),
        (["--rollout.tp_size=2"], "rollout.tp_size=2 applies to rollout.backend = 'sglang' only"),
        (["--rollout.backend=sglang", "--rollout.kv_after_update=keep"],
         "applies to rollout.backend = 'local' only; this run has rollout.backend='sglang'"),
    ],
)  # fmt: skip
def test_an_option_of_another_backend_is_refused(overrides: list[str], needle: str) -> None:
    """Not silently ignored: the message names the backend(s) the option belongs to."""
    with pytest.raises(ValueError) as info:
        load_config(None, overrides)
    assert needle in str(info.value)
    assert "invalid config key" not in str(info.value)  # one line, the key first


def test_options_of_the_chosen_backend_are_taken() -> None:
    cfg = load_config(None, ["--weights.backend=cuda-ipc", "--weights.ipc_copy=foreach"])
    assert cfg.weights.ipc_copy == "foreach"
    cfg = load_config(None, ["--rollout.backend=sglang", "--rollout.tp_size=2"])
    assert cfg.rollout.tp_size == 2
    cfg = load_config(None, ["--weights.backend=gloo", "--weights.delta=auto"])
    assert cfg.weights.delta == "auto"


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not found"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[controller\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_config(bad)


def test_help_and_config_import_no_torch() -> None:
    code = "import sys, asyncrl.cli, asyncrl; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    out = subprocess.run([sys.executable, "-m", "asyncrl.cli", "--help"], capture_output=True)
    assert out.returncode == 0 and b"run" in out.stdout


def test_cli_rejects_bad_override_before_starting_anything(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "asyncrl.cli", "run", "--controller.batch_size=x"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 2
    assert "controller.batch_size" in out.stderr
    assert not (tmp_path / "runs").exists()
