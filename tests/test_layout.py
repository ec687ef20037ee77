"""The three processes stay apart: what each entry module imports, in a fresh interpreter.

A run is three kinds of process (asyncrl/entrypoints/__init__.py): the controller
(``asyncrl run``), the embedded engine and the trainer ranks. A module one process loads
and another must never need is a layout mistake (the controller would start loading
torch, the engine the trainer's sender...). Transport modules say by name which process
runs them: ``*_send`` (and ``send_*``) the sending process, ``*_recv`` the receiving one,
``*_wire`` both. Each entry module is imported alone in its own interpreter (with the
modules its process loads later by name, e.g. the weight sender the factory picks) and
the ``asyncrl.*`` modules it pulled in are checked against the other sides' packages.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

W = "asyncrl.transports.weights."
X = "asyncrl.transports.experience."
TRAINER_SIDE = (
    "asyncrl.algorithms",
    "asyncrl.engines.train",
    "asyncrl.entrypoints.trainer",
    W + "send_engines",  # sends weights
    W + "send_staging",
    W + "send_stream",
    W + "collective_send",
    W + "cuda_ipc_send",
    W + "pusher_send",  # the embedding API's sender (the user's process: their trainer)
    X + "zmq_recv",  # receives experiences
)
ENGINE_SIDE = (
    "asyncrl.engines.rollout.local",
    "asyncrl.entrypoints.engine",
    W + "collective_recv",  # receives weights
    W + "cuda_ipc_recv",
)
CONTROLLER_SIDE = (
    "asyncrl.controllers",
    "asyncrl.gateway",
    "asyncrl.runner",
    "asyncrl.entrypoints.run",
    "asyncrl.launchers",
    "asyncrl.tasks",
    X + "zmq_send",  # sends experiences
)

PROCESSES = {
    # entry module, what the process also loads by name later, the other sides
    "controller": (
        "asyncrl.entrypoints.run",
        ["asyncrl.runner", "asyncrl.gateway"],
        (*TRAINER_SIDE, *ENGINE_SIDE, "torch"),  # the controller never loads torch
    ),
    "engine": ("asyncrl.entrypoints.engine", [], (*TRAINER_SIDE, *CONTROLLER_SIDE)),
    "trainer": (
        "asyncrl.entrypoints.trainer",
        [W + "collective_send", W + "cuda_ipc_send"],
        (*CONTROLLER_SIDE, *ENGINE_SIDE),
    ),
}


def _loaded(modules: list[str]) -> list[str]:
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.parametrize("process", sorted(PROCESSES))
def test_a_process_loads_no_module_of_another_process(process: str) -> None:
    entry, later, forbidden = PROCESSES[process]
    loaded = _loaded([entry, *later])
    assert entry in loaded
    wrong = [m for m in loaded if any(m == f or m.startswith(f + ".") for f in forbidden)]
    assert not wrong, f"the {process} ({entry}) imports modules of another process: {wrong}"


FAMILIES = tuple(f"asyncrl.engines.rollout.{f}" for f in ("sglang", "vllm", "local"))


def _imports(path: Path) -> list[str]:
    """Every module an ``import`` / ``from ... import`` in ``path`` names (any depth)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append(node.module)
            found += [f"{node.module}.{a.name}" for a in node.names]
    return found


def test_no_transport_imports_an_engine_family() -> None:
    """The weight transport reaches engines only through the EngineControl seam
    (``engines/rollout/base.py``), built by ``engines/rollout/factory.py``: no module under
    ``transports/`` imports ``engines.rollout.{sglang,vllm,local}``."""
    root = Path(__file__).resolve().parents[1] / "asyncrl" / "transports"
    wrong = [
        f"{p.relative_to(root.parent)}: {m}"
        for p in sorted(root.rglob("*.py"))
        for m in _imports(p)
        if any(m == f or m.startswith(f + ".") for f in FAMILIES)
    ]
    assert not wrong, f"transports import an engine family: {wrong}"
