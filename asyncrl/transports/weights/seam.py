"""The seam between the weight transport and the engine families: what a sender needs of
the engines it pushes to, written once here and implemented by each family
(``engines/rollout/{sglang,vllm,local}/family.py``), which the caller hands in.

Nothing under ``transports/`` imports ``asyncrl.engines``: the transport moves bytes
(buckets, links, deadlines, re-pushes) and reaches an engine only through
:class:`WeightAdapter` (its family: load format, flush rule, chunking, error
classification, CUDA IPC and LoRA) and the :class:`WeightEngine` it builds (one engine's
controls). The engines' errors are defined here too, at the lowest layer that raises
them; ``engines/rollout/base.py`` re-exports them for everyone else.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

if TYPE_CHECKING:
    import torch

    from asyncrl.transports.weights.bucket import BucketManifest

__all__ = [
    "AdapterControl",
    "BucketAnnouncement",
    "DigestCompare",
    "DigestReport",
    "EngineBadRequest",
    "EngineControl",
    "EngineError",
    "EngineUnavailable",
    "GroupSpec",
    "Liveness",
    "TensorHandoff",
    "TensorLoad",
    "TrainerLink",
    "WeightAdapter",
    "WeightEngine",
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


class GroupSpec(msgspec.Struct, frozen=True):
    """The weight group an engine joins (:meth:`EngineControl.init_weights_update_group`):
    its ranks are ``rank_offset ..`` of a group of ``world_size`` whose rank 0 (the trainer)
    hosts the TCP store at ``master_address:master_port``; ``group_name`` names the group
    in later calls, ``backend`` is torch's process-group backend. Each family writes it in
    its own wire (SGLang's ``/init_weights_update_group`` body holds exactly these
    fields)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class BucketAnnouncement(msgspec.Struct, frozen=True):
    """One bucket announced to an engine (:meth:`EngineControl.update_weights_from_distributed`):
    the tensors its one broadcast carries (``names``, ``dtypes``, ``shapes``, in order) over
    group ``group_name``. ``flush_cache``: the engine may flush its cache after loading it
    (the push's last bucket); ``weight_version``: the version set with it (None: set later);
    ``load_format``: how the engine reads the broadcast (None: its default); ``extra``:
    fields the engine ignores unless it knows them (asyncrl's bucket manifest). Each family
    writes what its wire takes of it (SGLang: all of it; vLLM: names, dtypes, shapes)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    weight_version: str | None = None
    load_format: str | None = None
    extra: dict[str, Any] | None = None


class EngineControl(Protocol):
    """One engine's weight-group routes, as its family's client speaks them.

    The vocabulary is the one SGLang serves (and the embedded engine); the vLLM family maps
    it onto vLLM 0.33's RL routes (``vllm/control.py``). Only the engine's own
    :class:`WeightAdapter` calls :meth:`update_weights_from_distributed` (it owns the load
    format); the transport calls the rest. Contract:

    - *form*: :meth:`get_server_info` tells how many ranks the engine joins the weight
      group with (``tp_size``: all of its ranks) and its release (``version``);
      :meth:`init_weights_update_group` joins them to the :class:`GroupSpec`'s group, whose
      rank 0 (the trainer) joins concurrently; it returns once the engine joined.
      :meth:`destroy_weights_update_group` leaves it (best effort).
    - *session*: :meth:`begin_weight_update` opens an update session (False: the engine has
      none), :meth:`end_weight_update` closes it; ``version``, when given, is the version the
      buckets of this session make (an engine that sets it on close does so; others ignore
      it and take it from :meth:`update_weight_version`).
    - *announce*: :meth:`update_weights_from_distributed` announces one bucket
      (:class:`BucketAnnouncement`): the engine
      receives exactly one broadcast per announced bucket, in announcement order, and the
      call answers once it received (and loaded or staged) it; an error answer names why.
    - *version*: :meth:`update_weight_version` makes the loaded weights version
      ``new_version`` (the embedded engine: switch to what it staged), never aborting
      requests. Every method raises EngineError (the engine answered no) or
      EngineUnavailable.
    """

    url: str

    async def get_server_info(self) -> dict[str, Any]: ...

    async def init_weights_update_group(self, group: GroupSpec) -> None: ...

    async def destroy_weights_update_group(
        self, group_name: str = "weight_update_group"
    ) -> None: ...

    async def begin_weight_update(self) -> bool: ...

    async def update_weights_from_distributed(self, bucket: BucketAnnouncement) -> None: ...

    async def end_weight_update(self, version: str | None = None) -> bool: ...

    async def update_weight_version(self, new_version: str) -> None: ...


class Liveness(Protocol):
    """An engine whose liveness can be waited for (launchers, restarts, the transport):
    :meth:`wait_healthy` polls it until it answers, else EngineUnavailable naming the engine
    (after ``timeout_s``, or at once when ``gone``, asked between polls, returns a reason)."""

    async def wait_healthy(
        self,
        timeout_s: float,
        interval_s: float = 0.2,
        gone: Callable[[], str | None] | None = None,
    ) -> None: ...


class WeightEngine(EngineControl, Liveness, Protocol):
    """An engine as the weight transport holds it: its weight-group routes plus generation's
    pause and resume (around a push) and liveness (before forming). ``pause_generation``
    stops scheduling (``abort``: in-flight requests return at once; other modes keep them),
    ``continue_generation`` resumes; ``close`` releases the client's connections."""

    async def pause_generation(self, mode: str = "abort") -> None: ...

    async def continue_generation(self) -> None: ...

    async def close(self) -> None: ...


class AdapterControl(Protocol):
    """An engine that loads LoRA adapters by name from a folder (SGLang's
    ``/load_lora_adapter``, vLLM's ``/v1/load_lora_adapter``); requests then name one in
    ``sampling_params["lora_path"]`` (see the clients). Contract: :meth:`load_lora_adapter`
    returns once ``lora_name`` serves requests (a name already loaded is refused: EngineError
    naming it); :meth:`unload_lora_adapter` returns once ``lora_name`` is gone, which SGLang
    delays until no request uses it (new requests naming it are refused from the call on).
    Both raise EngineError (the engine answered no) or EngineUnavailable.
    :meth:`refusal` classifies such an EngineError in the family's own words: ``"held"``
    (the name is loaded already), ``"gone"`` (the name is not loaded), ``"incomplete"`` (a
    load refused after a partial unload, which the engine expects retried), else ``""``."""

    url: str

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None: ...

    async def unload_lora_adapter(self, lora_name: str) -> None: ...

    def refusal(self, exc: EngineError) -> str: ...

    async def close(self) -> None: ...


class TensorLoad(msgspec.Struct, frozen=True):
    """Tensors handed over in-host (:meth:`TensorHandoff.update_weights_from_tensor`):
    ``serialized_named_tensors``, one base64 string per TP rank (may be empty when ``extra``
    describes the hand-off); the other fields as :class:`BucketAnnouncement`'s."""

    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    weight_version: str | None = None
    extra: dict[str, Any] | None = None


class TensorHandoff(Protocol):
    """An engine that maps tensors handed over in-host (CUDA IPC; the embedded engine):
    :meth:`update_weights_from_tensor` loads them and returns the engine's answer."""

    async def update_weights_from_tensor(self, load: TensorLoad) -> Any: ...


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


class WeightAdapter(Protocol):
    """One engine family's side of weight sync, as the transport uses it (built by the
    family, handed to the sender by its caller).

    Contract, attributes: ``name`` names the family in errors. ``loads_live``: buckets land
    in the live model as they arrive (SGLang, vLLM): whole tensors only, generation paused
    for the whole transfer, a failed push re-pushed as a whole new round and, failing
    that, the engines' weights are undefined; False: the engine stages and commits
    all-or-nothing (the embedded engine). ``no_ipc``: why ``weights.backend = "cuda-ipc"``
    cannot serve the family (empty: it takes the CUDA IPC hand-off,
    :class:`TensorHandoff`). ``adapters``: how an engine of the family loads LoRA adapter
    versions from a folder the trainer writes (None: adapters travel over the collective
    transport, as the embedded engine takes them); ``adapter_folders_kept``: an unloaded
    version's folder must stay while newer ones load (vLLM reloads from it), else it is
    deleted once unloaded (SGLang would reload it). ``compare_digests``: engines that
    report every loaded tensor's digest (vLLM): how their answer follows from the pushed
    tensors (None: not verifiable this way).

    Methods: :meth:`engine` builds one engine's :class:`WeightEngine`; :meth:`check`
    refuses what the engines cannot do (given each engine's ``get_server_info`` and the
    pause mode, ValueError) and answers whether the last bucket may flush their cache;
    :meth:`announce` announces one bucket to an engine in the family's load format (its
    answer once the engine received it); :meth:`received` says whether an error answer to
    an announcement still means the engine took part in the bucket's broadcast;
    :meth:`trainer_link` is rank 0's join when the family's ranks do not speak torch's
    process group for ``backend`` (None: torch's group); :meth:`digests` asks one engine for
    its digests (only when ``compare_digests`` is set).
    """

    name: str
    loads_live: bool
    no_ipc: str
    adapters: Callable[[str, float], AdapterControl] | None
    adapter_folders_kept: bool
    compare_digests: DigestCompare | None

    def engine(self, url: str, timeout_s: float) -> WeightEngine: ...

    def check(self, infos: list[dict[str, Any]], pause_mode: str) -> bool: ...

    def announce(
        self, engine: WeightEngine, m: BucketManifest, group_name: str, flush: bool
    ) -> Coroutine[Any, Any, None]: ...

    def received(self, exc: EngineError) -> bool: ...

    def trainer_link(
        self, backend: str, address: str, port: int, world: int, device: str
    ) -> TrainerLink | None: ...

    def digests(self, engine: WeightEngine) -> Awaitable[dict[str, str]]: ...
