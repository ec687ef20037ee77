"""Checks shared by the vLLM stand-in test files (``test_vllm_standin*.py``): the weight
calls of each push as vLLM requires them, the stand-in's ground truth after a run, and an
``asyncrl run`` against given vLLM servers. Split from one file so that pytest-xdist
(``--dist loadfile``) can put the stand-in runs on different workers."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path
from typing import Any

import torch

from tests.engines.rollout._runs import start_gloo_run
from tests.engines.rollout.vllm.server import VLLMStandIn

__all__ = ["STEPS", "check_state", "check_wire", "pushes_of", "sha", "start_run"]

STEPS = 3


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def pushes_of(server: VLLMStandIn) -> list[list[dict[str, Any]]]:
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


def check_wire(
    server: VLLMStandIn, mode: str = "keep", checked: bool | None = None
) -> list[list[dict[str, Any]]]:
    """Per push: /pause?mode, /start_weight_update, /update_weights..., /finish_weight_update
    {weight_version}, [/weight_checker: weights.verify, sampled by default: one engine per
    push], /resume; the first update after the group formed carries the names. ``checked``:
    whether every push (True) or none (False) of this engine was checked."""
    pushes = pushes_of(server)
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


def start_run(tmp: Path, model_dir: Path, urls: list[str], *extra: str) -> subprocess.Popen:
    """The vLLM stand-in tests' job (:func:`~tests.engines.rollout._runs.start_gloo_run`)."""
    return start_gloo_run("vllm", tmp, model_dir, urls, STEPS, *extra)


def check_state(server: VLLMStandIn, pushes: int, tp: int, mode: str = "keep") -> dict[str, Any]:
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
