"""Delta pushes (weights.delta): the encoding, the engine's bookkeeping, and real engines."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import torch

from asyncrl.config import GlooWeightsConfig
from asyncrl.engines.rollout.factory import make_weight_transport
from asyncrl.transports.weights.base import WeightSyncError
from asyncrl.transports.weights.bucket import checksum
from asyncrl.transports.weights.delta import DeltaEncoder, apply_payload
from asyncrl.transports.weights.delta_apply import DeltaApplier

sys.path.insert(0, str(Path(__file__).parent))
import test_collective
from test_collective import engines, expected, state  # the engine-process helpers

model_dir = test_collective.model_dir  # the fixture: a model of several 1 MiB buckets

CFG = GlooWeightsConfig(bucket_mb=1, min_buckets=2, timeout_s=60.0, delta="auto", dtype="bfloat16")


def _bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("nbytes", [8, 1003, 4096, 65541])
@pytest.mark.parametrize("frac", [0.0, 0.01, 0.5, 1.0])
def test_payload_round_trip_is_bit_exact(nbytes: int, frac: float) -> None:
    old = _bytes(nbytes, 1)
    new = old.clone()
    flip = torch.rand(nbytes, generator=torch.Generator().manual_seed(2)) < frac
    new[flip] ^= 0x5A
    new[-1] ^= 0x01  # the tail (nbytes % 8 bytes) always travels
    for mode in ("on", "auto"):
        enc = DeltaEncoder(mode)
        assert enc.take(0, old.clone(), True) == (None, -1)  # no base yet: the whole bucket
        payload, changed = enc.take(0, new.clone(), True)
        if payload is None:  # auto: not smaller than the bucket
            assert mode == "auto" and (changed < 0 or 12 * changed >= nbytes)
            continue
        dst = old.clone()
        assert apply_payload(dst, payload) == changed
        assert torch.equal(dst, new)
        assert payload.numel() == 12 * changed + nbytes % 8
        assert torch.equal(enc.bases[0], new)  # the base follows, whole or by its changed words


def test_nan_payloads_and_signed_zeros_survive() -> None:
    old = torch.tensor([1.0, 0.0, 2.0, 3.0] * 4, dtype=torch.bfloat16)
    new = old.clone()
    new.view(torch.int16)[1] = -32768  # -0.0
    new.view(torch.int16)[5] = 0x7FC1  # a NaN with a payload
    enc = DeltaEncoder("on")
    enc.take(0, old.view(torch.uint8).clone(), True)
    payload, _ = enc.take(0, new.view(torch.uint8).clone(), True)
    dst = old.view(torch.uint8).clone()
    apply_payload(dst, payload)
    assert torch.equal(dst, new.view(torch.uint8))


def _versions() -> list[torch.Tensor]:
    """Four versions of an 800-byte bucket, each changing 9 bytes of the last."""
    v = [_bytes(800, 0)]
    for i in range(1, 4):
        nxt = v[-1].clone()
        nxt[i * 100 : i * 100 + 9] += 1
        v.append(nxt)
    return v


def test_applier_catches_up_the_standby_buffer_or_refuses() -> None:
    """The buffer receiving v3 holds v1 (v2 is live): it replays v1->v2, then applies v2->v3."""
    v = _versions()
    enc, app = DeltaEncoder("on"), DeltaApplier()
    a, b = v[1].clone(), v[1].clone()  # v1 in both
    enc.take(0, v[1].clone(), True)
    app.received(a, 1)
    app.received(b, 1)
    p2, _ = enc.take(0, v[2].clone(), True)
    app.apply(0, b, a, p2, base=1, version=2)  # b: v2 (live after the commit)
    p3, _ = enc.take(0, v[3].clone(), True)
    app.apply(0, a, b, p3, base=2, version=3)  # a held v1: catch up with p2, then p3
    assert torch.equal(a, v[3]) and torch.equal(b, v[2])
    fresh = torch.zeros(800, dtype=torch.uint8)
    with pytest.raises(ValueError, match="full push is needed"):
        app.apply(0, fresh, None, p3, base=2, version=3)


def test_applier_catches_the_standby_buffer_up_after_a_commit_unless_a_push_started() -> None:
    """After v2's commit the standby buffer (v1) is brought to v2 off the push's path, so v3
    applies only its own payload; never backwards, and not once v3's push started."""
    v = _versions()
    enc, app = DeltaEncoder("on"), DeltaApplier()
    a, b = v[1].clone(), v[1].clone()
    enc.take(0, v[1].clone(), True)
    app.received(a, 1)
    app.received(b, 1)
    p2, _ = enc.take(0, v[2].clone(), True)
    app.apply(0, b, a, p2, base=1, version=2)  # b: v2, committed (live)
    gen = app.generation()
    assert app.catch_up(0, a, b, gen) and torch.equal(a, v[2])
    assert app.catch_up(0, b, a, gen) and torch.equal(b, v[2])  # at v2 already: untouched
    p3, _ = enc.take(0, v[3].clone(), True)
    app.apply(0, a, None, p3, base=2, version=3)  # no live buffer needed: a holds v2
    assert torch.equal(a, v[3])
    gen = app.generation()
    app.push_started()  # the next push's bucket 0: the catch-up of v3's commit stops
    assert not app.catch_up(0, b, a, gen) and torch.equal(b, v[2])
    assert app.catch_up(0, b, a, app.generation()) and torch.equal(b, v[3])
    assert app.catch_up(0, a, b, app.generation()) and torch.equal(a, v[3])  # never backwards
    c = v[1].clone()  # a buffer the last delta does not lead from (another sender's push):
    app.received(c, 1)  # left as it is, a delta against v1 may still come
    assert app.catch_up(0, c, a, app.generation()) and torch.equal(c, v[1])


def test_payload_buffers_are_reused_but_never_the_last_payloads() -> None:
    """A delta payload is received into one of two buffers kept per bucket: never the one
    holding the last payload (a catch-up replays it); large payloads get a fresh buffer."""
    app = DeltaApplier()
    seen = set()
    for version in range(1, 6):
        buf = app.payload_buffer(0, 120 - version, 1000, torch.device("cpu"))
        last = app._last.get(0)
        if last is not None:
            assert buf.untyped_storage().data_ptr() != last[2].untyped_storage().data_ptr()
        seen.add(buf.untyped_storage().data_ptr())
        app._last[0] = (version - 1, version, buf)
    assert len(seen) == 2
    big = app.payload_buffer(0, 600, 1000, torch.device("cpu"))
    assert big.untyped_storage().data_ptr() not in seen


def _train_steps(model_dir: Path, lr: float, steps: int):
    """The default job's model trained for real (AdamW on its LM loss over digit strings),
    yielding its fp32 weights after every step."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    vocab = model.config.vocab_size
    yield {n: p.detach() for n, p in model.named_parameters()}
    for _ in range(steps):
        ids = torch.randint(3, vocab, (8, 24))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        yield {n: p.detach() for n, p in model.named_parameters()}


def _bf16(weights: dict[str, torch.Tensor]) -> dict[str, int]:
    """What the engine (float32 parameters) must hold after a bfloat16 sync, per parameter."""
    return {n: checksum(t.bfloat16().float().contiguous()) for n, t in weights.items()}


def _push_trained(
    cfg: GlooWeightsConfig,
    model_dir: Path,
    tmp_path: Path,
    lr: float,
    steps: int,
    holds: Callable[[dict[str, torch.Tensor]], dict[str, int]],
    check_every: int,
) -> None:
    """Push the model's weights after each of ``steps`` real training steps (version 1 =
    the untrained model) to one engine, each push right after the last one's answer: the
    first in full, the rest as deltas; every ``check_every``-th version and the last, the
    engine holds ``holds(weights)`` bit for bit."""
    with engines(model_dir, tmp_path, [""]) as urls:
        sender = make_weight_transport(cfg, urls, "cpu")
        try:
            sender.connect()
            for version, w in enumerate(_train_steps(model_dir, lr, steps), start=1):
                stats = sender.push(w.items(), version).wait(60)
                assert stats["delta"] == float(version > 1), stats
                if (version - 1) % check_every == 0 or version == steps + 1:
                    assert state(urls[0]) == (str(version), holds(w)), f"v{version}"
        finally:
            sender.close()


def test_fifty_delta_pushes_of_a_trained_model_stay_bit_identical(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """weights.delta = on, bf16 sync of fp32 master weights at the default job's lr (1.5e-3:
    nearly every word changes, so the payloads are larger than the buckets; ``on`` sends them
    anyway): after every one of 50 pushes the engine holds the trainer's weights bit for bit;
    all but the first go as deltas."""
    cfg = msgspec.structs.replace(CFG, delta="on", full_every=0, bucket_mb=16)
    _push_trained(cfg, tiny_model_dir, tmp_path, 1.5e-3, 50, _bf16, check_every=1)


def _run_orders(
    cfg: GlooWeightsConfig,
    model_dir: Path,
    tmp_path: Path,
    fault: str,
    holds: Callable[[dict[str, torch.Tensor]], dict[str, int]],
) -> tuple[list[tuple[str, dict]], list]:
    """The orders one sender makes in a run: 8 versions of real training (lr 1e-6) pushed to
    an engine failing as ``fault`` says, a reconnect before v8; after each push that lands
    the engine holds ``holds(weights)`` bit for bit. Each push's kind and stats; the plan."""
    out: list[tuple[str, dict]] = []
    with engines(model_dir, tmp_path, [fault]) as urls:
        sender = make_weight_transport(cfg, urls, "cpu")
        try:
            sender.connect()
            for version, w in enumerate(_train_steps(model_dir, 1e-6, 8), start=1):
                if version == 8:
                    sender.connect()  # an engine (re)joined: full
                try:
                    stats = sender.push(w.items(), version).wait(60)
                except WeightSyncError as exc:
                    assert "injected failure" in str(exc)
                    out.append(("failed", {}))
                    continue
                out.append(("delta" if stats["delta"] else "full", stats))
                assert state(urls[0]) == (str(version), holds(w))
            plan = sender.stager.plan
        finally:
            sender.close()
    return out, plan


# v1 first, v4 the 3rd push since v1, v5 fails, v6 after the failure, v8 after reconnect
RUN_KINDS = ["full", "delta", "delta", "full", "failed", "full", "delta", "full", "delta"]


def test_full_push_is_forced_first_every_n_after_a_failure_and_a_reconnect(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = msgspec.structs.replace(CFG, full_every=3)
    pushes, _ = _run_orders(cfg, tiny_model_dir, tmp_path, "fail:0@5", _bf16)
    assert [kind for kind, _ in pushes] == RUN_KINDS
    for kind, stats in pushes:
        if kind == "delta":
            assert stats["delta_buckets"] >= 1 and stats["wire_bytes"] < stats["bytes"]


def test_one_sender_lands_every_push_when_a_tensor_spans_buckets(
    model_dir: Path, tmp_path: Path
) -> None:
    """The same orders where a tensor is split: float32 sync of the 1.5 MB embedding into
    1 MiB buckets, bucket 0 only its first chunk, so its parameter is a copy (joined at the
    commit) and the engine keeps one buffer for bucket 0: the bytes of its last push. v5
    fails at bucket 1, after bucket 0's delta went into that buffer (never committed); the
    sender pushes v6 in full, as a run does, and every push lands bit-exact."""
    cfg = msgspec.structs.replace(CFG, delta="on", dtype="float32", full_every=3)
    pushes, plan = _run_orders(cfg, model_dir, tmp_path, "fail:1@5", expected)
    assert [kind for kind, _ in pushes] == RUN_KINDS
    assert [e.whole for e in plan[0].entries] == [False]  # bucket 0: one chunk, nothing else
    for kind, stats in pushes:
        if kind == "delta":
            assert stats["delta_buckets"] == len(plan)


def test_delta_sender_holds_one_copy_of_the_weights_and_one_bucket(
    model_dir: Path, tmp_path: Path
) -> None:
    """Between pushes the delta sender holds its bases (one copy of the synced bytes), a
    chunk, and payload buffers of at most a quarter of their buckets (or a scratch slot and
    a compare mask without the compiled loops); the full sender at most one staging copy.
    The bases are what the engine holds: every push, delta or not, lands bit-exact."""
    cfg = msgspec.structs.replace(CFG, delta="on", dtype="float32", full_every=0)
    full = msgspec.structs.replace(cfg, delta="off", group_name="full")
    with engines(model_dir, tmp_path, [""]) as urls:
        senders = {"delta": make_weight_transport(cfg, urls, "cpu")}
        senders["full"] = make_weight_transport(full, urls, "cpu")
        try:
            for s in senders.values():
                s.connect()
            for version, w in enumerate(_train_steps(model_dir, 1e-6, 3), start=1):
                for mode, s in senders.items():
                    stats = s.push(w.items(), version).wait(60)
                    assert state(urls[0]) == (str(version), expected(w))
                    plan = s.stager.plan
                    synced, biggest = sum(m.nbytes for m in plan), max(m.nbytes for m in plan)
                    held = s.stager.memory_bytes()
                    if mode == "full":
                        assert held <= synced, (held, synced)
                        continue
                    assert len(plan) >= 2 and stats["delta"] == float(version > 1)
                    assert stats.get("delta_buckets", 0) == (len(plan) if version > 1 else 0)
                    assert held <= synced + biggest + biggest // 8, (held, synced, biggest)
        finally:
            for s in senders.values():
                s.close()


def test_back_to_back_delta_pushes_race_the_standby_catch_up_and_stay_exact(
    model_dir: Path, tmp_path: Path
) -> None:
    """float32 sync into float32 parameters (the receive buffers are the served tensors, two
    per bucket, so each commit starts a catch-up of the standby ones) and every word changing
    (lr 1e-3): each push follows the last one's answer at once, racing that catch-up; the
    engine holds every version bit for bit."""
    cfg = msgspec.structs.replace(CFG, delta="on", dtype="float32", full_every=0)
    # the versions not checked are pushed while a catch-up may still run
    _push_trained(cfg, model_dir, tmp_path, 1e-3, 9, expected, check_every=3)
