"""Our weight group against SGLang's own receiving side, for every covered version.

The receiving ranks are child processes running SGLang's code from its wheel
(``tests/engines/rollout/sglang/rank.py``): the group is joined with SGLang's
``init_custom_process_group`` as ``rank_offset + tp_rank`` and each bucket is
received and rebuilt with SGLang's ``FlattenedTensorBucket``. Our side is the
product's :func:`new_weight_group` and bucket packer. A group formed any other
way than SGLang forms it times out here (Gloo waits on other store keys).
"""

from __future__ import annotations

import hashlib
import threading

import pytest
import torch

from asyncrl.transports.weights.bucket import pack_into, plan_buckets, spec_of
from asyncrl.transports.weights.collective_wire import (
    broadcast,
    destroy_weight_group,
    new_weight_group,
)
from tests.engines.rollout.sglang import forks
from tests.engines.rollout.sglang.code import VERSIONS, sglang_src
from tests.engines.rollout.sglang.ranks import SGLangRank


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(300, 64, generator=g),  # 75 KiB: over the bound below
        "layer.0.q.weight": torch.randn(16, 16, generator=g).to(torch.bfloat16),
        "layer.0.q.bias": torch.randn(16, generator=g),
        "norm.weight": torch.randn(64, generator=g),
        "head.weight": torch.randn(5, 64, generator=g).to(torch.bfloat16),
    }


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("version", VERSIONS)
def test_sglang_ranks_receive_bit_exact(version: str, free_port: int, tmp_path) -> None:
    sglang_src(version)
    tp = 2
    weights = _weights()
    plan = plan_buckets(
        [spec_of(n, t) for n, t in weights.items()], 32 << 10, min_buckets=2, whole_only=True
    )
    assert all(e.whole for m in plan for e in m.entries)  # SGLang cannot load a chunk
    assert any(m.nbytes > 32 << 10 for m in plan)  # the oversized tensor: a bucket of its own
    with open(tmp_path / "ranks.log", "w") as log:
        ranks = [SGLangRank(version, log) for _ in range(tp)]
        try:
            fork = forks.server(version)  # the session's SGLang V fork server, where it runs
            if fork.server_pid() is not None:
                kids = fork.children()
                assert all(r.proc.pid in kids for r in ranks), ([r.proc.pid for r in ranks], kids)
            own: dict[str, object] = {}

            def form() -> None:
                own["group"] = new_weight_group("gloo", "127.0.0.1", free_port, 0, 1 + tp, "w", 60)

            t = threading.Thread(target=form)
            t.start()
            for i, r in enumerate(ranks):
                r.send(
                    "init",
                    master_address="127.0.0.1",
                    master_port=free_port,
                    rank_offset=1,
                    tp_rank=i,
                    world_size=1 + tp,
                    group_name="w",
                    backend="gloo",
                )
            joined = [r.answer(90) for r in ranks]
            t.join(90)
            assert [j["rank"] for j in joined] == [1, 2], joined
            assert all(j["ok"] for j in joined), joined
            group = own["group"]
            for m in plan:
                flat = torch.empty(m.numel, dtype=m.torch_dtype)
                pack_into(flat, m, weights)
                for r in ranks:  # SGLang's request fields: names, dtypes, shapes
                    r.send(
                        "recv",
                        names=[e.name for e in m.entries],
                        dtypes=[m.dtype] * len(m.entries),
                        shapes=[list(e.shape) for e in m.entries],
                        group_name="w",
                        load_format="flattened_bucket",
                    )
                broadcast(group, flat.view(torch.uint8))
                got = [r.answer(60) for r in ranks]
                assert all(a["ok"] and a["loaded"] == len(m.entries) for a in got), got
            want = {n: _sha(t) for n, t in weights.items()}
            for r in ranks:
                assert r.call("checksums")["sha256"] == want
                assert r.call("destroy", group_name="w")["destroyed"]
            destroy_weight_group(group)
        finally:
            for r in ranks:
                r.close()
