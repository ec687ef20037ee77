"""README's embedding example is ``examples/embedding.py`` word for word, and it runs: a real
engine (``asyncrl serve``, the tiny model), a real PyTorch trainer, real weight pushes."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import aiohttp
import pytest

from asyncrl import EngineUnavailable

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
    """The example's ``main`` beside an engine started by the public :class:`EngineProcess`:
    3 steps of 4 groups trained, and the engine ends serving exactly the trainer's weights as
    version 3 (not the file's)."""
    torch = pytest.importorskip("torch")
    from asyncrl import EngineProcess
    from asyncrl.transports.weights.bucket import checksum

    torch.set_num_threads(1)
    ex = _load()
    with EngineProcess.start(tiny_model_dir, args=("--threads", "1")) as engine:
        policy = ex.Policy(str(tiny_model_dir))
        before = {n: checksum(t.contiguous()) for n, t in policy.model.state_dict().items()}
        stats = asyncio.run(ex.main(engine.url, policy, 3))
        served = asyncio.run(_served(engine.url))
    assert stats["trained"] == 12 and stats["version"] == 3 and stats["failed"] == 0, stats
    trained = {n: checksum(t.contiguous()) for n, t in policy.model.state_dict().items()}
    assert served["weight_version"] == "3"
    assert {n: served["checksums"][n] for n in trained} == trained
    assert trained != before  # the trainer really changed the weights it pushed


def test_example_uses_only_the_public_api() -> None:
    """Whatever the examples import from asyncrl is exported by ``asyncrl`` itself (a user
    copies them): no ``asyncrl.procs``, ``asyncrl.engines...``, ``asyncrl.tasks...``."""
    import ast

    import asyncrl

    for path in sorted((ROOT / "examples").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("asyncrl"):
                assert node.module == "asyncrl", f"{path.name} imports {node.module}"
                for alias in node.names:
                    assert alias.name in asyncrl.__all__, f"{path.name}: {alias.name}"
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith("asyncrl."), f"{path.name}: {alias.name}"
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id == "asyncrl":
                    assert node.attr in asyncrl.__all__, f"{path.name}: asyncrl.{node.attr}"
    for name in asyncrl.__all__:  # each public name is documented
        assert getattr(asyncrl, name) is not None
        doc = getattr(getattr(asyncrl, name), "__doc__", None)
        assert name == "TINY_VOCAB" or (doc and doc.strip()), name


def _key_file(path: Path) -> Path:
    from asyncrl import secret

    path.write_text(secret.generate() + "\n")
    path.chmod(0o600)
    return path


def _by_hand_env() -> dict[str, str]:
    """A shell's environment: no run secret of this test session; one torch thread, as the
    in-process example above has (two spinning intra-op threads of the example's trainer
    beside a busy suite took it 82 s where one took 43 s, four busy loops on the 2 cores)."""
    from asyncrl.procs import python_env

    env = {k: v for k, v in python_env().items() if not k.startswith("ASYNCRL_SECRET")}
    return env | {"OMP_NUM_THREADS": "1"}


def _serve_by_hand(model: Path, port: int, key: Path, log: Path) -> subprocess.Popen:
    """``asyncrl serve --secret-file KEY`` as a user starts it in another terminal."""
    cmd = [sys.executable, "-m", "asyncrl.cli", "serve", "--model-path", str(model)]
    cmd += ["--port", str(port), "--secret-file", str(key), "--threads", "1"]
    with open(log, "wb") as out:
        return subprocess.Popen(
            cmd, env=_by_hand_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


@pytest.fixture(scope="module")
def hand_engine(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path]]:
    """One engine started by hand (:func:`_serve_by_hand`) holding a key of its own, not
    this session's, for the tests below (one started per test cost a fresh interpreter's
    torch import and model load each): its URL and key file."""
    from asyncrl.procs import free_port, stop

    folder = tmp_path_factory.mktemp("hand-engine")
    key, port = _key_file(folder / "engine.key"), free_port()
    engine = _serve_by_hand(tiny_model_dir, port, key, folder / "engine.log")
    try:
        yield f"http://127.0.0.1:{port}", key
    finally:
        stop([engine])


def test_embedding_example_with_secret_file_trains_against_a_hand_started_engine(
    tiny_model_dir: Path, tmp_path: Path, hand_engine: tuple[str, Path]
) -> None:
    """Issue 37 item 4: ``examples/embedding.py --url URL --secret-file F`` (the config's
    ``cluster.secret_file``, no ASYNCRL_SECRET_FILE) beside ``asyncrl serve --secret-file F``
    started separately: it trains 2 steps and pushes its weights (the engine serves version
    2); given another key it fails within seconds naming the key's source, not a hang."""
    from asyncrl import secret

    url, key = hand_engine
    other = _key_file(tmp_path / "other.key")
    example = [sys.executable, str(EXAMPLE), "--url", url, "--model-path", str(tiny_model_dir)]
    t0 = time.monotonic()
    wrong = subprocess.run(
        [*example, "--secret-file", str(other), "--steps", "1"],
        env=_by_hand_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    took = time.monotonic() - t0
    assert wrong.returncode != 0, wrong.stdout
    assert "refused this process's run secret" in wrong.stderr, wrong.stderr[-3000:]
    assert f"from the file {other} (cluster.secret_file)" in wrong.stderr
    assert took < 200, took  # may include the engine's start; the refusal itself is at once
    ok = subprocess.run(
        [*example, "--secret-file", str(key), "--steps", "2"],
        env=_by_hand_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr[-3000:]
    stats = json.loads(ok.stdout.strip().splitlines()[-1])
    assert stats["trained"] == 8 and stats["version"] == 2 and stats["failed"] == 0, stats

    async def version() -> str:
        headers = secret.auth_headers(secret.read_file(key))
        async with aiohttp.ClientSession(headers=headers) as s:
            async with s.get(f"{url}/get_weight_version") as r:
                assert r.status == 200
                return str((await r.json())["weight_version"])

    assert asyncio.run(version()) == "2"  # the trainer's pushes reached the engine


def test_controller_stops_at_once_when_an_engine_refuses_the_secret(
    hand_engine: tuple[str, Path],
) -> None:
    """An engine holding another key: the first 401 stops the controller (``next_batch``
    raises EngineKeyRefused naming the engine and this process's secret's source), where it
    used to fail group after group and hang below ``max_failed_groups``."""
    from asyncrl import Controller, EngineKeyRefused, Sample, load_config, wait_healthy

    url, _ = hand_engine  # its key is not this session's

    async def episode(ctx, sample):
        gen = await ctx.generate(sample.prompt_ids, max_new_tokens=2)
        return ctx.trajectory(sample.prompt_ids, [gen], 1.0)

    async def main() -> float:
        cfg = load_config(None, [f'--rollout.urls=["{url}"]', "--controller.batch_size=2"])
        with pytest.raises(EngineUnavailable, match="refused this process's run secret"):
            await wait_healthy(cfg, timeout_s=300)  # up, but not ours
        async with Controller(cfg, episode=episode) as ctl:
            ctl.submit(Sample(prompt_ids=[1, 3, 4, 13], id=i) for i in range(8))
            t0 = time.monotonic()
            with pytest.raises(RuntimeError) as got:
                await asyncio.wait_for(ctl.next_batch(), 60)
            assert isinstance(got.value.__cause__, EngineKeyRefused), got.value
            assert url in str(got.value) and "ASYNCRL_SECRET_FILE" in str(got.value)
            return time.monotonic() - t0

    assert asyncio.run(main()) < 10
