"""The worked skeleton of a new engine family (``family_skeleton.py`` here) is what
docs/rollout-engines.md shows, word for word, and one registry line makes a run use it: its
launch flags, start-up timeout, preflight rule, and its weight adapter in the transport."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.config import CudaIpcWeightsConfig, GlooWeightsConfig, SGLangRolloutConfig, load_config
from asyncrl.engines.rollout import factory
from asyncrl.engines.rollout.launcher import engine_spec, startup_timeout
from asyncrl.preflight import preflight

ROOT = Path(__file__).resolve().parents[3]
SKELETON = Path(__file__).with_name("family_skeleton.py")


def test_the_doc_shows_the_skeleton_word_for_word() -> None:
    doc = (ROOT / "docs" / "rollout-engines.md").read_text()
    assert f"```python\n{SKELETON.read_text()}```" in doc


def test_one_registry_line_makes_the_skeleton_the_family(monkeypatch: pytest.MonkeyPatch) -> None:
    skeleton = "tests.engines.rollout.family_skeleton"
    monkeypatch.setitem(factory.FAMILIES, SGLangRolloutConfig, skeleton)
    rc = SGLangRolloutConfig(extra_args=("--x",))
    assert factory.family(rc).name == "myserve"
    spec = engine_spec(rc, "/models/m", 2, seed=7, port=9000)
    assert spec.module == "myserve.launch_server"
    assert spec.extra_args == ("--random-seed", "1009", "--base-gpu-id", "2", "--x")
    assert startup_timeout(rc, "/models/m") == 600.0
    cfg = load_config(
        None, ["--rollout.backend=sglang", "--rollout.urls=", "--rollout.num_engines=9"]
    )
    with pytest.raises(ValueError, match="at most 8 engines"):
        preflight(cfg)
    adapter = factory.weight_family(rc)
    assert adapter.name == "myserve" and adapter.loads_live
    with pytest.raises(ValueError, match="does not reach myserve"):
        factory.make_weight_transport(
            CudaIpcWeightsConfig(), ["http://127.0.0.1:1"], "cuda", "abort", rc
        )
    sender = factory.make_weight_transport(
        GlooWeightsConfig(), ["http://127.0.0.1:1"], "cpu", "abort", rc
    )
    try:
        engines = sender.engines  # type: ignore[attr-defined]
        assert engines.family is adapter or engines.family.name == "myserve"
        assert sender.stager.whole  # type: ignore[attr-defined]  # live loader: whole tensors
    finally:
        sender.close()
