"""LoRA adapter versions on SGLang as it behaves: asyncrl's adapter sender and client against
the stand-in's LoRA serving (``sglang/lora.py``, every behaviour cited from SGLang's source;
its registry is SGLang's own ``LoRARegistry``).

What is checked: every pushed version is held bit for bit as the trainer's tensors; a
request pinned to v1 runs all its tokens on v1 while v2 and v3 load, and v1 is unloaded only
after it finished (SGLang's unload waits for it), so the ring never holds more than its
capacity; loads and unloads come in version order; nothing pauses; a request naming a
dropped version is refused with an error naming it (SGLang would reload it from its folder,
which the sender deleted).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncrl.config import LoraConfig
from asyncrl.controllers.adapters import AdapterNames
from asyncrl.controllers.episode import EpisodeContext, Gate, Generation
from asyncrl.controllers.router import Router
from asyncrl.engines.rollout.base import EngineBadRequest
from asyncrl.engines.rollout.sglang import SGLangClient
from asyncrl.transports.weights.adapter_send import AdapterFolderSender, AdapterSpec
from tests.engines.rollout._background import generate_in_background
from tests.engines.rollout.sglang.code import sglang_src
from tests.engines.rollout.sglang.server import start_standin
from tests.marks import needs_peft

pytestmark = needs_peft  # (not importorskip: see tests/marks.py)

RANK = 4
TARGETS = ("q_proj", "v_proj", "down_proj", "lm_head")
FLAGS = ("--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", *TARGETS)
FLAGS += ("--max-loras-per-batch", "3")


def _adapters(model_dir: Path, n: int) -> tuple[list[dict[str, torch.Tensor]], Any]:
    """``n`` adapter versions of the tiny model, under PEFT's saved names, and the PEFT
    model they belong to (real PEFT)."""
    from transformers import AutoModelForCausalLM

    from asyncrl.engines.train import lora

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    wrapped = lora.wrap(model, LoraConfig(rank=RANK, target_modules=TARGETS))
    base = {lora.saved_name(k): p.detach() for k, p in wrapped.named_parameters()}
    base = {k: t for k, t in base.items() if ".lora_" in k}
    gen = torch.Generator().manual_seed(0)
    out = [
        {k: torch.randn(t.shape, generator=gen) * 0.3 for k, t in base.items()} for _ in range(n)
    ]
    return out, wrapped


def _peft_logprobs(wrapped: Any, tensors: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """PEFT's next-token log-probs after ``ids`` with adapter ``tensors`` loaded."""
    from asyncrl.engines.train import lora

    with torch.no_grad():
        for k, p in wrapped.named_parameters():
            if lora.saved_name(k) in tensors:
                p.copy_(tensors[lora.saved_name(k)])
        return torch.log_softmax(wrapped(input_ids=torch.tensor([ids])).logits[0, -1], -1)


def _sha(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(k.encode())
        h.update(tensors[k].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("version", ["0.5.10", "0.5.23"])
def test_adapter_ring_on_sglang(version: str, tmp_path: Path, tiny_model_dir: Path) -> None:
    sglang_src(version)
    server = start_standin(version, tiny_model_dir, tmp_path / "sg", step_s=0.03, flags=FLAGS)
    spec = AdapterSpec("policy", RANK, 16.0, 0.0, 2, str(tmp_path / "adapters"), "base")
    sender = AdapterFolderSender([server.url], spec, SGLangClient, timeout_s=60)
    versions, wrapped = _adapters(tiny_model_dir, 3)
    try:
        sender.push(versions[0].items(), 1).wait(60)
        assert server.state()["lora"]["sha256"] == {"policy-v1": _sha(versions[0])}
        sp = {"max_new_tokens": 40, "ignore_eos": True, "lora_path": "policy-v1"}
        t, got = generate_in_background(
            lambda: SGLangClient(server.url),
            [("long.", [1, 3, 4], sp)],
            lambda: len(_req(server, "long.")["adapters"]) >= 3,
            "SGLang stand-in: request 'long.' started",
        )
        sender.push(versions[1].items(), 2).wait(60)  # beside v1: nothing waits
        assert len(_req(server, "long.")["adapters"]) < 40, "v2 waited for the request"
        h3 = sender.push(versions[2].items(), 3)  # the ring is full: v1 goes once unused
        stats = h3.wait(120)
        t.join(60)
        st = server.state()
        lora = st["lora"]
        assert _req(server, "long.")["adapters"] == ["policy-v1"] * 40
        assert len(got["long."].output_ids) == 40
        assert lora["held"] == ["policy-v2", "policy-v3"] and lora["most_held"] == 2
        events = [next(iter(e.items())) for e in lora["events"]]
        assert [e for e in events if e[0] != "unregister"] == [
            ("load", "policy-v1"),
            ("load", "policy-v2"),
            ("unload", "policy-v1"),
            ("load", "policy-v3"),
        ]
        assert sender.unloads == [(server.url, 1)]
        assert stats["unload_s"] > 0 and stats["bytes"] == sum(
            t.nbytes for t in versions[2].values()
        )
        for v, tensors in enumerate(versions, start=1):  # every push bit for bit
            assert lora["sha256"][f"policy-v{v}"] == _sha(tensors)
        assert not (tmp_path / "adapters" / "policy-v1").exists()
        for v in (2, 3):  # the stand-in applies an adapter as PEFT does
            ref = _peft_logprobs(wrapped, versions[v - 1], [1, 3, 4])
            for _ in range(2):
                tok, lp = asyncio.run(_first_token(server.url, f"policy-v{v}"))
                assert abs(lp - float(ref[tok])) < 1e-4, (v, tok, lp, float(ref[tok]))
        assert not any(c["path"] == "/pause_generation" for c in server.wire())

        async def dropped() -> None:
            c = SGLangClient(server.url)
            try:
                await c.generate([1, 3], {"max_new_tokens": 2, "lora_path": "policy-v1"})
            finally:
                await c.close()

        with pytest.raises(EngineBadRequest, match="implicitly load LoRA adapter policy-v1"):
            asyncio.run(dropped())
        assert server.state()["lora"]["held"] == ["policy-v2", "policy-v3"]
        # a resubmitted request (tokens already made) keeps its version while it is surely held
        # (ring of 3 at newest 3: v2, v3), else continues on the newest (v1 was dropped)
        for capacity, made, want in ((3, 2, 2), (3, 3, 3), (2, 2, 3), (3, 1, 3)):
            out = asyncio.run(_resubmitted(server.url, AdapterNames("policy", capacity, 3), made))
            assert out.versions == [made] * 2 + [want] * 3, (capacity, made, out.versions)
            sent = [c for c in server.wire() if c["path"] == "/generate"][-1]
            assert sent["body"]["lora_path"] == f"policy-v{want}" and sent["status"] == 200
    finally:
        sender.close()
        server.stop()


async def _resubmitted(url: str, names: AdapterNames, made: int) -> Generation:
    """Continue a request that made 2 tokens under version ``made`` (as after an abort)."""
    client = SGLangClient(url)
    gate = Gate()
    gate.adapters = names
    ctx = EpisodeContext(Router([client]), 0, 0, {}, 0, gate)
    try:
        partial = Generation([5, 6], [-1.0, -1.0], [made, made], "partial")
        return await ctx._generate([1, 3, 4], partial, {"ignore_eos": True}, 5)
    finally:
        await client.close()


async def _first_token(
    url: str, lora_path: str, client: Callable[[str], Any] = SGLangClient
) -> tuple[int, float]:
    """The first token of ``[1, 3, 4]`` on adapter ``lora_path`` and its log-prob, sampled
    by the engine at ``url`` (through ``client``)."""
    c = client(url)
    try:
        sp = {"max_new_tokens": 1, "temperature": 1.0, "lora_path": lora_path}
        res = await c.generate([1, 3, 4], sp)
        return res.output_ids[0], res.logprobs[0]
    finally:
        await c.close()


def _req(server: Any, rid: str) -> dict[str, Any]:
    return server.state()["reqs"].get(rid, {"adapters": []})


STEPS = 4
LOAD_ORDER = [("load", "policy-v1"), ("load", "policy-v2")]
"""The adapter loads and unloads of a LoRA run of STEPS steps with max_staleness=1: one load
per step in order, the oldest unloaded first (never more than 2 held)."""
for _v in range(3, STEPS + 1):
    LOAD_ORDER += [("unload", f"policy-v{_v - 2}"), ("load", f"policy-v{_v}")]


def run_lora_job(backend: str, url: str, model: Path, run_dir: Path, server_log: Path) -> None:
    """``asyncrl run --lora.rank=8`` for STEPS steps (batch 2, max_staleness 1) against the
    engine of ``backend`` at ``url``; it must end with rc 0 (else its output and the tail of
    the engine's log)."""
    from asyncrl.procs import finish, python_env

    cmd = [sys.executable, "-m", "asyncrl.cli", "run", "--run-dir", str(run_dir)]
    cmd += ["--quiet", f"--model.path={model}", f"--rollout.backend={backend}"]
    cmd += [f"--rollout.urls={json.dumps([url])}", "--lora.rank=8"]
    cmd += [f"--controller.total_steps={STEPS}", "--controller.batch_size=2"]
    cmd += ["--controller.max_staleness=1", "--logging.trace.enabled=false"]
    proc = subprocess.Popen(cmd, env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    rc, out = finish(proc, 240)
    assert rc == 0, out + server_log.read_text()[-3000:]


def check_adapters_named(named: list[str | None], sha256: dict[str, str], run_dir: Path) -> None:
    """What the requests of a :func:`run_lora_job` named (``named``, in order) and the last
    version the engine held (``sha256`` of each held version)."""
    from safetensors.torch import load_file

    # The first requests: version 0, the base model. Later ones name held versions only
    # (all answered 200); which versions get requests depends on timing, but the
    # last step's samples are at most max_staleness=1 behind: v{STEPS-2} or v{STEPS-1}.
    adapters = set(named) - {None}
    assert named[0] is None and adapters <= {f"policy-v{v}" for v in range(1, STEPS + 1)}
    assert adapters & {f"policy-v{STEPS - 2}", f"policy-v{STEPS - 1}"}, named
    final = load_file(str(run_dir / "final" / "adapter" / "adapter_model.safetensors"))
    assert sha256[f"policy-v{STEPS}"] == _sha(final)  # the trainer's final adapter, bit for bit


@pytest.mark.slow
def test_lora_run_against_sglang(tmp_path: Path, tiny_model_dir: Path) -> None:
    """``asyncrl run --lora.rank=8 --rollout.backend=sglang``: adapter-only pushes by folder,
    one load per step in order, the oldest unloaded first (never more than
    ``max_staleness + 1 = 2`` held), no pause, every request on the adapter it names, and
    the last version held bit for bit as the trainer's final adapter."""
    from asyncrl.engines.rollout.sglang.launcher import sglang_lora_args

    sglang_src("0.5.23")
    flags = sglang_lora_args(LoraConfig(rank=8), 2)  # asyncrl's launcher flags
    server = start_standin("0.5.23", tiny_model_dir, tmp_path / "sg", step_s=0.005, flags=flags)
    try:
        run_lora_job("sglang", server.url, tiny_model_dir, tmp_path / "run", server.log)
        wire = [c for c in server.wire() if c["method"] == "POST"]
        paths = {c["path"] for c in wire}
        assert paths <= {"/generate", "/load_lora_adapter", "/unload_lora_adapter"}, paths
        assert all(c["status"] == 200 for c in wire), [c for c in wire if c["status"] != 200]
        lora = server.state()["lora"]
        events = [next(iter(e.items())) for e in lora["events"] if "unregister" not in e]
        assert events == LOAD_ORDER
        assert lora["most_held"] == 2
        named = []  # the adapter each request named, in order (lists: a batch's items)
        for c in wire:
            if c["path"] == "/generate":
                p = c["body"]["lora_path"]
                named += p if isinstance(p, list) else [p]
        check_adapters_named(named, lora["sha256"], tmp_path / "run")
        folders = sorted(p.name for p in (tmp_path / "run" / "adapters").iterdir())
        assert folders == [f"policy-v{STEPS - 1}", f"policy-v{STEPS}"]
    finally:
        server.stop()
