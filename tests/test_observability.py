"""Seeing a run, on real short jobs (controller, engine, trainer processes): the timeline
(RUN_DIR/trace.json), ``asyncrl plot``, the TensorBoard and W&B sinks read back with those
libraries' own readers, and the progress line.

One async run (staleness 1) with every sink on and one sync run (staleness 0) serve all
tests of this module.
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from asyncrl import trace
from asyncrl.procs import python_env

STEPS, BATCH, GROUP = 6, 4, 8
EVAL_EVERY = 3  # the async run evaluates versions 0 (before training), 3 and 6 (at the end)
TOL_US = 5_000  # clocks of the three processes must agree within 5 ms


def _job(run_dir: Path, model_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "asyncrl.cli", "run", "--run-dir", str(run_dir)]
    cmd += [f"--model.path={model_dir}", f"--controller.total_steps={STEPS}"]
    cmd += [f"--controller.batch_size={BATCH}", *extra]
    out = subprocess.run(cmd, env=python_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


@pytest.fixture(scope="module")
def run_and_output(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> tuple[Path, str]:
    """The async run: traced, TensorBoard and W&B (offline, when installed) on, progress on."""
    run_dir = tmp_path_factory.mktemp("async") / "run"
    extra = ["--controller.max_staleness=1", "--logging.tensorboard.enabled=true"]
    extra += ["--logging.wandb.enabled=true", "--logging.wandb.mode=offline"]
    extra += [f"--eval.every_steps={EVAL_EVERY}", "--eval.before_train=true", "--eval.at_end=true"]
    extra += ["--eval.num_prompts=8", "--eval.k=2"]
    out = _job(run_dir, tiny_model_dir, *extra)
    return run_dir, out.stdout


@pytest.fixture(scope="module")
def run(run_and_output: tuple[Path, str]) -> Path:
    return run_and_output[0]


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    run_dir = tmp_path_factory.mktemp("sync") / "run"
    _job(run_dir, tiny_model_dir, "--controller.max_staleness=0", "--quiet")
    return run_dir


def _load(run_dir: Path) -> tuple[list[dict], dict[int, str], dict[tuple[int, int], str]]:
    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    return events, procs, tracks


def _spans(events: list[dict], procs: dict[int, str], tracks: dict, proc: str) -> list[dict]:
    """The complete spans of the process named ``proc`` (prefix), with their track names."""
    out = []
    for e in events:
        if e["ph"] == "X" and procs[e["pid"]].startswith(proc):
            out.append({**e, "track": tracks[(e["pid"], e["tid"])], "end": e["ts"] + e["dur"]})
    return out


def test_trace_has_every_span(run: Path) -> None:
    events, procs, tracks = _load(run)
    names = sorted(procs.values())
    assert names[0] == "controller" and len(names) == 3, names
    assert names[1].startswith("engine-") and names[2] == "trainer0"
    trainer = _spans(events, procs, tracks, "trainer")
    steps = [e["args"]["step"] for e in trainer if e["name"] == "train step"]
    assert steps == list(range(STEPS))
    assert sum(e["name"] == "push weights" for e in trainer) == STEPS
    assert sorted(e["name"] for e in trainer if e["track"] == "weight sync") == sorted(
        f"push v{v}" for v in range(1, STEPS + 1)
    )
    sends = [e for e in trainer if e["name"].startswith("send bucket")]
    assert len(sends) >= STEPS and all(e["track"].startswith("weight send #") for e in sends)
    commits = [e for e in trainer if e["name"] == "/update_weight_version"]
    assert len(commits) == STEPS and {e["track"] for e in commits} == {
        t for t in tracks.values() if t.startswith("engine http")
    }
    assert any(e["name"] == "actor forward/backward" for e in trainer)
    assert any(e["name"] == "actor optimizer step" for e in trainer)
    ctl = _spans(events, procs, tracks, "controller")
    gens = [e for e in ctl if e["name"].startswith("generate")]
    assert len(gens) >= STEPS * BATCH * GROUP  # every trained sample's request, at least
    assert all(e["track"].startswith("generate http") for e in gens)
    assert sum(e["name"] == "send batch" for e in ctl) == STEPS
    engine = _spans(events, procs, tracks, "engine")
    assert sum(e["name"] == "/update_weight_version" for e in engine) == STEPS
    assert any(e["name"] == "/generate" for e in engine)


def test_spans_of_a_track_nest(run: Path) -> None:
    events, procs, tracks = _load(run)
    by_track: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            by_track[(e["pid"], e["tid"])].append(e)
    for key, spans in by_track.items():
        spans.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_ends: list[float] = []
        for e in spans:
            while open_ends and e["ts"] >= open_ends[-1]:
                open_ends.pop()
            end = e["ts"] + e["dur"]
            assert not open_ends or end <= open_ends[-1], (
                f"{procs[key[0]]}/{tracks[key]}: {e['name']} at {e['ts']} overlaps its enclosing "
                f"span's end {open_ends[-1]} without nesting"
            )
            open_ends.append(end)


def test_clocks_agree(run: Path) -> None:
    """A request's span on the engine lies inside the caller's span of it (controller's
    generation by rid, trainer's commit per engine in order): the three clocks agree."""
    events, procs, tracks = _load(run)
    ctl = _spans(events, procs, tracks, "controller")
    engine = _spans(events, procs, tracks, "engine")
    trainer = _spans(events, procs, tracks, "trainer")
    # a call the controller gave up on (cancelled at the end of the run) may outlive its span
    by_rid: dict[str, list[dict]] = defaultdict(list)
    for e in ctl:
        if e["name"] in ("generate", "generate (abort)"):
            by_rid[e["args"]["rid"]].append(e)
    pairs = []
    for e in engine:
        if e["name"] == "/generate":
            rids = e["args"]["rid"]
            for rid in rids if isinstance(rids, list) else [rids]:
                if by_rid.get(rid):  # a resumed request reuses its rid: the call that overlaps
                    pairs.append((max(by_rid[rid], key=lambda o: _overlap(o, e)), e))
    assert len(pairs) >= STEPS * BATCH
    commits = sorted((e for e in engine if e["name"] == "/update_weight_version"), key=_ts)
    calls = sorted((e for e in trainer if e["name"] == "/update_weight_version"), key=_ts)
    pairs += list(zip(calls, commits, strict=True))
    worst = max(
        max(outer["ts"] - inner["ts"], inner["end"] - outer["end"]) for outer, inner in pairs
    )
    assert worst <= TOL_US, f"a callee's span leaves its caller's by {worst / 1000:.1f} ms"


def _ts(e: dict) -> float:
    return e["ts"]


def _overlap(a: dict, b: dict) -> float:
    return min(a["end"], b["end"]) - max(a["ts"], b["ts"])


def test_trainer_idle_agrees_with_metrics(run: Path) -> None:
    """Idle = the gaps in the trace between the trainer's busy spans (train step, push,
    checkpoint) that end at a train step; metrics.jsonl's ``idle_s`` is measured apart; both
    from step 1 on (step 0 waits for start-up). The gap before the final checkpoint follows
    the last step and is in no metrics row (counting it made this test flaky)."""
    events, procs, tracks = _load(run)
    busy = sorted(
        (e for e in _spans(events, procs, tracks, "trainer") if e["track"] == "trainer"
         and e["name"] in ("train step", "push weights", "checkpoint")),
        key=_ts,
    )  # fmt: skip
    gaps = [b["ts"] - a["end"] for a, b in itertools.pairwise(busy) if b["name"] == "train step"]
    trace_idle_s = sum(g for g in gaps if g > 0) / 1e6
    rows = _rows(run)
    metrics_idle_s = sum(r["idle_s"] for r in rows if r["step"] > 0)
    assert metrics_idle_s > 0
    assert abs(trace_idle_s - metrics_idle_s) <= 0.02 + 0.02 * metrics_idle_s


def test_tracer_sampling_and_merge(tmp_path: Path) -> None:
    t = trace.configure(tmp_path, "p", every=2)
    try:
        for step in range(4):
            t.set_step(step)
            with t.span(f"s{step}", "main"):
                pass
    finally:
        trace.configure(None, "p")
    path = trace.merge(tmp_path)
    assert path is not None
    names = [e["name"] for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert names == ["s0", "s2"]


# -- asyncrl plot --------------------------------------------------------------------------
def _every_row(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _rows(run_dir: Path) -> list[dict]:
    """The training steps' rows (eval rows left out)."""
    return [r for r in _every_row(run_dir) if "eval/reward_mean" not in r]


def _evals(run_dir: Path) -> list[dict]:
    return [r for r in _every_row(run_dir) if "eval/reward_mean" in r]


def test_the_run_evaluated_before_during_and_after(run: Path) -> None:
    assert [int(e["step"]) for e in _evals(run)] == [0, EVAL_EVERY, STEPS]


def test_plot_writes_pngs_of_both_runs(run: Path, sync_run: Path, tmp_path: Path) -> None:
    mpl_image = pytest.importorskip("matplotlib.image")
    out = tmp_path / "plots"
    cmd = [sys.executable, "-m", "asyncrl.cli", "plot", str(sync_run), str(run), "--out", str(out)]
    done = subprocess.run(cmd, env=python_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    names = ("reward", "staleness", "throughput", "time", "timeline")
    for name in names:
        path = out / f"{name}.png"
        assert path.is_file() and path.stat().st_size > 10_000, path
        pixels = mpl_image.imread(path)[..., :3].reshape(-1, 3)
        colors = {tuple(p) for p in pixels[:: max(1, len(pixels) // 20000)].round(2).tolist()}
        assert len(colors) > 20, f"{name}.png looks blank ({len(colors)} colours)"


def test_plotted_values_come_from_the_runs(run: Path, sync_run: Path) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from asyncrl import plot

    runs = [plot.load_run(sync_run), plot.load_run(run)]
    assert "sync" in runs[0].label and "staleness 1" in runs[1].label
    fig = plot._reward(plt, runs, 0.8, 4)
    raw = [line for line in fig.axes[0].lines if line.get_alpha() == 0.25]
    for line, r in zip(raw, runs, strict=True):
        assert list(line.get_ydata()) == [row["reward_mean"] for row in _rows(r.path)]
        assert list(line.get_xdata()) == list(range(STEPS))
    wall = [line for line in fig.axes[1].lines if line.get_alpha() == 0.25]
    assert list(wall[1].get_xdata()) == [row["wall_s"] for row in _rows(run)]
    # the held-out eval curve: only the run that evaluated has one, at the versions evaluated
    for ax, key in ((fig.axes[0], "step"), (fig.axes[1], "wall_s")):
        (dashed,) = [line for line in ax.lines if line.get_linestyle() == "--"]
        assert "held-out eval" in str(dashed.get_label())
        assert list(dashed.get_xdata()) == [e[key] for e in _evals(run)]
        assert list(dashed.get_ydata()) == [e["eval/reward_mean"] for e in _evals(run)]
    plt.close(fig)
    shares = plot.time_shares(runs[1])
    rows = _rows(run)[1:]
    assert shares["trainer"]["training"] == pytest.approx(sum(r["train_s"] for r in rows))
    assert 0 < shares["engines"]["generating"]
    strip = plot.intervals(runs[1])
    assert len(strip["trainer: train step"]) == STEPS
    sync_hist = [r["staleness_hist"] for r in _rows(sync_run)]
    assert all(len(h) == 1 for h in sync_hist)  # a synchronous run trains fresh samples only
    # throughput's "generated": every token the engines returned (the controller's counter),
    # not the trained samples' responses only
    fig = plot._throughput(plt, runs, 0.8, 4)
    gen = [line for line in fig.axes[0].lines if line.get_alpha() == 0.25][1]
    rows = _rows(run)
    want = [
        (b["ctl_generated_tokens"] - a["ctl_generated_tokens"]) / (b["wall_s"] - a["wall_s"])
        for a, b in itertools.pairwise(rows)
    ]
    assert list(gen.get_ydata()) == pytest.approx(want)
    assert rows[-1]["ctl_generated_tokens"] >= sum(r["response_tokens"] for r in rows) > 0
    plt.close(fig)


def test_plot_text_and_errors(run: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "asyncrl.cli", "plot", str(run), "--text"]
    done = subprocess.run(cmd, env=python_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    first = _rows(run)[0]["reward_mean"]
    assert f"    0 {first:6.3f}" in done.stdout and "trainer: training" in done.stdout
    table = done.stdout.split("held-out evals (eval/...):\n", 1)[1].splitlines()
    assert table[0].split() == ["version", "reward", "pass@1", "pass@2", "greedy"]
    for line, e in zip(table[1:], _evals(run), strict=False):
        assert line.split()[:2] == [str(int(e["step"])), f"{e['eval/reward_mean']:.3f}"]
    cmd = [sys.executable, "-m", "asyncrl.cli", "plot", str(tmp_path)]
    done = subprocess.run(cmd, env=python_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "metrics.jsonl not found" in done.stderr


# -- metric sinks --------------------------------------------------------------------------
def test_tensorboard_event_files_match_metrics(run: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from asyncrl.sinks import group_of

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    rows = _rows(run)
    for key in ("reward_mean", "staleness_max", "train_s", "sync_s", "pg_loss", "idle_s"):
        got = acc.Scalars(group_of(key))
        assert [e.step for e in got] == [r["step"] for r in rows]
        assert [e.value for e in got] == pytest.approx([r[key] for r in rows], rel=1e-6)
    assert group_of("reward_mean") == "reward/reward_mean"
    # eval rows under eval/, at the version evaluated (or the newest step logged, if later:
    # a sink takes steps in order)
    evals = _evals(run)
    got = acc.Scalars("eval/reward_mean")
    assert [e.value for e in got] == pytest.approx([r["eval/reward_mean"] for r in evals])
    assert [e.step for e in got] == [0, EVAL_EVERY, STEPS]
    assert [e.value for e in acc.Scalars("eval/weight_version")] == [0, EVAL_EVERY, STEPS]
    config = acc.Tensors("config")[0].tensor_proto.string_val[0].decode()
    assert f'"total_steps": {STEPS}' in config
    assert acc.Tensors("git_revision")


def _wandb_records(
    run_dir: Path, pattern: str = "wandb/offline-run-*/run-*.wandb"
) -> tuple[list[dict], Any]:
    from wandb.proto import wandb_internal_pb2 as pb
    from wandb.sdk.internal.datastore import DataStore

    (path,) = run_dir.glob(pattern)
    store = DataStore()
    store.open_for_scan(str(path))
    history, run_record = [], None
    while (data := store.scan_data()) is not None:
        rec = pb.Record()
        rec.ParseFromString(data)
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            history.append(
                {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in rec.history.item
                }
            )
        elif kind == "run":
            run_record = rec.run
    return history, run_record


def test_wandb_offline_run_matches_metrics(run: Path) -> None:
    pytest.importorskip("wandb.sdk.internal.datastore")
    history, run_record = _wandb_records(run)
    rows = _rows(run)
    # W&B merges what is logged at one step into one history row: an eval of version v joins
    # training step v's row; the final eval (version STEPS) is a row of its own
    assert [h["_step"] for h in history] == [r["step"] for r in rows] + [STEPS]
    for h, r in zip(history, rows, strict=False):
        assert h["reward/reward_mean"] == pytest.approx(r["reward_mean"])
        assert h["sync/sync_s"] == pytest.approx(r["sync_s"])
        assert h["algo/pg_loss"] == pytest.approx(r["pg_loss"])
    logged = [(h["_step"], h["eval/reward_mean"]) for h in history if "eval/reward_mean" in h]
    assert logged == [(int(e["step"]), pytest.approx(e["eval/reward_mean"])) for e in _evals(run)]
    assert run_record is not None and run_record.project == "asyncrl"
    config = {i.key: json.loads(i.value_json) for i in run_record.config.update}
    assert config["controller"]["total_steps"] == STEPS
    assert "git_revision" in config


def test_a_failing_sink_warns_once_and_the_run_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("tensorboard")
    from asyncrl.config import load_config
    from asyncrl.sinks import close_sinks, log_row, make_sinks

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the event folder should be")
    cfg = load_config(None, ["--logging.tensorboard.enabled=true",
                             f"--logging.tensorboard.log_dir={blocker}/tb"])  # fmt: skip
    sinks = make_sinks(cfg, tmp_path)
    for step in range(3):
        log_row(sinks, {"step": step, "reward_mean": 0.5})
    close_sinks(sinks)
    warnings = [r for r in caplog.records if "tensorboard" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelname == "WARNING"


def test_no_extra_is_imported_when_off() -> None:
    code = (
        "import sys, asyncio; from asyncrl.config import load_config;"
        "from asyncrl import runner, plot, sinks, progress, trace;"
        "sinks.make_sinks(load_config(None, []), __import__('pathlib').Path('.'));"
        "print(sorted(m for m in ('matplotlib', 'tensorboard', 'wandb', 'torch')"
        " if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=python_env(), capture_output=True,
                         text=True, timeout=120, check=True)  # fmt: skip
    assert out.stdout.strip() == "[]"


# -- progress ------------------------------------------------------------------------------
def test_progress_lines(run_and_output: tuple[Path, str]) -> None:
    _, stdout = run_and_output
    lines = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == STEPS and "\r" not in stdout  # not a terminal: plain lines
    assert lines[0].startswith(f"step 1/{STEPS} | reward ") and "ETA" in lines[-1]
    assert "tok/s" in lines[-1] and "- tok/s" not in lines[-1]
    assert f"(last {min(STEPS, 10)}: " in lines[-1]  # the running mean says what it is
    evals = [line for line in stdout.splitlines() if line.startswith("eval of v")]
    assert [e.split(" | ")[0] for e in evals] == ["eval of v0", f"eval of v{EVAL_EVERY}",
                                                   f"eval of v{STEPS}"]  # fmt: skip
    assert "pass@2" in evals[0] and "greedy" in evals[0]
    assert " | eval " in lines[-1] and "@v" in lines[-1]  # the step line carries the newest


def test_progress_live_line_rewrites_in_place() -> None:
    import io

    from asyncrl.progress import Progress

    buf = io.StringIO()
    p = Progress(3, buf, live=True)
    for step in range(3):
        p.update({"step": step, "wall_s": 1.0 + step, "reward_mean": 0.1 * step,
                  "response_tokens": 100})  # fmt: skip
    text = buf.getvalue()
    assert text.count("\r") == 3 and text.endswith("\n") and text.count("\n") == 1
    assert "100 tok/s" in text and "ETA 0s" in text


def test_progress_line_says_what_its_running_mean_is() -> None:
    """Issue 37 item 10: the bracket is the mean of the last 10 steps' rewards, labelled so
    (it was an unexplained ``avg``, an EMA)."""
    import io

    from asyncrl.progress import Progress

    buf = io.StringIO()
    p = Progress(12, buf, live=False)
    for step in range(12):
        p.update({"step": step, "wall_s": 1.0 + step, "reward_mean": float(step)})
    lines = buf.getvalue().splitlines()
    assert "reward 0.000 (last 1: 0.000)" in lines[0]
    assert "reward 11.000 (last 10: 6.500)" in lines[-1]  # mean of 2..11
    assert "avg" not in buf.getvalue()


def test_progress_eval_line_keeps_the_live_step_line_readable() -> None:
    import io

    from asyncrl.progress import Progress

    buf = io.StringIO()
    p = Progress(4, buf, live=True)
    p.update({"step": 0, "wall_s": 1.0, "reward_mean": 0.25})
    p.eval({"step": 1, "eval/reward_mean": 0.5, "eval/pass@1": 0.25, "eval/pass@4": 0.75})
    p.update({"step": 1, "wall_s": 2.0, "reward_mean": 0.5})
    text = buf.getvalue()
    eval_line = "eval of v1 | reward 0.500 | pass@1 0.250 | pass@4 0.750\n"
    assert eval_line in text
    before, after = text.split(eval_line)
    assert before.endswith("\r") and before.count("\n") == 0  # the step line was wiped first
    assert after.startswith("\rstep 2/4 | reward 0.500 (last 2: 0.375) | eval 0.500@v1 | ")


def test_plot_text_columns_are_labelled(tmp_path: Path) -> None:
    """``asyncrl plot --text``: a header names the columns and the smoothing (``--smooth``
    is applied, as for the PNGs), the time shares say what they are shares of."""
    from asyncrl.plot import main_plot

    rows = [{"step": i, "reward_mean": r, "wall_s": 1.0 + i, "train_s": 0.5}
            for i, r in enumerate([0.0, 1.0, 1.0])]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main_plot([str(tmp_path)], None, True, 0.5, 4) == 0
    lines = out.getvalue().splitlines()
    assert lines[1].split()[:3] == ["step", "reward", "smooth"], lines
    assert "EMA, weight 0.5" in lines[1]
    assert lines[3].split()[:3] == ["1", "1.000", "0.667"], lines  # debiased EMA at 0.5
    assert "share of the wall time after the first step:" in lines
    assert any(line.startswith("  trainer: training") for line in lines), lines


def test_run_records_where_its_engines_listen(run: Path) -> None:
    """RUN_DIR/engines.json names every engine and its URL (docs/embedding.md: reaching a
    run's engines by hand)."""
    engines = json.loads((run / "engines.json").read_text())
    processes = json.loads((run / "processes.json").read_text())
    assert set(engines) == {n for n in processes if n.startswith("engine")} == {"engine0"}
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", engines["engine0"]), engines
