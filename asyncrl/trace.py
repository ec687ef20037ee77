"""Timeline of a run: spans in the Chrome / Perfetto trace-event format.

Every process of a run (controller, trainer ranks, embedded engines) keeps one
:class:`Tracer` (``configure`` at start, ``get`` anywhere) that appends events to
its own file ``RUN_DIR/trace/<process>-<pid>.jsonl``, one JSON object a line, flushed
every ``FLUSH_S`` seconds and on ``close`` (a killed process loses at most that
much). At the end of the run :func:`merge` joins the files into
``RUN_DIR/trace.json`` (``{"traceEvents": [...]}``), which opens in
https://ui.perfetto.dev or chrome://tracing.

Clocks: ``ts`` is microseconds of the wall clock, taken as ``perf_counter`` plus
an offset fixed when the tracer is made, so one process's spans never move
against each other, and processes on one host share one clock (the same
``CLOCK_REALTIME``); across hosts they agree as far as the hosts' clocks do (NTP).

Events: complete spans (``ph: "X"``) on named tracks (``tid``; a name shown as
the thread's name), instants (``ph: "i"``). Spans of one track must nest or be
disjoint; concurrent work (generation requests) takes a free *lane* of its track
(:meth:`Tracer.take_lane`). Sampling: with ``every`` > 1, a process records events
only while its current step (:meth:`Tracer.set_step`: the trainer's step, the
controller's and engines' policy version) is divisible by ``every``;
a process stops writing after ``max_mb`` and marks where. Nothing here imports
torch: the controller uses it too.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

__all__ = [
    "ENV_DIR",
    "NULL",
    "Tracer",
    "child_env",
    "configure",
    "configure_from_env",
    "end_run",
    "get",
    "merge",
    "now_us",
    "start_run",
    "us_of",
]

ENV_DIR, ENV_EVERY, ENV_MAX_MB = "ASYNCRL_TRACE_DIR", "ASYNCRL_TRACE_EVERY", "ASYNCRL_TRACE_MAX_MB"
DEFAULT_MAX_MB = 128.0
"""Per process: the merged trace.json of a controller, an engine and a trainer stays under
~400 MB, which Perfetto's in-browser UI still opens (see ``logging.trace.max_mb``)."""

FLUSH_S = 1.0
_ENCODE = msgspec.json.Encoder().encode  # ~9x json.dumps per event (a span per request)


def _clock_offset_ns(tries: int = 7) -> int:
    """``time_ns() - perf_counter_ns()``, read between the two closest ``perf_counter`` reads
    of a few tries (a preemption between the reads would skew the offset of this process)."""
    best = None
    for _ in range(tries):
        a = time.perf_counter_ns()
        wall = time.time_ns()
        b = time.perf_counter_ns()
        if best is None or b - a < best[0]:
            best = (b - a, wall - (a + b) // 2)
    assert best is not None
    return best[1]


_OFFSET_NS = _clock_offset_ns()


def now_us() -> float:
    """Microseconds on the trace clock (wall-clock anchored, monotonic within the process)."""
    return (time.perf_counter_ns() + _OFFSET_NS) / 1000.0


def us_of(perf_s: float) -> float:
    """A ``time.perf_counter()`` reading of this process on the trace clock (microseconds)."""
    return perf_s * 1e6 + _OFFSET_NS / 1000.0


class Tracer:
    """Trace events of one process, appended to ``path`` (thread-safe)."""

    enabled = True

    def __init__(self, path: Path, process: str, every: int = 1, max_mb: float = DEFAULT_MAX_MB):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.process = process
        self.every = max(1, int(every))
        self.step = 0
        self.pid = os.getpid()
        self._max_bytes = int(max_mb * (1 << 20))
        self._written = 0
        self._lock = threading.Lock()
        self._buf: list[str] = []
        self._tids: dict[str, int] = {}
        self._lanes: dict[str, list[bool]] = {}
        self._last_flush = time.monotonic()
        self._file: Any = open(self.path, "a")  # closed by close()
        self._meta("process_name", 0, {"name": process})

    # -- recording ---------------------------------------------------------------------
    def sampled(self, step: int | None = None) -> bool:
        """Whether work of ``step`` (default: the step last given to :meth:`set_step`; a train
        step, a policy version) is traced."""
        return (self.step if step is None else step) % self.every == 0

    def set_step(self, step: int) -> None:
        """The step (policy version) this process now works on, for :meth:`sampled`."""
        self.step = step

    def complete(
        self, name: str, track: str, start_us: float, end_us: float, args: dict | None = None
    ) -> None:
        """A span ``[start_us, end_us]`` on ``track``."""
        ev = {"ph": "X", "name": name, "ts": start_us, "dur": max(0.0, end_us - start_us)}
        self._emit(ev, track, args)

    def instant(self, name: str, track: str, args: dict | None = None) -> None:
        """A mark at the current time on ``track``."""
        self._emit({"ph": "i", "s": "t", "name": name, "ts": now_us()}, track, args)

    @contextlib.contextmanager
    def span(self, name: str, track: str, args: dict | None = None) -> Iterator[dict]:
        """Time the block as a span on ``track``; the yielded dict is added to its args."""
        extra: dict[str, Any] = dict(args or {})
        t0 = now_us()
        try:
            yield extra
        finally:
            self.complete(name, track, t0, now_us(), extra)

    def take_lane(self, track: str) -> str:
        """A free lane of ``track`` (named ``"track #k"``), held for one of several concurrent
        spans until :meth:`free_lane`: spans of one lane never overlap."""
        with self._lock:
            lanes = self._lanes.setdefault(track, [])
            k = next((i for i, busy in enumerate(lanes) if not busy), len(lanes))
            if k == len(lanes):
                lanes.append(True)
            lanes[k] = True
        return f"{track} #{k}"

    def free_lane(self, lane: str) -> None:
        track, _, k = lane.rpartition(" #")
        with self._lock:
            self._lanes[track][int(k)] = False

    # -- output ------------------------------------------------------------------------
    def _tid(self, track: str) -> int:
        tid = self._tids.get(track)
        if tid is None:
            tid = self._tids[track] = len(self._tids) + 1
            self._meta("thread_name", tid, {"name": track})
            self._meta("thread_sort_index", tid, {"sort_index": tid})
        return tid

    def _meta(self, name: str, tid: int, args: dict) -> None:
        ev = {"ph": "M", "name": name, "pid": self.pid, "tid": tid, "args": args}
        self._buf.append(_ENCODE(ev).decode())

    def _emit(self, ev: dict[str, Any], track: str, args: dict | None) -> None:
        if self.step % self.every:
            return  # sampled out: this process's current step is not traced
        ev["pid"] = self.pid
        if args:
            ev["args"] = args
        with self._lock:
            if self._file is None:
                return
            ev["tid"] = self._tid(track)
            self._buf.append(_ENCODE(ev).decode())
            if len(self._buf) >= 4096 or time.monotonic() - self._last_flush > FLUSH_S:
                self._flush_locked()

    def _flush_locked(self) -> None:
        self._last_flush = time.monotonic()
        if not self._buf or self._file is None:
            return
        data = "\n".join(self._buf) + "\n"
        self._buf.clear()
        if self._written + len(data) > self._max_bytes:
            mark = {"ph": "i", "s": "p", "name": "trace truncated (trace.max_mb)", "ts": now_us()}
            self._file.write(json.dumps({**mark, "pid": self.pid, "tid": 0}) + "\n")
            self._file.close()
            self._file = None
            return
        self._file.write(data)
        self._file.flush()
        self._written += len(data)

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def close(self) -> None:
        """Write what is buffered and stop recording (idempotent)."""
        with self._lock:
            self._flush_locked()
            if self._file is not None:
                self._file.close()
                self._file = None


class _NullTracer(Tracer):
    """Tracing off: every call is a no-op."""

    enabled = False

    def __init__(self) -> None:
        self.every, self.step = 1, 0

    def sampled(self, step: int | None = None) -> bool:
        return False

    def set_step(self, step: int) -> None:
        pass

    def complete(self, *a: Any, **k: Any) -> None:
        pass

    def instant(self, *a: Any, **k: Any) -> None:
        pass

    @contextlib.contextmanager
    def span(self, name: str, track: str, args: dict | None = None) -> Iterator[dict]:
        yield {}

    def take_lane(self, track: str) -> str:
        return track

    def free_lane(self, lane: str) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


NULL: Tracer = _NullTracer()
_current: Tracer = NULL


def configure(
    run_dir: str | Path | None, process: str, every: int = 1, max_mb: float = DEFAULT_MAX_MB
) -> Tracer:
    """Make this process's tracer (``run_dir`` None: tracing off); replaces any previous one."""
    global _current
    _current.close()
    if run_dir is None:
        _current = NULL
    else:
        path = Path(run_dir) / "trace" / f"{process}-{os.getpid()}.jsonl"  # restarts: a new file
        _current = Tracer(path, process, every, max_mb)
    return _current


def child_env(
    run_dir: str | Path | None, every: int = 1, max_mb: float = DEFAULT_MAX_MB
) -> dict[str, str]:
    """Environment that makes a child process's :func:`configure_from_env` trace into
    ``run_dir`` (None: an environment that turns tracing off)."""
    if run_dir is None:
        return {ENV_DIR: ""}
    return {ENV_DIR: str(Path(run_dir).resolve()), ENV_EVERY: str(every), ENV_MAX_MB: str(max_mb)}


def configure_from_env(process: str) -> Tracer:
    """:func:`configure` from the variables :func:`child_env` sets (unset: tracing off)."""
    run_dir = os.environ.get(ENV_DIR) or None
    every = int(os.environ.get(ENV_EVERY, "1"))
    max_mb = float(os.environ.get(ENV_MAX_MB, str(DEFAULT_MAX_MB)))
    return configure(run_dir, process, every, max_mb)


def get() -> Tracer:
    """This process's tracer (a no-op one unless :func:`configure` made one)."""
    return _current


def merge(run_dir: str | Path) -> Path | None:
    """Join ``run_dir/trace/*.jsonl`` into ``run_dir/trace.json``; None when there is nothing.

    A line cut short by a killed process is skipped.
    """
    run_dir = Path(run_dir)
    files = sorted((run_dir / "trace").glob("*.jsonl"))
    if not files:
        return None
    events: list[dict] = []
    for f in files:
        for line in f.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    out = run_dir / "trace.json"
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    tmp.replace(out)
    return out


_saved_env: dict[str, str | None] = {}


def start_run(
    run_dir: Path, enabled: bool, every: int = 1, max_mb: float = DEFAULT_MAX_MB
) -> Tracer:
    """Trace this process as ``controller`` and let every child started from now on trace too
    (the variables of :func:`child_env` in ``os.environ``, restored by :func:`end_run`)."""
    env = child_env(run_dir if enabled else None, every, max_mb)
    for k in (ENV_DIR, ENV_EVERY, ENV_MAX_MB):
        _saved_env.setdefault(k, os.environ.get(k))
        os.environ.pop(k, None)
    os.environ.update(env)
    return configure(run_dir if enabled else None, "controller", every, max_mb)


def end_run(run_dir: Path) -> Path | None:
    """Close this process's tracer, restore the environment, merge the run's trace files
    (call after every child has ended); the path of ``trace.json`` or None."""
    was_on = get().enabled
    configure(None, "controller")
    for k, v in _saved_env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    _saved_env.clear()
    return merge(run_dir) if was_on else None
