"""``asyncrl run`` against stand-in engines: the job the stand-in tests of every family run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from asyncrl.procs import python_env


def start_gloo_run(
    backend: str, tmp: Path, model_dir: Path, urls: list[str], steps: int, *extra: str
) -> subprocess.Popen:
    """The default job on the model at ``model_dir`` against the ``backend`` engines at
    ``urls``: ``steps`` steps of batch 2 at max_staleness 1, weights over Gloo in buckets of
    1 MB, the run folder ``tmp / "run"``, ``extra`` flags last; its output piped."""
    cmd = [sys.executable, "-m", "asyncrl.cli", "run", "--run-dir", str(tmp / "run"), "--quiet"]
    cmd += [f"--model.path={model_dir}", f"--rollout.backend={backend}"]
    cmd += [f"--rollout.urls={json.dumps(urls)}", "--weights.backend=gloo"]
    cmd += [f"--controller.total_steps={steps}", "--controller.batch_size=2"]
    cmd += ["--controller.max_staleness=1", "--weights.bucket_mb=1", *extra]
    return subprocess.Popen(cmd, env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
