"""Run checkpoints on disk: layout, atomic writes, manifests, retention, resume lookup.

Layout of one checkpoint (written by the ``asyncrl run`` process and the trainer)::

    RUN_DIR/checkpoints/step-N/
        controller.msgpack   the controller's state (asyncrl.controllers.state), atomic
        trainer/             the trainer's (asyncrl.engines.train.run_state): DCP shards
        hf/                  the actor as a Hugging Face folder (checkpoint.export_hf only)
        manifest.json        written last, atomically: step, every file with size and CRC-32

A checkpoint exists for resume only once its manifest is there and every file it
names has the recorded size (checksums are verified when it is loaded). Writes go to
a temporary name, are fsynced, then renamed, then the folder is fsynced. Nothing here
imports torch.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import zlib
from pathlib import Path
from typing import Any

import msgspec

from asyncrl.config import RunConfig, load_config
from asyncrl.controllers.state import ControllerState

__all__ = [
    "CONTROLLER_FILE",
    "MANIFEST",
    "Manifest",
    "checkpoint_dir",
    "complete_checkpoints",
    "find_run_dir",
    "latest_checkpoint",
    "load_controller_state",
    "prune",
    "resume_config",
    "truncate_metrics",
    "write_atomic",
    "write_manifest",
]

MANIFEST = "manifest.json"
CONTROLLER_FILE = "controller.msgpack"
_FORMAT = 1

SAFE_ON_RESUME = (
    "controller.total_steps",
    "checkpoint.",
    "rollout.urls",
    "rollout.num_engines",
    "rollout.startup_timeout_s",
    "rollout.request_timeout_s",
    "rollout.max_restarts",
    "rollout.restart_window_s",
    "rollout.extra_args",
    "rollout.device",
    "trainer.world_size",
    "trainer.device",
    "trainer.threads",
    "trainer.max_restarts",
    "trainer.restart_window_s",
    "trainer.micro_batch_tokens",
    "weights.",
    "experience.",
)
"""Config keys (or sections, ending in ``.``) a resumed run may change: where and how
processes run, not what the checkpoint means."""


class FileEntry(msgspec.Struct, frozen=True):
    size: int
    crc32: int


class Manifest(msgspec.Struct, frozen=True):
    step: int
    files: dict[str, FileEntry]
    created: float = 0.0
    format: int = _FORMAT


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step}"


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so a reader sees the old file or the whole new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(ckpt: Path, step: int) -> Manifest:
    """Fsync every file of ``ckpt`` and commit it with a manifest (blocking: run in a thread)."""
    files: dict[str, FileEntry] = {}
    for p in sorted(ckpt.rglob("*")):
        if not p.is_file() or p.name == MANIFEST or p.name.endswith(".tmp"):
            continue
        with open(p, "rb") as f:
            os.fsync(f.fileno())
        files[str(p.relative_to(ckpt))] = FileEntry(p.stat().st_size, _crc(p))
    for d in {p.parent for p in ckpt.rglob("*")} | {ckpt}:
        _fsync_dir(d)
    manifest = Manifest(step=step, files=files, created=time.time())
    write_atomic(ckpt / MANIFEST, msgspec.json.encode(manifest))
    return manifest


def _read_manifest(ckpt: Path, verify: bool) -> Manifest | None:
    try:
        m = msgspec.json.decode((ckpt / MANIFEST).read_bytes(), type=Manifest)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None
    for name, entry in m.files.items():
        p = ckpt / name
        try:
            if p.stat().st_size != entry.size or (verify and _crc(p) != entry.crc32):
                return None
        except OSError:
            return None
    return m


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every checkpoint with a valid manifest, oldest first."""
    root = Path(run_dir) / "checkpoints"
    out = []
    for d in root.glob("step-*") if root.is_dir() else []:
        m = _read_manifest(d, verify=False)
        if m is not None and d.name == f"step-{m.step}":
            out.append((m.step, d))
    return sorted(out)


def latest_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    """The newest checkpoint whose files all match their manifest (checksums verified)."""
    for step, d in reversed(complete_checkpoints(run_dir)):
        if _read_manifest(d, verify=True) is not None:
            return step, d
    return None


def prune(run_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints, and unfinished ones older
    than the newest complete one. Returns what was deleted."""
    done = complete_checkpoints(run_dir)
    if not done:
        return []
    keep_dirs = {d for _, d in done[-keep:]}
    newest = done[-1][0]
    gone = []
    for d in (Path(run_dir) / "checkpoints").glob("step-*"):
        try:
            step = int(d.name.removeprefix("step-"))
        except ValueError:
            continue
        if d not in keep_dirs and step <= newest:
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    return gone


def load_controller_state(ckpt: Path) -> ControllerState:
    state = msgspec.msgpack.decode((ckpt / CONTROLLER_FILE).read_bytes(), type=ControllerState)
    if state.format != 1:
        raise ValueError(f"{ckpt}: controller state format {state.format} is not supported")
    return state


def find_run_dir(spec: str, runs_root: str = "runs") -> Path:
    """``--resume`` argument -> run folder: a folder, or ``latest`` (the newest run under
    ``runs_root`` that has a complete checkpoint)."""
    if spec != "latest":
        path = Path(spec)
        if not (path / "config.json").is_file():
            raise ValueError(f"--resume {spec}: not a run folder (no config.json)")
        return path
    root = Path(runs_root)
    runs = [d for d in root.iterdir() if d.is_dir()] if root.is_dir() else []
    runs = [d for d in runs if (d / "config.json").is_file() and complete_checkpoints(d)]
    if not runs:
        raise ValueError(f"--resume latest: no run with a complete checkpoint under {root}/")
    return max(runs, key=lambda d: max(p.stat().st_mtime for _, p in complete_checkpoints(d)))


def resume_config(run_dir: Path, overrides: list[str]) -> RunConfig:
    """The run's recorded config with ``overrides`` applied; unsafe overrides are refused."""
    base: dict[str, Any] = json.loads((Path(run_dir) / "config.json").read_text())
    for item in overrides:
        key = item.removeprefix("--").partition("=")[0]
        if not any(key == s or (s.endswith(".") and key.startswith(s)) for s in SAFE_ON_RESUME):
            raise ValueError(
                f"--{key} cannot change on --resume (the checkpoint was made with "
                f"{key}={_lookup(base, key)!r}); keys that may change: " + ", ".join(SAFE_ON_RESUME)
            )
    return load_config(None, overrides, base=base)


def _lookup(tree: dict[str, Any], key: str) -> Any:
    node: Any = tree
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def truncate_metrics(path: Path, step: int) -> int:
    """Keep the rows of ``metrics.jsonl`` (or ``trajectories.jsonl``) with ``step < step`` (a
    resume retrains the rest); returns how many rows were dropped."""
    if not path.is_file():
        return 0
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    keep = [ln for ln in lines if json.loads(ln).get("step", -1) < step]
    write_atomic(path, "".join(ln + "\n" for ln in keep).encode())
    return len(lines) - len(keep)
