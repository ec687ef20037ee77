"""The three processes stay apart: what each entry module imports, in a fresh interpreter.

A run is three kinds of process (asyncrl/entrypoints/__init__.py): the controller
(``asyncrl run``), the embedded engine and the trainer ranks. A module one process loads
and another must never need is a layout mistake (the controller would start loading
torch, the engine the trainer's sender...). Each entry module is imported alone in its
own interpreter and the ``asyncrl.*`` modules it pulled in are checked against the
other sides' packages.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

TRAINER_SIDE = (
    "asyncrl.algorithms",
    "asyncrl.engines.train",
    "asyncrl.entrypoints.trainer",
    "asyncrl.transports.weights.sender",
    "asyncrl.transports.weights.collective",
    "asyncrl.transports.weights.cuda_ipc",
)
ENGINE_SIDE = ("asyncrl.engines.rollout.local", "asyncrl.entrypoints.engine")
CONTROLLER_SIDE = (
    "asyncrl.controllers",
    "asyncrl.runner",
    "asyncrl.entrypoints.run",
    "asyncrl.launchers",
    "asyncrl.tasks",
)

FORBIDDEN = {
    # the controller also loads the run's driver (asyncrl.runner), as `asyncrl run` does
    "asyncrl.entrypoints.run": (TRAINER_SIDE + ENGINE_SIDE, "asyncrl.runner"),
    "asyncrl.entrypoints.engine": (TRAINER_SIDE + CONTROLLER_SIDE, None),
    "asyncrl.entrypoints.trainer": (CONTROLLER_SIDE + ENGINE_SIDE, None),
}


def _imported(module: str, also: str | None) -> list[str]:
    code = (
        "import importlib, json, sys\n"
        f"importlib.import_module({module!r})\n"
        + (f"importlib.import_module({also!r})\n" if also else "")
        + "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('asyncrl', 'torch'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.parametrize("entry", sorted(FORBIDDEN))
def test_an_entry_module_imports_nothing_of_another_process(entry: str) -> None:
    forbidden, also = FORBIDDEN[entry]
    if entry.endswith(".run"):
        forbidden = (*forbidden, "torch")  # the controller never loads torch
    loaded = _imported(entry, also)
    assert entry in loaded
    wrong = [m for m in loaded if any(m == f or m.startswith(f + ".") for f in forbidden)]
    assert not wrong, f"{entry} imports modules of another process: {wrong}"
