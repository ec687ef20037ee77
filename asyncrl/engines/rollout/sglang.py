"""SGLang HTTP client: the RolloutEngine that speaks SGLang's server protocol exactly.

Field names follow SGLang's ``io_struct.py`` (``GenerateReqInput``,
``InitWeightsUpdateGroupReqInput``, ``UpdateWeightsFromDistributedReqInput``,
``PauseGenerationReqInput``, ...). The embedded engine serves the same
endpoints, so this one client drives both. Server-side failures surface as
:class:`EngineError` (carrying the server's message); connection failures and
timeouts as :class:`EngineUnavailable`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import msgspec

from asyncrl.engines.rollout.base import EngineError, EngineUnavailable, GenerateResult

__all__ = ["SGLangClient"]


class SGLangClient:
    """One engine at ``base_url``. Create and use it inside one event loop."""

    def __init__(self, base_url: str, timeout_s: float = 120.0):
        self.url = base_url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, connector=aiohttp.TCPConnector(limit=0)
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            async with self._http().request(method, self.url + path, json=body) as resp:
                raw = await resp.read()
                if resp.status >= 400:
                    raise EngineError(path, resp.status, raw.decode(errors="replace")[:2000])
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
            raise EngineUnavailable(f"{self.url}{path}: {type(exc).__name__}: {exc}") from exc
        if not raw:
            return None
        try:
            return msgspec.json.decode(raw)
        except msgspec.DecodeError:
            return raw.decode(errors="replace")

    @staticmethod
    def _check_success(path: str, out: Any) -> Any:
        if isinstance(out, dict) and out.get("success") is False:
            raise EngineError(path, 200, str(out.get("message", out)))
        return out

    # -- generation ---------------------------------------------------------------------
    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        rid: str | None = None,
    ) -> GenerateResult:
        """One completion with per-token log-probs of the sampled tokens."""
        body: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": sampling_params,
            "return_logprob": True,
        }
        if rid is not None:
            body["rid"] = rid
        out = await self._call("POST", "/generate", body)
        return GenerateResult.from_sglang(out)

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        await self._call("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

    async def pause_generation(self, mode: str = "abort") -> None:
        await self._call("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._call("POST", "/continue_generation", {})

    async def flush_cache(self) -> None:
        await self._call("POST", "/flush_cache")

    # -- weights -----------------------------------------------------------------------
    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        path = "/init_weights_update_group"
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        self._check_success(path, await self._call("POST", path, body))

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        weight_version: str | None = None,
        load_format: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """One bucket (or per-tensor batch); ``extra`` adds fields SGLang ignores."""
        path = "/update_weights_from_distributed"
        body: dict[str, Any] = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
            "abort_all_requests": False,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        if load_format is not None:
            body["load_format"] = load_format
        if extra:
            body.update(extra)
        self._check_success(path, await self._call("POST", path, body))

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """SGLang's colocated update (CUDA IPC handles); ``extra`` adds fields SGLang ignores."""
        path = "/update_weights_from_tensor"
        body: dict[str, Any] = {
            "serialized_named_tensors": serialized_named_tensors,
            "flush_cache": flush_cache,
            "abort_all_requests": False,
        }
        if load_format is not None:
            body["load_format"] = load_format
        if weight_version is not None:
            body["weight_version"] = weight_version
        if extra:
            body.update(extra)
        self._check_success(path, await self._call("POST", path, body))

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        path = "/destroy_weights_update_group"
        self._check_success(path, await self._call("POST", path, {"group_name": group_name}))

    async def update_weight_version(self, new_version: str) -> None:
        path = "/update_weight_version"
        body = {"new_version": new_version, "abort_all_requests": False}
        self._check_success(path, await self._call("POST", path, body))

    async def get_weight_version(self) -> str:
        out = await self._call("GET", "/get_weight_version")
        return str(out["weight_version"])

    async def health(self) -> bool:
        """True when the server answers /health with 200."""
        try:
            await self._call("GET", "/health")
        except (EngineError, EngineUnavailable):
            return False
        return True

    async def wait_healthy(self, timeout_s: float, interval_s: float = 0.2) -> None:
        """Poll /health until it answers or ``timeout_s`` passes (then EngineUnavailable)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not await self.health():
            if loop.time() > deadline:
                raise EngineUnavailable(f"{self.url} not healthy after {timeout_s:.0f}s")
            await asyncio.sleep(interval_s)
