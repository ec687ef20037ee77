"""``asyncrl.procs.process_age_s``: the clock of the trainer's and engine's start-up lines."""

from __future__ import annotations

import subprocess
import sys
import time

from asyncrl.procs import process_age_s


def test_a_process_age_counts_from_its_own_start_and_ends_with_it() -> None:
    mine = process_age_s()
    assert mine is not None and mine > 0.0  # this interpreter started before this line
    argv = [sys.executable, "-c", "import sys; sys.stdin.read()"]
    child = subprocess.Popen(argv, stdin=subprocess.PIPE)
    try:
        first = process_age_s(child.pid)
        assert first is not None and first <= process_age_s()  # younger than this process
        deadline = time.monotonic() + 30.0
        while (age := process_age_s(child.pid)) is not None and age < first + 0.05:
            assert time.monotonic() < deadline, "the child's age never moved"
            time.sleep(0.01)
        assert age is not None and age >= first + 0.05  # it grows with the clock
    finally:
        child.kill()
        child.wait(timeout=30)
    assert process_age_s(child.pid) is None  # reaped: /proc no longer has it
