"""Each process imports only its own side of each transport.

Transport modules say by name which process runs them: ``*_send`` (and ``sender``) the
sending process, ``*_recv`` the receiving one, ``*_wire`` both. Importing a process's
modules, in a fresh interpreter, must not load the other side's.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

W = "asyncrl.transports.weights."
X = "asyncrl.transports.experience."
SENDERS = {W + "sender", W + "collective_send", W + "cuda_ipc_send"}
RECEIVERS = {W + "collective_recv", W + "cuda_ipc_recv"}

CASES = {
    # the trainer: sends weights, receives experiences
    "trainer": (
        ["asyncrl.engines.train.worker", W + "collective_send", W + "cuda_ipc_send"],
        RECEIVERS | {X + "zmq_send"},
    ),
    # the engine server: receives weights, nothing of experiences
    "engine": (
        ["asyncrl.engines.rollout.local.server"],
        SENDERS | {X + "zmq_send", X + "zmq_recv"},
    ),
    # the controller: sends experiences, nothing of weights
    "controller": (["asyncrl.runner"], SENDERS | RECEIVERS | {X + "zmq_recv"}),
}


def _loaded(modules: list[str]) -> set[str]:
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return set(json.loads(out.stdout))


@pytest.mark.parametrize("process", sorted(CASES))
def test_a_process_loads_no_module_of_the_other_side(process: str) -> None:
    modules, forbidden = CASES[process]
    assert _loaded(modules) & forbidden == set()
