"""Run configuration: frozen msgspec Structs, TOML files and dotted CLI overrides.

Every field has a default, so ``RunConfig()`` is the embedded default job. A TOML
file sets any subset of the sections below; ``--section.key=value`` overrides win
over the file. Validation errors are ``ValueError`` naming the dotted key and,
for choices, the allowed values. This module never imports torch.

Two sections are one type per backend (msgspec tagged unions, the tag being
``backend``): ``weights`` (:class:`CollectiveWeightsConfig` for ``auto`` / ``gloo`` /
``nccl`` / ``hccl``, :class:`CudaIpcWeightsConfig` for ``cuda-ipc``) and ``rollout``
(:class:`LocalRolloutConfig`, :class:`SGLangRolloutConfig`). An option of another
backend is refused, naming the backend(s) it belongs to; omitting ``backend`` keeps
the default one. Numeric limits are declared on the fields (``Annotated[int,
msgspec.Meta(gt=0)]``), checked when a config is decoded and when a section is built
in Python; non-finite floats are refused everywhere.
"""

from __future__ import annotations

import copy
import json
import math
import sys
import typing
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Final, Literal, TypeAlias

import msgspec

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "PAUSE_MODES",
    "AlgoConfig",
    "AutoWeightsConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "CollectiveWeightsConfig",
    "ControllerConfig",
    "CudaIpcWeightsConfig",
    "ExperienceConfig",
    "GlooWeightsConfig",
    "HcclWeightsConfig",
    "LocalRolloutConfig",
    "LoggingConfig",
    "ModelConfig",
    "NcclWeightsConfig",
    "PauseMode",
    "RolloutConfig",
    "RunConfig",
    "SGLangRolloutConfig",
    "TaskConfig",
    "TensorBoardConfig",
    "TraceConfig",
    "TrainerConfig",
    "WandbConfig",
    "WeightSyncConfig",
    "load_config",
]

# Declared limits (msgspec checks them on decode; _Section.__post_init__ on construction).
# Every float is bounded, which refuses NaN and infinities (NaN would reach config.json as null).
_MAX = sys.float_info.max
Positive: TypeAlias = Annotated[int, msgspec.Meta(gt=0)]
NonNegative: TypeAlias = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat: TypeAlias = Annotated[float, msgspec.Meta(gt=0, le=_MAX)]
NonNegativeFloat: TypeAlias = Annotated[float, msgspec.Meta(ge=0, le=_MAX)]
Finite: TypeAlias = Annotated[float, msgspec.Meta(ge=-_MAX, le=_MAX)]
Fraction: TypeAlias = Annotated[float, msgspec.Meta(ge=0, le=1)]
OpenFraction: TypeAlias = Annotated[float, msgspec.Meta(ge=0, lt=1)]
"""In [0, 1)."""

PauseMode: TypeAlias = Literal["abort", "retract", "in_place"]
"""How an engine pauses generation for a weight update (SGLang's ``/pause_generation`` modes,
served by the embedded engine too); see ``RolloutConfig.pause_mode``."""
PAUSE_MODES: Final[tuple[PauseMode, ...]] = typing.get_args(PauseMode)

DEFAULT_MAX_NEW_TOKENS: Final = 128
"""Generation budget of a request that names none: SGLang's default (``SamplingParams``),
which the embedded engine keeps, and the controller's when ``rollout.max_new_tokens`` is 0
and no built-in task chooses (the embedding API). See :meth:`RunConfig.generation_budget`."""


class _Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every config section: frozen, unknown keys rejected, declared limits checked.

    msgspec passes ``frozen`` and ``forbid_unknown_fields`` down to subclasses at runtime, but a
    type checker reads a ``dataclass_transform`` class's own keywords only (PEP 681), so every
    section restates ``frozen=True``: without it mypy takes the section for a mutable class.
    (``kw_only`` is not inherited by msgspec: a section's own fields may be passed by position.)

    msgspec checks a field's ``msgspec.Meta`` limits when it decodes, not when a section is
    built in Python (``ControllerConfig(batch_size=0)``): ``__post_init__`` checks them then,
    so a section that exists is within its limits. Subclasses with their own
    ``__post_init__`` call this one first.
    """

    def __post_init__(self) -> None:
        for name, tp in _limited_fields(type(self)):
            value = getattr(self, name)
            try:
                msgspec.convert(value, tp)
            except msgspec.ValidationError as exc:
                where = str(exc).partition(" - at `$")[2].rstrip("`")  # e.g. "[0]" in a tuple
                if where:
                    value = value[int(where.strip("[]"))]
                key = f"{_section_key(type(self))}.{name}{where}"
                raise ValueError(_limit_message(key, value, tp)) from None


class ModelConfig(_Section, frozen=True):
    path: str = ""
    """Local Hugging Face model directory. Empty: build (once) and use the tiny default model."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype of the trainer and the embedded engine."""


class TaskConfig(_Section, frozen=True):
    name: Literal["reverse", "math"] = "reverse"
    """Built-in task. ``reverse``: repeat n digits in reverse order; reward = fraction right;
    generation budget ``num_digits + 1`` (the digits and the end token). ``math``: prompts
    from a local JSONL/Parquet file (``path``), rendered with the model's chat template;
    reward 1 when the last integer in the response equals the answer, else 0."""
    num_digits: Positive = 2
    """Digits per prompt for the ``reverse`` task."""
    seed: int = 0
    """Seed of the prompt stream."""
    path: str = ""
    """``math``: local ``.jsonl`` or ``.parquet`` file with one problem per row."""
    prompt_key: str = "question"
    """``math``: column holding the problem text."""
    answer_key: str = "answer"
    """``math``: column holding the integer answer (``#### 42`` / ``\\boxed{42}`` also accepted)."""
    system_prompt: str = ""
    """``math``: optional system message put before each problem."""
    max_new_tokens: Positive = 512
    """``math``: generation budget per response (``rollout.max_new_tokens`` overrides it)."""
    shuffle: bool = True
    """``math``: visit the rows in a seeded random order each pass (else file order)."""
    reward_fn: str = ""
    """Custom reward ``package.module:function`` (importable, e.g. on PYTHONPATH) replacing the
    task's own; called as ``fn(sample, response_ids, response_text) -> float`` (may be
    ``async def``); ``sample.answer`` holds the row's answer (``math``) or the digits."""


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
    120 s for the embedded engine; SGLang 300 s + 20 s per GiB of weight files in the model
    folder (900 s when none is found there, e.g. a hub id)."""
    max_restarts: NonNegative = 3
    """Times the run restarts each engine it started that died (re-synced with the current
    weights before it takes requests again); one more death fails the run. 0: never."""
    pause_mode: PauseMode = "abort"
    """How engines pause for a weight update, both the trainer's pushes in ``asyncrl run``
    and ``Controller.weight_update`` (embedding API; which may also be told ``mode="wait"``:
    no new requests, the update starts once those in flight finished). ``abort``: in-flight
    requests return their partial output and the controller resumes them under the new
    weights (every token's version stays exact). ``retract`` (SGLang's mode): they go back to
    the engine's queue, their KV cache dropped, and go on under the new weights, their tokens'
    versions read from SGLang's per-request version spans (SGLang >= 0.5.22). ``in_place``:
    they stay put."""
    extra_args: tuple[str, ...] = ()
    """Extra command-line arguments of every launched engine server, passed through as they
    are (e.g. ``["--skip-tokenizer-init"]`` for SGLang, ``["--threads", "2"]`` locally)."""

    @property
    def backend(self) -> Literal["local", "sglang"]:
        """The tag: which rollout backend this is."""
        return typing.cast(Literal["local", "sglang"], self.__struct_config__.tag)


class LocalRolloutConfig(_RolloutBase, frozen=True, tag="local"):
    """``rollout.backend = "local"`` (the default): the embedded engine, started by the run."""

    device: str = "cpu"
    """Device of the embedded engine (``cpu`` or ``cuda[:i]``)."""
    max_batch_size: Positive = 256
    """Most sequences the embedded engine decodes together."""
    kv_after_update: Literal["recompute", "keep"] = "recompute"
    """``pause_mode = "in_place"``: the KV cache of requests in flight across a weight update
    is ``recompute``d under the new weights before their next token (exact; costs a prefill
    of every running sequence per update), or ``keep``t (their prefix keeps the old weights'
    keys/values, as vLLM's ``pause_generation(clear_cache=False)``; no re-prefill). Either way
    the behaviour log-probs are those sampled and a trajectory's version is its oldest
    token's."""


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


RolloutConfig: TypeAlias = LocalRolloutConfig | SGLangRolloutConfig
"""The ``rollout`` section: one type per ``rollout.backend``."""


class TrainerConfig(_Section, frozen=True):
    lr: Finite = 1.5e-3
    """AdamW learning rate."""
    weight_decay: Finite = 0.0
    """AdamW weight decay."""
    grad_clip: Finite = 1.0
    """Max global grad norm; <= 0 disables clipping."""
    micro_batch_tokens: Positive = 8192
    """Token budget of one micro-batch."""
    world_size: Positive = 1
    """Data-parallel trainer ranks (processes)."""
    device: str = "cpu"
    """``cpu`` (Gloo) or ``cuda`` (NCCL)."""
    threads: Positive = 1
    """torch intra-op threads per trainer rank on CPU."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """LR after warm-up: ``constant``, ``linear`` or ``cosine`` decay to ``lr * min_lr_ratio``."""
    warmup_steps: NonNegative = 0
    """Optimizer steps of linear LR warm-up from 0 to ``lr``."""
    decay_steps: NonNegative = 0
    """Steps (warm-up included) over which the LR decays; 0: ``controller.total_steps``."""
    min_lr_ratio: Fraction = 0.0
    """Final LR of the ``linear``/``cosine`` schedules as a fraction of ``lr``."""
    adam_betas: tuple[OpenFraction, OpenFraction] = (0.9, 0.99)
    """AdamW betas."""
    mixed_precision: Literal["none", "bf16"] = "none"
    """FSDP2 compute dtype: ``bf16`` runs forward/backward in bfloat16 over the master
    parameters (dtype ``model.dtype``) and reduces gradients in float32."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward (less memory, ~30% more compute)."""
    packing: Literal["auto", "on", "off"] = "auto"
    """Padding-free micro-batches (sequences packed in one row, position ids restarting at 0).
    ``auto``: packed when the model's attention backend supports it, padded otherwise."""
    max_restarts: NonNegative = 2
    """A trainer rank that dies restarts every rank from the last checkpoint (the steps
    after it are trained again, exactly once) at most this many times per run; 0: a trainer
    death ends the run."""
    reshard_after_forward: bool | None = None
    """FSDP2: free gathered parameters after forward (ZeRO-3); False keeps them until backward.
    None: True when more than one rank shares the model, False at world size 1."""


class AlgoConfig(_Section, frozen=True):
    name: Literal["grpo", "ppo"] = "grpo"
    """RL algorithm. ``grpo``: group-relative advantages, no critic. ``ppo``: a critic (value
    model from the same checkpoint) and GAE advantages."""
    group_size: Positive = 8
    """Samples per prompt (GRPO group; PPO samples each prompt this many times too)."""
    clip_eps: PositiveFloat = 0.2
    """PPO clip range of the surrogate objective."""
    norm_adv_by_std: bool = True
    """GRPO: divide group-centred advantages by the group's std (off = Dr.GRPO's unbiased form)."""
    behav_imp_weight_cap: Annotated[float, msgspec.Meta(ge=1, le=_MAX)] = 1.0
    """Cap of the importance weight proximal/behaviour (>= 1). 1 (V-trace style) only
    down-weights tokens the policy has moved away from and never amplifies stale ones."""
    decoupled: bool = True
    """Decoupled off-policy objective: clip against the proximal policy (the trainer's weights at
    the start of the step), weighted by the truncated ratio proximal/behaviour. Used when
    ``controller.max_staleness > 0``; at 0 the plain on-policy objective is used. ``False``:
    naive PPO clipped against the behaviour policy (the ablation)."""
    loss_agg: Literal["token-mean", "seq-mean", "token-sum-norm"] = "token-mean"
    """Loss aggregation. ``token-mean``: mean over every trained token of the batch;
    ``seq-mean``: mean over sequences of each sequence's token mean; ``token-sum-norm``:
    token sum over (sequences x max_new_tokens), Dr.GRPO's length-unbiased constant norm."""
    epochs: Positive = 1
    """Passes over each batch (the proximal policy is recomputed first when > 1 update)."""
    num_minibatches: Positive = 1
    """Optimizer steps per pass; the batch is split into this many minibatches."""
    kl_coef: NonNegativeFloat = 0.0
    """Weight of the KL penalty (k3 estimator) to the frozen initial model; 0 builds no
    reference model."""
    entropy_coef: NonNegativeFloat = 0.0
    """Weight of the entropy bonus (sample estimate -log p of the trained tokens)."""
    gamma: Fraction = 1.0
    """PPO: discount of GAE."""
    lam: Fraction = 0.95
    """PPO: GAE lambda."""
    whiten_adv: bool = True
    """PPO: normalise advantages to zero mean, unit std over the batch's trained tokens."""
    value_clip: Finite = 0.2
    """PPO: clip range of the value update around the old values; <= 0 disables it."""
    value_coef: NonNegativeFloat = 0.5
    """PPO: scale of the squared-error value loss."""
    critic_lr: NonNegativeFloat = 0.0
    """PPO: learning rate of the critic; 0 uses ``trainer.lr``."""
    critic_warmup_steps: NonNegative = 0
    """PPO: first steps that train only the critic (the actor is held)."""
    behav_clip_eps: OpenFraction = 0.2
    """Decoupled objective: behaviour-side trust region. A token whose proximal/behaviour
    ratio is already above ``1 + this`` (positive advantage) or below ``1 - this`` (negative)
    gets no gradient, so stale samples do not push tokens the intervening updates already
    moved. 0 disables it. No effect on the ``on-policy`` (staleness 0) and ``naive`` objectives."""


class ControllerConfig(_Section, frozen=True):
    batch_size: Positive = 32
    """GRPO groups (prompts) per train step."""
    max_staleness: NonNegative = 1
    """A sample generated by policy version v may train at step t only if t - v <= this."""
    total_steps: Positive = 120
    """Train steps of the run."""
    stale_policy: Literal["drop", "regenerate"] = "regenerate"
    """What happens to a group that would exceed the staleness bound at its step."""
    max_retries: NonNegative = 3
    """Retries of a failed engine request before the episode is reported failed."""
    retry_backoff_s: NonNegativeFloat = 0.05
    """First back-off before retrying a failed request on another engine; doubles per retry."""
    retry_backoff_max_s: NonNegativeFloat = 2.0
    """Upper bound of one retry back-off."""
    outage_timeout_s: PositiveFloat = 300.0
    """How long a request waits while no engine is in rotation (every engine restarting,
    re-syncing or not answering) before its episode fails; such a wait is no retry."""
    health_interval_s: PositiveFloat = 1.0
    """How often engines out of rotation are probed for liveness (``/model_info``; SGLang's
    ``/health`` runs a generation and is never used as a probe)."""
    inline_reward_s: NonNegativeFloat = 0.0002
    """A sync reward function whose calls take less than this runs on the event loop (no
    thread hop); slower ones run in a worker thread. 0: always a thread."""
    batch_requests: bool = True
    """Generation requests to one engine with identical ``input_ids`` started in the same
    event-loop turn (a GRPO group's samples of one prompt) travel as one batched
    ``/generate``: one HTTP round trip and one prefill instead of ``group_size``. Each waits
    for the slowest of its batch (a group finishes with its slowest sample anyway; a
    multi-turn episode's first turn waits for its group's). False: one request each."""


class _WeightsBase(_Section, frozen=True, tag_field="backend"):
    """What every weight-sync backend takes; ``backend`` (the tag) picks the subclass."""

    master_address: str = "127.0.0.1"
    """Address of the trainer ranks' and the weight-sync group's rendezvous (trainer rank 0)."""
    timeout_s: PositiveFloat = 300.0
    """Longest wait of weight sync on another process (a broadcast, an engine's HTTP answer, the
    group's rendezvous), per GiB moved: a wait for ``b`` bytes ends after ``timeout_s * max(1,
    b / 1 GiB)`` s with an error naming the engine(s) and the bucket. The engines keep their
    previous weights; the next push re-forms the group."""
    snapshot: bool = False
    """``false``: ``push`` returns at once and the trainer's next forward/backward overlaps the
    stream; only its next optimizer step waits until the sender has read the weights.
    ``true``: ``push`` copies every weight first (costs the trainer one copy of the model)."""
    pause_scope: Literal["commit", "transfer"] = "commit"
    """When engines pause generation: ``commit`` only around the switch to the new weights (the
    embedded engine stages buckets aside); ``transfer`` for the whole stream (SGLang, which
    loads each bucket as it arrives; always ``transfer`` with ``rollout.backend = "sglang"``)."""

    @property
    def backend(self) -> Literal["auto", "gloo", "nccl", "hccl", "cuda-ipc"]:
        """The tag: which weight-sync backend this is."""
        tag = self.__struct_config__.tag
        return typing.cast(Literal["auto", "gloo", "nccl", "hccl", "cuda-ipc"], tag)


class CollectiveWeightsConfig(_WeightsBase, frozen=True):
    """A collective group (trainer rank 0 + every engine rank) in flat buckets: the options
    of ``backend = "auto" | "gloo" | "nccl" | "hccl"`` (one subclass each)."""

    bucket_mb: Positive = 512
    """Upper bound of one flat bucket, MiB."""
    min_buckets: Positive = 8
    """A sync is cut into at least this many buckets (each still <= ``bucket_mb``), so packing,
    sending and verifying overlap from the first bucket on. 1: fill every bucket up to
    ``bucket_mb``."""
    staging_buckets: NonNegative = 0
    """Staging slots of the sender (each as large as a bucket): the packer runs ahead of the
    sends as far as they allow. 0: one per bucket (one copy of the weights; the trainer is
    released after a memcpy of the model); 2: double-buffered, least memory (the next optimizer
    step may wait for the tail of the stream)."""
    zero_copy_frac: Fraction = 0.75
    """``snapshot = false``: buckets within this leading fraction of a sync's bytes whose
    tensors already lie back to back in memory (one tensor per bucket, or a trainer with flat
    parameters) are broadcast from the tensors themselves instead of a staging copy; the
    trainer's next optimizer step waits until they have left. 0: always stage."""
    group_name: str = "asyncrl_weights"
    """Name of the weight-sync process group on the engines."""
    repush_attempts: NonNegative = 2
    """SGLang engines: how often a failed push is re-pushed (from the staged copy, engines
    still paused) before the run stops saying the engines' weights are undefined (SGLang loads
    buckets as they arrive). The embedded engine keeps its old weights instead."""
    verify: Literal["full", "sampled", "off"] = "sampled"
    """What each engine checks of every bucket before staging it (a mismatch fails the push
    and keeps the old weights). ``full``: a 64-bit checksum of every byte (one extra read of
    the weights per side; on a 2-core CPU box ~0.3x of a Gloo transfer, see
    docs/weight-sync.md). ``sampled``: the same checksum over a seeded subset of each bucket,
    every tensor's first and last bytes plus evenly spread blocks (catches a misordered,
    shifted, truncated or torn bucket, not a lone flipped bit; costs almost nothing). ``off``:
    none (TCP and NCCL protect the bytes on the wire). A delta bucket's payload is always
    checked in full (it is small), and the resulting bucket as this mode says."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Dtype floating-point weights travel in (and engines load): ``auto`` keeps each tensor's
    own; ``bfloat16`` syncs fp32 master weights as bf16 (the cast is fused into the packing)."""
    delta: Literal["off", "auto", "on"] = "off"
    """Into engines that accept deltas (the embedded engine; SGLang always gets full pushes):
    the sender keeps the bytes it pushed last (one extra copy of the synced weights in the sync
    dtype, on the trainer's device) and sends per bucket only the 8-byte words whose bits
    changed (index + word), or the whole bucket when that is smaller (``auto``, per bucket) or
    never (``on``: always the changed words). Bit-exact. A full push is forced on the first
    push, after (re)connecting, after a failed push and every ``full_every`` pushes. With
    ``delta`` on every bucket is staged (none sent in place)."""
    full_every: NonNegative = 50
    """With ``delta``: every this many pushes one is full (0: only when forced)."""


class AutoWeightsConfig(CollectiveWeightsConfig, frozen=True, tag="auto"):
    """``weights.backend = "auto"`` (the default): nccl on CUDA, hccl on an Ascend NPU, else
    gloo (resolved where the trainer runs)."""


class GlooWeightsConfig(CollectiveWeightsConfig, frozen=True, tag="gloo"):
    """``weights.backend = "gloo"``: TCP, any device (CPU tensors on the wire)."""


class NcclWeightsConfig(CollectiveWeightsConfig, frozen=True, tag="nccl"):
    """``weights.backend = "nccl"``: NVIDIA GPUs (trainer and engines on CUDA)."""


class HcclWeightsConfig(CollectiveWeightsConfig, frozen=True, tag="hccl"):
    """``weights.backend = "hccl"``: Ascend NPUs (``torch_npu``)."""


class CudaIpcWeightsConfig(_WeightsBase, frozen=True, tag="cuda-ipc"):
    """``weights.backend = "cuda-ipc"``: engines colocated on the trainer's GPU(s) copy the
    trainer's tensors through CUDA IPC handles (the embedded engine only)."""

    ipc_verify: bool = False
    """The sender sends a checksum per tensor and engines check their copies before switching.
    Off by default: the bytes never leave the GPU's memory, and the checksums cost a full extra
    read of the weights on each side (as much as the copy itself)."""
    ipc_copy: Literal["graph", "foreach"] = "graph"
    """How engines copy the trainer's tensors: ``graph`` (the per-tensor copies captured once
    per layout as a CUDA graph, then replayed: full-width copy kernels back to back; measured
    faster on an H100) or ``foreach`` (one multi-tensor copy)."""


WeightSyncConfig: TypeAlias = (
    AutoWeightsConfig | GlooWeightsConfig | NcclWeightsConfig | HcclWeightsConfig
    | CudaIpcWeightsConfig
)  # fmt: skip
"""The ``weights`` section: one type per ``weights.backend``."""


class ExperienceConfig(_Section, frozen=True):
    host: str = "127.0.0.1"
    """Address the controller binds its experience and control sockets to."""
    max_message_mb: Positive = 256
    """Largest experience message a receiver accepts, MiB."""
    transport: Literal["tcp", "ipc"] = "tcp"
    """``tcp``: bind ``tcp://{host}:<free port>`` (reachable across hosts when ``host`` is);
    ``ipc``: a Unix socket in the run folder (one host)."""
    endpoint: str = ""
    """Explicit ZeroMQ endpoint the controller binds (e.g. ``tcp://10.0.0.5:5555``); overrides
    ``host`` and ``transport``."""
    credits: Positive = 4
    """Messages one producer may have unacknowledged at one trainer rank; a producer without
    credit waits (back-pressure), so this bounds memory on both sides."""
    heartbeat_s: PositiveFloat = 1.0
    """Interval of the trainer ranks' heartbeats to the producers."""
    peer_timeout_s: PositiveFloat = 30.0
    """A trainer rank silent this long is reported lost; its unacknowledged messages stay
    pending and are redelivered if it says hello again."""
    assignment: Literal["balanced", "modulo"] = "balanced"
    """How whole GRPO groups map to trainer ranks: ``balanced`` (equal group counts, token-
    balanced, per step) or ``modulo`` (group_id mod world size, stateless)."""
    shm: Literal["auto", "on", "off"] = "auto"
    """Same-host fast path: batch payloads go through a shared-memory ring per trainer rank
    (``/dev/shm``) and ZeroMQ carries only headers. ``auto``: for every trainer rank that
    shares the controller's ``/dev/shm`` (same host; frames for the others); ``on``: the
    same, but an error where ``/dev/shm`` is missing; ``off``: always frames."""
    shm_mb: Positive = 64
    """Size of each shared-memory ring (one per producer and trainer rank), MiB; a message
    that finds no room in it goes as frames."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.peer_timeout_s <= 2 * self.heartbeat_s:
            raise ValueError(
                f"experience.peer_timeout_s ({self.peer_timeout_s}) must exceed twice "
                f"experience.heartbeat_s ({self.heartbeat_s})"
            )


class ClusterConfig(_Section, frozen=True):
    backend: Literal["local", "ray"] = "local"
    """Where the run's processes live. ``local``: child processes of ``asyncrl run`` on this
    host. ``ray``: the same processes inside Ray actors placed on a Ray cluster (install
    ``asyncrl[ray]``); every address is discovered on the node a process runs on."""
    address: str = ""
    """``ray``: the cluster to join (``ray.init(address=...)``); empty: ``RAY_ADDRESS`` or the
    cluster this node belongs to (``"auto"``)."""
    node_address: str = ""
    """``ray``: this (the driver's) node's address as the cluster knows it (Ray's
    ``_node_ip_address``); empty: Ray finds it."""
    trainer_resources: dict[str, float] = msgspec.field(default_factory=dict)
    """``ray``: extra custom resources each trainer rank's actor requires (e.g. ``{"trainer" =
    1}`` to keep trainers on nodes that offer that resource)."""
    engine_resources: dict[str, float] = msgspec.field(default_factory=dict)
    """``ray``: extra custom resources each engine's actor requires."""
    cpus_per_trainer: NonNegativeFloat = 1.0
    """``ray``: CPUs reserved per trainer rank."""
    cpus_per_engine: NonNegativeFloat = 1.0
    """``ray``: CPUs reserved per engine."""
    colocate: bool = False
    """``ray``: place engine i on the GPU(s) of trainer rank i (needed by
    ``weights.backend = "cuda-ipc"``, which works only within one GPU)."""
    start_timeout_s: PositiveFloat = 300.0
    """``ray``: how long the run waits for the cluster to place an actor."""


class CheckpointConfig(_Section, frozen=True):
    every_steps: NonNegative = 20
    """Checkpoint the whole run (trainer + controller) into ``RUN_DIR/checkpoints/step-N``
    every this many train steps (also on SIGTERM/SIGINT and at the end); 0: only at those."""
    keep: Positive = 2
    """Complete checkpoints kept (the oldest are deleted once a newer one is complete)."""
    export_hf: bool = False
    """Also export the actor as a Hugging Face folder inside every checkpoint (``hf/``); the
    final policy is always exported to ``RUN_DIR/final``."""
    on_signal: bool = True
    """SIGTERM / first SIGINT: checkpoint the run before stopping (a second signal stops at
    once)."""
    timeout_s: PositiveFloat = 600.0
    """How long the run waits for the trainer to finish writing one checkpoint."""


class TraceConfig(_Section, frozen=True):
    enabled: bool = True
    """Write the run's timeline, ``RUN_DIR/trace.json`` (Chrome / Perfetto trace events)."""
    every: Positive = 1
    """Sampling for long runs: trace the work of every ``every``-th step (policy version)."""
    max_mb: PositiveFloat = 512.0
    """Each process stops tracing once its file holds this many MB (and marks where)."""


class TensorBoardConfig(_Section, frozen=True):
    enabled: bool = False
    """Also log every metric to TensorBoard (the ``tensorboard`` extra)."""
    log_dir: str = ""
    """Event file folder; empty: ``RUN_DIR/tensorboard``."""


class WandbConfig(_Section, frozen=True):
    enabled: bool = False
    """Also log every metric to Weights & Biases (the ``wandb`` extra)."""
    project: str = "asyncrl"
    name: str = ""
    """The W&B run's name; empty: the run folder's name."""
    mode: Literal["online", "offline"] = "online"
    """``offline``: write the run under ``RUN_DIR/wandb`` only (``wandb sync`` uploads it)."""
    entity: str = ""


class LoggingConfig(_Section, frozen=True):
    trace: TraceConfig = msgspec.field(default_factory=TraceConfig)
    tensorboard: TensorBoardConfig = msgspec.field(default_factory=TensorBoardConfig)
    wandb: WandbConfig = msgspec.field(default_factory=WandbConfig)


class RunConfig(_Section, frozen=True):
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    task: TaskConfig = msgspec.field(default_factory=TaskConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=LocalRolloutConfig)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    algo: AlgoConfig = msgspec.field(default_factory=AlgoConfig)
    controller: ControllerConfig = msgspec.field(default_factory=ControllerConfig)
    weights: WeightSyncConfig = msgspec.field(default_factory=AutoWeightsConfig)
    experience: ExperienceConfig = msgspec.field(default_factory=ExperienceConfig)
    cluster: ClusterConfig = msgspec.field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = msgspec.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)
    run_dir: str = ""
    """Output folder (metrics.jsonl, config.json, logs). Empty: a new folder under ``runs/``."""
    seed: int = 0
    """Seed of model init, sampling and training."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.rollout, SGLangRolloutConfig) and isinstance(
            self.weights, CudaIpcWeightsConfig
        ):
            raise ValueError(
                "weights.backend='cuda-ipc' works with rollout.backend='local' only: SGLang's "
                "scheduler dies on asyncrl's CUDA IPC descriptor (load_format='asyncrl_ipc'); "
                "use weights.backend='nccl' (or 'auto') with rollout.backend='sglang'"
            )

    def generation_budget(self) -> int:
        """Most response tokens of one episode of a built-in task (the one rule; the embedding
        API's episodes get ``rollout.max_new_tokens or DEFAULT_MAX_NEW_TOKENS``):
        ``rollout.max_new_tokens`` when set, else the task's own: ``num_digits + 1`` for
        ``reverse`` (the digits and the end token), ``task.max_new_tokens`` for ``math``."""
        if self.rollout.max_new_tokens > 0:
            return self.rollout.max_new_tokens
        if self.task.name == "reverse":
            return self.task.num_digits + 1
        return self.task.max_new_tokens


_RETIRED = {
    "controller.pause_mode": "rollout.pause_mode (one knob for the run's pushes and "
    "Controller.weight_update; pass mode='wait' to Controller.weight_update for a drain)"
}
"""Keys of earlier versions -> where they went: named when given, dropped from a recorded
config.json (``--resume`` of a run made by an earlier version)."""


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def _section_types(tp: Any) -> tuple[type[msgspec.Struct], ...]:
    """The section type(s) a field's type holds: itself, a tagged union's members, or ()."""
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return (tp,)
    args = typing.get_args(tp)
    if args and all(isinstance(a, type) and issubclass(a, msgspec.Struct) for a in args):
        return args
    return ()


def _tag(cls: type[msgspec.Struct]) -> Any:
    return cls.__struct_config__.tag


@cache
def _default_variant(field: str) -> type[msgspec.Struct]:
    """The member of the tagged union ``RunConfig.<field>`` used when ``backend`` is omitted."""
    return type(getattr(RunConfig(), field))


def _variant(tp: Any, node: Any, field: str) -> type[msgspec.Struct] | None:
    """The section type a value of type ``tp`` (the field ``field``) decodes to, ``node`` being
    its tree: a tagged union's member named by the tree's ``backend`` (or the default one)."""
    types = _section_types(tp)
    if len(types) <= 1:
        return types[0] if types else None
    tag = node.get("backend") if isinstance(node, dict) else None
    chosen = [t for t in types if _tag(t) == tag]
    return chosen[0] if chosen else _default_variant(field)


def _walk(tree: dict[str, Any], path: list[str]) -> tuple[Any, type[msgspec.Struct] | None]:
    """(the type at ``path``, or None when the path leaves the config; the section type holding
    its last key). A tagged union resolves to the member the tree chooses."""
    tp: Any = RunConfig
    node: Any = tree
    parent: type[msgspec.Struct] | None = None
    for i, part in enumerate(path):
        parent = _variant(tp, node, path[i - 1] if i else "")
        if parent is None or part not in parent.__struct_fields__:
            return None, parent
        tp = _hints(parent)[part]
        node = node.get(part) if isinstance(node, dict) else None
    return tp, parent


@cache
def _section_key(cls: type) -> str:
    """The dotted key of the section type ``cls`` in RunConfig (``logging.trace``)."""

    def find(tp: type, prefix: str) -> str | None:
        for name, hint in _hints(tp).items():
            for member in _section_types(hint):
                if issubclass(member, cls):
                    return prefix + name
                found = find(member, f"{prefix}{name}.")
                if found:
                    return found
        return None

    return find(RunConfig, "") or cls.__name__


def _has_limit(tp: Any) -> bool:
    if typing.get_origin(tp) is Annotated:
        return True
    return any(_has_limit(a) for a in typing.get_args(tp) if not isinstance(a, str))


@cache
def _limited_fields(cls: type) -> tuple[tuple[str, Any], ...]:
    """The fields of ``cls`` with declared limits, and their (annotated) types."""
    return tuple((n, tp) for n, tp in _hints(cls).items() if _has_limit(tp))


def _limit_message(key: str, value: Any, tp: Any) -> str:
    """One line for ``value`` outside the limits declared on its field's type ``tp``."""
    try:
        finite = math.isfinite(float(value))
    except (TypeError, ValueError):
        finite = True
    meta = _meta(tp)
    if not finite or meta is None:
        return f"{key} must be a finite number, got {value!r}"
    return f"{key} must be {_bounds(meta)}, got {value!r}"


def _meta(tp: Any) -> msgspec.Meta | None:
    """The ``msgspec.Meta`` declared in ``tp`` (``Annotated``, also inside ``X | None`` and
    ``tuple[X, X]``)."""
    if typing.get_origin(tp) is Annotated:
        return next((m for m in tp.__metadata__ if isinstance(m, msgspec.Meta)), None)
    metas = (_meta(a) for a in typing.get_args(tp) if not isinstance(a, str))
    return next((m for m in metas if m is not None), None)


def _bounds(meta: msgspec.Meta) -> str:
    """``> 0``, ``>= 1``, ``in [0, 1)``: the limits of ``meta`` (the float range's own ends,
    which only keep out infinities, left unsaid)."""
    lo = f"[{meta.ge:g}" if meta.ge is not None and meta.ge > -_MAX else None
    lo = f"({meta.gt:g}" if meta.gt is not None else lo
    hi = f"{meta.le:g}]" if meta.le is not None and meta.le < _MAX else None
    hi = f"{meta.lt:g})" if meta.lt is not None else hi
    if lo and hi:
        return f"in {lo}, {hi}"
    if lo:
        return (">= " if lo[0] == "[" else "> ") + lo[1:]
    if hi:
        return ("<= " if hi[-1] == "]" else "< ") + hi[:-1]
    return "a finite number"


def _allowed(tree: dict[str, Any], path: list[str]) -> str:
    """Describe the allowed values (or keys) at a dotted path of RunConfig."""
    tp, parent = _walk(tree, path)
    if tp is None:
        if parent is not None and path[-1] == parent.__struct_config__.tag_field:  # backend
            union = _section_types(_hints(RunConfig)[path[0]])
            return "allowed values: " + ", ".join(repr(_tag(t)) for t in union)
        if parent is not None and len(path) > 0:
            return "allowed keys: " + ", ".join(_keys(parent))
        return ""
    if typing.get_origin(tp) is Literal:
        return "allowed values: " + ", ".join(repr(a) for a in typing.get_args(tp))
    types = _section_types(tp)
    if len(types) == 1:
        return "allowed keys: " + ", ".join(_keys(types[0]))
    return ""


def _keys(cls: type[msgspec.Struct]) -> tuple[str, ...]:
    tag = cls.__struct_config__.tag_field
    return ((tag,) if tag else ()) + cls.__struct_fields__


def _backend_error(tree: dict[str, Any], path: list[str]) -> str | None:
    """``weights.ipc_copy='foreach' applies to weights.backend = 'cuda-ipc' only; ...``: the
    unknown key ``path`` is an option of other members of its tagged union."""
    if len(path) != 2:
        return None
    section, name = path
    types = _section_types(_hints(RunConfig).get(section))
    owners = [repr(_tag(t)) for t in types if name in t.__struct_fields__]
    if len(types) < 2 or not owners:
        return None
    node = tree.get(section, {})
    value, chosen = node.get(name), _variant(_hints(RunConfig)[section], node, section)
    return (
        f"{section}.{name}={value!r} applies to {section}.backend = {' | '.join(owners)} only; "
        f"this run has {section}.backend={_tag(chosen) if chosen else None!r}"
    )


def _fill_backends(tree: dict[str, Any]) -> None:
    """A tagged-union section given without ``backend`` is the default backend's."""
    for name, hint in _hints(RunConfig).items():
        node = tree.get(name)
        if len(_section_types(hint)) > 1 and isinstance(node, dict) and "backend" not in node:
            tree[name] = {"backend": _tag(_default_variant(name)), **node}


def _drop_recorded_extras(tree: dict[str, Any], given: set[str]) -> None:
    """A recorded config.json (``base``) keeps what still applies: the options of the backend
    now chosen (an override may switch it) and no retired key; keys the user gives are kept
    (and judged)."""
    for key in _RETIRED:
        section, _, name = key.partition(".")
        if key not in given and isinstance(tree.get(section), dict):
            tree[section].pop(name, None)
    for name, hint in _hints(RunConfig).items():
        node = tree.get(name)
        if len(_section_types(hint)) < 2 or not isinstance(node, dict):
            continue
        chosen = _variant(hint, node, name)
        assert chosen is not None
        for key in [k for k in node if k not in _keys(chosen) and f"{name}.{k}" not in given]:
            del node[key]


def _lookup(tree: Any, path: list[str]) -> Any:
    for part in path:
        if isinstance(tree, dict):
            tree = tree.get(part)
        elif isinstance(tree, list | tuple) and part.isdigit() and int(part) < len(tree):
            tree = tree[int(part)]
        else:
            return None
    return tree


def _parse_value(text: str) -> Any:
    """CLI values: JSON when they parse as JSON (numbers, bools, lists), else the raw string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _as_list_if_listed(tree: dict[str, Any], key: str, value: Any) -> Any:
    """A plain string given for a list-valued key (``--rollout.urls=http://a:1,http://b:2``)
    is its comma-separated items; anything else (JSON lists too) is kept."""
    if not isinstance(value, str):
        return value
    tp, _ = _walk(tree, key.split("."))  # None: msgspec names the unknown key
    if typing.get_origin(tp) in (tuple, list):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            node[part] = child = {}
        if not isinstance(child, dict):
            raise ValueError(f"--{'.'.join(parts[: i + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _convert(tree: dict[str, Any]) -> RunConfig:
    _fill_backends(tree)
    try:
        return msgspec.convert(tree, RunConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ValueError(_error_line(tree, str(exc))) from None


def _error_line(tree: dict[str, Any], msg: str) -> str:
    """msgspec's ``... - at `$.section.key``` as one line that starts with the dotted key."""
    own = msg.split(" - at `$", 1)[0]
    if own.split(".", 1)[0] in RunConfig.__struct_fields__:  # a check of ours names its key
        return own
    path: list[str] = []
    if "at `$." in msg:
        dotted = msg.rsplit("at `$.", 1)[1].rstrip("`")
        path = [p for p in dotted.replace("[", ".").replace("]", "").split(".") if p]
    if "unknown field" in msg:
        path = [*path, msg.split("`")[1]]
        key = ".".join(path)
        if key in _RETIRED:
            return f"{key} is now {_RETIRED[key]}"
        return _backend_error(tree, path) or _invalid(tree, path, msg)
    if own.startswith("Expected `") and "` " in own:  # a declared limit: "Expected `int` >= 1"
        tp, _ = _walk(tree, [p for p in path if not p.isdigit()])
        return _limit_message(_dotted(path), _lookup(tree, path), tp)
    return _invalid(tree, path, msg)


def _dotted(path: list[str]) -> str:
    """``["trainer", "adam_betas", "0"]`` -> ``trainer.adam_betas[0]``."""
    return "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in path).lstrip(".")


def _invalid(tree: dict[str, Any], path: list[str], msg: str) -> str:
    hint = _allowed(tree, path)
    return f"invalid config key {_dotted(path) or '<root>'}: {msg}" + (f" ({hint})" if hint else "")


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    base: dict[str, Any] | None = None,
) -> RunConfig:
    """Build a RunConfig from an optional TOML file (or a ``base`` tree, e.g. a run's
    config.json) and ``section.key=value`` overrides.

    Raises ValueError naming the offending key for unknown keys, wrong types,
    out-of-range values, disallowed choices and options of another backend.
    """
    tree: dict[str, Any] = copy.deepcopy(base or {})
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file not found: {p}")
        try:
            tree = msgspec.toml.decode(p.read_bytes())
        except msgspec.DecodeError as exc:
            raise ValueError(f"{p}: not valid TOML: {exc}") from None
    given: set[str] = set()
    for item in overrides or []:
        key, sep, value = item.removeprefix("--").partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} must look like --section.key=value")
        _set_dotted(tree, key, _as_list_if_listed(tree, key, _parse_value(value)))
        given.add(key)
    if base is not None:
        _drop_recorded_extras(tree, given)
    return _convert(tree)


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    """Plain JSON-able dict of a config (for config.json in the run folder); ``backend`` is
    written in the ``weights`` and ``rollout`` sections."""
    return msgspec.to_builtins(cfg)
