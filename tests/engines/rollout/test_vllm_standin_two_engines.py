"""``asyncrl run --rollout.backend=vllm`` (``keep`` pauses) against two vLLM stand-in
engines of two ranks each (see test_vllm_standin.py): its own file so that pytest-xdist
can run it beside the other stand-in files."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.procs import finish
from tests.engines.rollout._vllm_checks import STEPS, check_state, check_wire, start_run
from tests.engines.rollout.vllm.server import start_vllm


@pytest.mark.slow
def test_two_engines_tp2(tmp_path: Path, tiny_model_dir: Path) -> None:
    """``asyncrl run --rollout.backend=vllm`` (``keep`` pauses) against two engines of two
    ranks each, ranks 1..4 of a world of 5 (offsets 1 and 3): every push bit-exact on every
    rank, every token's version exact, none aborted."""
    servers = [
        start_vllm(tiny_model_dir, tmp_path / f"v{i}", tp_size=2, step_s=0.01) for i in range(2)
    ]
    try:
        rc, out = finish(start_run(tmp_path, tiny_model_dir, [s.url for s in servers]), 240)
        assert rc == 0, out + "".join(s.log.read_text()[-2000:] for s in servers)
        states = [check_state(s, STEPS, tp=2) for s in servers]
        assert states[0]["sha256"]["rank0"] == states[1]["sha256"]["rank0"]
        assert all(len(check_wire(s)) == STEPS for s in servers)
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
