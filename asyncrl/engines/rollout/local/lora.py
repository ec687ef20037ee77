"""The embedded engine's LoRA adapters: an in-memory ring of adapter versions, one batch.

Contract (:class:`AdapterRing`):

- Every target linear layer of the base model (``target_modules``, matched by the last
  component of its name, as PEFT does) is wrapped by :class:`LoraLinear`, which adds the
  LoRA delta ``x @ A_v^T @ B_v^T * scaling`` of *each row's own* adapter version ``v``
  (gathered per row from stacked factors): one running batch mixes versions.
- The ring holds at most ``capacity`` versions (the run's ``max_staleness + 1``), each in a
  slot of the stacked factors (memory: :attr:`AdapterRing.nbytes`, fixed at start). Version
  ``"0"`` starts as the zero adapter (the base model, as PEFT's fresh adapter with B = 0).
- A request is *pinned* to a version: the one it names (``{name}-v{N}``, which must be held:
  :class:`UnknownAdapter` names the held ones), else the newest when it first joins the
  batch; it runs on that version to its end (the engine unpins it when it finishes).
- :meth:`AdapterRing.load` (after :meth:`AdapterRing.check`) puts a new version in a free
  slot beside the others, and it becomes the newest: new requests go to it. A slot is free
  when empty or when it holds a version that is not the newest and that no request uses;
  otherwise the load waits (never more than ``capacity`` versions; never one unloaded in use).
  Nothing pauses, aborts or recomputes: rows keep their version and their KV cache.
- :meth:`AdapterRing.check` refuses, before anything loads, an adapter whose names or
  shapes do not fit the base model (PEFT's saved names, ``lora_A``: ``(rank, in)``,
  ``lora_B``: ``(out, rank)``, every target layer present once).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from asyncrl.engines.rollout.checks import BadRequest

__all__ = ["AdapterRing", "LoraLinear", "LoraSpec", "UnknownAdapter"]

PREFIX = "base_model.model."  # PEFT's prefix of the saved adapter keys


class UnknownAdapter(BadRequest):
    """A request named an adapter version this engine does not hold (HTTP 400)."""


@dataclass(frozen=True)
class LoraSpec:
    """What the engine serves: adapters of ``rank`` on ``target_modules``, ``capacity``
    versions at once, scaled by ``alpha / rank``, named ``{name}-v{N}``."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    capacity: int
    name: str = "policy"

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class LoraLinear(nn.Module):
    """A base ``nn.Linear`` plus the per-row LoRA delta of the ring's current rows. It owns
    the base layer's own ``weight`` and ``bias`` (same parameter names as before wrapping);
    the stacked factors are buffers (``A``: ``(capacity, rank, in)``, ``B``: ``(capacity,
    out, rank)``)."""

    A: torch.Tensor
    B: torch.Tensor

    def __init__(self, base: nn.Linear, ring: AdapterRing, rank: int, capacity: int):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.ring = ring
        w = base.weight
        kw: dict[str, Any] = {"dtype": w.dtype, "device": w.device}
        self.register_buffer("A", torch.zeros(capacity, rank, base.in_features, **kw))
        self.register_buffer("B", torch.zeros(capacity, base.out_features, rank, **kw))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(x, self.weight, self.bias)
        rows, one = self.ring.rows, self.ring.uniform
        if one is not None:  # every row on one version: plain matmuls (PEFT's own order)
            if one < 0:
                return y
            lin = nn.functional.linear
            return y + lin(lin(x, self.A[one]), self.B[one]) * self.ring.scaling
        assert rows is not None and rows.shape[0] == x.shape[0], "rows set for this batch"
        a = self.A.index_select(0, rows)  # (batch, rank, in)
        b = self.B.index_select(0, rows)  # (batch, out, rank)
        h = torch.bmm(x.reshape(x.shape[0], -1, x.shape[-1]), a.transpose(1, 2))
        d = torch.bmm(h, b.transpose(1, 2)).reshape(*y.shape)
        return y + d * self.ring.scaling


class AdapterRing:
    """Adapter versions of one engine (see module docstring). Thread-safe: pins come from
    the scheduler and the HTTP handlers, loads from weight sync."""

    def __init__(self, model: nn.Module, spec: LoraSpec, version: str = "0"):
        if spec.rank < 1 or spec.capacity < 1:
            raise ValueError("LoRA rank and capacity must be >= 1")
        self.spec = spec
        self.scaling = spec.scaling
        self.layers: dict[str, LoraLinear] = {}
        for name, mod in list(model.named_modules()):
            if name.rsplit(".", 1)[-1] in spec.target_modules and isinstance(mod, nn.Linear):
                parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
                wrapped = LoraLinear(mod, self, spec.rank, spec.capacity)
                setattr(parent, name.rsplit(".", 1)[-1], wrapped)
                self.layers[name] = wrapped
        if not self.layers:
            raise ValueError(f"LoRA target modules {list(spec.target_modules)} match no layer")
        self.rows: torch.Tensor | None = None  # per-row slot of the forward under way
        self.uniform: int | None = -1  # the one slot every row uses (-1: the zero adapter)
        self._cv = threading.Condition()
        self._slots: list[str | None] = [None] * spec.capacity  # version held per slot
        self._refs = [0] * spec.capacity  # requests pinned per slot
        self._slots[0] = version  # the zero adapter: the base model
        self._zero = {0}  # slots holding the zero adapter (skipped in forward)
        self.newest = version
        self._waiting_load = False
        self.loads = 0

    # -- names and pins -----------------------------------------------------------------
    def label(self, version: str) -> str:
        return f"{self.spec.name}-v{version}"

    def held(self) -> list[str]:
        """The held versions, oldest first (by version number where numeric)."""
        with self._cv:
            got = [v for v in self._slots if v is not None]
        return sorted(got, key=lambda v: (0, int(v)) if v.isdigit() else (1, 0))

    def _version_of(self, lora_path: str) -> str:
        prefix = f"{self.spec.name}-v"
        if lora_path.startswith(prefix):
            return lora_path[len(prefix) :]
        return lora_path if lora_path.isdigit() else ""

    def pin_named(self, lora_path: str) -> tuple[str, int]:
        """Pin a request to the version ``lora_path`` names; UnknownAdapter unless held."""
        version = self._version_of(str(lora_path))
        with self._cv:
            if version in self._slots:
                slot = self._slots.index(version)
                self._refs[slot] += 1
                return version, slot
        held = ", ".join(self.label(v) for v in self.held())
        raise UnknownAdapter(
            f"lora_path {lora_path!r}: this engine holds adapter versions {held} "
            f"(at most {self.spec.capacity}; older ones are unloaded once unused)"
        )

    def pin_newest(self) -> tuple[str, int] | None:
        """Pin a request joining the batch to the newest version; None while a load waits
        to replace the newest itself (a one-version ring): the request waits to join."""
        with self._cv:
            if self._waiting_load and self.spec.capacity == 1:
                return None
            slot = self._slots.index(self.newest)
            self._refs[slot] += 1
            return self.newest, slot

    def unpin(self, slot: int) -> None:
        with self._cv:
            self._refs[slot] -= 1
            assert self._refs[slot] >= 0, "unpinned more often than pinned"
            self._cv.notify_all()

    def set_rows(self, slots: Sequence[int]) -> None:
        """The slot of every row of the next forward (the scheduler, before each call)."""
        first = slots[0] if slots else -1
        if all(s == first for s in slots):
            self.uniform, self.rows = (-1 if first in self._zero else first), None
        else:
            self.uniform = None
            device = next(iter(self.layers.values())).A.device
            self.rows = torch.tensor(list(slots), dtype=torch.long, device=device)

    # -- loading ------------------------------------------------------------------------
    def check(self, named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, dict[str, Any]]:
        """The adapter's factors per layer, or ValueError naming what does not fit the base
        model (nothing is loaded)."""
        r = self.spec.rank
        got: dict[str, dict[str, Any]] = {}
        for key, t in named:
            body = key.removeprefix(PREFIX)
            layer, _, part = body.rpartition(".lora_")
            if body == key or part not in ("A.weight", "B.weight") or layer not in self.layers:
                raise ValueError(
                    f"{key!r} is no LoRA factor of this engine's target layers ({PREFIX}<layer>"
                    f".lora_A|B.weight; layers of {', '.join(self.spec.target_modules)})"
                )
            base = self.layers[layer]
            want = (r, base.in_features) if part[0] == "A" else (base.out_features, r)
            if tuple(t.shape) != want:
                raise ValueError(f"{key}: shape {tuple(t.shape)} != {want} (rank {r})")
            if not t.is_floating_point():
                raise ValueError(f"{key}: dtype {t.dtype} is not floating point")
            if part[0] in got.setdefault(layer, {}):
                raise ValueError(f"{key} sent twice")
            got[layer][part[0]] = t
        missing = [n for n in self.layers if len(got.get(n, {})) != 2]
        if missing:
            raise ValueError(
                f"an adapter must hold lora_A and lora_B of every target layer: "
                f"{len(missing)} of {len(self.layers)} incomplete ({', '.join(missing[:3])})"
            )
        return got

    def load(
        self, version: str, named: Sequence[tuple[str, torch.Tensor]], timeout_s: float
    ) -> int:
        """Check, then load ``version`` into a free slot (waiting up to ``timeout_s`` for the
        oldest unused version to be unloaded) and make it the newest; returns the slot.
        TimeoutError names the versions still in use."""
        factors = self.check(named)
        deadline = time.monotonic() + timeout_s
        with self._cv:
            if version in self._slots:  # the same version again (a re-sync): same weights
                same = self._slots.index(version)
                if self._refs[same] == 0:
                    self._copy(same, factors)
                self.newest = version
                return same
            self._waiting_load = True
            try:
                slot = self._free_slot()
                while slot is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        use = {v: self._refs[i] for i, v in enumerate(self._slots) if v}
                        raise TimeoutError(
                            f"adapter v{version}: no free slot within {timeout_s:g}s (ring of "
                            f"{self.spec.capacity}, requests per version: {use})"
                        )
                    self._cv.wait(left)
                    slot = self._free_slot()
            finally:
                self._waiting_load = False
            self._slots[slot] = None  # unloaded: no request can pin it while it is written
            self._copy(slot, factors)
            self._slots[slot] = version
            self._zero.discard(slot)
            self.newest = version
            self.loads += 1
            self._cv.notify_all()
            return slot

    def _free_slot(self) -> int | None:
        """An empty slot, else the oldest unused slot other than the newest's (capacity 1:
        the newest's own once unused)."""
        if None in self._slots:
            return self._slots.index(None)
        unused = [
            i
            for i, v in enumerate(self._slots)
            if self._refs[i] == 0 and (v != self.newest or self.spec.capacity == 1)
        ]
        if not unused:
            return None
        return min(unused, key=lambda i: self._order(self._slots[i]))

    @staticmethod
    def _order(version: str | None) -> tuple[int, int]:
        return (0, int(version)) if version and version.isdigit() else (1, 0)

    def _copy(self, slot: int, factors: dict[str, dict[str, Any]]) -> None:
        with torch.no_grad():
            for name, layer in self.layers.items():
                layer.A[slot].copy_(factors[name]["A"])
                layer.B[slot].copy_(factors[name]["B"])

    # -- reporting ----------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Memory of every slot's factors (fixed at start: ``capacity`` adapters)."""
        return sum(lay.A.nbytes + lay.B.nbytes for lay in self.layers.values())

    def info(self) -> dict[str, Any]:
        """The ring for ``/get_server_info``: versions held, requests per version, memory."""
        with self._cv:
            use = {self.label(v): self._refs[i] for i, v in enumerate(self._slots) if v}
        return {
            "name": self.spec.name,
            "rank": self.spec.rank,
            "capacity": self.spec.capacity,
            "newest": self.label(self.newest),
            "versions": use,
            "loads": self.loads,
            "bytes": self.nbytes,
        }

    def factors(self, version: str) -> dict[str, torch.Tensor]:
        """The held adapter ``version`` under PEFT's saved names (for checksums and tests)."""
        with self._cv:
            slot = self._slots.index(version)
        out = {}
        for name, layer in self.layers.items():
            out[f"{PREFIX}{name}.lora_A.weight"] = layer.A[slot].clone()
            out[f"{PREFIX}{name}.lora_B.weight"] = layer.B[slot].clone()
        return out
