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

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp

from asyncrl.core import GenerateResult
from asyncrl.secret import auth_headers

if TYPE_CHECKING:
    import torch

__all__ = [
    "AdapterControl",
    "ControlledEngine",
    "DigestReport",
    "EngineBadRequest",
    "EngineControl",
    "EngineError",
    "EngineUnavailable",
    "KeyedHttp",
    "ManagedEngine",
    "RolloutEngine",
    "TensorHandoff",
    "TrainerLink",
    "WeightFamily",
    "parse_sglang_generate",
]


class EngineError(RuntimeError):
    """The engine answered with an error (HTTP >= 400, or ``success: false`` with HTTP 200).

    ``message`` is the server's own message (``error.message`` or ``message`` of its
    JSON body, else the body text); ``status`` the HTTP status; ``path`` the endpoint.
    """

    def __init__(self, path: str, status: int, message: str, answered: bool = True):
        super().__init__(f"{path} -> {status}: {message}")
        self.path = path
        self.status = status
        self.message = message
        self.answered = answered
        """The engine's own handler answered (a JSON object body, e.g. SGLang's
        ``{"success": false, "message": ...}`` with HTTP 400): it ran, and for a weight update
        it may have received and loaded data before failing. False: a proxy's or framework's
        error page."""


class EngineBadRequest(EngineError):
    """The engine rejected the request as malformed (HTTP 4xx): retrying it cannot help."""


class EngineUnavailable(ConnectionError):
    """The engine could not be reached or timed out (recoverable: retry elsewhere)."""


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
    version = _parse_version(meta.get("weight_version", "0"))
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
            v = _parse_version(span["version"])
            start, end = max(0, int(span["start"])), min(n, int(span["end"]))
            out[start:end] = [v] * max(0, end - start)
            out[end:] = [v] * (n - end)  # until a later span says otherwise
    except (KeyError, TypeError, ValueError) as exc:
        raise EngineError("/generate", 200, f"malformed weight_versions {spans!r:.200}") from exc
    return out


def _parse_version(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0  # SGLang's "default" before any update


class KeyedHttp:
    """A lazily opened ``aiohttp`` session that sends the run secret on every request
    (:func:`asyncrl.secret.auth_headers`), shared by the HTTP engine clients. The class
    using it sets ``self._timeout`` and ``self._session = None`` in its ``__init__``; the
    session belongs to the event loop of its first request."""

    _timeout: aiohttp.ClientTimeout
    _session: aiohttp.ClientSession | None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=self._timeout,
                connector=aiohttp.TCPConnector(limit=0),
                headers=auth_headers(),
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

    async def generate_batch(
        self,
        input_ids: list[list[int]],
        sampling_params: list[dict[str, Any]],
        rids: list[str] | None = None,
    ) -> list[GenerateResult]:
        """Several completions in one request (SGLang's list-form ``/generate``), answered in
        order once all finished; errors as :meth:`generate`, once for the whole batch."""
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


class EngineControl(Protocol):
    """What the weight transport (trainer process) needs from one engine.

    The vocabulary is SGLang's weight-sync routes, which the embedded engine serves too;
    the vLLM family maps each onto vLLM 0.33's RL routes (``vllm/control.py``). Contract:

    - *form*: :meth:`get_server_info` tells how many ranks the engine joins the weight
      group with (``tp_size``: all of its ranks) and its release (``version``);
      :meth:`init_weights_update_group` joins them as ranks ``rank_offset ..`` of a group of
      ``world_size`` whose rank 0 (the trainer, hosting the TCP store at ``master_address:
      master_port``) joins concurrently; it returns once the engine joined.
      :meth:`destroy_weights_update_group` leaves it (best effort).
    - *session*: :meth:`begin_weight_update` opens an update session (False: the engine has
      none), :meth:`end_weight_update` closes it; ``version``, when given, is the version the
      buckets of this session make (an engine that sets it on close does so; others ignore
      it and take it from :meth:`update_weight_version`).
    - *announce*: :meth:`update_weights_from_distributed` announces one bucket: the engine
      receives exactly one broadcast per announced bucket, in announcement order, and the
      call answers once it received (and loaded or staged) it; an error answer names why.
    - *version*: :meth:`update_weight_version` makes the loaded weights version
      ``new_version`` (the embedded engine: switch to what it staged), never aborting
      requests. Every method raises EngineError (the engine answered no) or
      EngineUnavailable.
    """

    url: str

    async def get_server_info(self) -> dict[str, Any]: ...

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None: ...

    async def destroy_weights_update_group(
        self, group_name: str = "weight_update_group"
    ) -> None: ...

    async def begin_weight_update(self) -> bool: ...

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
    ) -> None: ...

    async def end_weight_update(self, version: str | None = None) -> bool: ...

    async def update_weight_version(self, new_version: str) -> None: ...


class AdapterControl(Protocol):
    """An engine that loads LoRA adapters by name from a folder (SGLang's
    ``/load_lora_adapter``, vLLM's ``/v1/load_lora_adapter``); requests then name one in
    ``sampling_params["lora_path"]`` (see the clients). Contract: :meth:`load_lora_adapter`
    returns once ``lora_name`` serves requests (a name already loaded is refused: EngineError
    naming it); :meth:`unload_lora_adapter` returns once ``lora_name`` is gone, which SGLang
    delays until no request uses it (new requests naming it are refused from the call on).
    Both raise EngineError (the engine answered no) or EngineUnavailable."""

    url: str

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None: ...

    async def unload_lora_adapter(self, lora_name: str) -> None: ...

    async def close(self) -> None: ...


class ManagedEngine(RolloutEngine, Protocol):
    """A RolloutEngine whose liveness can be waited for (launchers, restarts, the transport)."""

    async def wait_healthy(
        self,
        timeout_s: float,
        interval_s: float = 0.2,
        gone: Callable[[], str | None] | None = None,
    ) -> None:
        """Poll liveness until it answers, else EngineUnavailable naming the engine."""
        ...


class ControlledEngine(ManagedEngine, EngineControl, Protocol):
    """An engine as the weight transport holds it: its controls, plus the controller seam's
    pause/continue and liveness (the transport pauses generation around a push)."""


class TensorHandoff(Protocol):
    """An engine that maps tensors handed over in-host (CUDA IPC; the embedded engine)."""

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Any: ...


class TrainerLink(Protocol):
    """Trainer rank 0's end of a formed weight group (the collective transport's data path).

    Contract: :meth:`post` starts the broadcast of ``tensor`` (a bucket's bytes, ``uint8``)
    from rank 0 to every engine rank and returns at once with a handle; broadcasts reach the
    ranks in the order they were posted. :meth:`finish` blocks until the posted broadcast
    read ``tensor`` (it may be reused). :meth:`close` leaves the group (best effort). Posts
    come from one thread, finishes from another, in the same order."""

    def post(self, tensor: torch.Tensor) -> Any: ...

    def finish(self, work: Any, tensor: torch.Tensor) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class DigestReport:
    """One engine's digests compared with what it holds had it loaded exactly the pushed
    tensors: ``compared`` of its ``total`` tensors (per worker rank) compared, ``wrong`` the
    ones that differ (named)."""

    compared: int
    total: int
    wrong: list[str]


DigestCompare = Callable[
    ["Mapping[str, torch.Tensor]", dict[str, str], "int | None", int], DigestReport
]
"""``(pushed, answer, sample, seed)``: compare an engine's digest ``answer`` with the
pushed tensors (HF names, the bytes pushed); ``sample``: that many of its tensors, chosen
with ``seed``, else all. Raises ValueError naming why it cannot compute what the engine holds
(then nothing can be verified: the caller fails loudly)."""


@dataclass(frozen=True)
class WeightFamily:
    """What the weight transport must know of an engine family (built by the factory).

    ``loads_live``: buckets land in the live model as they arrive (SGLang, vLLM): whole
    tensors only, generation paused for the whole transfer, a failed push re-pushed as a
    whole new round and, failing that, the engines' weights are undefined. Otherwise the
    engine stages and commits all-or-nothing (the embedded engine). ``check`` refuses what
    the engines cannot do (given every engine's ``get_server_info`` and the pause mode) and
    answers whether the last bucket may flush the engine's cache. ``received`` says whether
    an error answer to a bucket's announcement still means the engine took part in its
    broadcast (SGLang answers 400 after receiving). ``make(url, timeout_s)`` builds one
    engine's :class:`ControlledEngine`; ``ipc``: it takes asyncrl's CUDA IPC hand-off
    (:class:`TensorHandoff`)."""

    name: str
    make: Callable[[str, float], ControlledEngine]
    loads_live: bool = False
    ipc: bool = False
    no_ipc: str = ""
    """Why ``weights.backend = "cuda-ipc"`` cannot serve this family (when not ``ipc``)."""
    check: Callable[[list[dict[str, Any]], str], bool] = lambda infos, mode: True
    received: Callable[[EngineError], bool] = lambda exc: exc.status == 200
    adapters: Callable[[str, float], AdapterControl] | None = None
    """LoRA runs: how an engine of this family loads adapter versions from a folder the
    trainer writes (SGLang, vLLM); None: adapters travel over the collective transport
    into the engine's in-memory ring (the embedded engine)."""
    digests: Callable[[ControlledEngine], Awaitable[dict[str, str]]] | None = None
    """Engines that report the sha256 of every loaded tensor (vLLM's ``/weight_checker``):
    how to ask one; ``weights.verify`` then compares them with the trainer's after each push
    (``transports/weights/send_digests.py``). None: the engine checks buckets itself (the
    embedded engine) or cannot be asked (SGLang)."""
    compare_digests: DigestCompare | None = None
    """With ``digests``: how the engine's answer follows from the pushed tensors (vLLM fuses,
    pads, shards and casts them: ``vllm/layout.py``)."""
    nccl_group: Callable[[str, int, int, str], TrainerLink] | None = None
    """``weights.backend = "nccl"``: how trainer rank 0 joins the group when the engines' ranks
    do not speak torch's NCCL process group (vLLM: its ``PyNcclCommunicator``, formed by
    vLLM's own trainer-side code). Called as ``(master_address, master_port, world_size,
    device)`` in a thread, concurrently with the engines' join calls; it returns once every
    rank joined. None: torch's own group (``collective_wire.new_weight_group``)."""
    adapter_folders_kept: bool = False
    """The folder of an unloaded adapter version stays while ``capacity`` newer versions
    load (vLLM: its unload forgets the name only, and a running request whose adapter left
    the cache reloads it from its folder); False: deleted once unloaded (SGLang reloads an
    unloaded name from its folder when a request names it, so the folder must go)."""
