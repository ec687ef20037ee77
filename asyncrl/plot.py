"""``asyncrl plot RUN_DIR [RUN_DIR ...]``: pictures of runs from metrics.jsonl and trace.json.

Writes five PNGs (matplotlib, the ``plot`` extra) to ``--out`` (default
``RUN_DIR/plots`` of the first run); several runs are overlaid in each:

- ``reward.png``: ``reward_mean`` per step (faint) with an exponential moving
  average (``--smooth``), against the step and against wall time; with the run's evals
  (``[eval]``) their held-out ``eval/reward_mean`` as dots joined by a dashed line, at the
  weight version evaluated (against the step) and when the eval ended (against wall time);
- ``staleness.png``: the share of each step's samples per staleness (step - the
  oldest policy version of the sample's tokens), one panel per run;
- ``throughput.png``: tokens generated (every token the engines returned, trained or
  not: ``ctl_generated_tokens``) and trained per second of wall time, per step, smoothed;
- ``time.png``: where the time went (run totals): trainer training / pushing /
  idle (metrics.jsonl), engines generating (any request in flight) / paused /
  idle (trace.json);
- ``timeline.png``: a strip of ``--window`` steps from the middle of each run's
  trace: engines generating and paused, trainer steps, weight pushes — the
  overlap at a glance.

``--text`` prints a terminal view instead (no matplotlib needed).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["Run", "intervals", "load_run", "main_plot", "smooth", "text_view", "write_pngs"]


class Run:
    """One run's data: metrics rows (training steps), eval rows (``eval/...`` keys, ``step``
    the weight version evaluated; may be empty), trace events (may be empty), a label."""

    def __init__(
        self,
        path: Path,
        rows: list[dict[str, Any]],
        events: list[dict],
        label: str,
        evals: list[dict[str, Any]] | None = None,
    ):
        self.path, self.rows, self.events, self.label = path, rows, events, label
        self.evals = evals or []

    def col(self, key: str, default: float = 0.0) -> list[float]:
        return [float(r.get(key, default)) for r in self.rows]


def load_run(run_dir: str | Path) -> Run:
    """Read ``metrics.jsonl`` (required) and ``trace.json`` (optional); ValueError if unusable."""
    path = Path(run_dir)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise ValueError(f"{metrics} not found (is {path} a run folder?)")
    every = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    evals = [r for r in every if "eval/reward_mean" in r]  # eval rows: not training steps
    rows = [r for r in every if "eval/reward_mean" not in r]
    if not rows:
        raise ValueError(f"{metrics} has no steps yet")
    events: list[dict] = []
    if (path / "trace.json").is_file():
        events = json.loads((path / "trace.json").read_text()).get("traceEvents", [])
    label = path.name
    if (path / "config.json").is_file():
        cfg = json.loads((path / "config.json").read_text())
        s = cfg.get("controller", {}).get("max_staleness")
        if s is not None:
            label += " (sync)" if s == 0 else f" (async, staleness {s})"
    return Run(path, rows, events, label, evals)


def smooth(xs: Sequence[float], alpha: float) -> list[float]:
    """Exponential moving average, debiased (as TensorBoard's smoothing): ``alpha`` in [0, 1)."""
    out, acc, weight = [], 0.0, 0.0
    for x in xs:
        acc = alpha * acc + (1 - alpha) * x
        weight = alpha * weight + (1 - alpha)
        out.append(acc / weight)
    return out


# -- trace --------------------------------------------------------------------------------
def _spans(run: Run) -> list[dict]:
    procs = {e["pid"]: e["args"]["name"] for e in run.events if e.get("name") == "process_name"}
    tracks = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in run.events
        if e.get("name") == "thread_name"
    }
    return [
        {**e, "proc": procs.get(e["pid"], "?"), "track": tracks.get((e["pid"], e["tid"]), "?")}
        for e in run.events
        if e.get("ph") == "X"
    ]


def intervals(run: Run) -> dict[str, list[tuple[float, float]]]:
    """Merged busy intervals (seconds on the trace clock) per row of the timeline strip."""
    rows: dict[str, list[tuple[float, float]]] = {}
    paused_from: dict[str, float] = {}
    for e in sorted(_spans(run), key=lambda e: e["ts"]):
        a, b = e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6
        key = None
        if e["proc"] == "controller" and e["track"].startswith("generate "):
            key = "engine " + e["track"].split()[1].rsplit(":", 1)[-1] + " generating"
        elif e["proc"].startswith("trainer") and e["track"] == "trainer":
            key = {"train step": "trainer: train step", "push weights": "trainer: push call"}.get(
                e["name"]
            )
        elif e["proc"].startswith("trainer") and e["track"] == "weight sync":
            key = "weight sync (background)"
        elif e["proc"].startswith("trainer") and e["track"].startswith("engine http"):
            engine = "engine " + e["track"].rsplit(":", 1)[-1] + " paused"
            if e["name"] == "/pause_generation":
                paused_from[engine] = a
            elif e["name"] == "/continue_generation" and engine in paused_from:
                rows.setdefault(engine, []).append((paused_from.pop(engine), b))
        if key:
            rows.setdefault(key, []).append((a, b))
    return {k: _merge(v) for k, v in sorted(rows.items())}


def _merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _total(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in spans)


def time_shares(run: Run) -> dict[str, dict[str, float]]:
    """Seconds per activity from the first step's report on (start-up excluded): ``trainer``
    from metrics.jsonl, ``engines`` from the trace."""
    rows = run.rows[1:] or run.rows
    train, push, idle = (sum(float(r.get(k, 0.0)) for r in rows) for k in
                         ("train_s", "push_call_s", "idle_s"))  # fmt: skip
    wall = run.rows[-1]["wall_s"] - (run.rows[0]["wall_s"] if len(run.rows) > 1 else 0.0)
    out = {
        "trainer": {
            "training": train,
            "push call": push,
            "idle": idle,
            "other": max(0.0, wall - train - push - idle),
        }
    }
    spans = intervals(run)
    gen = [k for k in spans if k.endswith("generating")]
    if gen:
        lo = min(spans[k][0][0] for k in gen)
        hi = max(spans[k][-1][1] for k in gen)
        busy = sum(_total(spans[k], lo, hi) for k in gen) / len(gen)
        paused = [k for k in spans if k.endswith("paused")]
        pause = sum(_total(spans[k], lo, hi) for k in paused) / max(1, len(paused))
        out["engines"] = {
            "generating": busy,
            "paused": pause,
            "idle": max(0.0, hi - lo - busy - pause),
        }
    return out


# -- pictures -----------------------------------------------------------------------------
def write_pngs(runs: list[Run], out: Path, alpha: float = 0.8, window: int = 4) -> list[Path]:
    """Write the five PNGs for ``runs`` into ``out``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, draw in (
        ("reward", _reward),
        ("staleness", _staleness),
        ("throughput", _throughput),
        ("time", _time),
        ("timeline", _timeline),
    ):
        fig = draw(plt, runs, alpha, window)
        path = out / f"{name}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    return paths


def _reward(plt: Any, runs: list[Run], alpha: float, window: int) -> Any:
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for i, run in enumerate(runs):
        c = f"C{i}"
        r, steps, wall = run.col("reward_mean"), run.col("step"), run.col("wall_s")
        for ax, x in ((a, steps), (b, wall)):
            ax.plot(x, r, color=c, alpha=0.25, lw=1)
            ax.plot(x, smooth(r, alpha), color=c, lw=2, label=run.label)
        if run.evals:
            ev = [float(e["eval/reward_mean"]) for e in run.evals]
            label = f"{run.label}: held-out eval"
            for ax, key in ((a, "step"), (b, "wall_s")):
                x = [float(e.get(key, 0.0)) for e in run.evals]
                ax.plot(x, ev, color=c, ls="--", marker="o", ms=4, lw=1, label=label)
    a.set(xlabel="step", ylabel="reward (mean of the step's samples)", title="reward per step")
    b.set(xlabel="wall time (s)", title="reward over wall time")
    b.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _staleness(plt: Any, runs: list[Run], alpha: float, window: int) -> Any:
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 3.4), squeeze=False)
    for ax, run in zip(axes[0], runs, strict=True):
        hists = [r.get("staleness_hist") or [] for r in run.rows]
        depth = max((len(h) for h in hists), default=1)
        steps = run.col("step")
        bottom = [0.0] * len(hists)
        for s in range(depth):
            share = [(h[s] / sum(h)) if s < len(h) and sum(h) else 0.0 for h in hists]
            ax.bar(steps, share, bottom=bottom, width=1.0, color=f"C{s}", label=f"staleness {s}")
            bottom = [x + y for x, y in zip(bottom, share, strict=True)]
        ax.set(xlabel="step", ylabel="share of the step's samples", title=run.label, ylim=(0, 1))
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


def _rate(run: Run, key: str) -> tuple[list[float], list[float]]:
    """``key`` per second of wall time, per step. ``ctl_generated_tokens`` is cumulative (since
    the controller started: a resume restarts it), the others per step."""
    wall, vals = run.col("wall_s"), run.col(key)
    cumulative = key == "ctl_generated_tokens"
    xs, ys = [], []
    for i in range(1, len(wall)):
        dt = wall[i] - wall[i - 1]
        if dt > 0:
            v = vals[i] - vals[i - 1] if cumulative else vals[i]
            xs.append(run.rows[i]["step"])
            ys.append((v if v >= 0 else vals[i]) / dt)
    return xs, ys


def _generated_key(run: Run) -> str:
    """Tokens the engines generated (``ctl_generated_tokens``); runs written before it had only
    the trained samples' responses (``response_tokens``)."""
    has = bool(run.rows) and "ctl_generated_tokens" in run.rows[0]
    return "ctl_generated_tokens" if has else "response_tokens"


def _throughput(plt: Any, runs: list[Run], alpha: float, window: int) -> Any:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for i, run in enumerate(runs):
        for ax, key in zip(axes, (_generated_key(run), "train_tokens"), strict=True):
            xs, ys = _rate(run, key)
            ax.plot(xs, ys, color=f"C{i}", alpha=0.25, lw=1)
            ax.plot(xs, smooth(ys, alpha), color=f"C{i}", lw=2, label=run.label)
    title = "generated (all tokens the engines returned)"
    axes[0].set(xlabel="step", ylabel="tokens / s", title=title)
    axes[1].set(xlabel="step", title="trained (tokens per second of wall time)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    return fig


def _time(plt: Any, runs: list[Run], alpha: float, window: int) -> Any:
    fig, ax = plt.subplots(figsize=(10, 0.9 + 0.7 * len(runs) * 2))
    labels, y = [], 0
    colors = {"training": "C0", "push call": "C1", "idle": "0.85", "other": "0.6"}
    colors.update({"generating": "C2", "paused": "C3"})
    seen: set[str] = set()
    for run in runs:
        for who, parts in time_shares(run).items():
            total = sum(parts.values()) or 1.0
            left = 0.0
            for k, v in parts.items():
                label = k if k not in seen else None
                seen.add(k)
                ax.barh(y, v / total, left=left, color=colors[k], label=label)
                if v / total > 0.06:
                    ax.text(left + v / total / 2, y, f"{v:.1f}s", ha="center", va="center")
                left += v / total
            labels.append(f"{run.label}\n{who}")
            y += 1
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set(xlabel="share of the run", title="where time goes", xlim=(0, 1))
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    return fig


def _timeline(plt: Any, runs: list[Run], alpha: float, window: int) -> Any:
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 0.6 + 1.5 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs, strict=True):
        rows = intervals(run)
        steps = rows.get("trainer: train step", [])
        if not steps:
            ax.set_title(f"{run.label}: no trace.json")
            continue
        mid = max(0, len(steps) // 2 - window // 2)
        lo, hi = steps[mid][0], steps[min(len(steps), mid + window) - 1][1]
        names = list(rows)
        for y, name in enumerate(names):
            spans = [(a - lo, b - a) for a, b in rows[name] if b > lo and a < hi]
            color = "C3" if "paused" in name else "C2" if "generating" in name else f"C{y % 2}"
            ax.broken_barh(spans, (y - 0.4, 0.8), color=color)
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.set(xlim=(0, hi - lo), title=f"{run.label}: {window} steps from the middle")
    axes[-1, 0].set_xlabel("seconds")
    fig.tight_layout()
    return fig


# -- terminal -----------------------------------------------------------------------------
def text_view(runs: list[Run], width: int = 40, alpha: float = 0.8) -> str:
    """Per run: a table of step, reward (the step's mean), smoothed reward (debiased EMA of
    weight ``alpha``, as the PNGs' bold line) and a bar of the smoothed reward; then the
    time shares of the trainer and the engines."""
    lines = []
    for run in runs:
        lines.append(f"== {run.label}")
        lines.append(
            f"{'step':>5} {'reward':>6} {'smooth':>6}  smoothed reward, '#' = 1/{width} "
            f"(smooth: EMA, weight {alpha:g})"
        )
        r = run.col("reward_mean")
        for row, s in zip(run.rows, smooth(r, alpha), strict=True):
            bar = "#" * round(width * max(0.0, min(1.0, s)))
            lines.append(f"{row['step']:5d} {row['reward_mean']:6.3f} {s:6.3f}  {bar}")
        lines += _eval_lines(run)
        shares = time_shares(run)
        if shares:
            lines.append("share of the wall time after the first step:")
        for who, parts in shares.items():
            total = sum(parts.values()) or 1.0
            shares_text = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in parts.items())
            lines.append(f"  {who}: {shares_text}")
    return "\n".join(lines)


def _eval_lines(run: Run) -> list[str]:
    """The run's evals as a table: the weight version evaluated, its held-out reward, pass@1,
    pass@k and the greedy reward (``-`` where the eval did not measure it)."""
    if not run.evals:
        return []
    found = {key for e in run.evals for key in e if key.startswith("eval/pass@")}
    ks = sorted(found, key=lambda key: int(key.rsplit("@", 1)[1]))
    cols = ["eval/reward_mean", *ks, "eval/greedy_reward"]
    names = ["reward", *(k.removeprefix("eval/") for k in ks), "greedy"]
    out = ["held-out evals (eval/...):", f"{'version':>7} " + " ".join(f"{n:>7}" for n in names)]
    for e in run.evals:
        vals = [f"{e[c]:7.3f}" if c in e else f"{'-':>7}" for c in cols]
        out.append(f"{int(e['step']):7d} " + " ".join(vals))
    return out


def main_plot(
    run_dirs: Sequence[str], out: str | None, text: bool, alpha: float, window: int
) -> int:
    """The ``asyncrl plot`` command; returns the exit status."""
    import sys

    try:
        runs = [load_run(d) for d in run_dirs]
    except (ValueError, json.JSONDecodeError) as exc:
        print(f"asyncrl plot: {exc}", file=sys.stderr)
        return 2
    if not math.isfinite(alpha) or not 0 <= alpha < 1:
        print(f"asyncrl plot: --smooth must be in [0, 1), got {alpha}", file=sys.stderr)
        return 2
    if text:
        print(text_view(runs, alpha=alpha))
        return 0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(
            "asyncrl plot: PNGs need matplotlib (pip install 'asyncrl[plot]'); --text needs "
            "nothing",
            file=sys.stderr,
        )
        return 2
    dest = Path(out) if out else runs[0].path / "plots"
    for path in write_pngs(runs, dest, alpha, window):
        print(path)
    return 0
