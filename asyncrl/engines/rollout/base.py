"""The two engine seams: what the controller needs from a generation server
(:class:`RolloutEngine`) and what the weight transport needs from it (:class:`EngineControl`).

Each engine family (``sglang/``, ``vllm/``, ``local/``, the embedded engine, which speaks
SGLang's protocol) implements both; :mod:`asyncrl.engines.rollout.factory` builds them from
the tagged ``RolloutConfig`` (the one place a family is chosen).

RolloutEngine contract: ``generate`` returns the sampled token ids, the log-prob of each under
the sampling distribution, the engine's weight version and the finish reason
(``"stop"``, ``"length"`` or ``"abort"``; an aborted request returns the tokens
generated so far). ``pause_generation(mode)`` stops scheduling (``abort``:
in-flight requests return at once with ``finish_reason == "abort"``;
``in_place``: they wait), ``continue_generation`` resumes. Weight updates
switch ``weight_version`` only once the whole update is loaded. ``generate_stream``
yields the same request's output as it grows: cumulative partial results
(``finish_reason == ""``) and, last, the final one (what ``generate`` would return).
``sampling_params["lora_path"]`` (LoRA runs; not a sampling parameter) names the adapter
version a request runs on (``{name}-v{N}``); the client sends it where its engine takes it
(SGLang: the request's ``lora_path``).
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import aiohttp
import msgspec

from asyncrl.core import GenerateRequest, GenerateResult
from asyncrl.secret import auth_headers
from asyncrl.transports.weights.seam import (
    AdapterControl,
    BucketAnnouncement,
    DigestCompare,
    DigestReport,
    EngineBadRequest,
    EngineControl,
    EngineError,
    EngineUnavailable,
    GroupSpec,
    Liveness,
    TensorHandoff,
    TensorLoad,
    TrainerLink,
    WeightAdapter,
    WeightEngine,
)

__all__ = [
    "AdapterControl",
    "BucketAnnouncement",
    "ControlledEngine",
    "DigestCompare",
    "DigestReport",
    "EngineBadRequest",
    "EngineControl",
    "EngineError",
    "EngineUnavailable",
    "GroupSpec",
    "KeyedHttp",
    "Liveness",
    "ManagedEngine",
    "PolledHealth",
    "RolloutEngine",
    "TensorHandoff",
    "TensorLoad",
    "TrainerLink",
    "WeightAdapter",
    "WeightEngine",
    "batch_rids",
    "distributed_update_body",
    "failure",
    "parse_sglang_generate",
    "parse_version",
    "poll_healthy",
    "set_optional",
    "weight_group_body",
]


def parse_sglang_generate(out: Any, partial: bool = False) -> GenerateResult:
    """Parse SGLang's /generate response (single request, return_logprob=True).

    ``partial``: an event of a streamed request, whose ``finish_reason`` is null until
    the last (then ``finish_reason == ""`` here)."""
    if not isinstance(out, dict) or "meta_info" not in out:
        raise EngineError("/generate", 200, f"unexpected response: {str(out)[:200]}")
    meta = out["meta_info"]
    ids = list(out.get("output_ids", []))
    lps = [float(x[0]) for x in meta.get("output_token_logprobs", [])]
    if len(lps) != len(ids):
        raise EngineError("/generate", 200, f"{len(ids)} tokens but {len(lps)} log-probs")
    fr = meta.get("finish_reason") or {}
    reason = fr.get("type", "length") if isinstance(fr, dict) else str(fr)
    if partial and meta.get("finish_reason") is None:
        reason = ""
    version = parse_version(meta.get("weight_version", "0"))
    return GenerateResult(
        output_ids=ids,
        logprobs=lps,
        weight_version=version,
        finish_reason=reason,
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        versions=_expand_spans(meta.get("weight_versions"), len(ids), version),
    )


def _expand_spans(spans: Any, n: int, last: int) -> list[int] | None:
    """SGLang's ``meta_info.weight_versions`` (``[{version, start, end}]``, output-token
    ranges, 0.5.23 srt/utils/weight_versions.py:63-108) as one version per token; None when
    absent or a single span (every token has ``last``). Tokens no span covers (none in
    SGLang's output) get the version of the span before them."""
    if not isinstance(spans, list) or len(spans) <= 1:
        return None
    out = [last] * n
    try:
        for span in spans:
            v = parse_version(span["version"])
            start, end = max(0, int(span["start"])), min(n, int(span["end"]))
            out[start:end] = [v] * max(0, end - start)
            out[end:] = [v] * (n - end)  # until a later span says otherwise
    except (KeyError, TypeError, ValueError) as exc:
        raise EngineError("/generate", 200, f"malformed weight_versions {spans!r:.200}") from exc
    return out


def parse_version(v: Any) -> int:
    """An engine's weight version label as our integer version: SGLang's and vLLM's
    "default" (before any update) and any other non-number are 0."""
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


async def failure(call: Awaitable[object]) -> str | None:
    """None once ``call`` (a liveness probe) answers; else why not (its EngineError or
    EngineUnavailable as text)."""
    try:
        await call
    except (EngineError, EngineUnavailable) as exc:
        return str(exc) or type(exc).__name__
    return None


async def poll_healthy(
    url: str,
    why_unhealthy: Callable[[], Awaitable[str | None]],
    timeout_s: float,
    interval_s: float = 0.2,
    gone: Callable[[], str | None] | None = None,
    fatal: Callable[[str], str | None] | None = None,
) -> None:
    """The families' health wait: poll ``why_unhealthy`` (None: healthy) until it holds or
    ``timeout_s`` passes, then EngineUnavailable naming ``url``, the timeout and the last
    failure. The pause between polls starts at 10 ms and doubles up to ``interval_s`` (a
    server that is about to answer, as a run's forked engine is, is seen at once; one that
    takes minutes is polled every ``interval_s``). ``gone`` is asked between polls: a reason
    it returns (e.g. "the process exited with 1") ends the wait at once, naming ``url`` and
    that reason; so does ``fatal``'s message for a failure no retry mends (a refused key)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    pause = min(0.01, interval_s)
    while (why := await why_unhealthy()) is not None:
        if gone is not None and (reason := gone()) is not None:
            raise EngineUnavailable(f"engine {url} is gone: {reason}")
        if fatal is not None and (message := fatal(why)) is not None:
            raise EngineUnavailable(message)
        if loop.time() > deadline:
            raise EngineUnavailable(
                f"engine {url} did not answer within {timeout_s:g}s (last: {why})"[:500]
            )
        await asyncio.sleep(pause)
        pause = min(pause * 2, interval_s)


def batch_rids(requests: list[GenerateRequest]) -> list[str] | None:
    """The request ids of a batch (:meth:`RolloutEngine.generate_batch`): every request's,
    or None when none names one; ValueError when only some do."""
    named = [r.rid for r in requests if r.rid is not None]
    if not named:
        return None
    if len(named) != len(requests):
        raise ValueError("generate_batch: either every request names its rid or none does")
    return [str(r) for r in named]


def weight_group_body(group: GroupSpec) -> dict[str, Any]:
    """The body of ``/init_weights_update_group`` (SGLang's route; the embedded engine
    serves the same): the group's fields as they are named."""
    return {
        "master_address": str(group.master_address),
        "master_port": int(group.master_port),
        "rank_offset": int(group.rank_offset),
        "world_size": int(group.world_size),
        "group_name": str(group.group_name),
        "backend": str(group.backend),
    }


def distributed_update_body(bucket: BucketAnnouncement) -> dict[str, Any]:
    """The body of ``/update_weights_from_distributed`` (SGLang's route; the embedded engine
    serves the same): never aborting requests; the optional fields only where set (SGLang
    omits None); ``extra``: fields SGLang ignores (asyncrl's bucket manifest)."""
    body: dict[str, Any] = {
        "names": [str(n) for n in bucket.names],
        "dtypes": [str(d) for d in bucket.dtypes],
        "shapes": [[int(x) for x in s] for s in bucket.shapes],
        "group_name": str(bucket.group_name),
        "flush_cache": bool(bucket.flush_cache),
        "abort_all_requests": False,
    }
    set_optional(body, bucket.weight_version, bucket.load_format, bucket.extra)
    return body


def set_optional(
    body: dict[str, Any],
    weight_version: str | None,
    load_format: str | None,
    extra: dict[str, Any] | None,
) -> None:
    """Add the optional fields of a weight-update request that are set (SGLang omits None)."""
    if weight_version is not None:
        body["weight_version"] = str(weight_version)
    if load_format is not None:
        body["load_format"] = str(load_format)
    if extra:
        body.update(extra)


class PolledHealth(abc.ABC):
    """:meth:`health` and :meth:`wait_healthy` (:class:`Liveness`) from one liveness probe,
    the family's :meth:`_why_unhealthy`, for a client whose ``url`` names its engine."""

    url: str

    @abc.abstractmethod
    async def _why_unhealthy(self) -> str | None:
        """Probe the engine once: None when it answers, else why not; never raises."""

    def _fatal(self, why: str) -> str | None:
        """The message for a probe failure ``why`` that no retry mends (None: retry)."""
        return None

    async def health(self) -> bool:
        """True while the engine answers its liveness probe; never raises."""
        return await self._why_unhealthy() is None

    async def wait_healthy(
        self,
        timeout_s: float,
        interval_s: float = 0.2,
        gone: Callable[[], str | None] | None = None,
    ) -> None:
        """Poll the probe until it answers or ``timeout_s`` passes: then EngineUnavailable
        naming the URL, the timeout and the last failure. ``gone`` (optional) is asked
        between polls: a reason it returns (e.g. "the process exited with 1") ends the wait
        at once, naming the URL and that reason; so does :meth:`_fatal`'s message. The one
        health wait: launchers, the run and benchmarks all wait through it."""
        await poll_healthy(self.url, self._why_unhealthy, timeout_s, interval_s, gone, self._fatal)


def _json_text(obj: Any) -> str:
    return msgspec.json.encode(obj).decode()


class KeyedHttp:
    """A lazily opened ``aiohttp`` session that sends the run secret on every request
    (:func:`asyncrl.secret.auth_headers`), shared by the HTTP engine clients. The class
    using it sets ``self._timeout`` and ``self._session = None`` in its ``__init__``; the
    session belongs to the event loop of its first request. Request bodies (``json=``) are
    encoded by msgspec (~9x the standard library's ``json.dumps``: one body per generate
    request is on the controller's hot path)."""

    _timeout: aiohttp.ClientTimeout
    _session: aiohttp.ClientSession | None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=self._timeout,
                connector=aiohttp.TCPConnector(limit=0),
                headers=auth_headers(),
                json_serialize=_json_text,
            )
        return self._session

    async def close(self) -> None:
        """Close the session (a later request opens a new one)."""
        if self._session is not None:
            await self._session.close()
            self._session = None


class RolloutEngine(Protocol):
    """A generation server as the controller sees it (module docstring: the contract).

    The receiving side of weight sync is driven by the weight transport through
    :class:`EngineControl` (the same object, built by the factory).
    """

    url: str

    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str | None = None
    ) -> GenerateResult:
        """Complete ``input_ids``. Raises EngineError (server said no) or EngineUnavailable."""
        ...

    def generate_stream(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str | None = None
    ) -> AsyncIterator[GenerateResult]:
        """Complete ``input_ids``, yielding the output as it grows: cumulative results with
        ``finish_reason == ""``, the final one last (its ``finish_reason`` set, as
        :meth:`generate` returns it). Errors as :meth:`generate`, at any point; closing
        the iterator early abandons the request (the server aborts it)."""
        ...

    async def generate_batch(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Several completions in one request (SGLang's list-form ``/generate``), answered in
        order once all finished; errors as :meth:`generate`, once for the whole batch. Either
        every request names its ``rid`` or none does (ValueError)."""
        ...

    async def pause_generation(self, mode: str = "abort") -> None:
        """Stop scheduling. ``abort`` returns in-flight requests; other modes keep them."""
        ...

    async def continue_generation(self) -> None:
        """Resume scheduling after a pause."""
        ...

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """Finish request ``rid`` (or all) now; its ``generate`` returns the partial output."""
        ...

    async def get_weight_version(self) -> str:
        """The version of the weights now loaded."""
        ...

    async def health(self) -> bool:
        """True when the server answers a cheap liveness probe; never raises."""
        ...

    async def close(self) -> None:
        """Release the client's connections (the server keeps running)."""
        ...


class ManagedEngine(RolloutEngine, Liveness, Protocol):
    """A RolloutEngine whose liveness can be waited for (launchers, restarts, the transport)."""


class ControlledEngine(ManagedEngine, WeightEngine, Protocol):
    """An engine as both seams hold it: the controller's (:class:`RolloutEngine`) and the
    weight transport's (:class:`~asyncrl.transports.weights.seam.WeightEngine`, which pauses
    generation around a push): what the families' clients are."""
