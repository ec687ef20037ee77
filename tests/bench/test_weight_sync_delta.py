"""``asyncrl bench weight-sync --delta``'s steps into a real engine whose bucket holds a chunk.

The bench's two senders push every version in turn into one engine process; a tensor larger
than a bucket (Qwen2-0.5B's embedding at ``--bucket-mb 128``) is split, and its buckets'
parameters are copies, so the engine keeps one receive buffer for them (``delta_apply``)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.bench.weight_sync_delta import PUSH_ORDER, _push_step, _senders
from asyncrl.procs import free_port, python_env, stop
from asyncrl.transports.weights.bucket import checksum
from tests.runs import spawn_shared

sys.path.insert(0, str(Path(__file__).parents[1] / "transports" / "weights"))
from test_collective import _healthy, state, tied_qwen2  # the engine-process helpers
from test_delta import _train_steps


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tied-embedding Qwen2 whose bf16 embedding (1.25 MiB) spans two 1 MiB buckets."""
    return tied_qwen2(tmp_path_factory, vocab_size=10240)


@contextlib.contextmanager
def bf16_engine(model_dir: Path, tmp: Path) -> Iterator[str]:
    """One real engine process serving ``model_dir`` in bf16, as the bench's does."""
    port = free_port()
    args = ["-m", "asyncrl.entrypoints.engine", "--model-path", str(model_dir)]
    args += ["--port", str(port), "--dtype", "bfloat16"]
    proc = spawn_shared(args, tmp / f"engine_{port}.log", python_env())
    try:
        url = f"http://127.0.0.1:{port}"
        asyncio.run(_healthy([url]))
        yield url
    finally:
        stop([proc])


def test_bench_steps_land_every_delta_bit_exact_when_a_tensor_spans_buckets(
    model_dir: Path, tmp_path: Path
) -> None:
    """Real AdamW steps (lr 1e-6), each pushed by the bench's full and delta senders in its
    order (bf16 sync, 1 MiB buckets, the embedding chunked): every push lands and the engine
    then holds the weights cast to bf16 bit for bit; all but the delta sender's first push
    go as deltas, bucket 0 (only the embedding's first chunk) among them. The full sender
    pushing first failed: the delta sender's v2 was against v1, the chunk's buffer held v2."""
    args = argparse.Namespace(
        bucket_mb=1, min_buckets=2, verify="full", send_host="127.0.0.1", delta_mode="on"
    )
    with bf16_engine(model_dir, tmp_path) as url:
        senders = _senders(args, [url])
        try:
            assert list(senders) == list(PUSH_ORDER)
            for version, w in enumerate(_train_steps(model_dir, 1e-6, 3), start=1):
                want = {n: checksum(t.bfloat16().contiguous()) for n, t in w.items()}
                holds = functools.partial(_holds, url, str(version), want)
                pushed = _push_step(senders, w, version, 0.0, holds)
                plan = senders["delta"].stager.plan
                assert not plan[0].entries[0].whole and len(plan[0].entries) == 1  # a chunk
                assert all(r["verified"] == 1.0 for r in pushed.values()), (version, pushed)
                assert pushed["full"]["delta"] == 0.0
                assert pushed["delta"]["delta"] == float(version > 1)
                if version > 1:
                    assert pushed["delta"]["delta_buckets"] == len(plan)
        finally:
            for s in senders.values():
                s.close()


def _holds(url: str, version: str, want: dict[str, int]) -> bool:
    return state(url) == (version, want)
