"""README's embedding example is ``examples/embedding.py`` word for word, and it runs: a real
engine (``asyncrl serve``, the tiny model), a real PyTorch trainer, real weight pushes."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "embedding.py"


def _readme_block() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Embedding the controller") :]
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("```\n", start)].strip("\n")


def _example_region() -> str:
    parts = EXAMPLE.read_text().split("# [readme]\n")
    assert len(parts) == 3, "examples/embedding.py needs exactly two '# [readme]' markers"
    return parts[1].strip("\n")


def test_readme_embedding_example_is_the_example_file() -> None:
    assert _readme_block() == _example_region(), (
        "README's embedding example and examples/embedding.py (between the [readme] markers) "
        "differ: copy the file's region into README"
    )


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("asyncrl_example_embedding", EXAMPLE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


async def _served(url: str) -> dict:
    from asyncrl.engines.rollout.sglang import SGLangClient

    client = SGLangClient(url)
    try:
        return await client._call("GET", "/get_weights_checksum")
    finally:
        await client.close()


def test_embedding_example_trains_and_pushes_real_weights(tiny_model_dir: Path) -> None:
    """The example's own engine start and ``main``: 3 steps of 4 groups trained, and the
    engine ends serving exactly the trainer's weights as version 3 (not the file's)."""
    torch = pytest.importorskip("torch")
    from asyncrl.procs import stop
    from asyncrl.transports.weights.bucket import checksum

    torch.set_num_threads(1)
    ex = _load()
    proc, url = ex.start_engine(str(tiny_model_dir))
    try:
        asyncio.run(ex.wait_healthy(url))
        policy = ex.Policy(str(tiny_model_dir))
        before = {n: checksum(t.contiguous()) for n, t in policy.model.state_dict().items()}
        stats = asyncio.run(ex.main(url, policy, 3))
        served = asyncio.run(_served(url))
    finally:
        stop([proc])
    assert stats["trained"] == 12 and stats["version"] == 3 and stats["failed"] == 0, stats
    trained = {n: checksum(t.contiguous()) for n, t in policy.model.state_dict().items()}
    assert served["weight_version"] == "3"
    assert {n: served["checksums"][n] for n in trained} == trained
    assert trained != before  # the trainer really changed the weights it pushed
