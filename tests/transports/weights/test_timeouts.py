"""Every wait of a push ends: an engine that stops reading mid-push (SIGSTOP) is named; one
that left the run (SIGKILL) is not waited for once the sender is told the new engine set."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.config import GlooWeightsConfig
from asyncrl.engines.rollout.factory import make_weight_transport
from asyncrl.procs import free_port, python_env, stop
from asyncrl.transports.weights.base import WeightSyncError
from tests.runs import spawn_shared

sys.path.insert(0, str(Path(__file__).parent))
from test_collective import ENGINE, FAULTY, _healthy, _model_weights, expected, state

TIMEOUT_S = 3.0


def _stopped(proc: subprocess.Popen) -> bool:
    with open(f"/proc/{proc.pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_engine_stopped_mid_push_is_reported_in_time_and_the_next_push_reforms(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    import asyncio

    procs: list[subprocess.Popen] = []
    urls = []
    try:
        for i, fault in enumerate(["", "stop:0@2"]):  # engine 1 hangs when v2 starts arriving
            port = free_port()
            args = [*(FAULTY if fault else ENGINE), "--model-path", str(tiny_model_dir)]
            args += ["--port", str(port)] + (["--faults", fault] if fault else [])
            procs.append(spawn_shared(args, tmp_path / f"engine{i}.log", python_env()))
            urls.append(f"http://127.0.0.1:{port}")
        asyncio.run(_healthy(urls))
        cfg = GlooWeightsConfig(bucket_mb=1, min_buckets=2, timeout_s=TIMEOUT_S)
        sender = make_weight_transport(cfg, urls, "cpu")
        try:
            sender.connect()
            w1, w2, w3 = (_model_weights(tiny_model_dir, seed=s) for s in (1, 2, 3))
            sender.push(w1.items(), 1).wait(60)
            t0 = time.monotonic()
            with pytest.raises(WeightSyncError) as err:
                sender.push(w2.items(), 2).wait(60)
            took = time.monotonic() - t0
            assert _stopped(procs[1])  # it really hung mid-push
            # the budget of the push's bytes (< 1 GiB: one timeout_s), plus the engine's verdicts
            assert took < 2 * TIMEOUT_S + 2, took
            msg = str(err.value)
            assert urls[1] in msg and "bucket 0" in msg and urls[0] not in msg, msg
            assert state(urls[0]) == ("1", expected(w1))  # the healthy one kept serving v1
            os.kill(procs[1].pid, signal.SIGCONT)
            sender.push(w3.items(), 3).wait(60)  # the run goes on: the group is re-formed
            assert [state(u) for u in urls] == [("3", expected(w3))] * 2
        finally:
            sender.close()
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
        stop(procs)


def test_push_waiting_on_an_engine_that_left_goes_to_the_others_at_once(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine SIGKILLed for good: the push after it re-forms the group and waits for the
    dead engine's /health (weights.timeout_s, 600 s here) until the sender is told the new
    engine set; then it stops waiting and delivers to the engine left, at once."""
    import asyncio

    procs: list[subprocess.Popen] = []
    urls = []
    try:
        for i in range(2):
            port = free_port()
            args = ["-m", "asyncrl.entrypoints.engine", "--model-path"]
            args += [str(tiny_model_dir), "--port", str(port)]
            procs.append(spawn_shared(args, tmp_path / f"engine{i}.log", python_env()))
            urls.append(f"http://127.0.0.1:{port}")
        asyncio.run(_healthy(urls))
        cfg = GlooWeightsConfig(bucket_mb=1, min_buckets=2, timeout_s=600.0)
        sender = make_weight_transport(cfg, urls, "cpu")
        try:
            sender.connect()
            w1, w2, w3 = (_model_weights(tiny_model_dir, seed=s) for s in (1, 2, 3))
            sender.push(w1.items(), 1).wait(60)
            os.kill(procs[1].pid, signal.SIGKILL)
            procs[1].wait(10)
            with pytest.raises(WeightSyncError):  # its connections are gone: fails at once
                sender.push(w2.items(), 2).wait(30)
            handle = sender.push(w3.items(), 3)  # re-forms: waits for urls[1] to answer
            deadline = time.monotonic() + 30
            while sender.engines._op is None and time.monotonic() < deadline:
                time.sleep(0.01)  # until that re-form is under way
            assert sender.engines._op is not None, "the re-form never started"
            assert not handle.done()
            sender.engines_changed([urls[0]], epoch=1)
            stats = handle.wait(60)  # not weights.timeout_s (600 s): the change released it
            assert stats["attempts"] == 1.0
            assert state(urls[0]) == ("3", expected(w3))
            text = caplog.text
            assert f"engine(s) {urls[1]} left the run's engine set" in text, text
            sender.engines_changed(urls, epoch=0)  # an older set: ignored
            sender.push(w1.items(), 4).wait(30)
            assert state(urls[0]) == ("4", expected(w1))
        finally:
            sender.close()
    finally:
        stop(procs)
