"""``asyncrl bench fuzz``, small: a real engine and a real experience channel take hostile
input; every request answered (no 5xx), every malformed message counted, every cut restored,
the valid messages after it bit-exact."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(600)
def test_bench_fuzz_small(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "fuzz.json"
    args = ["--requests", "300", "--messages", "400", "--producer-messages", "150", "--cuts", "2",
            "--heavy", "1", "--limit-mb", "1", "--model-path", str(tiny_model_dir)]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "bench", "fuzz", *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "asyncrl serve" in proc.stdout and "experience -> consumer" in proc.stdout
    res = json.loads(out.read_text())
    assert res["failures"] == []
    h, e = res["http"], res["experience"]
    assert h["sent"] == 300 and h["5xx"] == 0 and h["unanswered"] == 0 and h["greedy_unchanged"]
    c, p = e["consumer"], e["producer"]
    assert c["sent"] == 400 and c["rejected"] == c["expected_rejects"] == 400 - 2
    assert c["reconnects"] == 2 and p["disconnects"] >= 2
    assert p["sent"] == 150 and p["rejected"] == p["expected_rejects"] == 150 - 2
    assert e["valid_after"] == {"bit_exact": True, "report_received": True}
    assert c["rejected_by"].get("oversized", 0) >= 3  # the three heavy kinds
