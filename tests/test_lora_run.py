"""End to end: `asyncrl run --lora.rank=8` learns the default task with adapter-only pushes,
and no weight update pauses or aborts generation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.procs import python_env
from tests.marks import needs_peft

pytestmark = needs_peft  # (not importorskip: see tests/marks.py)

STEPS = 50


@pytest.mark.slow
def test_lora_run_learns_with_adapter_only_pushes_and_no_pause(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "asyncrl.cli", "run", "--lora.rank=8", "--run-dir", str(run)]
    cmd += [f"--model.path={tiny_model_dir}", "--quiet", f"--controller.total_steps={STEPS}"]
    cmd += ["--logging.trace.enabled=false"]
    proc = subprocess.Popen(cmd, env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    first = sum(r["reward_mean"] for r in rows[:5]) / 5
    last = sum(r["reward_mean"] for r in rows[-5:]) / 5
    assert last - first >= 0.3, f"reward {first:.3f} -> {last:.3f}"
    adapter = {r["bytes"] for r in rows}
    assert len(adapter) == 1 and all(r["pauses"] == 0 for r in rows)
    stats = _engine_stats(run / "engine0.log")
    assert stats["pauses"] == 0 and stats["aborted"] == 0
    model_bytes = (tiny_model_dir / "model.safetensors").stat().st_size
    assert adapter.pop() < model_bytes
    assert (run / "final" / "adapter" / "adapter_model.safetensors").is_file()


def _engine_stats(log: Path) -> dict:
    """The engine's counters, logged when it shut down."""
    lines = [ln for ln in log.read_text().splitlines() if "engine stats: " in ln]
    assert lines, f"{log} has no 'engine stats' line"
    return json.loads(lines[-1].split("engine stats: ", 1)[1])
