"""``asyncrl run --rollout.backend=sglang`` against SGLang as it behaves, per version.

The other side is the stand-in written from SGLang's source
(``tests/engines/rollout/sglang/standin.py``, every behaviour cited there), whose
weight-receiving ranks are SGLang's own code: its ``init_custom_process_group``
joins the group and its ``FlattenedTensorBucket`` rebuilds every bucket. What is
checked, per push and per TP rank: the bytes SGLang's code received equal what
the trainer packed (the sender's checksum of each bucket), and at the end every
rank's tensors equal the trainer's final weights (sha256); every token was made
by fully loaded weights and carried their version (the stand-in's ground truth);
the client's per-token versions equal that ground truth, spans included; the
calls on the wire come in the order SGLang needs.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncrl.procs import finish, pid_alive
from tests.engines.rollout._background import check_versions, generate_in_background
from tests.engines.rollout._runs import start_gloo_run
from tests.engines.rollout.sglang.code import VERSIONS, sglang_src
from tests.engines.rollout.sglang.server import StandInServer, start_standin

STEPS = 3


def _run(tmp: Path, model_dir: Path, urls: list[str], *extra: str) -> subprocess.Popen:
    """The SGLang stand-in tests' job (:func:`~tests.engines.rollout._runs.start_gloo_run`),
    every bucket's checksum covering all its bytes (see rank.py), delta asked for: SGLang
    still gets full pushes (a delta payload would not match the bucket SGLang receives into,
    and _check_state would count it bad)."""
    checks = ("--weights.verify=full", "--weights.delta=auto")
    return start_gloo_run("sglang", tmp, model_dir, urls, STEPS, *extra, *checks)


def _finish(proc: subprocess.Popen, timeout_s: float = 240) -> tuple[int, str]:
    return finish(proc, timeout_s)


def _check_wire(server: StandInServer, pushes: int, session: bool) -> None:
    """Per push: pause, [begin], updates one at a time (last relabels), [end], relabel,
    continue; no update call overlaps another (SGLang serves them in arrival order)."""
    calls = [c for c in server.wire() if c["path"] != "/generate" and c["method"] == "POST"]
    missing = [c["path"] for c in calls if c["status"] == 404]  # SGLang < 0.5.22: asked once
    assert missing == ([] if session else ["/begin_weight_update"]), missing
    calls = [c for c in calls if c["status"] != 404]
    paths = [c["path"] for c in calls]
    for c in calls:
        if c["path"] != "/update_weights_from_distributed":
            continue
        assert c["status"] == 200, c
        assert c["body"]["load_format"] == "flattened_bucket"
        assert c["body"]["abort_all_requests"] is False
        assert "asyncrl_bucket" in c["note"]  # an unknown field, ignored by SGLang
    starts = [i for i, p in enumerate(paths) if p == "/pause_generation"]
    assert len(starts) == pushes, paths
    for a, b in zip(starts, [*starts[1:], len(paths)], strict=True):
        one = paths[a:b]
        want = ["/pause_generation"] + (["/begin_weight_update"] if session else [])
        assert one[: len(want)] == want, one
        k = len(want)
        updates = [p for p in one[k:] if p == "/update_weights_from_distributed"]
        assert updates and one[k : k + len(updates)] == updates, one
        tail = one[k + len(updates) :]
        want_tail = (["/end_weight_update"] if session else []) + [
            "/update_weight_version",
            "/continue_generation",
        ]
        assert tail[: len(want_tail)] == want_tail, one
        last = calls[a + k + len(updates) - 1]["body"]
        assert last.get("weight_version") is not None  # relabelled with the last bucket's load


def _check_state(server: StandInServer, pushes: int, tp: int) -> dict[str, Any]:
    st = server.state()
    assert st["label"] == str(pushes) and st["truth"] == pushes, st["label"]
    for v in range(1, pushes + 1):  # every bucket of every push, bit-exact on every TP rank
        counts = st["verified"][str(v)]
        assert all(counts.get(f"rank{r}:bad", 0) == 0 for r in range(tp)), counts
        assert len({counts.get(f"rank{r}:ok", 0) for r in range(tp)}) == 1, counts
    assert st["mixed_tokens"] == 0 and st["label_errors"] == 0
    first = st["sha256"]["rank0"]
    assert all(s == first for s in st["sha256"].values())  # every TP rank holds the same
    return st


@pytest.mark.slow
@pytest.mark.parametrize("version", [v for v in VERSIONS if v != VERSIONS[-1]])
def test_run_against_sglang(version: str, tmp_path: Path, tiny_model_dir: Path) -> None:
    """A whole run per SGLang version (the newest runs in test_two_engines_tp2)."""
    sglang_src(version)
    new = version >= "0.5.22"
    mode = "retract" if new else "abort"  # 0.5.10 reports no spans: abort keeps it exact
    server = start_standin(version, tiny_model_dir, tmp_path / "sglang", step_s=0.01)
    try:
        proc = _run(tmp_path, tiny_model_dir, [server.url], f"--rollout.pause_mode={mode}")
        rc, out = _finish(proc)
        assert rc == 0, out + server.log.read_text()[-3000:]
        st = _check_state(server, STEPS, tp=1)
        _check_wire(server, STEPS, session=new)
        assert not any(c["path"] == "/health" for c in server.wire())  # no 1 s probes
        assert len(st["reqs"]) > 0
    finally:
        server.stop()


@pytest.mark.slow
def test_two_engines_tp2(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Two engines of two TP ranks each (the newest SGLang, retracting pauses): ranks 1..4
    of a world of 5."""
    version = VERSIONS[-1]
    sglang_src(version)
    servers = [
        start_standin(version, tiny_model_dir, tmp_path / f"sglang{i}", tp_size=2, step_s=0.01)
        for i in range(2)
    ]
    try:
        proc = _run(
            tmp_path, tiny_model_dir, [s.url for s in servers], "--rollout.pause_mode=retract"
        )
        rc, out = _finish(proc)
        assert rc == 0, out + "".join(s.log.read_text()[-2000:] for s in servers)
        states = [_check_state(s, STEPS, tp=2) for s in servers]
        assert states[0]["sha256"]["rank0"] == states[1]["sha256"]["rank0"]
        assert sum(len(st["reqs"]) for st in states) > 0
        for s in servers:
            _check_wire(s, STEPS, session=True)
            assert not any(c["path"] == "/health" for c in s.wire())  # no 1 s probes
        ranks = [
            c["body"]["rank_offset"]
            for s in servers
            for c in s.wire()
            if c["path"] == "/init_weights_update_group"
        ]
        worlds = {
            c["body"]["world_size"]
            for s in servers
            for c in s.wire()
            if c["path"] == "/init_weights_update_group"
        }
        assert sorted(ranks) == [1, 3] and worlds == {5}
    finally:
        for s in servers:
            s.stop()


@pytest.mark.slow
def test_failed_push_is_repushed(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The second push's load fails after SGLang received a bucket: weights undefined, so it
    is re-pushed (engines still paused) and the run goes on with exact weights."""
    sglang_src("0.5.23")
    server = start_standin("0.5.23", tiny_model_dir, tmp_path / "sglang", fail_calls="3")
    try:
        proc = _run(tmp_path, tiny_model_dir, [server.url], "--weights.min_buckets=2")
        rc, out = _finish(proc)
        assert rc == 0, out + server.log.read_text()[-3000:]
        st = _check_state(server, STEPS, tp=1)
        assert st["update_calls"] > STEPS  # one push went twice (one bucket per push here)
        failed = [c for c in server.wire() if c["status"] == 400]
        assert [c["path"] for c in failed] == ["/update_weights_from_distributed"]
        log = (tmp_path / "run" / "trainer0.log").read_text()
        assert "re-pushing" in log and "kept old weights" not in log
    finally:
        server.stop()


@pytest.mark.slow
def test_push_failing_every_time_stops_the_run(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Every load fails: after the re-push the engine's weights are undefined, which no
    trainer restart can repair, so the run stops at once with an error naming the engine
    (exit code 1), and leaves none of its processes behind."""
    sglang_src("0.5.23")
    fail = ",".join(str(k) for k in range(1, 100))  # every update call's load fails
    server = start_standin("0.5.23", tiny_model_dir, tmp_path / "sglang", fail_calls=fail)
    try:
        proc = _run(tmp_path, tiny_model_dir, [server.url], "--weights.repush_attempts=1")
        rc, out = _finish(proc, timeout_s=180)
        t_exit = time.time()
        assert rc == 1, out
        assert "UNDEFINED" in out and server.url in out and "kept old weights" not in out, out
        updates = [c for c in server.wire() if c["path"] == "/update_weights_from_distributed"]
        assert len(updates) == 2 and all(c["status"] == 400 for c in updates), updates
        # promptly: from the re-push's failed load to the run's exit (trainer grace 10 s)
        assert t_exit - updates[-1]["t"] < 30, t_exit - updates[-1]["t"]
        assert "restarting the trainer" not in out, out  # fatal, not restartable
        pids = json.loads((tmp_path / "run" / "processes.json").read_text())
        assert pids and not [n for n, pid in pids.items() if pid_alive(pid)], pids
    finally:
        server.stop()


@pytest.mark.parametrize("version", ["0.5.22", "0.5.23"])
def test_spans_expand_to_exact_token_versions(
    version: str, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Requests retracted across a push carry SGLang's version spans; the client's
    per-token versions equal the stand-in's ground truth token by token."""
    from safetensors.torch import load_file

    from asyncrl.config import GlooWeightsConfig
    from asyncrl.engines.rollout.factory import make_weight_transport
    from asyncrl.engines.rollout.sglang import SGLangClient

    sglang_src(version)
    server = start_standin(version, tiny_model_dir, tmp_path / "sglang", step_s=0.02)
    sender = None
    try:
        cfg = GlooWeightsConfig(bucket_mb=1, min_buckets=2, timeout_s=60, verify="full")
        sender = make_weight_transport(cfg, [server.url], "cpu", "retract", "sglang")
        sender.connect()
        weights = load_file(str(tiny_model_dir / "model.safetensors"))
        sp = {"max_new_tokens": 60, "ignore_eos": True}
        t, results = generate_in_background(
            lambda: SGLangClient(server.url),
            [(f"s{i}.", [1, 3, 4], sp) for i in range(3)],
            lambda: any(len(r["truth"]) >= 5 for r in server.state()["reqs"].values()),
            "a request started",
        )
        sender.push(((n, w + 1) for n, w in weights.items()), 1).wait(120)
        t.join(120)
        st = server.state()
        check_versions(results, st["reqs"])
        assert st["mixed_tokens"] == 0 and st["label_errors"] == 0
        want = {
            n: hashlib.sha256((w + 1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for n, w in weights.items()
        }
        assert st["sha256"]["rank0"] == want
    finally:
        if sender is not None:
            sender.close()
        server.stop()
