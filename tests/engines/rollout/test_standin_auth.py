"""The SGLang and vLLM servers asyncrl launches get the run secret as ``--api-key``, and
guard what the real servers guard with it — which differs:

- SGLang (srt/utils/auth.py:74-146, 0.5.10 to 0.5.23): every route but ``/health*`` and
  ``/metrics``: the weight, pause and generate routes all need the key.
- vLLM 0.33 (entrypoints/serve/middleware/authenticate.py:11, :59): only ``/v1``, ``/v2``,
  ``/inference``, ``/cohere``: generation needs the key, but ``/pause``, ``/resume``,
  ``/update_weights``, ``/init_weight_transfer_engine`` do NOT (vLLM says so itself,
  common/cli_args.py:339-343). So asyncrl's launcher also passes ``--middleware`` with
  its run-secret guard (asyncrl/engines/rollout/vllm/auth.py; vLLM runs it before its own
  middleware and every route, serve/middleware/register.py:57-66): then every route
  needs the key, and a refused ``/pause`` or weight call changes nothing.

The stand-ins are started through ``asyncrl.entrypoints.keyed`` as the launchers start the
real servers, and each enforces the key with the real server's rule (its own code for
SGLang).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

from asyncrl import secret
from tests.engines.rollout.sglang.code import sglang_src
from tests.engines.rollout.sglang.server import start_standin
from tests.engines.rollout.vllm.server import start_vllm
from tests.runs import leaks


def _status(url: str, method: str = "GET", key: str | None = None, body: object = None) -> int:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_sglang_standin_guards_every_route_but_health(tiny_model_dir: Path, tmp_path: Path) -> None:
    sglang_src("0.5.23")
    server = start_standin("0.5.23", tiny_model_dir, tmp_path)
    try:
        wrong = secret.generate()
        for method, path, body in [
            ("GET", "/model_info", None),
            ("POST", "/pause_generation", {"mode": "abort"}),
            ("POST", "/update_weight_version", {"new_version": "9"}),
            ("POST", "/generate", {"input_ids": [1, 2], "sampling_params": {}}),
        ]:
            assert _status(server.url + path, method, None, body) == 401, path
            assert _status(server.url + path, method, wrong, body) == 401, path
        assert server.state()["label"] != "9"  # the refused relabel did nothing
        assert _status(server.url + "/model_info", key=secret.load()) == 200
    finally:
        server.stop()


def test_vllm_standin_guards_only_v1_and_inference(tiny_model_dir: Path, tmp_path: Path) -> None:
    """vLLM's ``--api-key`` alone (no ``--middleware``): what the guard below closes."""
    server = start_vllm(tiny_model_dir, tmp_path, guard=False)
    try:
        gen = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 1}, "model": "m"}
        assert _status(server.url + "/inference/v1/generate", "POST", None, gen) == 401
        wrong = secret.generate()
        assert _status(server.url + "/inference/v1/generate", "POST", wrong, gen) == 401
        # what vLLM leaves open, as vLLM does: anyone reaching the port pauses it
        assert _status(server.url + "/is_paused") == 200
        assert _status(server.url + "/pause?mode=keep", "POST") == 200
        assert server.get("/is_paused")["is_paused"] is True
        assert _status(server.url + "/resume", "POST") == 200
    finally:
        server.stop()


def test_vllm_standin_with_the_launchers_middleware_guards_every_route(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Started with the launcher's ``--middleware`` (start_vllm takes it from
    ``vllm_args``): every route refuses a request without the key or with a wrong one
    (401, the handler never runs: the stand-in's call log stays empty of them), and
    nothing changes: pause state, served version, weight group, weights."""
    server = start_vllm(tiny_model_dir, tmp_path)
    try:
        before, served = server.state(), server.wire()  # served: start_vllm's /health
        wrong = secret.generate()
        init = {"init_info": {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                              "world_size": 2}}  # fmt: skip
        update = {"update_info": {"names": ["x"], "dtype_names": ["float32"], "shapes": [[1]]}}
        for method, path, body in [
            ("POST", "/pause?mode=keep", None),
            ("POST", "/resume", None),
            ("POST", "/init_weight_transfer_engine", init),
            ("POST", "/start_weight_update", {}),
            ("POST", "/update_weights", update),
            ("POST", "/finish_weight_update", {"weight_version": "9"}),
            ("POST", "/update_weight_version", {"weight_version": "9"}),
            ("POST", "/weight_checker", {"mode": "checksum"}),
            ("POST", "/abort_requests", {"request_ids": []}),
            ("POST", "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/tmp"}),
            ("POST", "/inference/v1/generate", {"token_ids": [1], "sampling_params": {}}),
            ("GET", "/is_paused", None),
            ("GET", "/weight_info", None),
            ("GET", "/health", None),
            ("GET", "/standin/state", None),
        ]:
            for key in (None, wrong, secret.load() + "x"):
                assert _status(server.url + path, method, key, body) == 401, (path, key)
        assert server.wire() == served  # no handler ran
        assert server.get("/is_paused")["is_paused"] is False
        assert server.state() == before  # label, pushes, update calls, weights' sha256, reqs
        assert _status(server.url + "/pause?mode=keep", "POST", secret.load()) == 200
        assert server.get("/is_paused")["is_paused"] is True  # the key opens it
        # the guard's flag is an import path: the key is in the server's memory only
        assert leaks(secret.load(), tmp_path, [server.proc.pid]) == []
        assert b"--middleware=" in Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()
    finally:
        server.stop()
