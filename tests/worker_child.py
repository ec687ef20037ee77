"""Run by tests/test_forkserver.py as a pytest session of its own (``python -m pytest
tests/worker_child.py``, OUT in ``ASYNCRL_TEST_WORKER_OUT``): a test that starts a process
the way tests do (``subprocess.Popen``), writes both pids to OUT and waits to be killed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def test_start_a_child_and_wait_to_be_killed() -> None:
    out = os.environ["ASYNCRL_TEST_WORKER_OUT"]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(out + ".tmp", "w") as f:
        json.dump({"worker": os.getpid(), "child": child.pid}, f)
    os.replace(out + ".tmp", out)
    time.sleep(600)
