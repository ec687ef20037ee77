"""The weight-transport factory: backend chosen once, clear errors naming what to install."""

from __future__ import annotations

import importlib.util

import msgspec
import pytest
import torch

from asyncrl.config import (
    CudaIpcWeightsConfig,
    GlooWeightsConfig,
    HcclWeightsConfig,
    NcclWeightsConfig,
    WeightSyncConfig,
    load_config,
)
from asyncrl.engines.rollout.factory import make_weight_transport
from asyncrl.transports.weights.collective_send import CollectiveWeightSender, resolve_backend

URLS = ["http://127.0.0.1:1"]


def test_sglang_engines_get_full_pushes_only() -> None:
    """SGLang loads what it receives: with weights.delta asked for, no base is kept for it."""
    cfg = GlooWeightsConfig(delta="auto")
    local = make_weight_transport(cfg, URLS, "cpu")
    sglang = make_weight_transport(cfg, URLS, "cpu", engine="sglang")
    try:
        assert local.stager.delta is not None and sglang.stager.delta is None
    finally:
        local.close()
        sglang.close()


def test_auto_and_gloo_on_cpu_give_the_gloo_collective() -> None:
    for backend in ("auto", "gloo"):
        sender = make_weight_transport(
            msgspec.convert({"backend": backend}, WeightSyncConfig), URLS, "cpu"
        )
        assert isinstance(sender, CollectiveWeightSender) and sender.backend == "gloo"
    assert resolve_backend("auto", "cpu") == "gloo"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_missing_backends_say_what_to_install() -> None:
    with pytest.raises(ValueError, match=r"nccl.*CUDA"):
        make_weight_transport(NcclWeightsConfig(), URLS, "cpu")
    with pytest.raises(ValueError, match=r"cuda-ipc.*CUDA"):
        make_weight_transport(CudaIpcWeightsConfig(), URLS, "cpu")
    if importlib.util.find_spec("torch_npu") is None:
        with pytest.raises(ValueError, match=r"torch_npu.*pip install torch-npu"):
            make_weight_transport(HcclWeightsConfig(), URLS, "cpu")


def test_config_rejects_unknown_backend_and_bad_sizes() -> None:
    with pytest.raises(ValueError, match=r"weights.backend"):
        load_config(overrides=["--weights.backend=mpi"])
    with pytest.raises(ValueError, match=r"weights.min_buckets"):
        load_config(overrides=["--weights.min_buckets=0"])
    with pytest.raises(ValueError, match=r"weights.zero_copy_frac must be in \[0, 1\]"):
        load_config(overrides=["--weights.zero_copy_frac=1.5"])
    cfg = load_config(overrides=["--weights.bucket_mb=64", "--weights.snapshot=true"])
    assert cfg.weights.bucket_mb == 64 and cfg.weights.snapshot
    assert load_config(overrides=["--weights.verify=off"]).weights.verify == "off"
    assert load_config().weights.verify == "sampled"
    with pytest.raises(ValueError, match=r"weights.verify"):
        load_config(overrides=["--weights.verify=false"])
    with pytest.raises(ValueError, match=r"weights.full_every"):
        load_config(overrides=["--weights.full_every=-1"])
    with pytest.raises(ValueError, match=r"weights.delta"):
        load_config(overrides=["--weights.delta=maybe"])
