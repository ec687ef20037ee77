"""``asyncrl run --algo ppo`` is ``--algo.name=ppo``, a named recipe (checked before anything
starts)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from asyncrl.procs import python_env


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "asyncrl.cli", "run", *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, cwd=cwd, timeout=60, env=python_env()
    )


def test_algo_alias_reaches_the_config(tmp_path: Path) -> None:
    # a bad key after the alias fails config validation: the alias itself parsed
    out = _run(["--algo", "ppo", "--algo.lam=2"], tmp_path)
    assert out.returncode == 2 and "algo.lam" in out.stderr
    out = _run(["--algo", "dpo"], tmp_path)
    assert out.returncode == 2 and "invalid choice" in out.stderr
    assert "'dr_grpo', 'dapo', 'gspo', 'luspo', 'cispo', 'sapo'" in out.stderr  # the known ones
    out = _run(["--algo", "dapo", "--algo.lam=2"], tmp_path)  # a recipe's keys then the user's
    assert out.returncode == 2 and "algo.lam" in out.stderr
    assert not (tmp_path / "runs").exists()


def test_run_help_lists_every_recipe(tmp_path: Path) -> None:
    from asyncrl.config.algo_recipes import RECIPES

    out = _run(["--help"], tmp_path)
    text = " ".join(out.stdout.split())
    assert out.returncode == 0
    for name, (doc, _) in RECIPES.items():
        assert f"{name}: {' '.join(doc.split())}" in text
