"""Shared fixtures: free loopback ports, the tiny model, and GPU skipping."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from asyncrl.procs import free_port as _free_port

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    return _free_port()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny default model (Qwen2 architecture, digit tokenizer) in Hugging Face format."""
    from asyncrl.tasks.tiny_model import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
