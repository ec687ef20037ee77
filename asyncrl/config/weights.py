"""The ``weights`` section: one config type per weight-sync backend (tag ``backend``)."""

from __future__ import annotations

import typing
from typing import Literal, TypeAlias

from asyncrl.config.base import Fraction, NonNegative, Positive, PositiveFloat, _Section


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
    pause_scope: Literal["commit", "transfer", "none"] = "commit"
    """When engines pause generation: ``commit`` only around the switch to the new weights (the
    embedded engine stages buckets aside); ``transfer`` for the whole stream (SGLang, which
    loads each bucket as it arrives; always ``transfer`` with ``rollout.backend = "sglang"``);
    ``none`` never (the embedded engine switches between two decoding steps on its own; always
    ``none`` with ``lora.rank > 0``: an adapter version loads beside the served ones)."""

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
    checked in full (it is small), and the resulting bucket as this mode says. vLLM engines:
    after each push, their ``/weight_checker`` digests against the trainer's (``full``: every
    engine and tensor; ``sampled``: one engine per push, 8 tensors; a mismatch re-sends the
    push; see docs/weight-sync.md, "Integrity"). SGLang: not checked."""
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
