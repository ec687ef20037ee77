"""What ``asyncrl bench NAME --help`` says, and the numbers two benchmarks report (issue 37
item 10): every option shows its default and no help points into a source file; ``bench
transport`` times exactly ``--trajectories``; ``bench gateway``'s added p99 is a percentile
of per-call differences, never a difference of percentiles."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.bench import BENCHES, run_bench
from asyncrl.bench.gateway import added_latency
from asyncrl.procs import python_env


def _help(name: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        run_bench(name, ["--help"])
    assert done.value.code == 0
    return out.getvalue()


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_bench_help_shows_every_default_and_no_source_file(name: str) -> None:
    text = _help(name)
    parser = _parser_of(name)
    for action in parser._actions:
        if not action.option_strings or action.help == "==SUPPRESS==":
            continue
        default = action.default
        if default is None or default is False or default in ("", [], "==SUPPRESS=="):
            continue
        flag = action.option_strings[-1]
        options = text[text.index("options:") :]
        start = re.search(rf"^  (?:-\w+, )*{re.escape(flag)}\b", options, re.MULTILINE)
        assert start, f"{name} {flag} not listed"
        block = options[start.end() :]
        nxt = re.search(r"\n  -", block)
        block = block[: nxt.start()] if nxt else block
        assert "default" in block, f"{name} {flag}: no default shown:\n{block}"
    assert not re.search(r"\bsee [a-z_]+\b(?!\.md)", text), text  # "see weight_sync_engines"
    assert ".py" not in text, text


def _parser_of(name: str) -> object:
    """The benchmark's own parser, caught as argparse builds it for ``--help``."""
    import argparse

    made: list[argparse.ArgumentParser] = []
    original = argparse.ArgumentParser.parse_known_args  # parse_args calls it too

    def capture(self: argparse.ArgumentParser, *a: object, **k: object) -> object:
        made.append(self)
        raise SystemExit(0)  # before the benchmark does anything

    argparse.ArgumentParser.parse_known_args = capture  # type: ignore[method-assign,assignment]
    try:
        with contextlib.suppress(SystemExit):
            run_bench(name, [])
    finally:
        argparse.ArgumentParser.parse_known_args = original  # type: ignore[method-assign]
    assert made, name
    return made[0]


def test_added_latency_is_a_percentile_of_differences() -> None:
    """A slow tail at the engine and a steady gateway: the old statistic (p99 - p99) said
    the gateway adds -89 ms at p99 and +5 ms at p50; paired, the p99 of the per-call
    differences is >= their p50, and unpaired no p99 "added" is claimed."""
    gw = [0.010] * 98 + [0.011] * 2
    engine = [0.005] * 98 + [0.100] * 2
    paired = added_latency(gw, engine, paired=True)
    assert paired["added_p99_ms"] >= paired["added_p50_ms"] == pytest.approx(5.0)
    loose = added_latency(gw, engine, paired=False)
    assert "added_p99_ms" not in loose and loose["added_p50_ms"] == pytest.approx(5.0)
    assert loose["gateway_p99_ms"] == pytest.approx(11.0)
    assert loose["engine_p99_ms"] == pytest.approx(100.0)


def _transport(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "asyncrl.cli", "bench", "transport", *args]
    return subprocess.run(cmd, env=python_env(), capture_output=True, text=True, timeout=240)


def test_bench_transport_times_exactly_the_trajectories_asked_for(tmp_path: Path) -> None:
    out = _transport(tmp_path, "--trajectories=24", "--group-sizes=8", "--repeats=1",
                     f"--json={tmp_path / 't.json'}")  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "t.json").read_text())["runs"]
    assert rows and all(r["trajectories"] == 24 for r in rows), rows
    bad = _transport(tmp_path, "--trajectories=20", "--group-sizes=8,1")
    assert bad.returncode == 2 and "must be a positive multiple of every group" in bad.stderr
