"""Metric sinks beyond metrics.jsonl: TensorBoard and Weights & Biases (optional extras).

``make_sinks(cfg, run_dir)`` (the one factory) returns the sinks that
``[logging.tensorboard]`` / ``[logging.wandb]`` enable. Each gets every step's
metrics row under the row's own names, grouped by prefix (``group_of``:
``reward/``, ``perf/``, ``staleness/``, ``sync/``, ``algo/``, ``engine/``), with
the step as the x axis; at the start, the run's config and git revision.

A step can be logged twice: a restarted trainer retrains from its checkpoint, and
``--resume`` retrains the steps after the newest checkpoint. ``metrics.jsonl`` then
drops its rows from that step on; the sinks follow as far as each backend allows
(``rewind``): TensorBoard gets a ``SessionLog.START`` event at that step, on which
its reader discards every event at or after the step
(``tensorboard/backend/event_processing/plugin_event_accumulator.py``,
``_CheckForRestartAndMaybePurge``, 2.21.0; the first START of a log dir only opens
it), so each step shows the values of its last training. W&B refuses a step lower
than one it has (history steps only increase): after a trainer restart the W&B run
keeps the values first logged for a retrained step and skips the retrained rows; a
resumed run continues the same W&B run (its id is kept in ``RUN_DIR/wandb-run-id``)
from the step W&B reports it has (online; offline it knows none, and the rows that a
killed run had not yet written come again).

Contract: a sink never stops the run. Its first failure (missing package, no
network, a bad key) logs one warning and turns that sink off; ``metrics.jsonl``
is unaffected. Nothing imports ``tensorboard`` or ``wandb`` unless enabled, and
neither imports torch here (the controller's process).
"""

from __future__ import annotations

import logging
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any, Protocol

from asyncrl.config import RunConfig, to_dict

__all__ = [
    "MetricSink",
    "close_sinks",
    "git_revision",
    "group_of",
    "log_row",
    "make_sinks",
    "rewind_sinks",
]

log = logging.getLogger("asyncrl.sinks")

_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward_",)),
    ("staleness", ("staleness_", "weight_version", "ctl_")),
    ("engine", ("ctl_engine", "ctl_engines")),
    ("sync", ("sync_s", "push_", "snapshot_s", "bytes", "buckets")),
    ("perf", ("wall_s", "controller_s", "train_s", "idle_s", "cpu_", "train_tokens",
              "response_tokens", "num_samples", "updates")),
)  # fmt: skip


def group_of(key: str) -> str:
    """``group/key`` for a metrics.jsonl name (the most specific prefix wins; else ``algo``);
    a name that already has its group (``eval/reward_mean``) is kept as it is."""
    if "/" in key:
        return key
    best, length = "algo", 0
    for group, prefixes in _GROUPS:
        for p in prefixes:
            if key.startswith(p) and len(p) > length:
                best, length = group, len(p)
    return f"{best}/{key}"


def git_revision(path: Path | None = None) -> str:
    """The git commit of the source tree asyncrl runs from ("" outside a checkout)."""
    where = path or Path(__file__).resolve().parent
    try:
        cmd = ["git", "-C", str(where), "rev-parse", "HEAD"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


class MetricSink(Protocol):
    """Where metrics rows go besides metrics.jsonl."""

    name: str

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """Record ``scalars`` (grouped names) at ``step``."""
        ...

    def rewind(self, step: int) -> None:
        """Steps ``>= step`` will be logged again: drop (or keep, if the backend cannot)
        what was logged for them."""
        ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Event files via tensorboard's own event writer (no TensorFlow, no torch)."""

    name = "tensorboard"

    def __init__(self, log_dir: Path, config: dict[str, Any], revision: str, start_step: int = 0):
        """``start_step`` > 0: a resumed run; events of an earlier attempt in ``log_dir`` at
        or after it are discarded by TensorBoard's reader."""
        import json

        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        self._writer = EventFileWriter(str(log_dir))
        self.rewind(start_step)  # a fresh log dir: the first START only opens it
        self._text("config", "```\n" + json.dumps(config, indent=1) + "\n```")
        self._text("git_revision", revision or "(not a git checkout)")

    def rewind(self, step: int) -> None:
        from tensorboard.compat.proto import event_pb2

        start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
        self._writer.add_event(self._event(wall_time=time.time(), step=step, session_log=start))
        self._writer.flush()

    def _text(self, tag: str, text: str) -> None:
        from tensorboard.compat.proto import tensor_pb2, tensor_shape_pb2, types_pb2
        from tensorboard.plugins.text import metadata

        tensor = tensor_pb2.TensorProto(
            dtype=types_pb2.DT_STRING,
            string_val=[text.encode()],
            tensor_shape=tensor_shape_pb2.TensorShapeProto(),
        )
        meta = metadata.create_summary_metadata(display_name=tag, description="")
        value = self._summary.Value(tag=tag, metadata=meta, tensor=tensor)
        self._writer.add_event(self._event(wall_time=time.time(), step=0, summary=self._summary(
            value=[value])))  # fmt: skip

    def log(self, step: int, scalars: dict[str, float]) -> None:
        values = [self._summary.Value(tag=k, simple_value=v) for k, v in scalars.items()]
        self._writer.add_event(
            self._event(wall_time=time.time(), step=step, summary=self._summary(value=values))
        )

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """A W&B run (``mode = "offline"`` writes it under the run folder, no network)."""

    name = "wandb"

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        config: dict[str, Any],
        revision: str,
    ):
        """A resume continues the run's W&B run (same id): the steps W&B already has are
        skipped (its ``starting_step``; offline, W&B knows none, so all are logged)."""
        import wandb

        wc = cfg.logging.wandb
        id_file = run_dir / "wandb-run-id"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        self._run = wandb.init(
            project=wc.project,
            entity=wc.entity or None,
            name=wc.name or run_dir.name,
            mode=wc.mode,
            dir=str(run_dir),
            config={**config, "git_revision": revision},
            reinit="finish_previous",
            id=run_id,
            resume="allow",
        )
        self._last = self._skip_through = self._run.starting_step - 1  # steps only increase

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if step <= self._skip_through:  # a retrained step W&B already has
            return
        self._run.log(scalars, step=step)
        self._last = step

    def rewind(self, step: int) -> None:
        self._skip_through = self._last

    def close(self) -> None:
        self._run.finish()


class _Guarded:
    """A sink that warns once on its first failure and is off from then on."""

    def __init__(self, name: str, sink: MetricSink | None):
        self.name, self.sink = name, sink

    def call(self, what: str, *args: Any) -> None:
        if self.sink is None:
            return
        try:
            getattr(self.sink, what)(*args)
        except Exception as exc:  # any failure of a sink: warn once, never stop the run
            log.warning("metric sink %s failed (%s: %s); it is off for the rest of the run",
                        self.name, type(exc).__name__, exc)  # fmt: skip
            self.sink = None


def make_sinks(cfg: RunConfig, run_dir: Path, start_step: int = 0) -> list[_Guarded]:
    """The enabled sinks, each guarded (a sink that cannot start is reported and skipped).

    A resumed run passes the step it retrains from."""
    lc = cfg.logging
    if not (lc.tensorboard.enabled or lc.wandb.enabled):
        return []
    config, revision = to_dict(cfg), git_revision()
    out = []
    if lc.tensorboard.enabled:
        log_dir = Path(lc.tensorboard.log_dir or run_dir / "tensorboard")
        tb = lambda: TensorBoardSink(log_dir, config, revision, start_step)  # noqa: E731
        out.append(_start("tensorboard", tb))
    if lc.wandb.enabled:
        out.append(_start("wandb", lambda: WandbSink(cfg, run_dir, config, revision)))
    return out


def _start(name: str, build: Any) -> _Guarded:
    guarded = _Guarded(name, None)
    try:
        guarded.sink = build()
    except Exception as exc:  # ImportError, no network, bad key...: the run goes on without it
        log.warning("metric sink %s could not start (%s: %s); the run goes on without it",
                    name, type(exc).__name__, exc)  # fmt: skip
    return guarded


def log_row(sinks: list[_Guarded], row: dict[str, Any]) -> None:
    """Send a metrics row's numeric values (grouped names) to every sink."""
    if not sinks:
        return
    scalars = {
        group_of(k): float(v)
        for k, v in row.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
    }
    for s in sinks:
        s.call("log", int(row["step"]), scalars)


def rewind_sinks(sinks: list[_Guarded], step: int) -> None:
    """Steps ``>= step`` will be logged again (a restarted trainer retrains them)."""
    for s in sinks:
        s.call("rewind", step)


def close_sinks(sinks: list[_Guarded]) -> None:
    for s in sinks:
        s.call("close")
