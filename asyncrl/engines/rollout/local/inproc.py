"""The embedded engine in this very process: a :class:`LocalEngine` behind the rollout seam.

:class:`InProcEngine` is a :class:`~asyncrl.engines.rollout.base.RolloutEngine` and an
:class:`~asyncrl.engines.rollout.base.EngineControl` (pause, continue, abort, versions, the
weight-group routes) that calls the engine directly instead of over HTTP, so a
``Controller(..., engines=[InProcEngine.load(path)])`` and the gateway run against a real
model in one process (tests, notebooks, embedding users). It imports torch and
transformers: nothing in asyncrl imports it; import it only where a model runs here.

Same semantics as the HTTP path by construction, not by a second copy of its rules: each
request is checked and built by the engine server's own code
(:class:`~asyncrl.engines.rollout.local.server.EngineServer`: the same field checks,
context limits, adapter pins), answered by the server's own answer builder and read back
with :func:`~asyncrl.engines.rollout.base.parse_sglang_generate`, as
:class:`~asyncrl.engines.rollout.sglang.SGLangClient` reads the HTTP answer; sampling
parameters make the same JSON round trip they make on the wire. A request the server would
answer with HTTP 400 raises :class:`EngineBadRequest` (status 400, the server's message),
anything else that fails :class:`EngineError` (status 500); a ``success: false`` answer of the
weight receiver raises :class:`EngineError` (status 200), as the HTTP client does.
``tests/engines/rollout/test_inproc.py`` checks both paths give the same tokens, log-probs
and versions for the same seed and requests.

Threads: the model runs on the engine's scheduler thread; what waits for a step boundary
(abort, pause, a weight switch) runs in a worker thread, so no call blocks the event loop.
A request belongs to the loop that made it (its answer is posted there), so one client
serves any number of event loops. Cancelling a ``generate`` (or closing a stream early)
aborts its request on the engine, as a client that hangs up on the server does.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec

from asyncrl.config import PAUSE_MODES
from asyncrl.core import GenerateRequest, GenerateResult
from asyncrl.engines.rollout.base import (
    BucketAnnouncement,
    EngineBadRequest,
    EngineError,
    GroupSpec,
    PolledHealth,
    batch_rids,
    distributed_update_body,
    parse_sglang_generate,
    weight_group_body,
)
from asyncrl.engines.rollout.checks import BadRequest
from asyncrl.engines.rollout.local.engine import LocalEngine, Request
from asyncrl.engines.rollout.local.server import EngineServer, _answer, load_engine, progress

__all__ = ["InProcEngine"]


class InProcEngine(PolledHealth):
    """A :class:`LocalEngine` of this process as a rollout engine and its controls.

    ``owns``: :meth:`stop` stops the engine (:meth:`load` makes such a client); ``close``
    never does (the protocol's meaning: the client lets go, the server keeps serving).
    """

    def __init__(
        self,
        engine: LocalEngine,
        model_path: str = "",
        url: str = "inproc://engine",
        owns: bool = False,
    ):
        self.engine = engine
        self.server = EngineServer(engine, model_path)
        self.url = url
        self.owns = owns

    @classmethod
    def load(
        cls, model_path: str, url: str = "inproc://engine", **engine_args: Any
    ) -> InProcEngine:
        """The model at ``model_path`` behind a new engine that this client owns;
        ``engine_args`` as :func:`~asyncrl.engines.rollout.local.server.load_engine` takes
        them (defaults: CPU, float32, ``asyncrl serve``'s batch and prefill limits)."""
        args: dict[str, Any] = {"device": "cpu", "dtype": "float32", "max_batch_size": 256}
        args |= {"seed": 0, **engine_args}
        engine = load_engine(model_path, **args)
        return cls(engine, model_path, url, owns=True)

    def __repr__(self) -> str:
        return f"InProcEngine({self.url!r})"

    # -- generation ---------------------------------------------------------------------
    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str | None = None
    ) -> GenerateResult:
        """One completion of ``input_ids`` (see the module docstring for the errors)."""
        rids = None if rid is None else [rid]
        return (await self._complete([input_ids], [sampling_params], rids))[0]

    async def generate_batch(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Several completions queued together (one prefill), answered in order."""
        rids = batch_rids(requests)
        input_ids = [r.input_ids for r in requests]
        return await self._complete(input_ids, [r.sampling_params for r in requests], rids)

    async def generate_stream(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str | None = None
    ) -> AsyncIterator[GenerateResult]:
        """:meth:`generate` as it grows: a cumulative result (``finish_reason == ""``) after
        each step that made tokens, the final one last; closing the iterator early aborts
        the request."""
        rids = None if rid is None else [rid]
        # as the server's streamed /generate: a lora_path is not pinned (the request runs on
        # the newest adapter version when it joins; server.EngineServer._stream)
        [req] = self._requests([input_ids], [sampling_params], rids, pin=False)
        try:
            async for n in progress(self.engine, req):
                yield parse_sglang_generate(_answer(req, True, n), partial=True)
        finally:
            if not req.future.done():  # the reader went away (cancelled or closed early)
                await asyncio.shield(asyncio.to_thread(self.engine.abort, req.rid))

    async def _complete(
        self, input_ids: list[list[int]], sps: list[dict[str, Any]], rids: list[str] | None
    ) -> list[GenerateResult]:
        reqs = self._requests(input_ids, sps, rids)
        self.engine.submit_all(reqs)
        try:
            await asyncio.gather(*(r.future for r in reqs))
        except asyncio.CancelledError:  # the caller went away: as a client hanging up
            await asyncio.shield(asyncio.to_thread(self._abort_each, [r.rid for r in reqs]))
            raise
        return [parse_sglang_generate(_answer(r, True)) for r in reqs]

    def _requests(
        self,
        input_ids: list[list[int]],
        sps: list[dict[str, Any]],
        rids: list[str] | None,
        pin: bool = True,
    ) -> list[Request]:
        """The engine's requests, checked and pinned by the server's own code (a refusal is
        EngineBadRequest with the server's message); the caller's dicts are not changed."""
        loop = asyncio.get_running_loop()
        try:
            wire = [msgspec.json.decode(msgspec.json.encode(sp)) for sp in sps]  # as sent
        except (TypeError, msgspec.EncodeError) as exc:
            raise EngineBadRequest("/generate", 400, f"sampling_params: {exc}") from None
        paths = [sp.pop("lora_path", None) if isinstance(sp, dict) else None for sp in wire]
        try:
            reqs = [
                self.server._request(  # the HTTP handler's own checks
                    [int(t) for t in ids], sp, None if rids is None else str(rids[i]), loop
                )
                for i, (ids, sp) in enumerate(zip(input_ids, wire, strict=True))
            ]
            if pin:
                self.server._pin_named(reqs, [None if p is None else str(p) for p in paths])
        except BadRequest as exc:
            raise EngineBadRequest("/generate", 400, str(exc)) from None
        return reqs

    def _abort_each(self, rids: list[str]) -> None:
        for rid in rids:
            self.engine.abort(rid)

    # -- scheduling -----------------------------------------------------------------------
    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """Finish request ``rid`` (or all) now; its ``generate`` returns the partial output."""
        n = await asyncio.to_thread(self.engine.abort, str(rid), bool(abort_all))
        self.engine.stats["aborted"] += n  # as the server counts an abort asked for

    async def pause_generation(self, mode: str = "abort") -> None:
        """Stop scheduling between two steps (``abort`` | ``retract`` | ``in_place``)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        await asyncio.to_thread(self.engine.pause, mode)

    async def continue_generation(self) -> None:
        self.engine.resume()

    async def flush_cache(self) -> None:
        """Nothing to drop (the engine keeps no prefix cache), as its server answers."""

    # -- versions and weights ---------------------------------------------------------------
    async def get_weight_version(self) -> str:
        return str(self.engine.weight_version)

    async def update_weight_version(self, new_version: str) -> None:
        """Switch to the staged update as version ``new_version`` (or relabel: none staged)."""
        body = {"new_version": str(new_version), "abort_all_requests": False}
        await self._weights("/update_weight_version", self.server.weights.commit, body)

    async def get_server_info(self) -> dict[str, Any]:
        """The server's ``/get_server_info`` answer (counters, version, pause state)."""
        resp = await self.server.get_server_info(None)  # type: ignore[arg-type]  # unread
        return dict(json.loads(resp.text or "{}"))

    async def init_weights_update_group(self, group: GroupSpec) -> None:
        """Join the weight group as rank ``rank_offset`` (returns once joined)."""
        body = weight_group_body(group)
        await self._weights("/init_weights_update_group", self.server.weights.init_group, body)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        body = {"group_name": str(group_name)}
        await self._weights(
            "/destroy_weights_update_group", self.server.weights.destroy_group, body
        )

    async def begin_weight_update(self) -> bool:
        """False: the embedded engine has no update session (its server answers 404)."""
        return False

    async def end_weight_update(self, version: str | None = None) -> bool:
        return False

    async def update_weights_from_distributed(self, bucket: BucketAnnouncement) -> None:
        """Receive and stage one announced bucket (the HTTP route's body and checks)."""
        body = distributed_update_body(bucket)
        await self._weights(
            "/update_weights_from_distributed", self.server.weights.update_from_distributed, body
        )

    async def _weights(
        self,
        path: str,
        call: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]],
        body: dict[str, Any],
    ) -> dict[str, Any]:
        """One weight-receiver call, shielded as the server shields it (a cancelled caller
        never interrupts an update half-way), its answer read as the HTTP client reads it."""
        wire = msgspec.json.decode(msgspec.json.encode(body))
        try:
            out = await asyncio.shield(call(wire))
        except BadRequest as exc:
            raise EngineBadRequest(path, 400, str(exc)) from None
        except Exception as exc:
            raise EngineError(path, 500, f"{type(exc).__name__}: {exc}", answered=False) from exc
        if isinstance(out, dict) and out.get("success") is False:
            raise EngineError(path, 200, str(out.get("message")))
        return out

    # -- liveness -------------------------------------------------------------------------
    async def _why_unhealthy(self) -> str | None:
        """The engine's scheduler runs and no step is stuck (:meth:`health`)."""
        return self.engine.health()

    async def close(self) -> None:
        """Nothing to release (no connections); the engine keeps serving."""

    def stop(self) -> None:
        """Stop the engine (every request in flight is answered ``abort``) when this client
        owns it (:meth:`load`), and the weight receiver's threads."""
        if self.owns:
            self.engine.stop()
        self.server.weights.close()
