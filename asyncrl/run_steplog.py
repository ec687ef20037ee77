"""The run's step log: one metrics row per trained step (``metrics.jsonl``, the sinks, the
progress line), eval rows, checkpoint and recovery records, CPU times.

Files in the run folder (each line one JSON object):

- ``metrics.jsonl``: a row per trained step, in step order (``reward/<name>_mean`` per
  named reward component, :func:`component_means`), and eval rows; a recovery or a
  resume from checkpoint ``n`` drops the rows of steps ``>= n`` (:meth:`StepLog.rewind`)
  and the retrained steps are logged again, so each step has one row in the end.
- ``trajectories.jsonl`` (``logging.trajectories``): every trajectory of every step.
- ``checkpoints.jsonl``: one record per committed checkpoint; ``recoveries.jsonl``: one
  per trainer restart or engine back in rotation.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from asyncrl.controllers import checkpoints as ckpts
from asyncrl.core import Batch
from asyncrl.launchers.base import Placed
from asyncrl.procs import cpu_seconds
from asyncrl.progress import Progress
from asyncrl.sinks import log_row, rewind_sinks
from asyncrl.transports.experience.control import StepDone

__all__ = ["StepLog", "component_means", "write_trajectories"]


class StepLog:
    """Rows of one run. ``processes``: the launcher's name -> placed process (for CPU
    times); ``sinks``: TensorBoard / W&B (``asyncrl.sinks``), set once they are made."""

    def __init__(
        self,
        run_dir: Path,
        processes: Callable[[], Mapping[str, Placed]],
        trajectories: bool = False,
        progress: Progress | None = None,
        quiet: bool = True,
    ) -> None:
        self.run_dir = run_dir
        self.processes = processes
        self.trajectories = trajectories
        self.progress = progress
        self.quiet = quiet
        self.rows: list[dict[str, Any]] = []
        self.newest: dict[int, dict[str, Any]] = {}  # the newest row of every step logged
        self.sinks: list[Any] = []
        self.save_stats: list[dict[str, float]] = []
        self.t0 = time.perf_counter()
        self.t_controller = self.t0

    def step(self, msg: StepDone, batch: Batch, ctl_stats: Mapping[str, Any]) -> None:
        """Step ``msg.step`` is trained (``batch`` was its batch): its metrics row."""
        stale = [batch.step - t.min_version for t in batch.trajectories]
        row = {
            "step": msg.step,
            "reward_mean": batch.reward_mean,
            **component_means(batch),
            "staleness_max": batch.staleness_max,
            "staleness_mean": sum(stale) / len(stale),
            "staleness_hist": [stale.count(k) for k in range(max(stale) + 1)],
            "response_tokens": sum(len(t.response_ids) for t in batch.trajectories),
            "weight_version": msg.version,
            "num_samples": len(batch.trajectories),
            "filtered_groups": batch.filtered,
            "filtered_share": batch.filtered / (batch.filtered + len(batch.groups)),
            "sample_ids": [_sample_id(x) for x in batch.samples],
            "wall_s": time.perf_counter() - self.t0,
            "controller_s": time.perf_counter() - self.t_controller,
            **{k: v for k, v in msg.metrics.items() if k not in ("num_samples",)},
            **{f"ctl_{k}": v for k, v in ctl_stats.items()},
            **self.cpu_times(),
        }
        self.add(row)
        if self.trajectories:
            write_trajectories(self.run_dir / "trajectories.jsonl", batch)
        if self.progress is not None:
            self.progress.update(row)

    def add(self, row: dict[str, Any]) -> None:
        """Log one step's row (the newest of its step)."""
        self.newest[row["step"]] = row
        self._write(row)

    def _write(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        log_row(self.sinks, row)

    def eval_row(self, row: dict[str, Any]) -> None:
        """An eval's metrics: one metrics.jsonl row (``step`` = the version asked for); the
        sinks get it at the newest step logged (W&B takes steps in order only)."""
        row["wall_s"] = time.perf_counter() - self.t0
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        newest = max([row["step"], *(r["step"] for r in self.rows[-1:])])
        log_row(self.sinks, {**row, "step": newest})
        if self.progress is not None:
            self.progress.eval(row)

    async def rewind(self, step: int) -> None:
        """The trainer went back to checkpoint ``step``: forget the rows of steps ``>= step``
        (in memory, in the files, in the sinks); they are logged again when retrained. A
        step before ``step`` whose row an earlier rewind dropped (a recovery from an older
        checkpoint, then one from a newer) gets its newest row back."""
        self.rows = [r for r in self.rows if r["step"] < step]
        await asyncio.to_thread(ckpts.truncate_metrics, self.run_dir / "metrics.jsonl", step)
        await asyncio.to_thread(ckpts.truncate_metrics, self.run_dir / "trajectories.jsonl", step)
        rewind_sinks(self.sinks, step)
        have = {r["step"] for r in self.rows}
        for s in sorted(s for s in self.newest if s < step and s not in have):
            self._write(self.newest[s])

    def checkpoint(self, stats: dict[str, float], folder: Path) -> None:
        """Checkpoint ``stats["step"]`` in ``folder`` is committed: checkpoints.jsonl."""
        self.save_stats.append(stats)
        with open(self.run_dir / "checkpoints.jsonl", "a") as f:
            f.write(json.dumps(stats) + "\n")
        if not self.quiet:
            print(
                f"checkpoint {folder} (trainer stall {stats['stall_s']:.3f}s, "
                f"{stats['save_s']:.2f}s)",
                flush=True,
            )

    def recovery(self, rec: dict[str, Any]) -> None:
        """One recovery (a trainer restart, an engine back in rotation): recoveries.jsonl."""
        with open(self.run_dir / "recoveries.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")

    def cpu_times(self) -> dict[str, float]:
        """CPU seconds used so far by this process and each child (Linux /proc; else empty)."""
        out = {"cpu_controller_s": time.process_time()}
        for name, placed in self.processes().items():
            cpu = cpu_seconds(placed.pid) if placed.here else None
            if cpu is not None:
                out[f"cpu_{name}_s"] = cpu
        return out

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()


def write_trajectories(path: Path, batch: Batch) -> None:
    """Every trajectory of ``batch`` as one JSON line: step, session (gateway sessions;
    else null), episode, reward, and per token (prompt then response, one length):
    token_ids, loss_mask, logprobs, versions (prompt tokens: mask 0, log-prob 0, the
    version of the first response token); ``rewards`` (the named components) when it has
    them."""
    with open(path, "a") as f:
        for t in batch.trajectories:
            n = len(t.prompt_ids)
            first = int(t.versions[0]) if len(t.versions) else 0
            row = {
                "step": batch.step,
                "session": t.metadata.get("session"),
                "episode": t.episode_id,
                "group": t.group_id,
                "reward": t.reward,
                **({"rewards": t.rewards} if t.rewards else {}),
                "token_ids": [*t.prompt_ids.tolist(), *t.response_ids.tolist()],
                "loss_mask": [0] * n + t.loss_mask.tolist(),
                "logprobs": [0.0] * n + t.behav_logprobs.tolist(),
                "versions": [first] * n + t.versions.tolist(),
            }
            f.write(json.dumps(row) + "\n")


def component_means(batch: Batch) -> dict[str, float]:
    """``reward/<name>_mean`` per named reward component (``Trajectory.rewards``: the
    functions of ``task.rewards``, or what an episode put there), over the batch's
    trajectories that carry it."""
    sums: dict[str, list[float]] = {}
    for t in batch.trajectories:
        for name, value in t.rewards.items():
            sums.setdefault(name, []).append(float(value))
    return {f"reward/{n}_mean": sum(v) / len(v) for n, v in sorted(sums.items())}


def _sample_id(sample: Any) -> Any:
    """A sample's ``id`` (None if it has none): an attribute, or a key of a sample restored
    from a checkpoint as a plain dict (an agent run's: its queue holds two kinds)."""
    if isinstance(sample, dict):
        return sample.get("id")
    return getattr(sample, "id", None)
