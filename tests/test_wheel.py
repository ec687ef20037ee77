"""The built wheel: contents, declared dependencies, and benchmarks that run from an install.

The wheel is built offline (no build isolation, no index) from a copy of the
source, installed with ``--no-deps --no-index`` into a fresh virtualenv whose
dependencies come from this test's environment (a ``.pth`` line naming its
site-packages: the folders only, not their ``.pth`` files, so the editable
install of the source tree is not seen). The commands then run from an
unrelated folder with no ``PYTHONPATH``: only the wheel's asyncrl can answer.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 300
# modules of optional backends that this environment does not install: their distributions
NOT_INSTALLED = {"torch_npu": "torch-npu", "sglang": "sglang", "vllm": "vllm"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "asyncrl", src / "asyncrl", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("dist")
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    cmd += ["--no-index", str(src), "-w", str(out)]
    subprocess.run(cmd, check=True, timeout=TIMEOUT, capture_output=True)
    (whl,) = out.glob("asyncrl-*.whl")
    return whl


def test_wheel_contents(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "asyncrl").rglob("*.py")}
    assert sources <= names, sorted(sources - names)
    assert "asyncrl/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/"))]
    assert {f"asyncrl/bench/{m}.py" for m in ("transport", "weight_sync", "learning")} <= names


def _imported_modules() -> set[str]:
    """Top-level names of every module that asyncrl's source imports (absolute imports)."""
    found: set[str] = set()
    for path in (ROOT / "asyncrl").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found - {"asyncrl", "__future__"} - set(sys.stdlib_module_names)


def test_every_import_is_declared(wheel: Path) -> None:
    meta = zipfile.ZipFile(wheel)
    (name,) = [n for n in meta.namelist() if n.endswith(".dist-info/METADATA")]
    requires = [line.split(":", 1)[1] for line in meta.read(name).decode().splitlines()
                if line.startswith("Requires-Dist:")]  # fmt: skip
    declared = {_norm(re.split(r"[\s\[<>=!~;]", r.strip(), maxsplit=1)[0]) for r in requires}
    owners = md.packages_distributions()
    missing = []
    for mod in sorted(_imported_modules()):
        dists = owners.get(mod) or [NOT_INSTALLED.get(mod, f"<unknown owner of {mod}>")]
        if not any(_norm(d) in declared for d in dists):
            missing.append((mod, dists))
    assert not missing, f"imported but not declared in pyproject: {missing}"


@pytest.fixture(scope="module")
def fresh_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    env_dir = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(site, "_deps_of_the_test_env.pth").write_text("\n".join(sorted(ours)) + "\n")
    cmd = [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps"]
    subprocess.run([*cmd, "--no-index", str(wheel)], check=True, timeout=TIMEOUT)
    return env_dir


def _env() -> dict[str, str]:
    # nor the session's shared fork server (its processes would run this tree's asyncrl)
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "ASYNCRL_FORK_SERVER")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["HF_HUB_OFFLINE"] = "1"
    return env


def test_installed_wheel_runs_benchmarks(fresh_venv: Path, tmp_path: Path) -> None:
    bin_dir = fresh_venv / "bin"
    where = subprocess.run(
        [bin_dir / "python", "-c", "import asyncrl; print(asyncrl.__file__)"],
        cwd=tmp_path, env=_env(), check=True, capture_output=True, text=True, timeout=120,
    ).stdout  # fmt: skip
    assert Path(where.strip()).is_relative_to(fresh_venv), where

    helped = subprocess.run(
        [bin_dir / "asyncrl", "bench", "transport", "--help"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert helped.returncode == 0, helped.stderr
    assert "usage: asyncrl bench transport" in helped.stdout
    assert "--trajectories" in helped.stdout

    out = tmp_path / "ws.json"
    cmd = [bin_dir / "asyncrl", "bench", "weight-sync", "--model", "tiny", "--dtype", "float32"]
    cmd += ["--repeats", "1", "--modes", "overlap", "--no-naive", "--json", str(out)]
    ran = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True,
                         timeout=TIMEOUT)  # fmt: skip
    assert ran.returncode == 0, ran.stdout + ran.stderr
    import json

    rows = json.loads(out.read_text())
    assert [r["mode"] for r in rows] == ["overlap"]
    assert rows[0]["verified"] is True
    assert rows[0]["total_s"] > 0
