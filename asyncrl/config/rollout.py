"""The ``rollout`` section: one config type per rollout backend (tag ``backend``)."""

from __future__ import annotations

import typing
from typing import Annotated, Final, Literal, TypeAlias

import msgspec

from asyncrl.config.base import (
    NonNegative,
    NonNegativeFloat,
    OpenFraction,
    Positive,
    PositiveFloat,
    _Section,
)

PauseMode: TypeAlias = Literal["abort", "retract", "in_place"]
"""How an engine pauses generation for a weight update (SGLang's ``/pause_generation`` modes,
served by the embedded engine too); see ``RolloutConfig.pause_mode``."""
PAUSE_MODES: Final[tuple[PauseMode, ...]] = typing.get_args(PauseMode)
VLLMPauseMode: TypeAlias = Literal["keep", "abort", "wait"]
"""vLLM 0.33's ``/pause?mode=`` modes (vllm/entrypoints/rl/online/api_router.py:31-75)."""
VLLM_PAUSE_MODES: Final[tuple[VLLMPauseMode, ...]] = typing.get_args(VLLMPauseMode)

DEFAULT_MAX_NEW_TOKENS: Final = 128
"""Generation budget of a request that names none: SGLang's default (``SamplingParams``),
which the embedded engine keeps, and the controller's when ``rollout.max_new_tokens`` is 0
and no built-in task chooses (the embedding API). See :meth:`RunConfig.generation_budget`."""


class _RolloutBase(_Section, frozen=True, tag_field="backend"):
    """What every rollout backend takes; ``backend`` (the tag) picks the subclass."""

    urls: tuple[str, ...] = ()
    """Engines already running elsewhere (``http://host:port``). Empty: the run starts them."""
    num_engines: Positive = 1
    """Engines the run starts when ``urls`` is empty."""
    host: str = "127.0.0.1"
    """Address the engines the run starts bind to."""
    temperature: PositiveFloat = 1.0
    """Sampling temperature of rollouts."""
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    """Nucleus sampling mass of rollouts, in (0, 1]."""
    max_new_tokens: NonNegative = 0
    """Generation budget per episode; 0: the built-in task's own (see ``task.name``), or
    ``DEFAULT_MAX_NEW_TOKENS`` (128) for episodes of the embedding API."""
    request_timeout_s: PositiveFloat = 120.0
    """Timeout of one HTTP request to an engine."""
    startup_timeout_s: PositiveFloat | None = None
    """How long the run waits for an engine to become healthy. Unset: scaled to the model:
    120 s for the embedded engine; SGLang and vLLM 300 s + 20 s per GiB of weight files in the model
    folder (900 s when none is found there, e.g. a hub id). Engines of ``urls`` that refuse
    connections for 5 s fail the run before anything starts unless this is set (engines
    started together with the run: their port opens once they are up)."""
    max_restarts: NonNegative = 3
    """Times the run restarts each engine it started that died (re-synced with the current
    weights before it takes requests again) in any ``restart_window_s``; one more death in
    that window takes the engine out of the run (the run fails when none is left). 0: never."""
    restart_window_s: NonNegativeFloat = 600.0
    """The window of ``max_restarts``, per engine; 0: ``max_restarts`` per run."""
    pause_mode: PauseMode = "abort"
    """How engines pause for a weight update, both the trainer's pushes in ``asyncrl run``
    and ``Controller.weight_update`` (embedding API; which may also be told ``mode="wait"``:
    no new requests, the update starts once those in flight finished). ``abort``: in-flight
    requests return their partial output and the controller resumes them under the new
    weights (every token's version stays exact). ``retract`` (SGLang's mode): they go back to
    the engine's queue, their KV cache dropped, and go on under the new weights, their tokens'
    versions read from SGLang's per-request version spans (SGLang >= 0.5.22). ``in_place``:
    they stay put. Default per backend: ``abort`` (SGLang: the one mode whose per-token
    versions every supported SGLang reports), ``in_place`` (embedded engine), ``keep``
    (vLLM)."""
    extra_args: tuple[str, ...] = ()
    """Extra command-line arguments of every launched engine server, passed through as they
    are (e.g. ``["--skip-tokenizer-init"]`` for SGLang, ``["--threads", "2"]`` locally)."""

    @property
    def backend(self) -> Literal["local", "sglang", "vllm"]:
        """The tag: which rollout backend this is."""
        return typing.cast(Literal["local", "sglang", "vllm"], self.__struct_config__.tag)

    @property
    def pause_modes(self) -> tuple[str, ...]:
        """The ``pause_mode`` values this backend's engines take."""
        return PAUSE_MODES


class LocalRolloutConfig(_RolloutBase, frozen=True, tag="local"):
    """``rollout.backend = "local"`` (the default): the embedded engine, started by the run."""

    device: str = "cpu"
    """Device of the embedded engine (``cpu`` or ``cuda[:i]``)."""
    max_batch_size: Positive = 256
    """Most sequences the embedded engine decodes together."""
    pause_mode: PauseMode = "in_place"
    """The embedded engine pauses ``in_place`` by default (with ``kv_after_update = "keep"``,
    vLLM's way): requests in flight across an update are neither aborted nor re-prefilled,
    each token keeps the version that sampled it and its sampled log-prob (what the
    off-policy correction divides by). ``abort`` re-prefills every request in flight at every
    update (measured: 1.62x vs 2.02x sync's throughput on the longtail workload at staleness
    2; docs/algorithms.md, "Pausing for an update")."""
    kv_after_update: Literal["recompute", "keep"] = "keep"
    """``pause_mode = "in_place"``: the KV cache of requests in flight across a weight update
    is ``keep``t (default: their prefix keeps the old weights' keys/values, as vLLM's
    ``pause_generation(clear_cache=False)``; no re-prefill), or ``recompute``d under the new
    weights before their next token (costs a prefill of every running sequence per update).
    Either way the behaviour log-probs are those sampled, each token's version is the one
    whose weights ran its step, and a trajectory's version is its oldest token's. Engines the
    run starts get it as ``--kv-after-update``; a server started by hand (``rollout.urls``)
    keeps its own flag (default ``recompute``)."""


class SGLangRolloutConfig(_RolloutBase, frozen=True, tag="sglang"):
    """``rollout.backend = "sglang"``: SGLang servers (launched by the run, or ``urls``)."""

    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """``--dtype`` of launched SGLang servers. ``auto``: ``bfloat16`` for a checkpoint stored
    in float32 or of unknown dtype (SGLang's own ``auto`` would serve it in float16), else
    SGLang's ``auto`` (as stored). The embedded engine always uses ``model.dtype``."""
    sglang_entrypoint: Literal["auto", "serve", "launch_server"] = "auto"
    """How launched SGLang servers start: ``serve`` (``sglang serve``, SGLang's recommended
    entry point), ``launch_server`` (``python -m sglang.launch_server``, deprecated where
    ``serve`` exists). ``auto``: ``serve`` when the installed SGLang declares the ``sglang``
    console script, else ``launch_server``."""
    tp_size: Positive = 1
    """GPUs per launched SGLang server (``--tp-size``)."""
    mem_fraction_static: OpenFraction = 0.0
    """SGLang's ``--mem-fraction-static`` of launched servers, in (0, 1); 0 keeps SGLang's
    default."""


class VLLMRolloutConfig(_RolloutBase, frozen=True, tag="vllm"):
    """``rollout.backend = "vllm"``: vLLM 0.33 servers with its RL API (launched by the run
    with ``VLLM_SERVER_DEV_MODE=1``, or ``urls`` of servers started so)."""

    pause_mode: VLLMPauseMode = "keep"  # type: ignore[assignment]
    """How vLLM pauses for a weight update (``/pause?mode=``): ``keep`` (default) freezes
    in-flight requests with their KV cache and resumes them after the update (no abort;
    each token's version from vLLM's ``weight_versions`` spans); ``abort`` returns them
    partial (resumed by their episodes); ``wait`` lets them finish first. Under ``abort``
    and ``wait`` vLLM answers new requests 503 until it resumes: the client waits and
    retries, it does not fail."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """``--dtype`` of launched vLLM servers. ``auto``: ``bfloat16`` for a checkpoint stored
    in float32 or of unknown dtype, else vLLM's ``auto`` (as stored)."""
    tp_size: Positive = 1
    """GPUs per launched vLLM server (``--tensor-parallel-size``)."""
    gpu_memory_utilization: OpenFraction = 0.0
    """vLLM's ``--gpu-memory-utilization`` of launched servers, in (0, 1); 0 keeps vLLM's
    default."""
    retry_503_s: PositiveFloat = 600.0
    """How long a request answered 503 (vLLM paused in ``abort``/``wait`` mode) is retried
    before it fails with EngineUnavailable."""

    @property
    def pause_modes(self) -> tuple[str, ...]:
        return VLLM_PAUSE_MODES


RolloutConfig: TypeAlias = LocalRolloutConfig | SGLangRolloutConfig | VLLMRolloutConfig
"""The ``rollout`` section: one type per ``rollout.backend``."""
