"""Run configuration: frozen msgspec Structs, TOML files and dotted CLI overrides.

Every field has a default, so ``RunConfig()`` is the embedded default job. A TOML
file sets any subset of the sections below; ``--section.key=value`` overrides win
over the file. Validation errors are ``ValueError`` naming the dotted key and,
for choices, the allowed values. This module never imports torch.
"""

from __future__ import annotations

import json
import math
import typing
from pathlib import Path
from typing import Any, Literal

import msgspec

__all__ = [
    "AlgoConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "ControllerConfig",
    "ExperienceConfig",
    "LoggingConfig",
    "ModelConfig",
    "RolloutConfig",
    "RunConfig",
    "TaskConfig",
    "TensorBoardConfig",
    "TraceConfig",
    "TrainerConfig",
    "WandbConfig",
    "WeightSyncConfig",
    "load_config",
]


class _Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every config section: frozen, unknown keys rejected.

    msgspec passes ``frozen`` and ``forbid_unknown_fields`` down to subclasses at runtime, but a
    type checker reads a ``dataclass_transform`` class's own keywords only (PEP 681), so every
    section restates ``frozen=True``: without it mypy takes the section for a mutable class.
    (``kw_only`` is not inherited by msgspec: a section's own fields may be passed by position.)
    """


class ModelConfig(_Section, frozen=True):
    path: str = ""
    """Local Hugging Face model directory. Empty: build (once) and use the tiny default model."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype of the trainer and the embedded engine."""


class TaskConfig(_Section, frozen=True):
    name: Literal["reverse", "math"] = "reverse"
    """Built-in task. ``reverse``: repeat n digits in reverse order; reward = fraction right.
    ``math``: prompts from a local JSONL/Parquet file (``path``), rendered with the model's chat
    template; reward 1 when the last integer in the response equals the answer, else 0."""
    num_digits: int = 2
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
    max_new_tokens: int = 512
    """``math``: generation budget per response (``rollout.max_new_tokens`` overrides it)."""
    shuffle: bool = True
    """``math``: visit the rows in a seeded random order each pass (else file order)."""
    reward_fn: str = ""
    """Custom reward ``package.module:function`` (importable, e.g. on PYTHONPATH) replacing the
    task's own; called as ``fn(sample, response_ids, response_text) -> float`` (may be
    ``async def``); ``sample.answer`` holds the row's answer (``math``) or the digits."""


class RolloutConfig(_Section, frozen=True):
    backend: Literal["local", "sglang"] = "local"
    """``local``: the embedded engine (started by the run); ``sglang``: SGLang servers."""
    urls: tuple[str, ...] = ()
    """Engines already running elsewhere (``http://host:port``). Empty: the run starts them."""
    num_engines: int = 1
    """Embedded engines the run starts when ``urls`` is empty."""
    host: str = "127.0.0.1"
    """Address the embedded engines bind to."""
    device: str = "cpu"
    """Device of the embedded engine (``cpu`` or ``cuda[:i]``)."""
    max_batch_size: int = 256
    """Most sequences the embedded engine decodes together."""
    temperature: float = 1.0
    """Sampling temperature of rollouts."""
    top_p: float = 1.0
    """Nucleus sampling mass of rollouts."""
    max_new_tokens: int = 0
    """Generation budget per episode; 0 lets the task choose."""
    request_timeout_s: float = 120.0
    """Timeout of one HTTP request to an engine."""
    startup_timeout_s: float | None = None
    """How long the run waits for an engine to become healthy. Unset: scaled to the model:
    120 s for the embedded engine; SGLang 300 s + 20 s per GiB of weight files in the model
    folder (900 s when none is found there, e.g. a hub id)."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """``--dtype`` of launched SGLang servers. ``auto``: ``bfloat16`` for a checkpoint stored
    in float32 or of unknown dtype (SGLang's own ``auto`` would serve it in float16), else
    SGLang's ``auto`` (as stored). The embedded engine always uses ``model.dtype``."""
    sglang_entrypoint: Literal["auto", "serve", "launch_server"] = "auto"
    """How launched SGLang servers start: ``serve`` (``sglang serve``, SGLang's recommended
    entry point), ``launch_server`` (``python -m sglang.launch_server``, deprecated where
    ``serve`` exists). ``auto``: ``serve`` when the installed SGLang declares the ``sglang``
    console script, else ``launch_server``."""
    max_restarts: int = 3
    """Times the run restarts each engine it started that died (re-synced with the current
    weights before it takes requests again); one more death fails the run. 0: never."""
    pause_mode: Literal["abort", "retract", "in_place"] = "abort"
    """How engines pause for a weight update. ``abort``: in-flight requests return their
    partial output and the controller resumes them under the new weights (every token's
    version stays exact). ``retract`` (SGLang's mode): they go back to the engine's queue,
    their KV cache dropped, and go on under the new weights, their tokens' versions read from
    SGLang's per-request version spans (SGLang >= 0.5.22). ``in_place``: they stay put."""
    tp_size: int = 1
    """GPUs per launched SGLang server (``--tp-size``); the embedded engine needs 1."""
    mem_fraction_static: float = 0.0
    """SGLang's ``--mem-fraction-static`` of launched servers; 0 keeps SGLang's default."""
    extra_args: tuple[str, ...] = ()
    """Extra command-line arguments of every launched engine server, passed through as they
    are (e.g. ``["--skip-tokenizer-init"]`` for SGLang, ``["--threads", "2"]`` locally)."""
    kv_after_update: Literal["recompute", "keep"] = "recompute"
    """Embedded engine, ``pause_mode = "in_place"``: the KV cache of requests in flight across
    a weight update is ``recompute``d under the new weights before their next token (exact;
    costs a prefill of every running sequence per update), or ``keep``t (their prefix keeps
    the old weights' keys/values, as vLLM's ``pause_generation(clear_cache=False)``; no
    re-prefill). Either way the behaviour log-probs are those sampled and a trajectory's
    version is its oldest token's."""


class TrainerConfig(_Section, frozen=True):
    lr: float = 1.5e-3
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Max global grad norm; <= 0 disables clipping."""
    micro_batch_tokens: int = 8192
    """Token budget of one micro-batch."""
    world_size: int = 1
    """Data-parallel trainer ranks (processes)."""
    device: str = "cpu"
    """``cpu`` (Gloo) or ``cuda`` (NCCL)."""
    threads: int = 1
    """torch intra-op threads per trainer rank on CPU."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """LR after warm-up: ``constant``, ``linear`` or ``cosine`` decay to ``lr * min_lr_ratio``."""
    warmup_steps: int = 0
    """Optimizer steps of linear LR warm-up from 0 to ``lr``."""
    decay_steps: int = 0
    """Steps (warm-up included) over which the LR decays; 0: ``controller.total_steps``."""
    min_lr_ratio: float = 0.0
    """Final LR of the ``linear``/``cosine`` schedules as a fraction of ``lr``."""
    adam_betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    mixed_precision: Literal["none", "bf16"] = "none"
    """FSDP2 compute dtype: ``bf16`` runs forward/backward in bfloat16 over the master
    parameters (dtype ``model.dtype``) and reduces gradients in float32."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward (less memory, ~30% more compute)."""
    packing: Literal["auto", "on", "off"] = "auto"
    """Padding-free micro-batches (sequences packed in one row, position ids restarting at 0).
    ``auto``: packed when the model's attention backend supports it, padded otherwise."""
    max_restarts: int = 2
    """A trainer rank that dies restarts every rank from the last checkpoint (the steps
    after it are trained again, exactly once) at most this many times per run; 0: a trainer
    death ends the run."""
    reshard_after_forward: bool | None = None
    """FSDP2: free gathered parameters after forward (ZeRO-3); False keeps them until backward.
    None: True when more than one rank shares the model, False at world size 1."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0 or self.decay_steps < 0 or self.max_restarts < 0:
            raise ValueError(
                "trainer.warmup_steps, trainer.decay_steps and trainer.max_restarts must be >= 0"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"trainer.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not all(0.0 <= b < 1.0 for b in self.adam_betas):
            raise ValueError(f"trainer.adam_betas must be in [0, 1), got {self.adam_betas}")


class AlgoConfig(_Section, frozen=True):
    name: Literal["grpo", "ppo"] = "grpo"
    """RL algorithm. ``grpo``: group-relative advantages, no critic. ``ppo``: a critic (value
    model from the same checkpoint) and GAE advantages."""
    group_size: int = 8
    """Samples per prompt (GRPO group; PPO samples each prompt this many times too)."""
    clip_eps: float = 0.2
    """PPO clip range of the surrogate objective."""
    norm_adv_by_std: bool = True
    """GRPO: divide group-centred advantages by the group's std (off = Dr.GRPO's unbiased form)."""
    behav_imp_weight_cap: float = 1.0
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
    epochs: int = 1
    """Passes over each batch (the proximal policy is recomputed first when > 1 update)."""
    num_minibatches: int = 1
    """Optimizer steps per pass; the batch is split into this many minibatches."""
    kl_coef: float = 0.0
    """Weight of the KL penalty (k3 estimator) to the frozen initial model; 0 builds no
    reference model."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (sample estimate -log p of the trained tokens)."""
    gamma: float = 1.0
    """PPO: discount of GAE."""
    lam: float = 0.95
    """PPO: GAE lambda."""
    whiten_adv: bool = True
    """PPO: normalise advantages to zero mean, unit std over the batch's trained tokens."""
    value_clip: float = 0.2
    """PPO: clip range of the value update around the old values; <= 0 disables it."""
    value_coef: float = 0.5
    """PPO: scale of the squared-error value loss."""
    critic_lr: float = 0.0
    """PPO: learning rate of the critic; 0 uses ``trainer.lr``."""
    critic_warmup_steps: int = 0
    """PPO: first steps that train only the critic (the actor is held)."""
    behav_clip_eps: float = 0.2
    """Decoupled objective: behaviour-side trust region. A token whose proximal/behaviour
    ratio is already above ``1 + this`` (positive advantage) or below ``1 - this`` (negative)
    gets no gradient, so stale samples do not push tokens the intervening updates already
    moved. 0 disables it. No effect on the ``on-policy`` (staleness 0) and ``naive`` objectives."""


class ControllerConfig(_Section, frozen=True):
    batch_size: int = 32
    """GRPO groups (prompts) per train step."""
    max_staleness: int = 1
    """A sample generated by policy version v may train at step t only if t - v <= this."""
    total_steps: int = 120
    """Train steps of the run."""
    stale_policy: Literal["drop", "regenerate"] = "regenerate"
    """What happens to a group that would exceed the staleness bound at its step."""
    max_retries: int = 3
    """Retries of a failed engine request before the episode is reported failed."""
    pause_mode: Literal["abort", "in_place", "wait"] = "abort"
    """How ``Controller.weight_update`` quiesces the engines (embedding API). ``abort``:
    in-flight requests return their partial output and are resumed under the new weights;
    ``in_place``: engines hold requests and go on after the update; ``wait``: no new request
    is sent and the update starts once the in-flight ones finished. ``asyncrl run``'s trainer
    pauses the engines itself with ``rollout.pause_mode``."""
    retry_backoff_s: float = 0.05
    """First back-off before retrying a failed request on another engine; doubles per retry."""
    retry_backoff_max_s: float = 2.0
    """Upper bound of one retry back-off."""
    outage_timeout_s: float = 300.0
    """How long a request waits while no engine is in rotation (every engine restarting,
    re-syncing or not answering) before its episode fails; such a wait is no retry."""
    health_interval_s: float = 1.0
    """How often engines out of rotation are probed with ``/health``."""
    inline_reward_s: float = 0.0002
    """A sync reward function whose calls take less than this runs on the event loop (no
    thread hop); slower ones run in a worker thread. 0: always a thread."""
    batch_requests: bool = True
    """Generation requests to one engine with identical ``input_ids`` started in the same
    event-loop turn (a GRPO group's samples of one prompt) travel as one batched
    ``/generate``: one HTTP round trip and one prefill instead of ``group_size``. Each waits
    for the slowest of its batch (a group finishes with its slowest sample anyway; a
    multi-turn episode's first turn waits for its group's). False: one request each."""

    def __post_init__(self) -> None:
        for key in ("max_retries", "retry_backoff_s", "retry_backoff_max_s", "inline_reward_s"):
            if getattr(self, key) < 0:
                raise ValueError(f"controller.{key} must be >= 0, got {getattr(self, key)!r}")
        if self.health_interval_s <= 0:
            value = self.health_interval_s
            raise ValueError(f"controller.health_interval_s must be > 0, got {value}")


class WeightSyncConfig(_Section, frozen=True):
    backend: Literal["auto", "gloo", "nccl", "hccl", "cuda-ipc"] = "auto"
    """Transport of trainer weights into the engines. ``auto``: nccl on CUDA, else gloo."""
    bucket_mb: int = 512
    """Upper bound of one flat bucket, MiB."""
    master_address: str = "127.0.0.1"
    """Address of the weight-sync group's rendezvous (trainer rank 0)."""
    group_name: str = "asyncrl_weights"
    """Name of the weight-sync process group on the engines."""
    timeout_s: float = 300.0
    """Longest wait of weight sync on another process (a broadcast, an engine's HTTP answer, the
    group's rendezvous), per GiB moved: a wait for ``b`` bytes ends after ``timeout_s * max(1,
    b / 1 GiB)`` s with an error naming the engine(s) and the bucket. The engines keep their
    previous weights; the next push re-forms the group."""
    min_buckets: int = 8
    """A sync is cut into at least this many buckets (each still <= ``bucket_mb``), so packing,
    sending and verifying overlap from the first bucket on. 1: fill every bucket up to
    ``bucket_mb``."""
    snapshot: bool = False
    """``false``: ``push`` returns at once and the trainer's next forward/backward overlaps the
    stream; only its next optimizer step waits until the sender has read the weights.
    ``true``: ``push`` copies every weight first (costs the trainer one copy of the model)."""
    staging_buckets: int = 0
    """Staging slots of the sender (each as large as a bucket): the packer runs ahead of the
    sends as far as they allow. 0: one per bucket (one copy of the weights; the trainer is
    released after a memcpy of the model); 2: double-buffered, least memory (the next optimizer
    step may wait for the tail of the stream)."""
    repush_attempts: int = 2
    """SGLang engines: how often a failed push is re-pushed (from the staged copy, engines
    still paused) before the run stops saying the engines' weights are undefined (SGLang loads
    buckets as they arrive). The embedded engine keeps its old weights instead."""
    pause_scope: Literal["commit", "transfer"] = "commit"
    """When engines pause generation: ``commit`` only around the switch to the new weights (the
    embedded engine stages buckets aside); ``transfer`` for the whole stream (SGLang, which
    loads each bucket as it arrives; always ``transfer`` with ``rollout.backend = "sglang"``)."""
    ipc_verify: bool = False
    """``cuda-ipc`` only: the sender sends a checksum per tensor and engines check their copies
    before switching. Off by default: the bytes never leave the GPU's memory, and the checksums
    cost a full extra read of the weights on each side (as much as the copy itself)."""
    zero_copy_frac: float = 0.75
    """Collectives, ``snapshot = false``: buckets within this leading fraction of a sync's bytes
    whose tensors already lie back to back in memory (one tensor per bucket, or a trainer with
    flat parameters) are broadcast from the tensors themselves instead of a staging copy; the
    trainer's next optimizer step waits until they have left. 0: always stage."""
    ipc_copy: Literal["graph", "foreach"] = "graph"
    """``cuda-ipc`` only, how engines copy the trainer's tensors: ``graph`` (the per-tensor
    copies captured once per layout as a CUDA graph, then replayed: full-width copy kernels
    back to back; measured faster on an H100) or ``foreach`` (one multi-tensor copy)."""

    verify: Literal["full", "sampled", "off"] = "sampled"
    """Collectives: what each engine checks of every bucket before staging it (a mismatch fails
    the push and keeps the old weights). ``full``: a 64-bit checksum of every byte (one extra
    read of the weights per side; on a 2-core CPU box ~0.3x of a Gloo transfer, see
    docs/weight-sync.md). ``sampled``: the same checksum over a seeded subset of each bucket,
    every tensor's first and last bytes plus evenly spread blocks (catches a misordered,
    shifted, truncated or torn bucket, not a lone flipped bit; costs almost nothing). ``off``:
    none (TCP and NCCL protect the bytes on the wire). A delta bucket's payload is always
    checked in full (it is small), and the resulting bucket as this mode says."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Dtype floating-point weights travel in (and engines load): ``auto`` keeps each tensor's
    own; ``bfloat16`` syncs fp32 master weights as bf16 (the cast is fused into the packing)."""
    delta: Literal["off", "auto", "on"] = "off"
    """Collectives into engines that accept deltas (the embedded engine; SGLang always gets full
    pushes): the sender keeps the bytes it pushed last (one extra copy of the synced weights in
    the sync dtype, on the trainer's device) and sends per bucket only the 8-byte words whose
    bits changed (index + word), or the whole bucket when that is smaller (``auto``, per
    bucket) or never (``on``: always the changed words). Bit-exact. A full push is forced on
    the first push, after (re)connecting, after a failed push and every ``full_every``
    pushes. With ``delta`` on every bucket is staged (none sent in place)."""
    full_every: int = 50
    """With ``delta``: every this many pushes one is full (0: only when forced)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.zero_copy_frac <= 1.0:
            raise ValueError(f"weights.zero_copy_frac must be in [0, 1], got {self.zero_copy_frac}")
        if self.full_every < 0:
            raise ValueError(f"weights.full_every must be >= 0, got {self.full_every}")
        if self.timeout_s <= 0:
            raise ValueError(f"weights.timeout_s must be > 0, got {self.timeout_s}")


class ExperienceConfig(_Section, frozen=True):
    host: str = "127.0.0.1"
    """Address the controller binds its experience and control sockets to."""
    max_message_mb: int = 256
    """Largest experience message a receiver accepts, MiB."""
    transport: Literal["tcp", "ipc"] = "tcp"
    """``tcp``: bind ``tcp://{host}:<free port>`` (reachable across hosts when ``host`` is);
    ``ipc``: a Unix socket in the run folder (one host)."""
    endpoint: str = ""
    """Explicit ZeroMQ endpoint the controller binds (e.g. ``tcp://10.0.0.5:5555``); overrides
    ``host`` and ``transport``."""
    credits: int = 4
    """Messages one producer may have unacknowledged at one trainer rank; a producer without
    credit waits (back-pressure), so this bounds memory on both sides."""
    heartbeat_s: float = 1.0
    """Interval of the trainer ranks' heartbeats to the producers."""
    peer_timeout_s: float = 30.0
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
    shm_mb: int = 64
    """Size of each shared-memory ring (one per producer and trainer rank), MiB; a message
    that finds no room in it goes as frames."""

    def __post_init__(self) -> None:
        for key in ("credits", "heartbeat_s", "peer_timeout_s", "shm_mb"):
            if getattr(self, key) <= 0:
                raise ValueError(f"experience.{key} must be > 0, got {getattr(self, key)!r}")
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
    cpus_per_trainer: float = 1.0
    """``ray``: CPUs reserved per trainer rank."""
    cpus_per_engine: float = 1.0
    """``ray``: CPUs reserved per engine."""
    colocate: bool = False
    """``ray``: place engine i on the GPU(s) of trainer rank i (needed by
    ``weights.backend = "cuda-ipc"``, which works only within one GPU)."""
    start_timeout_s: float = 300.0
    """``ray``: how long the run waits for the cluster to place an actor."""

    def __post_init__(self) -> None:
        for key in ("cpus_per_trainer", "cpus_per_engine"):
            if getattr(self, key) < 0:
                raise ValueError(f"cluster.{key} must be >= 0, got {getattr(self, key)!r}")
        if self.start_timeout_s <= 0:
            raise ValueError(f"cluster.start_timeout_s must be > 0, got {self.start_timeout_s}")


class CheckpointConfig(_Section, frozen=True):
    every_steps: int = 20
    """Checkpoint the whole run (trainer + controller) into ``RUN_DIR/checkpoints/step-N``
    every this many train steps (also on SIGTERM/SIGINT and at the end); 0: only at those."""
    keep: int = 2
    """Complete checkpoints kept (the oldest are deleted once a newer one is complete)."""
    export_hf: bool = False
    """Also export the actor as a Hugging Face folder inside every checkpoint (``hf/``); the
    final policy is always exported to ``RUN_DIR/final``."""
    on_signal: bool = True
    """SIGTERM / first SIGINT: checkpoint the run before stopping (a second signal stops at
    once)."""
    timeout_s: float = 600.0
    """How long the run waits for the trainer to finish writing one checkpoint."""

    def __post_init__(self) -> None:
        if self.every_steps < 0 or self.keep < 1 or self.timeout_s <= 0:
            raise ValueError(
                "checkpoint.every_steps must be >= 0, checkpoint.keep >= 1 and "
                f"checkpoint.timeout_s > 0 (got {self.every_steps}, {self.keep}, "
                f"{self.timeout_s})"
            )


class TraceConfig(_Section, frozen=True):
    enabled: bool = True
    """Write the run's timeline, ``RUN_DIR/trace.json`` (Chrome / Perfetto trace events)."""
    every: int = 1
    """Sampling for long runs: trace the work of every ``every``-th step (policy version)."""
    max_mb: float = 512.0
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

    def __post_init__(self) -> None:
        if self.trace.every < 1 or self.trace.max_mb <= 0:
            raise ValueError(
                f"logging.trace.every must be >= 1 and max_mb > 0, got {self.trace.every}, "
                f"{self.trace.max_mb}"
            )


class RunConfig(_Section, frozen=True):
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    task: TaskConfig = msgspec.field(default_factory=TaskConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    algo: AlgoConfig = msgspec.field(default_factory=AlgoConfig)
    controller: ControllerConfig = msgspec.field(default_factory=ControllerConfig)
    weights: WeightSyncConfig = msgspec.field(default_factory=WeightSyncConfig)
    experience: ExperienceConfig = msgspec.field(default_factory=ExperienceConfig)
    cluster: ClusterConfig = msgspec.field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = msgspec.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)
    run_dir: str = ""
    """Output folder (metrics.jsonl, config.json, logs). Empty: a new folder under ``runs/``."""
    seed: int = 0
    """Seed of model init, sampling and training."""

    def __post_init__(self) -> None:
        _check_positive(self)
        _check_backend_options(self)


_COLLECTIVES = ("auto", "gloo", "nccl", "hccl")
_COLLECTIVE_ONLY = ("verify", "delta", "full_every", "dtype", "zero_copy_frac", "staging_buckets",
                    "min_buckets", "bucket_mb")  # fmt: skip
# option -> (the key choosing the backend, the backends it applies to): a value other than the
# default under another backend would be ignored silently, so it is refused
_BACKEND_ONLY: dict[str, tuple[str, tuple[str, ...]]] = {
    "weights.ipc_verify": ("weights.backend", ("cuda-ipc",)),
    "weights.ipc_copy": ("weights.backend", ("cuda-ipc",)),
    **{f"weights.{k}": ("weights.backend", _COLLECTIVES) for k in _COLLECTIVE_ONLY},
    "rollout.kv_after_update": ("rollout.backend", ("local",)),
    **{
        f"rollout.{k}": ("rollout.backend", ("sglang",))
        for k in ("sglang_entrypoint", "dtype", "tp_size", "mem_fraction_static")
    },
}


def _check_backend_options(cfg: RunConfig) -> None:
    """An option set (not its default) under a backend that does not use it: ValueError naming
    the backends it belongs to."""
    for key, (chooser, backends) in _BACKEND_ONLY.items():
        section, name = key.split(".")
        node = getattr(cfg, section)
        backend = getattr(node, chooser.split(".")[1])
        if backend in backends:
            continue
        value, default = getattr(node, name), getattr(type(node)(), name)
        if value != default:
            raise ValueError(
                f"{key}={value!r} applies to {chooser} = {' | '.join(map(repr, backends))} "
                f"only; this run has {chooser}={backend!r}"
            )


_POSITIVE = {
    "controller.batch_size",
    "controller.total_steps",
    "algo.group_size",
    "algo.epochs",
    "algo.num_minibatches",
    "rollout.num_engines",
    "rollout.max_batch_size",
    "trainer.world_size",
    "trainer.micro_batch_tokens",
    "trainer.threads",
    "weights.bucket_mb",
    "weights.min_buckets",
    "weights.timeout_s",
    "task.num_digits",
    "experience.max_message_mb",
}


def _check_numbers(node: msgspec.Struct, prefix: str = "") -> None:
    """Every float of the config finite (NaN would reach config.json as null), and every
    ``*timeout*`` / ``*interval*`` field > 0; ValueError names the key."""
    for name in node.__struct_fields__:
        value, key = getattr(node, name), f"{prefix}{name}"
        if isinstance(value, msgspec.Struct):
            _check_numbers(value, key + ".")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{key} must be a finite number, got {value!r}")
        elif (
            isinstance(value, int | float)
            and not isinstance(value, bool)
            and ("timeout" in name or "interval" in name)
            and value <= 0
        ):
            raise ValueError(f"{key} must be > 0, got {value!r}")


def _check_positive(cfg: RunConfig) -> None:
    _check_numbers(cfg)
    for key in sorted(_POSITIVE):
        section, field = key.split(".")
        value = getattr(getattr(cfg, section), field)
        if value <= 0:
            raise ValueError(f"{key} must be > 0, got {value!r}")
    if cfg.rollout.backend == "sglang" and cfg.weights.backend == "cuda-ipc":
        raise ValueError(
            "weights.backend='cuda-ipc' works with rollout.backend='local' only: SGLang's "
            "scheduler dies on asyncrl's CUDA IPC descriptor (load_format='asyncrl_ipc'); use "
            "weights.backend='nccl' (or 'auto') with rollout.backend='sglang'"
        )
    if cfg.weights.repush_attempts < 0:
        raise ValueError(f"weights.repush_attempts must be >= 0, got {cfg.weights.repush_attempts}")
    if cfg.controller.max_staleness < 0:
        raise ValueError(
            f"controller.max_staleness must be >= 0, got {cfg.controller.max_staleness}"
        )
    if cfg.rollout.max_restarts < 0:
        raise ValueError(f"rollout.max_restarts must be >= 0, got {cfg.rollout.max_restarts}")
    if not 0.0 < cfg.rollout.top_p <= 1.0:
        raise ValueError(f"rollout.top_p must be in (0, 1], got {cfg.rollout.top_p}")
    _check_algo(cfg.algo)
    if cfg.rollout.temperature <= 0:
        raise ValueError(f"rollout.temperature must be > 0, got {cfg.rollout.temperature}")


def _check_algo(a: AlgoConfig) -> None:
    if a.clip_eps <= 0:
        raise ValueError(f"algo.clip_eps must be > 0, got {a.clip_eps}")
    if a.behav_imp_weight_cap < 1:
        raise ValueError(f"algo.behav_imp_weight_cap must be >= 1, got {a.behav_imp_weight_cap}")
    if not 0.0 <= a.gamma <= 1.0 or not 0.0 <= a.lam <= 1.0:
        raise ValueError(f"algo.gamma and algo.lam must be in [0, 1], got {a.gamma}, {a.lam}")
    if not 0.0 <= a.behav_clip_eps < 1.0:
        raise ValueError(f"algo.behav_clip_eps must be in [0, 1) (0: off), got {a.behav_clip_eps}")
    for key in ("kl_coef", "entropy_coef", "value_coef", "critic_lr", "critic_warmup_steps"):
        if getattr(a, key) < 0:
            raise ValueError(f"algo.{key} must be >= 0, got {getattr(a, key)}")


def _field_type(struct_type: type, name: str) -> Any:
    hints = typing.get_type_hints(struct_type)
    return hints[name]


def _allowed(path: list[str]) -> str:
    """Describe the allowed values (or keys) at a dotted path of RunConfig."""
    tp: Any = RunConfig
    for part in path:
        if not (isinstance(tp, type) and issubclass(tp, msgspec.Struct)):
            return ""
        if part not in tp.__struct_fields__:
            return "allowed keys: " + ", ".join(tp.__struct_fields__)
        tp = _field_type(tp, part)
    if typing.get_origin(tp) is Literal:
        return "allowed values: " + ", ".join(repr(a) for a in typing.get_args(tp))
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return "allowed keys: " + ", ".join(tp.__struct_fields__)
    return ""


def _parse_value(text: str) -> Any:
    """CLI values: JSON when they parse as JSON (numbers, bools, lists), else the raw string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _as_list_if_listed(key: str, value: Any) -> Any:
    """A plain string given for a list-valued key (``--rollout.urls=http://a:1,http://b:2``)
    is its comma-separated items; anything else (JSON lists too) is kept."""
    if not isinstance(value, str):
        return value
    tp: Any = RunConfig
    for part in key.split("."):
        if not (isinstance(tp, type) and issubclass(tp, msgspec.Struct)):
            return value
        if part not in tp.__struct_fields__:
            return value  # msgspec names the unknown key
        tp = _field_type(tp, part)
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
    try:
        return msgspec.convert(tree, RunConfig, strict=False)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        own = msg.split(" - at `$", 1)[0]
        if own.split(".", 1)[0] in RunConfig.__struct_fields__:  # a check of ours names its key
            raise ValueError(own) from None
        path: list[str] = []
        if "at `$." in msg:
            dotted = msg.rsplit("at `$.", 1)[1].rstrip("`")
            path = [p for p in dotted.replace("[", ".").replace("]", "").split(".") if p]
        if "unknown field" in msg:
            field = msg.split("`")[1]
            path = [*path, field]
        hint = _allowed(path)
        key = ".".join(path) or "<root>"
        raise ValueError(
            f"invalid config key {key}: {msg}" + (f" ({hint})" if hint else "")
        ) from None


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    base: dict[str, Any] | None = None,
) -> RunConfig:
    """Build a RunConfig from an optional TOML file (or a ``base`` tree, e.g. a run's
    config.json) and ``section.key=value`` overrides.

    Raises ValueError naming the offending key for unknown keys, wrong types,
    out-of-range values and disallowed choices.
    """
    tree: dict[str, Any] = dict(base or {})
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file not found: {p}")
        try:
            tree = msgspec.toml.decode(p.read_bytes())
        except msgspec.DecodeError as exc:
            raise ValueError(f"{p}: not valid TOML: {exc}") from None
    for item in overrides or []:
        key, sep, value = item.removeprefix("--").partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} must look like --section.key=value")
        _set_dotted(tree, key, _as_list_if_listed(key, _parse_value(value)))
    return _convert(tree)


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    """Plain JSON-able dict of a config (for config.json in the run folder)."""
    return msgspec.to_builtins(cfg)
