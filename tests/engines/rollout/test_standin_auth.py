"""The SGLang and vLLM servers asyncrl launches get the run secret as ``--api-key``, and
guard what the real servers guard with it — which differs:

- SGLang (srt/utils/auth.py:74-146, 0.5.10 to 0.5.23): every route but ``/health*`` and
  ``/metrics``: the weight, pause and generate routes all need the key.
- vLLM 0.33 (entrypoints/serve/middleware/authenticate.py:11, :59): only ``/v1``, ``/v2``,
  ``/inference``, ``/cohere``: generation needs the key, but ``/pause``, ``/resume``,
  ``/update_weights``, ``/init_weight_transfer_engine`` do NOT (vLLM says so itself,
  common/cli_args.py:339-343). docs/security.md tells what to do about it.

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
    server = start_vllm(tiny_model_dir, tmp_path)
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
