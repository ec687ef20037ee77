"""The trainer's end of a vLLM NCCL weight group: vLLM's own trainer-side code
(``asyncrl/engines/rollout/vllm/trainer_nccl.py``, the optional extra ``vllm-trainer``).

On a CPU: which families join with their own code (vLLM for NCCL only), the error naming the
extra where vLLM does not import (here: vLLM is not installed, its source is only unpacked
for the tests), the refusal of a communicator vLLM disabled, and the trainer-side rendezvous
(vLLM's ``StatelessProcessGroup`` as rank 0, concurrent with ``/init_weight_transfer_engine``)
against the stand-in with Gloo in place of NCCL (``vllm/trainer_side.py``). On two GPUs with
vLLM installed: the real ``trainer_init`` and packed broadcast against vLLM's worker-side code.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from asyncrl.config import load_config
from asyncrl.engines.rollout.factory import weight_family
from asyncrl.engines.rollout.vllm import TRAINER_EXTRA
from asyncrl.preflight import preflight
from asyncrl.procs import free_port, python_env, stop
from tests.engines.rollout.vllm.code import vllm_env
from tests.engines.rollout.vllm.server import start_vllm
from tests.runs import spawn_shared


def _installed(dist: str) -> bool:
    """An installed distribution (not a name on sys.path: pytest puts this folder first, and
    its ``vllm/`` is the tests' helpers)."""
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


NO_VLLM = not _installed("vllm")


def test_only_the_vllm_family_joins_nccl_with_its_own_code() -> None:
    for name in ("sglang", "local"):  # torch's group meets their ranks
        assert weight_family(name).trainer_link("nccl", "127.0.0.1", 1, 2, "cuda:0") is None
    assert weight_family("vllm").trainer_link("gloo", "127.0.0.1", 1, 2, "cpu") is None


@pytest.mark.skipif(not NO_VLLM, reason="vLLM is installed here: its absence cannot be shown")
def test_without_vllm_the_error_names_the_extra() -> None:
    family = weight_family("vllm")
    with pytest.raises(ValueError, match=r"pip install 'asyncrl\[vllm-trainer\]'"):
        family.trainer_link("nccl", "127.0.0.1", free_port(), 2, "cuda:0")
    for weights in ("nccl", "auto"):  # auto is nccl on a CUDA trainer
        overrides = ["--rollout.backend=vllm", f"--weights.backend={weights}"]
        cfg = load_config(None, [*overrides, "--trainer.device=cuda"])
        with pytest.raises(ValueError, match=r"asyncrl\[vllm-trainer\]") as err:
            preflight(cfg)
        assert TRAINER_EXTRA in str(err.value) and "weights.backend='gloo'" in str(err.value)
    gloo = load_config(None, ["--rollout.backend=vllm", "--weights.backend=gloo"])
    preflight(gloo)  # the tests' and stand-ins' path needs no vLLM


def test_a_disabled_pynccl_communicator_is_refused() -> None:
    """vLLM's communicator disables itself when NCCL does not load (pynccl.py:125-137) and its
    broadcast then does nothing (pynccl.py:544-545): the link refuses it."""
    from asyncrl.engines.rollout.vllm.trainer_nccl import PyNcclLink

    with pytest.raises(RuntimeError, match="would send nothing"):
        PyNcclLink(SimpleNamespace(available=False, disabled=True))


def test_trainer_side_rendezvous_against_the_standin(tmp_path: Path, tiny_model_dir: Path) -> None:
    """``weights.backend = "nccl"`` with the vLLM family: the sender joins through the
    family's join (here vLLM's ``StatelessProcessGroup`` hosting the store, Gloo on it),
    concurrently with ``/init_weight_transfer_engine`` to an engine of TP 2 (world 3), and
    two pushes arrive bit-exact on both ranks."""
    server = start_vllm(tiny_model_dir, tmp_path / "vllm", tp_size=2)
    try:
        cmd = ["-m", "tests.engines.rollout.vllm.trainer_side", server.url, str(tiny_model_dir)]
        log = tmp_path / "trainer_side.log"  # forked from the shared server: torch imported
        proc = spawn_shared(cmd, log, python_env(vllm_env()))
        try:
            code = proc.wait(180)
        finally:
            stop([proc])
        text = log.read_text(errors="replace")
        assert code == 0, text[-3000:] + server.log.read_text()[-2000:]
        got = json.loads([ln for ln in text.splitlines() if ln.startswith("{")][-1])
        assert got["joins"] == [{"address": "127.0.0.1", "world_size": 3, "device": "cpu"}]
        st = server.state()
        assert st["label"] == "2"
        assert st["sha256"]["rank0"] == got["want"] and st["sha256"]["rank1"] == got["want"]
        inits = [c for c in server.wire() if c["path"] == "/init_weight_transfer_engine"]
        assert [c["status"] for c in inits] == [200]
        assert inits[0]["body"]["init_info"]["rank_offset"] == 1
    finally:
        server.stop()


def _cuda_count() -> int:
    if importlib.util.find_spec("torch") is None:
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(NO_VLLM, reason=f"vLLM is not installed ({TRAINER_EXTRA})")
@pytest.mark.skipif(
    _cuda_count() < 2,
    reason="two CUDA devices needed: NCCL refuses two ranks of one communicator on one GPU",
)
def test_real_vllm_nccl_group_two_gpus(tmp_path: Path) -> None:
    """The trainer's ``join_vllm_nccl`` (vLLM's ``trainer_init``, cuda:0) and a receiving rank
    running vLLM's worker-side ``stateless_init_process_group`` + ``packed_nccl_broadcast_
    consumer`` (cuda:1): buckets posted through :class:`PyNcclLink` arrive bit-exact."""
    port = free_port()
    child = Path(__file__).with_name("vllm") / "nccl_worker.py"
    proc = subprocess.Popen(
        [sys.executable, str(child), str(port)],
        env={**os.environ, **python_env()},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        import torch

        from asyncrl.engines.rollout.vllm.trainer_nccl import join_vllm_nccl

        link = join_vllm_nccl("127.0.0.1", port, 2, "cuda:0")
        gen = torch.Generator(device="cuda:0").manual_seed(0)
        tensors = [torch.randn(n, generator=gen, device="cuda:0") for n in (1000, 3, 4096)]
        for t in tensors:  # one chunk each (the worker's cap is 1 byte: every tensor closes one)
            wire = t.view(torch.uint8)
            link.finish(link.post(wire), wire)
        out, _ = proc.communicate(timeout=120)
        got = json.loads(out.strip().splitlines()[-1])
        want = [hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest() for t in tensors]
        assert got["sha256"] == want, out
        link.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
