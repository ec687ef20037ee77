"""Upstream code never skips silently in CI: a test that needs the unpacked SGLang or vLLM
source (or vLLM's server dependencies) and does not find it skips locally, naming why, and
FAILS when ``CI=true`` (as ``.ci/run`` runs); ``.ci/run`` itself stops first when they are
absent (``scripts/upstream-sources``)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.engines.rollout.sglang import code as sglang_code
from tests.engines.rollout.vllm import code as vllm_code

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("ci", ["true", ""])
def test_absent_upstream_code_fails_under_ci_and_skips_locally(
    ci: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CI", ci)
    monkeypatch.setattr(vllm_code, "ROOT", tmp_path)
    monkeypatch.setattr(vllm_code, "DEPS", tmp_path / "deps")
    monkeypatch.setattr(sglang_code, "ROOT", tmp_path)
    outcome = pytest.fail.Exception if ci else pytest.skip.Exception
    checks = [vllm_code.vllm_src, vllm_code.vllm_deps, lambda: sglang_code.sglang_src("0.5.23")]
    for check in checks:
        with pytest.raises(outcome, match=r"setup\.sh") as got:
            check()
        assert str(tmp_path) in str(got.value)  # names where it looked


def test_ci_run_stops_when_the_upstream_sources_are_absent(tmp_path: Path) -> None:
    """``scripts/upstream-sources`` (run by ``.ci/run`` before the suite) in a checkout
    without ``.cache``: exit 1, naming every absent source; in this one: exit 0."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "upstream-sources", tmp_path / "scripts")
    bare = subprocess.run(
        ["bash", str(tmp_path / "scripts" / "upstream-sources")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bare.returncode == 1, bare.stdout + bare.stderr
    for name in ("sglang/0.5.10", "sglang/0.5.23", "vllm/0.33.0", "vllm-deps/0.33.0"):
        assert name in bare.stderr, bare.stderr
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.index("scripts/upstream-sources") < ci.index("scripts/test")
    here = subprocess.run(
        ["bash", str(ROOT / "scripts" / "upstream-sources")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if here.returncode:  # this checkout lacks them: the local rule (skip, saying why)
        vllm_code.missing(here.stderr.strip())
