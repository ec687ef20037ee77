"""SGLang HTTP client: the RolloutEngine that speaks SGLang's server protocol exactly.

Field names and types follow SGLang's ``io_struct.py`` (``GenerateReqInput``,
``AbortReq``, ``PauseGenerationReqInput``, ``ContinueGenerationReqInput``,
``InitWeightsUpdateGroupReqInput``, ``UpdateWeightsFromDistributedReqInput``,
``UpdateWeightsFromTensorReqInput``, ``UpdateWeightVersionReqInput``,
``FlushCacheReqInput``); ``tests/engines/rollout/test_sglang_schema.py`` checks
every request this client sends against that schema. The embedded engine
serves the same endpoints, so this one client drives both.

Errors: a server answer with HTTP 4xx raises :class:`EngineBadRequest`, any
other HTTP error or a ``success: false`` body raises :class:`EngineError` —
both carry the server's message. Connection failures and timeouts raise
:class:`EngineUnavailable` (recoverable: retry, maybe elsewhere).

The flags of SGLang server processes: :mod:`asyncrl.engines.rollout.sglang.launcher`
(started by :mod:`asyncrl.engines.rollout.launcher`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec

from asyncrl import secret
from asyncrl.config import PAUSE_MODES
from asyncrl.core import GenerateRequest, GenerateResult
from asyncrl.engines.rollout.base import (
    BucketAnnouncement,
    EngineBadRequest,
    EngineError,
    EngineUnavailable,
    GroupSpec,
    KeyedHttp,
    PolledHealth,
    TensorLoad,
    batch_rids,
    distributed_update_body,
    failure,
    parse_sglang_generate,
    set_optional,
    weight_group_body,
)
from asyncrl.engines.rollout.sse import read_generate_stream

__all__ = ["SGLangClient"]


def _server_message(raw: bytes) -> str:
    """The message of an error body: ``error.message``, ``message``, ``detail`` or the text."""
    text = raw.decode(errors="replace")
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return text[:2000]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        for key in ("message", "detail", "error", "error_message"):
            if body.get(key):
                return str(body[key])
    return text[:2000]


def _is_json_object(raw: bytes) -> bool:
    try:
        return isinstance(msgspec.json.decode(raw), dict)
    except msgspec.DecodeError:
        return False


class SGLangClient(KeyedHttp, PolledHealth):
    """One SGLang-protocol server at ``base_url``. Create and use it inside one event loop.

    ``record=True`` keeps every request sent as ``(method, path, body)`` in
    ``self.sent`` and every decoded answer as ``(path, answer)`` in ``self.answers``
    (the schema test reads them).
    """

    def __init__(self, base_url: str, timeout_s: float = 120.0, record: bool = False):
        self.url = base_url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self.sent: list[tuple[str, str, dict[str, Any] | None]] | None = [] if record else None
        self.answers: list[tuple[str, Any]] | None = [] if record else None
        self._routes: dict[tuple[str, ...], str] = {}  # routes wanted -> the one it answers
        self.has_session: bool | None = None  # /begin_weight_update exists (SGLang >= 0.5.22)

    def __repr__(self) -> str:
        return f"SGLangClient({self.url!r})"

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        if self.sent is not None:
            self.sent.append((method, path, body))
        try:
            async with self._http().request(method, self.url + path, json=body) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
            raise EngineUnavailable(f"{self.url}{path}: {type(exc).__name__}: {exc}") from exc
        if status >= 400:
            answered = _is_json_object(raw)
            cls = EngineBadRequest if status < 500 else EngineError
            raise cls(path, status, _server_message(raw), answered=answered)
        if not raw:
            return None
        try:
            out = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            return raw.decode(errors="replace")
        if self.answers is not None:
            self.answers.append((path, out))
        if isinstance(out, dict) and out.get("success") is False:
            raise EngineError(path, status, str(out.get("message") or _server_message(raw)))
        return out

    # -- generation ---------------------------------------------------------------------
    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        rid: str | None = None,
    ) -> GenerateResult:
        """One completion of ``input_ids`` with per-token log-probs of the sampled tokens."""
        body: dict[str, Any] = {
            "input_ids": [int(t) for t in input_ids],
            "sampling_params": dict(sampling_params),
            "return_logprob": True,
        }
        _move_lora_path(body)
        if rid is not None:
            body["rid"] = str(rid)
        return parse_sglang_generate(await self._call("POST", "/generate", body))

    async def generate_stream(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        rid: str | None = None,
    ) -> AsyncIterator[GenerateResult]:
        """:meth:`generate` streamed (SGLang's ``stream: true``): the cumulative output after
        every event, the final result last (see :mod:`asyncrl.engines.rollout.sse`)."""
        body: dict[str, Any] = {
            "input_ids": [int(t) for t in input_ids],
            "sampling_params": dict(sampling_params),
            "return_logprob": True,
            "stream": True,
        }
        _move_lora_path(body)
        if rid is not None:
            body["rid"] = str(rid)
        if self.sent is not None:
            self.sent.append(("POST", "/generate", body))
        async for res in read_generate_stream(self._http(), self.url + "/generate", body):
            yield res

    async def generate_batch(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Several completions in one ``/generate`` (SGLang's list form: one list per field),
        answered in order once all finished; as :meth:`generate` per item."""
        rids = batch_rids(requests)
        body: dict[str, Any] = {
            "input_ids": [[int(t) for t in r.input_ids] for r in requests],
            "sampling_params": [dict(r.sampling_params) for r in requests],
            "return_logprob": True,
        }
        _move_lora_path(body)
        if rids is not None:
            body["rid"] = rids
        out = await self._call("POST", "/generate", body)
        if not isinstance(out, list) or len(out) != len(requests):
            got = f"{len(out)} answers" if isinstance(out, list) else type(out).__name__
            raise EngineError("/generate", 200, f"batch of {len(requests)}: got {got}")
        return [parse_sglang_generate(o) for o in out]

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """Abort request ``rid`` (or every request): its /generate returns the partial output."""
        await self._call("POST", "/abort_request", {"rid": str(rid), "abort_all": bool(abort_all)})

    async def pause_generation(self, mode: str = "abort") -> None:
        """Stop scheduling: ``abort`` | ``retract`` | ``in_place`` (SGLang's modes)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        await self._call("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._call("POST", "/continue_generation", {})

    async def flush_cache(self) -> None:
        """Drop the server's prefix cache (SGLang refuses while requests run)."""
        await self._call("POST", "/flush_cache")

    # -- LoRA adapters -----------------------------------------------------------------
    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Load the PEFT adapter folder ``lora_path`` as ``lora_name`` (SGLang's
        ``LoadLoRAAdapterReqInput``; 400 ``error_message`` on a duplicate name, a rank or
        target module the server was not started for, or LoRA off)."""
        body = {"lora_name": str(lora_name), "lora_path": str(lora_path)}
        await self._call("POST", "/load_lora_adapter", body)

    async def unload_lora_adapter(self, lora_name: str) -> None:
        """Unload ``lora_name``; SGLang answers once no request uses it
        (``_unload_lora_adapter_locked``, tokenizer_communicator_mixin.py:619-637 in 0.5.10)."""
        await self._call("POST", "/unload_lora_adapter", {"lora_name": str(lora_name)})

    def refusal(self, exc: EngineError) -> str:
        """SGLang's adapter refusals (see ``AdapterControl``): a name loaded already ("already
        loaded", 0.5.10 lora_manager.py:187-193; "already exists", lora_registry.py:230-233),
        one not loaded ("does not exist", lora_registry.py:107-110), a load refused after a
        partial unload (0.5.22+: "has an incomplete unload", 0.5.23
        tokenizer_control_mixin.py:682-686)."""
        text = str(exc)
        if "already loaded" in text or "already exists" in text:
            return "held"
        if "does not exist" in text:
            return "gone"
        return "incomplete" if "has an incomplete unload" in text else ""

    # -- weights -----------------------------------------------------------------------
    async def init_weights_update_group(self, group: GroupSpec) -> None:
        """Join the weight-sync process group as ranks ``rank_offset..`` (blocks until formed)."""
        await self._call("POST", "/init_weights_update_group", weight_group_body(group))

    async def update_weights_from_distributed(self, bucket: BucketAnnouncement) -> None:
        """Receive one broadcast of the named tensors (``load_format="flattened_bucket"``:
        one flat buffer). ``flush_cache=True`` commits; ``weight_version`` is set with it.
        ``extra`` adds fields SGLang ignores (asyncrl's bucket manifest)."""
        body = distributed_update_body(bucket)
        await self._call("POST", "/update_weights_from_distributed", body)

    async def update_weights_from_tensor(self, load: TensorLoad) -> Any:
        """Load tensors handed over in-host (CUDA IPC handles), one base64 string per TP rank.
        ``extra`` adds fields SGLang ignores (asyncrl's IPC descriptor); returns the answer."""
        body: dict[str, Any] = {
            "serialized_named_tensors": [str(s) for s in load.serialized_named_tensors],
            "flush_cache": bool(load.flush_cache),
            "abort_all_requests": False,
        }
        set_optional(body, load.weight_version, load.load_format, load.extra)
        return await self._call("POST", "/update_weights_from_tensor", body)

    async def begin_weight_update(self) -> bool:
        """Open SGLang's weight-update session (0.5.22+: update calls outside one answer 400,
        0.5.23 scheduler_components/weight_updater.py:192-198). False when the server has no
        such route (404: SGLang 0.5.10, the embedded engine): go on without."""
        return await self._session_call("/begin_weight_update")

    async def end_weight_update(self, version: str | None = None) -> bool:
        """Close the session :meth:`begin_weight_update` opened (False: no such route).
        ``version`` is not sent: SGLang took it with the last bucket's load."""
        return await self._session_call("/end_weight_update")

    async def _session_call(self, path: str) -> bool:
        if self.has_session is False:
            return False
        try:
            await self._call("POST", path, {})
        except EngineBadRequest as exc:
            if exc.status != 404:
                raise
            self.has_session = False
            return False
        self.has_session = True
        return True

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        """Leave the weight-sync process group ``group_name``."""
        await self._call("POST", "/destroy_weights_update_group", {"group_name": str(group_name)})

    async def update_weight_version(self, new_version: str) -> None:
        """Relabel the loaded weights (never aborts running requests)."""
        body = {"new_version": str(new_version), "abort_all_requests": False}
        await self._call("POST", "/update_weight_version", body)

    async def _get_either(self, paths: tuple[str, ...]) -> Any:
        """GET the first of ``paths`` this server has (a 404 tries the next; remembered)."""
        known = self._routes.get(paths)
        if known is not None:
            return await self._call("GET", known)
        for i, path in enumerate(paths):
            try:
                out = await self._call("GET", path)
            except EngineBadRequest as exc:
                if exc.status != 404 or i == len(paths) - 1:
                    raise
                continue
            self._routes[paths] = path
            return out
        raise AssertionError("unreachable")

    async def get_weight_version(self) -> str:
        """The served weights' version label: ``/model_info``'s ``weight_version``
        (SGLang >= 0.5.10; its ``/get_weight_version`` answers 404, http_server.py:581-587 in
        0.5.10, gone in 0.5.22), else ``/get_weight_version`` (the embedded engine)."""
        out = await self._get_either(("/model_info", "/get_weight_version"))
        if not isinstance(out, dict) or "weight_version" not in out:
            raise EngineError("/model_info", 200, f"unexpected response: {out!r:.200}")
        return str(out["weight_version"])

    async def get_server_info(self) -> dict[str, Any]:
        """The server's ``/server_info`` (``/get_server_info`` is SGLang's deprecated alias and
        the embedded engine's route): SGLang: launch arguments (``tp_size``, ``version``) and
        state; the embedded engine: step and token counters. Versions read from here are launch
        values: the served version is :meth:`get_weight_version`."""
        out = await self._get_either(("/server_info", "/get_server_info"))
        if not isinstance(out, dict):
            raise EngineError("/server_info", 200, f"unexpected response: {out!r:.200}")
        return out

    # -- liveness ----------------------------------------------------------------------
    async def _why_unhealthy(self) -> str | None:
        """The server answers ``/model_info`` (``/get_model_info``) (:meth:`health`).

        A liveness probe, cheap on every server. Not SGLang's ``/health``: that runs a
        one-token generation (>= 1 s; 503 after 20 s while generation is paused;
        0.5.23 http_server.py:721-799), so it fails during every long weight update.
        """
        return await failure(self._get_either(("/model_info", "/get_model_info")))

    def _fatal(self, why: str) -> str | None:
        """A refused key (401): no retry mends it (docs/security.md)."""
        return f"{secret.refused(self.url)} ({why})" if " -> 401: " in why else None


def _move_lora_path(body: dict[str, Any]) -> None:
    """``sampling_params["lora_path"]`` (asyncrl's way to name an adapter version, not a
    sampling parameter: SGLang's ``SamplingParams`` refuses unknown keys) becomes the
    request's own ``lora_path`` (``GenerateReqInput.lora_path``, io_struct.py:181 in 0.5.10:
    one name, or one per item of a batch; None: the base model)."""
    sps = body["sampling_params"]  # the request's own copies
    if isinstance(sps, dict):
        if (path := sps.pop("lora_path", None)) is not None:
            body["lora_path"] = str(path)
        return
    paths = [sp.pop("lora_path", None) for sp in sps]
    if any(p is not None for p in paths):
        body["lora_path"] = [None if p is None else str(p) for p in paths]
