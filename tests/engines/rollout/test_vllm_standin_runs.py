"""``asyncrl run --rollout.backend=vllm`` against vLLM 0.33's own API server code over the
stand-in's engine core (see test_vllm_standin.py): ``abort`` and ``wait`` pauses, a failed
update re-sent as a new round, a server without ``--enable-scale-out``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from asyncrl.procs import finish
from tests.engines.rollout._vllm_checks import STEPS, check_state, check_wire, pushes_of, start_run
from tests.engines.rollout.vllm.server import start_vllm


@pytest.mark.slow
def test_failed_update_is_resent_as_a_new_round(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The second push's update fails after the receive (vLLM ends the session, the model
    mid-reload): the push is sent again as a whole new round and the run goes on exact."""
    server = start_vllm(tiny_model_dir, tmp_path / "vllm", fail_calls="2")
    try:
        rc, out = finish(start_run(tmp_path, tiny_model_dir, [server.url]), 240)
        assert rc == 0, out + server.log.read_text()[-3000:]
        check_state(server, STEPS, tp=1)
        failed = [c for c in server.wire() if c["status"] >= 400]
        assert [c["path"] for c in failed] == ["/update_weights"], failed
        pushes = pushes_of(server)
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
        run = start_run(tmp_path, tiny_model_dir, [server.url], f"--rollout.pause_mode={mode}")
        rc, out = finish(run, 240)
        assert rc == 0, out + server.log.read_text()[-3000:]
        check_state(server, STEPS, tp=1, mode=mode)
        assert len(check_wire(server, mode)) == STEPS
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
        rc, out = finish(start_run(tmp_path, tiny_model_dir, [server.url]), 120)
        assert rc != 0, out
        lines = [ln for ln in out.splitlines() if ln.startswith("asyncrl run: failed:")]
        assert len(lines) == 1 and "--enable-scale-out" in lines[0], out[-3000:]
        assert "Scale-out endpoints are disabled" in lines[0]
        refused = [c for c in server.wire() if c["path"] == "/inference/v1/generate"]
        assert refused and {c["status"] for c in refused} == {403}
        # at once: the first refusal stopped it, not controller.max_failed_groups failed
        # groups in a row (whose stop names that key), and no group failed before it
        assert "max_failed_groups" not in out and "groups in a row" not in out, out[-3000:]
        log = out + (tmp_path / "run" / "controller.log").read_text()
        assert not re.search(r"group \d+ failed: ", log), log[-3000:]
    finally:
        server.stop()
