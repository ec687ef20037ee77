"""The LoRA adapter ring after an engine is killed and replaced, and SGLang 0.5.23's refusals
that it expects to be retried; against the SGLang 0.5.23 stand-in (``sglang/lora.py``: its
registry is SGLang's own ``LoRARegistry``; the pending-unload rule cited there from
tokenizer_control_mixin.py).

- A replaced engine gets back the older versions a resubmission may still name (reloaded
  from their folders by the trainer's re-sync), so a request continuing on such a version
  runs there; an engine that kept its versions ends with no more than the ring's capacity.
- A load that failed part-way (SGLang then refuses the name: "has an incomplete unload")
  and an unload that failed are retried as SGLang asks: the unload first, then the load.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncrl.controllers.adapters import AdapterNames
from asyncrl.engines.rollout.sglang import SGLangClient
from asyncrl.transports.weights.adapter_send import AdapterFolderSender, AdapterSpec
from tests.engines.rollout.sglang.code import sglang_src
from tests.engines.rollout.sglang.server import StandInServer, start_standin
from tests.engines.rollout.test_sglang_lora import FLAGS, _adapters, _resubmitted, _sha
from tests.marks import needs_peft

pytestmark = needs_peft  # (not importorskip: see tests/marks.py)

VERSION = "0.5.23"


@pytest.fixture(scope="module")
def versions(tiny_model_dir: Path) -> list[dict[str, torch.Tensor]]:
    sglang_src(VERSION)
    return _adapters(tiny_model_dir, 4)[0]


def _start(servers: Any, tmp_path: Path, tiny_model_dir: Path, *flags: str) -> StandInServer:
    server = start_standin(
        VERSION, tiny_model_dir, tmp_path / f"sg{len(servers)}", flags=(*FLAGS, *flags)
    )
    servers.append(server)
    return server


def test_a_replaced_engine_gets_back_the_versions_a_request_may_name(
    tmp_path: Path, tiny_model_dir: Path, versions: list[dict[str, torch.Tensor]]
) -> None:
    """Ring of 3 on two engines; v1..v3 pushed; engine B SIGKILLed and replaced by a fresh
    one; the trainer's re-sync at v3 (engines_changed, connect, push v3 again) loads v2 and
    v3 on the new engine from their folders, and unloads v1 from engine A (no request may
    name it: a continuation keeps v only while v >= newest - capacity + 2). A request
    continuing on v2 then runs on the new engine with v2's adapter, bit for bit."""
    servers: list[StandInServer] = []
    spec = AdapterSpec("policy", 4, 16.0, 0.0, 3, str(tmp_path / "adapters"), "base")
    try:
        a = _start(servers, tmp_path, tiny_model_dir)
        b = _start(servers, tmp_path, tiny_model_dir)
        sender = AdapterFolderSender([a.url, b.url], spec, SGLangClient, timeout_s=60)
        try:
            for v in (1, 2, 3):
                sender.push(versions[v - 1].items(), v).wait(60)
            assert b.state()["lora"]["held"] == ["policy-v1", "policy-v2", "policy-v3"]
            os.kill(b.proc.pid, signal.SIGKILL)  # a real death, then a new engine in its place
            b.proc.wait(30)
            b2 = _start(servers, tmp_path, tiny_model_dir)
            sender.engines_changed([a.url, b2.url], 1)  # as the trainer's re-sync does
            sender.connect()
            sender.push(versions[2].items(), 3).wait(60)
            new, kept = b2.state()["lora"], a.state()["lora"]
            assert new["held"] == ["policy-v2", "policy-v3"] == kept["held"]
            assert new["sha256"]["policy-v2"] == _sha(versions[1])
            out = asyncio.run(_resubmitted(b2.url, AdapterNames("policy", 3, 3), 2))
            assert out.versions == [2] * 5
            reqs = b2.state()["reqs"]
            assert [r["adapters"] for r in reqs.values()] == [["policy-v2"] * 3]
            sender.push(versions[3].items(), 4).wait(60)  # the ring goes on: 3 held at most
            for s in (a, b2):
                lora = s.state()["lora"]
                assert lora["held"] == ["policy-v2", "policy-v3", "policy-v4"]
                assert lora["most_held"] <= 3
        finally:
            sender.close()
    finally:
        for s in servers:
            s.stop()


def test_incomplete_unload_and_failed_unload_are_retried_as_sglang_asks(
    tmp_path: Path, tiny_model_dir: Path, versions: list[dict[str, torch.Tensor]]
) -> None:
    """v2's first load fails part-way (SGLang 0.5.23 leaves it pending and then refuses it:
    "has an incomplete unload. Retry the unload before loading it again"); v1's first
    unload fails (pending). Each push still lands: the sender retries the unload, then the
    load; nothing is left pending and v2, v3 are held bit for bit."""
    servers: list[StandInServer] = []
    spec = AdapterSpec("policy", 4, 16.0, 0.0, 2, str(tmp_path / "adapters"), "base")
    faults = ("--lora-fail-load", "policy-v2", "--lora-fail-unload", "policy-v1")
    try:
        s = _start(servers, tmp_path, tiny_model_dir, *faults)
        sender = AdapterFolderSender([s.url], spec, SGLangClient, timeout_s=60)
        try:
            for v in (1, 2, 3):
                sender.push(versions[v - 1].items(), v).wait(60)
        finally:
            sender.close()
        lora = s.state()["lora"]
        events = [next(iter(e.items())) for e in lora["events"]]
        assert events == [
            ("load", "policy-v1"),
            ("partial_load", "policy-v2"),  # 400: the ranks' error; then the load is refused
            ("unload", "policy-v2"),  # the pending unload completed, as SGLang asks
            ("load", "policy-v2"),
            ("unregister", "policy-v1"),
            ("failed_unload", "policy-v1"),  # 400, pending: retried
            ("unload", "policy-v1"),
            ("load", "policy-v3"),
        ], events
        assert lora["pending"] == [] and lora["held"] == ["policy-v2", "policy-v3"]
        assert lora["sha256"]["policy-v3"] == _sha(versions[2])
        refused = [c for c in s.wire() if c["status"] == 400]
        assert [c["path"] for c in refused] == [
            "/load_lora_adapter", "/load_lora_adapter", "/unload_lora_adapter"
        ]  # fmt: skip
    finally:
        for srv in servers:
            srv.stop()
