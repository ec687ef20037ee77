"""The embedded engine's bucket turns (``WeightReceiver._turn_of``): buckets of a push may
arrive in any order over concurrent HTTP requests and are taken in index order."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.engines.rollout.local.weights import WeightReceiver, WeightRequestError, _Update
from asyncrl.transports.weights.bucket import BucketManifest


def _bucket(version: int, index: int) -> BucketManifest:
    return BucketManifest(dtype="float32", entries=(), index=index, count=3, version=version)


def _receiver(update: _Update | None) -> WeightReceiver:
    r = object.__new__(WeightReceiver)  # only the turn state: no engine, no group
    r._update, r._turn, r.turn_timeout_s = update, asyncio.Condition(), 60.0
    return r


async def test_a_new_pushs_bucket_waits_for_its_bucket_0_not_the_failed_push() -> None:
    """v11 failed after bucket 1 (the engine's state: v11, next bucket 2); v12's bucket 1
    request arrives before its bucket 0's. It must wait for v12's bucket 0, not be judged
    against v11's state (was: "bucket 1 of v12 out of turn (v11 bucket 2)" — a loaded CI
    run's test_checksum_mismatch_keeps_old_weights_then_next_push_succeeds)."""
    r = _receiver(_Update(version=11, count=3, next_index=2))
    early = asyncio.ensure_future(r._turn_of(_bucket(12, 1)))
    await asyncio.sleep(0)  # one loop turn: the early request reaches its wait (or fails)
    assert not early.done(), early.exception() if early.done() else None
    up = await r._turn_of(_bucket(12, 0))  # v12's bucket 0: a new push
    up.next_index += 1  # received (what _stage does), and the next may come
    async with r._turn:
        r._turn.notify_all()
    assert await asyncio.wait_for(early, 60) is up and up.version == 12


async def test_a_bucket_of_an_older_push_is_refused_at_once() -> None:
    r = _receiver(_Update(version=12, count=3, next_index=1))
    with pytest.raises(WeightRequestError, match=r"out of turn \(v12 bucket 1\)"):
        await asyncio.wait_for(r._turn_of(_bucket(11, 2)), 60)
