"""Planning and packing a push's buckets (trainer process): :class:`BucketStager`.

A push's tensors are planned into flat buckets once per layout (``bucket.plan_buckets``:
one dtype per bucket, at most ``weights.bucket_mb``; whole tensors only for engines that
load live) and packed bucket by bucket into staging slots, the bucket's checksum computed as it is
packed. Slots: ``weights.staging_buckets`` of them (0: one per bucket, so the trainer is
released after one copy of the weights; 2: double-buffered, least memory), each allocated
when first used; the packer runs that many buckets ahead of the sends. A bucket within
the first ``weights.zero_copy_frac`` of the bytes whose tensors already lie back to back
in memory is sent from the tensors themselves (no copy) when the transport allows it
(``zero_copy_ok``).

Deltas (``weights.delta``, see ``delta``): every bucket has a base (the bytes pushed
last); a push without deltas packs straight into the bases, a delta push packs chunk by
chunk and compares as it goes (CPU, compiled loops: ``DeltaEncoder.take_chunked``), else
into one scratch slot, and brings the base up to date, and the bucket goes as a delta
payload against the version every engine holds (``base_version``) or whole from its base.
So the sender holds one copy of the synced bytes plus one chunk (or one bucket), its
small payloads kept for the next push, and a push's payloads while it is in flight
(``memory_bytes``). ``forget_base`` after anything that may have changed what
the engines hold (a re-form, a failed push).

Not thread-safe: ``pack`` runs on the sender's packer thread while the sender's loop
waits for it; everything else on the sender's loop (or in ``push`` in snapshot mode,
while no push runs).
"""

from __future__ import annotations

import itertools

import msgspec
import torch

from asyncrl import trace
from asyncrl.config import CollectiveWeightsConfig
from asyncrl.transports.weights.bucket import (
    BucketManifest,
    TensorSpec,
    checksum,
    pack_checksum,
    pack_into,
    plan_buckets,
    span_of,
    spec_of,
)
from asyncrl.transports.weights.delta import DeltaEncoder, DeltaInfo
from asyncrl.transports.weights.delta_pack import Segments
from asyncrl.transports.weights.integrity import bucket_checksum, full_checksum

__all__ = ["BucketStager"]

Packed = tuple[BucketManifest, torch.Tensor]
"""A packed bucket: its manifest (version, checksum, delta set) and the bytes to send."""


class BucketStager:
    """The plan, the staging slots and the delta bases of one sender (see module docstring).

    ``zero_copy_ok``: the transport is done with a bucket's buffer once its send completes,
    so a bucket may be sent from the caller's memory; ``delta_ok``: it can send delta
    buckets.
    """

    def __init__(
        self,
        cfg: CollectiveWeightsConfig,
        device: torch.device,
        whole: bool = False,
        zero_copy_ok: bool = False,
        delta_ok: bool = False,
    ):
        self.cfg = cfg
        self.device = device
        self.whole = whole
        """Engines load each bucket live as it arrives: whole tensors only, every staged
        bucket kept for a re-push, no deltas, no zero-copy sends."""
        self.zero_copy_ok = zero_copy_ok
        self.plan: list[BucketManifest] = []
        self.upto: list[int] = []  # bytes up to each bucket (every wait's budget grows with it)
        self.ahead = 1  # buckets the packer may run ahead of the sends
        self.slot_bytes: list[int] = []  # staging slot sizes; a slot is allocated on first use
        self.slots: dict[int, torch.Tensor] = {}
        self.in_place: set[int] = set()  # buckets of the current push sent from its tensors
        self.stats: dict[str, float] = {}  # this push's delta counters
        self._plan_key: tuple[TensorSpec, ...] = ()
        self._zero_copy_upto = 0  # buckets [0, upto) may be sent from the caller's memory
        # engines that load live take what they receive as it is: always full pushes, so no
        # base is kept for them
        takes = cfg.delta != "off" and delta_ok and not whole
        self.delta = DeltaEncoder(cfg.delta) if takes else None
        self.engines_delta = False  # every engine says it applies deltas
        self.base_version: int | None = None  # the version every engine holds, if known
        self.delta_now = False  # the push in flight sends deltas against base_version
        self._deltas_in_row = 0

    @property
    def depth(self) -> int:
        """How many buckets the packer may run ahead of the sends (a bucket's buffer is
        reused, or its payload freed, only once it was sent)."""
        return self.ahead

    def memory_bytes(self) -> int:
        """Bytes this sender holds between pushes: staging slots and delta bases (a push
        adds its delta payloads until it is delivered: ``stats["payload_bytes"]``)."""
        held = sum(t.numel() for t in self.slots.values())
        return held + (0 if self.delta is None else self.delta.memory_bytes())

    def plan_for(self, tensors: dict[str, torch.Tensor]) -> list[BucketManifest]:
        """The buckets of ``tensors`` (planned again only when their layout changed)."""
        sync = self.cfg.dtype
        specs = tuple(
            spec_of(n, t)
            if sync == "auto" or not t.is_floating_point()
            else TensorSpec(n, sync, tuple(t.shape))
            for n, t in tensors.items()
        )
        if specs != self._plan_key:
            self._plan_key = specs
            self.plan = plan_buckets(
                specs, self.cfg.bucket_mb << 20, self.cfg.min_buckets, whole_only=self.whole
            )
            if self.delta is not None:  # new buckets: no base any more, the next push is full
                self.delta.reset()
                self.base_version = None
            self._size_slots()
        return self.plan

    def _size_slots(self) -> None:
        plan, cfg = self.plan, self.cfg
        depth = cfg.staging_buckets
        if depth == 0 or cfg.snapshot or self.whole:
            depth = len(plan)  # live loaders: kept for a re-push
        depth = max(1, min(depth, len(plan)))
        total, upto = sum(m.nbytes for m in plan), 0
        while upto < len(plan) and sum(m.nbytes for m in plan[: upto + 1]) <= (
            cfg.zero_copy_frac * total
        ):
            upto += 1
        self._zero_copy_upto = upto
        self.upto = list(itertools.accumulate(m.nbytes for m in plan))
        self.ahead = depth
        if self.delta is not None:  # one scratch slot: a bucket leaves it as it is packed
            self.slot_bytes = [max(m.nbytes for m in plan)]
        else:
            self.slot_bytes = [max(m.nbytes for m in plan[j::depth]) for j in range(depth)]
        self.slots = {}

    def budget_s(self, nbytes: int) -> float:
        """How long a wait on ``nbytes`` moved may take: ``timeout_s`` per GiB, at least one."""
        return self.cfg.timeout_s * max(1.0, nbytes / (1 << 30))

    def decide_delta(self) -> None:
        """Whether this push sends deltas: only against a version every engine holds (not the
        first push, nor after a (re)connect or a failed push) and not on every
        ``full_every``-th push. Starts the push's counters."""
        every = self.cfg.full_every
        self.delta_now = (
            self.delta is not None
            and self.engines_delta
            and self.base_version is not None
            and (every == 0 or self._deltas_in_row < every - 1)
        )
        self.stats = {}

    def forget_base(self) -> None:
        """The engines may hold anything now: the next push is full."""
        self.base_version = None

    def pushed(self, version: int) -> None:
        """Every engine now holds ``version``: the base of the next push's deltas."""
        if self.delta is not None:
            self.base_version = version
            self._deltas_in_row = self._deltas_in_row + 1 if self.delta_now else 0

    def pack(self, k: int, tensors: dict[str, torch.Tensor], version: int) -> Packed:
        """Bucket ``k`` of the plan, packed as ``version`` (or a view of ``tensors``)."""
        mode = self.cfg.verify
        m = msgspec.structs.replace(self.plan[k], version=version, verify=mode)
        span = self.zero_copy(k, tensors)
        if span is not None:  # send straight from the caller's memory: nothing to copy
            self.in_place.add(k)
            return msgspec.structs.replace(m, checksum=bucket_checksum(span, m, mode)), span
        if self.delta is not None and not self.delta_now:  # straight into the base, sent whole
            flat = self.delta.base(k, m.nbytes, self.device).view(m.torch_dtype)
            m = self._pack_into(flat, m, tensors)
            self._count(m.nbytes, m.nbytes, 0)
            return m, flat
        if self.delta is not None:  # a delta push: packed and compared chunk by chunk
            segs = Segments([(e.name, e.start, e.numel) for e in m.entries], tensors)
            took = self.delta.take_chunked(k, segs, m.torch_dtype)
            if took is not None:
                base = self.delta.bases[k].view(m.torch_dtype)
                m = msgspec.structs.replace(m, checksum=bucket_checksum(base, m, self.cfg.verify))
                return self._delta_packed(k, m, *took)
        slot = self._slot(k % len(self.slot_bytes))
        flat = slot[: m.nbytes].view(m.torch_dtype)
        m = self._pack_into(flat, m, tensors)
        if self.delta is None:
            return m, flat
        return self._delta_of(k, m, slot[: m.nbytes])

    def _pack_into(
        self, flat: torch.Tensor, m: BucketManifest, tensors: dict[str, torch.Tensor]
    ) -> BucketManifest:
        """Pack bucket ``m`` of ``tensors`` into ``flat``; ``m`` with its checksum."""
        mode = self.cfg.verify
        if mode == "full":  # fused: each block summed right after its copy, while in cache
            value: int | None = full_checksum(flat, m, pack_checksum(flat, m, tensors))
        else:
            pack_into(flat, m, tensors)
            value = bucket_checksum(flat, m, mode)
        return msgspec.structs.replace(m, checksum=value)

    def pack_traced(self, k: int, tensors: dict[str, torch.Tensor], version: int) -> Packed:
        """:meth:`pack` as a span of the trace."""
        with trace.get().span(f"pack bucket {k}", "weight pack", {"bytes": self.plan[k].nbytes}):
            return self.pack(k, tensors, version)

    def _delta_of(self, k: int, m: BucketManifest, packed: torch.Tensor) -> Packed:
        """A delta push: bucket k, packed into the scratch slot, brings its base up to date
        and goes as a delta payload, or whole from the base when that is not smaller."""
        assert self.delta is not None
        return self._delta_packed(k, m, *self.delta.take(k, packed, True))

    def _delta_packed(
        self, k: int, m: BucketManifest, payload: torch.Tensor | None, changed: int
    ) -> Packed:
        """Bucket k's payload, or (None) the bucket whole from its base."""
        assert self.delta is not None
        if payload is None:
            self._count(m.nbytes, max(changed, 0), 0)
            return m, self.delta.bases[k].view(m.torch_dtype)
        self._count(payload.numel(), changed, payload.numel())
        value = None if self.cfg.verify == "off" else checksum(payload)
        assert self.base_version is not None
        info = DeltaInfo(self.base_version, payload.numel(), value)
        return msgspec.structs.replace(m, delta=info), payload

    def _count(self, wire: int, changed_words: int, payload: int) -> None:
        """This push's delta counters: bytes on the wire, changed words, payload bytes."""
        st = self.stats
        st["wire_bytes"] = st.get("wire_bytes", 0.0) + wire
        st["changed_words"] = st.get("changed_words", 0.0) + changed_words
        if payload:
            st["payload_bytes"] = st.get("payload_bytes", 0.0) + payload
            st["delta_buckets"] = st.get("delta_buckets", 0.0) + 1

    def _slot(self, j: int) -> torch.Tensor:
        """Staging slot ``j``, allocated when a bucket is first staged in it: buckets sent in
        place never cost the sender memory (on a GPU the allocator would hold it at once)."""
        slot = self.slots.get(j)
        if slot is None:
            slot = self.slots[j] = torch.empty(
                self.slot_bytes[j], dtype=torch.uint8, device=self.device
            )
        return slot

    def zero_copy(self, k: int, tensors: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """Bucket k as one view of the caller's memory, when it may be sent from there.

        Only for transports done with a buffer when its send returns (collectives),
        not in snapshot mode (there the caller may write its tensors once ``push``
        returns), for buckets within the first ``zero_copy_frac`` of the sync's bytes
        (sent early, so the trainer's next optimizer step waits little for them), and
        only when the bucket's entries already lie back to back in one storage in
        manifest order (one whole tensor; or a trainer whose parameters live in one
        flat buffer, see ``trainer.flat_params``). Everything else is staged.
        """
        if not self.zero_copy_ok or self.cfg.snapshot or self.whole or k >= self._zero_copy_upto:
            return None
        if self.delta is not None:  # the base must be a copy of its own
            return None
        return span_of(self.plan[k], tensors, self.device)
