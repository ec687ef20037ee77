"""asyncrl's vLLM family against vLLM 0.33's own API server code (``vllm/app.py``) over an
engine core written from vLLM's source (``vllm/standin.py``, every behaviour cited there), whose
receiving ranks join with vLLM's own ``StatelessProcessGroup`` and rebuild every chunk
with vLLM's own ``unpack_tensor`` (Gloo in place of NCCL, which cannot run on a CPU).

Checked: every push bit-exact on every receiving rank (sha256 of every tensor against
what the trainer sent); every token's version exact with ``keep`` pauses, no request
aborted (the stand-in's ground truth against the client's per-token versions from vLLM's
spans); the calls in the order vLLM requires (pause, start, update(s) in flight with the
broadcast, finish with the version, resume); the metadata sent once, then the empty-list
form; a failed update re-sent as a whole new round.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncrl.procs import finish, python_env
from tests.engines.rollout.vllm.server import VLLMStandIn, start_vllm

STEPS = 3


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def _pushes(server: VLLMStandIn) -> list[list[dict[str, Any]]]:
    """The weight calls of each push, from its ``/pause`` to its ``/resume`` or to the call
    that failed (a failed round is left paused: what follows belongs to the next round)."""
    calls = [c for c in server.wire() if c["method"] == "POST" and "generate" not in c["path"]]
    out: list[list[dict[str, Any]]] = []
    inside = False
    for c in calls:
        if c["path"] == "/pause":
            out.append([])
            inside = True
        if inside:
            out[-1].append(c)
        inside = inside and c["path"] != "/resume" and c["status"] < 400
    return out


def _check_wire(
    server: VLLMStandIn, mode: str = "keep", checked: bool | None = None
) -> list[list[dict[str, Any]]]:
    """Per push: /pause?mode, /start_weight_update, /update_weights..., /finish_weight_update
    {weight_version}, [/weight_checker: weights.verify, sampled by default: one engine per
    push], /resume; the first update after the group formed carries the names. ``checked``:
    whether every push (True) or none (False) of this engine was checked."""
    pushes = _pushes(server)
    for one in pushes:
        ok = [c for c in one if c["status"] == 200]
        paths = [c["path"] for c in ok]
        # keep: clear_cache=false, else vLLM resets the running requests' KV (rl:35)
        want = {"mode": mode, **({"clear_cache": "false"} if mode == "keep" else {})}
        assert one[0]["query"] == want, one[0]
        k = paths.index("/start_weight_update")
        updates = [p for p in paths[k + 1 :] if p == "/update_weights"]
        assert updates and paths[k + 1 : k + 1 + len(updates)] == updates, paths
        tail = paths[k + 1 + len(updates) :]
        check = tail == ["/finish_weight_update", "/weight_checker", "/resume"]
        assert check or tail == ["/finish_weight_update", "/resume"], paths
        assert checked is None or check == checked, paths
        fin = [c for c in ok if c["path"] == "/finish_weight_update"][-1]
        assert fin["body"]["weight_version"], fin
    return pushes


def _start_run(tmp: Path, model_dir: Path, urls: list[str], *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "asyncrl.cli", "run", "--run-dir", str(tmp / "run"), "--quiet"]
    cmd += [f"--model.path={model_dir}", "--rollout.backend=vllm"]
    cmd += [f"--rollout.urls={json.dumps(urls)}", "--weights.backend=gloo"]
    cmd += [f"--controller.total_steps={STEPS}", "--controller.batch_size=2"]
    cmd += ["--controller.max_staleness=1", "--weights.bucket_mb=1", *extra]
    return subprocess.Popen(cmd, env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _check_state(server: VLLMStandIn, pushes: int, tp: int, mode: str = "keep") -> dict[str, Any]:
    """Every push bit-exact on every rank, every token under the version that made it;
    ``keep``: nothing aborted, no cache reset, no request re-prefilled."""
    st = server.state()
    assert st["label"] == str(pushes) and st["truth"] == pushes, (st["label"], st["truth"])
    for v in range(1, pushes + 1):  # every push, the same bytes on every rank
        assert len(set(st["pushes"][str(v)].values())) == 1 and len(st["pushes"][str(v)]) == tp
    assert st["mixed_tokens"] == 0 and st["label_errors"] == 0
    if mode == "keep":
        # none aborted by a pause (a request the run itself hung up on as it ended is
        # aborted by vLLM too, async_llm.py:807-812: that is no pause's doing)
        aborted = [r for r in st["reqs"].values() if r["finish"] == "abort" and not r["hung_up"]]
        assert not aborted, aborted
        assert st["cache_resets"] == 0, st["cache_resets"]
        assert not [r for r in st["reqs"].values() if r["prefills"] != 1]  # none re-prefilled
    first = st["sha256"]["rank0"]
    assert all(s == first for s in st["sha256"].values())
    return st


def test_pushes_are_exact_and_keep_versions_exact(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Two pushes while requests run under ``keep``: bit-exact on both ranks (TP 2), the
    tokens' versions from vLLM's spans equal the ground truth, nothing aborted, the second
    push's metadata sent as empty lists."""
    from safetensors.torch import load_file

    from asyncrl.config import GlooWeightsConfig
    from asyncrl.engines.rollout.factory import make_weight_transport
    from asyncrl.engines.rollout.vllm.client import VLLMClient

    server = start_vllm(tiny_model_dir, tmp_path / "vllm", tp_size=2, step_s=0.02)
    sender = None
    try:
        cfg = GlooWeightsConfig(bucket_mb=1, timeout_s=60)
        sender = make_weight_transport(cfg, [server.url], "cpu", "keep", "vllm")
        sender.connect()
        weights = load_file(str(tiny_model_dir / "model.safetensors"))
        results: dict[str, Any] = {}

        async def generate() -> None:
            c = VLLMClient(server.url)
            sp = {"max_new_tokens": 80, "ignore_eos": True}
            rids = [f"s{i}" for i in range(3)]
            out = await asyncio.gather(*(c.generate([1, 3, 4], sp, rid=r) for r in rids))
            results.update(zip(rids, out, strict=True))
            await c.close()

        t = threading.Thread(target=lambda: asyncio.run(generate()))
        t.start()
        deadline = time.monotonic() + 60
        while not any(len(r["truth"]) >= 5 for r in server.state()["reqs"].values()):
            assert time.monotonic() < deadline, "no request started"
            time.sleep(0.05)
        for v in (1, 2):
            sender.push(((n, w + v) for n, w in weights.items()), v).wait(120)
            time.sleep(0.2)
        t.join(120)
        st = server.state()
        spanned = 0
        for rid, res in results.items():
            truth = st["reqs"][rid]["truth"]
            assert res.token_versions() == truth, (rid, res.versions, truth)
            assert res.finish_reason == "length"
            spanned += len(set(truth)) > 1
        assert spanned, "no request spanned a push"
        assert st["mixed_tokens"] == 0 and st["label_errors"] == 0
        want = {n: _sha(w + 2) for n, w in weights.items()}
        assert st["sha256"]["rank0"] == want and st["sha256"]["rank1"] == want
        pushes = _check_wire(server, checked=True)  # one engine: each push checked
        assert len(pushes) == 2
        first, second = ([c for c in p if c["path"] == "/update_weights"] for p in pushes)
        assert first[0]["body"]["update_info"]["n_names"] == len(weights)
        assert [c["body"]["update_info"]["n_names"] for c in second] == [0]  # unchanged: empty
    finally:
        if sender is not None:
            sender.close()
        server.stop()


@pytest.mark.slow
def test_failed_update_is_resent_as_a_new_round(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The second push's update fails after the receive (vLLM ends the session, the model
    mid-reload): the push is sent again as a whole new round and the run goes on exact."""
    server = start_vllm(tiny_model_dir, tmp_path / "vllm", fail_calls="2")
    try:
        rc, out = finish(_start_run(tmp_path, tiny_model_dir, [server.url]), 240)
        assert rc == 0, out + server.log.read_text()[-3000:]
        _check_state(server, STEPS, tp=1)
        failed = [c for c in server.wire() if c["status"] >= 400]
        assert [c["path"] for c in failed] == ["/update_weights"], failed
        pushes = _pushes(server)
        k = next(i for i, p in enumerate(pushes) if any(c["status"] >= 400 for c in p))
        failed_round = [c["path"] for c in pushes[k]]  # left paused: no finish, no resume
        assert failed_round == ["/pause", "/start_weight_update", "/update_weights"], pushes[k]
        again = [c for c in server.wire() if c["t"] > pushes[k][-1]["t"]]
        again = [c for c in again if c["method"] == "POST" and "generate" not in c["path"]]
        if again[0]["path"] == "/init_weight_transfer_engine":  # the group was re-formed
            again = again[1:]
        paths = [c["path"] for c in again]
        assert paths[:6] == ["/pause", "/start_weight_update", "/update_weights",
                             "/finish_weight_update", "/weight_checker",
                             "/resume"], paths  # fmt: skip
        assert again[2]["body"]["update_info"]["n_names"] > 0  # metadata unknown: sent whole
        assert again[3]["body"]["weight_version"] == "2"
        log = (tmp_path / "run" / "trainer0.log").read_text()
        assert "re-pushing" in log
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["abort", "wait"])
def test_run_with_abort_and_wait_pauses(tmp_path: Path, tiny_model_dir: Path, mode: str) -> None:
    """``asyncrl run --rollout.backend=vllm --rollout.pause_mode=abort|wait`` against vLLM's
    own app (the run secret as its ``--api-key``): finishes; every push bit-exact; every
    token's version the one that made it; the pauses sent as asked (vLLM's default
    ``clear_cache``: no request is kept)."""
    server = start_vllm(tiny_model_dir, tmp_path / "vllm", step_s=0.01)
    try:
        run = _start_run(tmp_path, tiny_model_dir, [server.url], f"--rollout.pause_mode={mode}")
        rc, out = finish(run, 240)
        assert rc == 0, out + server.log.read_text()[-3000:]
        _check_state(server, STEPS, tp=1, mode=mode)
        assert len(_check_wire(server, mode)) == STEPS
    finally:
        server.stop()


def test_run_against_a_vllm_without_scale_out_stops_at_once(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """vLLM started without ``--enable-scale-out`` answers the generate route 403 (its own
    ``register_scale_out_api_routers``, scale_out/factories.py:95-128): a run against it
    (``rollout.urls``) stops at once with one line naming the flag."""
    server = start_vllm(tiny_model_dir, tmp_path / "vllm", drop=("--enable-scale-out",))
    try:
        t0 = time.monotonic()
        rc, out = finish(_start_run(tmp_path, tiny_model_dir, [server.url]), 120)
        took = time.monotonic() - t0
        assert rc != 0, out
        lines = [ln for ln in out.splitlines() if ln.startswith("asyncrl run: failed:")]
        assert len(lines) == 1 and "--enable-scale-out" in lines[0], out[-3000:]
        assert "Scale-out endpoints are disabled" in lines[0]
        refused = [c for c in server.wire() if c["path"] == "/inference/v1/generate"]
        assert refused and {c["status"] for c in refused} == {403}
        assert took < 60, took  # not after controller.max_failed_groups failed groups
    finally:
        server.stop()


@pytest.mark.slow
def test_two_engines_tp2(tmp_path: Path, tiny_model_dir: Path) -> None:
    """``asyncrl run --rollout.backend=vllm`` (``keep`` pauses) against two engines of two
    ranks each, ranks 1..4 of a world of 5 (offsets 1 and 3): every push bit-exact on every
    rank, every token's version exact, none aborted."""
    servers = [
        start_vllm(tiny_model_dir, tmp_path / f"v{i}", tp_size=2, step_s=0.01) for i in range(2)
    ]
    try:
        rc, out = finish(_start_run(tmp_path, tiny_model_dir, [s.url for s in servers]), 240)
        assert rc == 0, out + "".join(s.log.read_text()[-2000:] for s in servers)
        states = [_check_state(s, STEPS, tp=2) for s in servers]
        assert states[0]["sha256"]["rank0"] == states[1]["sha256"]["rank0"]
        assert all(len(_check_wire(s)) == STEPS for s in servers)
        # weights.verify=sampled: one engine's /weight_checker per push, in turn (v mod 2)
        checks = [len([c for c in s.wire() if c["path"] == "/weight_checker"]) for s in servers]
        assert sorted(checks) == [1, 2], checks
        assert sum(len(st["reqs"]) for st in states) > 0
        inits = [c["body"]["init_info"] for s in servers for c in s.wire()
                 if c["path"] == "/init_weight_transfer_engine"]  # fmt: skip
        assert sorted(i["rank_offset"] for i in inits) == [1, 3]
        assert {i["world_size"] for i in inits} == {5}
    finally:
        for s in servers:
            s.stop()


def test_wire_matches_vllms_own_client(tmp_path: Path, tiny_model_dir: Path) -> None:
    """One push by vLLM's own ``HTTPVLLMWeightSyncClient`` (``vllm/reference.py``) and one by
    asyncrl's vLLM family: the same weight routes in the same order with the same bodies
    (asyncrl adds the pause around them); both land bit-exact."""
    from safetensors.torch import load_file

    from asyncrl.config import GlooWeightsConfig
    from asyncrl.engines.rollout.factory import make_weight_transport
    from tests.engines.rollout.vllm.code import vllm_env

    # vLLM's client sends no key (clients.py:66-75): its server without asyncrl's guard
    ref = start_vllm(tiny_model_dir, tmp_path / "ref", guard=False)
    ours = start_vllm(tiny_model_dir, tmp_path / "ours")
    sender = None
    try:
        cmd = [sys.executable, "-m", "tests.engines.rollout.vllm.reference", ref.url]
        done = subprocess.run([*cmd, str(tiny_model_dir)], env=python_env(vllm_env()),
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        cfg = GlooWeightsConfig(bucket_mb=1, timeout_s=60)
        sender = make_weight_transport(cfg, [ours.url], "cpu", "keep", "vllm")
        sender.connect()
        weights = load_file(str(tiny_model_dir / "model.safetensors"))
        sender.push(((n, w + 1) for n, w in weights.items()), 1).wait(60)
        want = {n: _sha(w + 1) for n, w in weights.items()}
        assert ref.state()["sha256"]["rank0"] == want == ours.state()["sha256"]["rank0"]

        def weight_calls(s: VLLMStandIn) -> list[tuple[str, Any]]:
            keep = ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                    "/finish_weight_update")  # fmt: skip
            out = []
            for c in s.wire():
                if c["path"] in keep:
                    body = dict(c["body"] or {})
                    if "init_info" in body:
                        body = {k: v for k, v in body["init_info"].items() if k != "master_port"}
                    out.append((c["path"], body if c["path"] != "/update_weights" else
                                c["body"]["update_info"]))  # fmt: skip
            return out

        r, o = weight_calls(ref), weight_calls(ours)
        assert [p for p, _ in r] == [p for p, _ in o], (r, o)
        assert r[0][1].keys() == o[0][1].keys()  # the same init_info fields
        assert {k: v for k, v in o[0][1].items() if k != "packed_buffer_size_bytes"} == {
            k: v for k, v in r[0][1].items() if k != "packed_buffer_size_bytes"
        }
        assert r[2][1] == o[2][1] and r[3][1] == o[3][1] == {"weight_version": "1"}
        assert r[1][1] == o[1][1] == {}  # start: no body
    finally:
        if sender is not None:
            sender.close()
        ref.stop()
        ours.stop()
