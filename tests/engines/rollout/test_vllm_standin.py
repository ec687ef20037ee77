"""asyncrl's vLLM family against vLLM 0.33's own API server code (``vllm/app.py``) over an
engine core written from vLLM's source (``vllm/standin.py``, every behaviour cited there), whose
receiving ranks join with vLLM's own ``StatelessProcessGroup`` and rebuild every chunk
with vLLM's own ``unpack_tensor`` (Gloo in place of NCCL, which cannot run on a CPU).

Checked: every push bit-exact on every receiving rank (sha256 of every tensor against
what the trainer sent); every token's version exact with ``keep`` pauses, no request
aborted (the stand-in's ground truth against the client's per-token versions from vLLM's
spans); the calls in the order vLLM requires (pause, start, update(s) in flight with the
broadcast, finish with the version, resume); the metadata sent once, then the empty-list
form; a failed update re-sent as a whole new round. Here: pushes by asyncrl's vLLM family
and by vLLM's own client; ``asyncrl run`` against the stand-in: test_vllm_standin_runs.py and
test_vllm_standin_two_engines.py (separate files: pytest-xdist puts them on other workers).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from asyncrl.procs import finish, python_env
from tests.engines.rollout._background import check_versions, generate_in_background
from tests.engines.rollout._vllm_checks import check_wire, sha
from tests.engines.rollout.vllm import forks
from tests.engines.rollout.vllm.server import VLLMStandIn, start_vllm
from tests.runs import spawn_shared


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
        if forks.SERVER.server_pid() is not None:  # the server and its rank 1: forks (forks.py)
            kids = forks.SERVER.children()
            assert server.proc.pid in kids, kids
            rank_pids = server.state()["rank_pids"]
            assert len(rank_pids) == 1 and rank_pids[0] in kids, (rank_pids, kids)
            assert "-m tests.engines.rollout.vllm.rank --connect" in kids[rank_pids[0]]
        cfg = GlooWeightsConfig(bucket_mb=1, timeout_s=60)
        sender = make_weight_transport(cfg, [server.url], "cpu", "keep", "vllm")
        sender.connect()
        weights = load_file(str(tiny_model_dir / "model.safetensors"))
        sp = {"max_new_tokens": 80, "ignore_eos": True}
        t, results = generate_in_background(
            lambda: VLLMClient(server.url),
            [(f"s{i}", [1, 3, 4], sp) for i in range(3)],
            lambda: any(len(r["truth"]) >= 5 for r in server.state()["reqs"].values()),
            "a request started",
        )
        for v in (1, 2):
            sender.push(((n, w + v) for n, w in weights.items()), v).wait(120)
            time.sleep(0.2)
        t.join(120)
        st = server.state()
        check_versions(results, st["reqs"])
        assert all(res.finish_reason == "length" for res in results.values())
        assert st["mixed_tokens"] == 0 and st["label_errors"] == 0
        want = {n: sha(w + 2) for n, w in weights.items()}
        assert st["sha256"]["rank0"] == want and st["sha256"]["rank1"] == want
        pushes = check_wire(server, checked=True)  # one engine: each push checked
        assert len(pushes) == 2
        first, second = ([c for c in p if c["path"] == "/update_weights"] for p in pushes)
        assert first[0]["body"]["update_info"]["n_names"] == len(weights)
        assert [c["body"]["update_info"]["n_names"] for c in second] == [0]  # unchanged: empty
    finally:
        if sender is not None:
            sender.close()
        server.stop()


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
        cmd = ["-m", "tests.engines.rollout.vllm.reference", ref.url, str(tiny_model_dir)]
        log = tmp_path / "reference.log"  # forked from the shared server: torch imported
        code, _ = finish(spawn_shared(cmd, log, python_env(vllm_env())), 120)
        assert code == 0, log.read_text(errors="replace")[-3000:]
        cfg = GlooWeightsConfig(bucket_mb=1, timeout_s=60)
        sender = make_weight_transport(cfg, [ours.url], "cpu", "keep", "vllm")
        sender.connect()
        weights = load_file(str(tiny_model_dir / "model.safetensors"))
        sender.push(((n, w + 1) for n, w in weights.items()), 1).wait(60)
        want = {n: sha(w + 1) for n, w in weights.items()}
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
