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
import shutil
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
    "asyncrl.pusher",  # the embedding API's sender (the user's process: their trainer)
    X + "zmq_recv",  # receives experiences
)
L = "asyncrl.engines.rollout.local."
ENGINE_SIDE = (
    # the embedded engine; its folder's family.py (launch flags, weight adapter) is shared
    *(L + m for m in ("attention", "checks", "decode", "engine", "kv", "lora", "sampling")),
    L + "server",
    L + "weights",
    "asyncrl.entrypoints.engine",
    L + "collective_recv",  # receives weights
    L + "cuda_ipc_recv",
)
CONTROLLER_SIDE = (
    "asyncrl.controllers",
    "asyncrl.gateway",
    "asyncrl.runner",
    "asyncrl.entrypoints.run",
    "asyncrl.launchers",
    "asyncrl.tasks",
    X + "zmq_send",  # sends experiences
    *(X + m for m in ("send_peers", "send_ring", "send_socket")),  # zmq_send's parts
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


def test_the_family_folders_hold_every_module_of_the_embedded_engine() -> None:
    """ENGINE_SIDE names the embedded engine's modules one by one (its folder also holds
    ``family.py``, which the controller and the trainer load): a new module there is placed
    on purpose."""
    folder = Path(__file__).resolve().parents[1] / "asyncrl" / "engines" / "rollout" / "local"
    shared = {"__init__", "family", "inproc"}  # inproc: the in-process client of tests
    found = {p.stem for p in folder.glob("*.py")} - shared
    assert {L + m for m in found} <= set(ENGINE_SIDE), sorted(found)


# -- the import graph: layers ---------------------------------------------------------------
LAYERS: tuple[tuple[str, ...], ...] = (
    # lowest first; a module may import from its own layer and the layers before it only
    ("core", "config", "trace", "secret", "loops", "net", "progress", "plot", "sinks"),
    ("procs", "forkserver"),
    ("transports",),  # bytes between processes: experiences, weights (knows no engine)
    ("engines",),  # train engine; rollout families (client, launcher, weight adapter)
    ("controllers",),
    ("tasks", "algorithms"),
    ("gateway",),
    ("launchers", "guard", "preflight", "embedding", "pusher", "task_factory"),
    ("runner", "run_ledger", "run_loops", "run_steplog", "run_supervisor"),
    ("entrypoints",),
    ("cli", "bench", "__init__"),  # __init__: the package's public names (lazy)
)
"""The layer order of asyncrl's top-level packages and modules (``asyncrl.X``), written once."""

PENDING: dict[tuple[str, str], str] = {
    # (importing file, imported module): why it is still there. Each must still occur (a
    # fixed one is removed from here); the graph is checked without them.
}
"""Upward imports known today, each with who removes it (none today: the controller's engine
set takes ``controllers.deaths``' Restarter and Death, which the launchers implement)."""


def _top(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "asyncrl":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def import_graph(root: Path) -> list[tuple[str, str, str, int]]:
    """Every import in the package at ``root`` (a folder named ``asyncrl``) as ``(file,
    imported module, importing top-level name, line)``: module-level and function-level
    imports, and imports under ``if TYPE_CHECKING:`` too (a type-only import is still a
    dependency a reader follows, and a cycle through annotations is still a cycle).
    Relative imports are resolved against the file's package."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        parts = list(rel.with_suffix("").parts)
        package = parts[:-1]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        src = _top(".".join(parts))
        assert src is not None
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                module = ".".join([*base, *([node.module] if node.module else [])])
                names = [_submodule(root, module, a.name) for a in node.names]
            found += [(rel.as_posix(), n, src, node.lineno) for n in names]
    return found


def _submodule(root: Path, module: str, name: str) -> str:
    """``module.name`` when that is a module or package under ``root`` (``from asyncrl
    import trace``), else ``module`` (``name`` is a name inside it)."""
    path = root.parent.joinpath(*f"{module}.{name}".split("."))
    return f"{module}.{name}" if path.with_suffix(".py").is_file() or path.is_dir() else module


def layer_errors(root: Path, pending: dict[tuple[str, str], str] | None = None) -> list[str]:
    """What breaks the layer order in the package at ``root``: an import from a lower layer
    into a higher one, a top-level name not placed in :data:`LAYERS`, a cycle between
    top-level names (of one layer: across layers a cycle needs an upward import), and a
    ``pending`` entry that no longer occurs."""
    pending = {} if pending is None else pending
    rank = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    errors, seen, edges = [], set(), {}
    for file, module, src, line in import_graph(root):
        dst = _top(module)
        if dst is None or dst == src:
            continue
        if (file, module) in pending:
            seen.add((file, module))
            continue
        for name in (src, dst):
            if name not in rank:
                errors.append(f"asyncrl.{name} is in no layer: place it in LAYERS")
                rank[name] = -1
        if rank[dst] > rank[src]:
            errors.append(f"{file}:{line}: {src} (layer {rank[src]}) imports {module} "
                          f"(layer {rank[dst]}, higher)")  # fmt: skip
        edges.setdefault(src, set()).add(dst)
    errors += [f"{f}: no longer imports {m}: remove it from PENDING" for f, m in pending.keys()
               - seen]  # fmt: skip
    errors += [f"import cycle: {' -> '.join(c)}" for c in _cycles(edges)]
    return errors


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each name that lies on one (depth-first search)."""
    out, done = [], set()
    for start in sorted(edges):
        stack, path = [(start, iter(sorted(edges.get(start, ()))))], [start]
        while stack:
            _, nxt = stack[-1]
            child = next(nxt, None)
            if child is None:
                stack.pop()
                path.pop()
            elif child == start and start not in done:
                out.append([*path, start])
                done.update(path)
            elif child not in path and child not in done:
                stack.append((child, iter(sorted(edges.get(child, ())))))
                path.append(child)
    return out


ROOT = Path(__file__).resolve().parents[1] / "asyncrl"


def test_imports_follow_the_layers_and_no_package_cycle() -> None:
    errors = layer_errors(ROOT, PENDING)
    assert not errors, "\n".join(errors)


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(ROOT, tmp_path / "asyncrl", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path / "asyncrl"


def test_a_planted_engine_import_in_a_transport_function_fails(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    base = root / "transports" / "weights" / "base.py"
    base.write_text(base.read_text() + "\n\ndef _planted():\n    import asyncrl.engines\n")
    errors = layer_errors(root, PENDING)
    assert any(
        "transports/weights/base.py" in e and "imports asyncrl.engines" in e for e in errors
    ), errors
    assert any(e.startswith("import cycle:") and "transports" in e for e in errors), errors


def test_a_planted_cycle_within_a_layer_and_an_unplaced_package_fail(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    procs = root / "procs.py"  # procs and forkserver share a layer; forkserver imports procs
    procs.write_text(procs.read_text() + "\n\nif False:\n    from asyncrl import forkserver\n")
    (root / "newpkg.py").write_text("from asyncrl.core import Sample\n")
    errors = layer_errors(root, PENDING)
    assert any("cycle" in e and "procs" in e and "forkserver" in e for e in errors), errors
    assert "asyncrl.newpkg is in no layer: place it in LAYERS" in errors
    assert layer_errors(root, {**PENDING, ("asyncrl/x.py", "asyncrl.y"): "gone"})[-1:] != []


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


def test_no_transport_imports_an_engine() -> None:
    """The weight transport reaches engines only through the seam it defines
    (``transports/weights/seam.py``), implemented by each family's ``family.py`` and handed in
    by the caller: no module under ``transports/`` imports ``asyncrl.engines`` (any depth,
    lazily or not), nor any package above it."""
    root = ROOT / "transports"
    above = ("asyncrl.engines", "asyncrl.controllers", "asyncrl.runner", "asyncrl.launchers")
    wrong = [
        f"{p.relative_to(root.parent)}: {m}"
        for p in sorted(root.rglob("*.py"))
        for m in _imports(p)
        if any(m == f or m.startswith(f + ".") for f in above)
    ]
    assert not wrong, f"transports import an engine or a layer above: {wrong}"
