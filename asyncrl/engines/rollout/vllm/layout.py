"""What a vLLM 0.33 engine holds after loading Hugging Face-named tensors, for ``weights.verify``.

vLLM's ``POST /weight_checker {"action": "checksum"}`` answers the sha256 of the bytes of every
parameter of the loaded model on every worker (``.cpu().contiguous()``), keyed
``dp{i}:pp{i}:pcp{i}:tp{i}:NAME`` (entrypoints/rl/online/api_router.py:232-266,
model_loader/weight_checksum.py:32-38, v1/worker/gpu_worker.py:380-391). Those parameters
are not the tensors the trainer pushes; vLLM's loader makes them (``qwen2`` below is
model_executor/models/qwen2.py, ``linear`` model_executor/layers/linear.py, ``vocab``
model_executor/layers/vocab_parallel_embedding.py):

- fused: ``q_proj``/``k_proj``/``v_proj`` into ``qkv_proj`` (rows q, k, v), ``gate_proj``/
  ``up_proj`` into ``gate_up_proj`` (rows gate, up), weights and biases alike (the stacked
  mapping, qwen2.py:325-333; offsets linear.py:1101-1107 and the merged loader's
  ``shard_id * shard_size``);
- sharded over TP: each rank holds its rows of every fused part (q: rank ``r``'s,
  linear.py:1313-1320; gate/up likewise), its columns of ``o_proj``/``down_proj``
  (``RowParallelLinear``: the input dimension), its rows of the padded vocabulary;
  everything else (norms) whole on every rank;
- padded: ``embed_tokens``/``lm_head`` have ``ceil(V / 64) * 64`` rows
  (``DEFAULT_VOCAB_PADDING_SIZE``, vocab:36, 95-97, 286-291), split evenly over TP; a rank's
  rows past the vocabulary are zero (``weight_loader``: ``param[:n].copy_``, ``param[n:]
  .fill_(0)``, vocab:517-519);
- cast: every parameter is in the model's dtype (``--dtype``; ``auto`` serves a float32
  checkpoint in bfloat16, config/model.py:2440-2442), the loaded tensor copied into it
  (``param.data.copy_``: a round-to-nearest-even cast).

:func:`held_digests` computes those digests from the pushed tensors. The dtype is not on the
wire: it is the one of float32 / bfloat16 / float16 under which the engine's digests of the
first replicated parameters (norms) equal ours (:func:`engine_dtype`). Not computed (the
keys then differ from the engine's and the check fails, saying so): other fusions
(MoE experts, MLA, already-fused checkpoints), pipeline parallelism splitting a tensor, and
TP wider than the KV heads (vLLM then replicates KV heads, linear.py:1066-1068).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

from asyncrl.engines.rollout.base import DigestReport

__all__ = [
    "DTYPES",
    "PADDING",
    "LayoutError",
    "VLLMDigests",
    "VLLMParam",
    "engine_dtype",
    "held_digests",
    "vllm_params",
]

PADDING = 64
"""``DEFAULT_VOCAB_PADDING_SIZE`` (vocab_parallel_embedding.py:36)."""
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""The float dtypes vLLM's ``--dtype`` serves a model in (config/model.py:100, 2384-2390)."""

_STACKED = {  # HF part -> (vLLM parameter, index of the part), qwen2.py:325-333
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}
_ROW_PARALLEL = (".o_proj.weight", ".down_proj.weight")  # input dim split over TP
_VOCAB = ("embed_tokens.weight", "lm_head.weight")


class LayoutError(ValueError):
    """The engine's parameters are not what this layout computes (named in the message)."""


@dataclass(frozen=True)
class VLLMParam:
    """One vLLM parameter: its name, the pushed tensors it is made of (in row order) and how."""

    name: str
    parts: tuple[str, ...]
    kind: str  # "fused" | "row" | "vocab" | "whole"


def vllm_params(names: Collection[str]) -> dict[str, VLLMParam]:
    """vLLM's parameters made of the pushed tensors ``names`` (HF names), by vLLM name.
    A fused parameter missing one of its parts raises :class:`LayoutError`."""
    fused: dict[str, dict[int, str]] = {}
    out: dict[str, VLLMParam] = {}
    for name in names:
        hit = next((k for k in _STACKED if k in name), None)
        if hit is not None:
            param, index = _STACKED[hit]
            fused.setdefault(name.replace(hit, param), {})[index] = name
        elif name.endswith(_ROW_PARALLEL):
            out[name] = VLLMParam(name, (name,), "row")
        elif name.endswith(_VOCAB):
            out[name] = VLLMParam(name, (name,), "vocab")
        else:
            out[name] = VLLMParam(name, (name,), "whole")
    for param, parts in fused.items():
        want = 3 if ".qkv_proj." in param else 2
        if sorted(parts) != list(range(want)):
            got = ", ".join(parts[i] for i in sorted(parts))
            raise LayoutError(f"{param}: vLLM fuses {want} tensors into it, pushed only {got}")
        out[param] = VLLMParam(param, tuple(parts[i] for i in range(want)), "fused")
    return out


def _shard(t: torch.Tensor, dim: int, rank: int, tp: int, name: str) -> torch.Tensor:
    if t.shape[dim] % tp:
        raise LayoutError(f"{name}: {t.shape[dim]} not divisible over TP {tp}")
    size = t.shape[dim] // tp
    return t.narrow(dim, rank * size, size)


def held_tensor(
    p: VLLMParam, pushed: Mapping[str, torch.Tensor], rank: int, tp: int, dtype: torch.dtype
) -> torch.Tensor:
    """The tensor TP rank ``rank`` of ``tp`` holds as ``p`` after loading ``pushed``."""
    parts = [pushed[n] for n in p.parts]
    if p.kind == "fused":
        t = torch.cat([_shard(x, 0, rank, tp, n) for x, n in zip(parts, p.parts, strict=True)])
    elif p.kind == "row":
        t = _shard(parts[0], 1, rank, tp, p.name)
    elif p.kind == "vocab":
        x = parts[0]
        padded = -(-x.shape[0] // PADDING) * PADDING
        rows = padded // tp if padded % tp == 0 else -1
        if rows < 0:
            raise LayoutError(f"{p.name}: {padded} padded rows not divisible over TP {tp}")
        t = torch.zeros((rows, *x.shape[1:]), dtype=dtype)
        start, end = min(rank * rows, x.shape[0]), min((rank + 1) * rows, x.shape[0])
        t[: end - start].copy_(x[start:end])
        return t
    else:
        t = parts[0]
    return t.to(dtype)


def _sha(t: torch.Tensor) -> str:
    raw = t.detach().cpu().contiguous().view(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy().data).hexdigest()


def split_key(key: str) -> tuple[str, str]:
    """vLLM's ``dp:pp:pcp:tp:NAME`` key as (``tp{i}``, NAME); a key of another form is
    (``""``, key)."""
    head = key.split(":", 4)
    if len(head) == 5 and head[3].startswith("tp"):
        return head[3], head[4]
    return "", key


def engine_dtype(
    params: Mapping[str, VLLMParam],
    pushed: Mapping[str, torch.Tensor],
    held: Mapping[str, set[str]],
    tp: int,
    probes: int = 4,
) -> torch.dtype | None:
    """The dtype the engine holds: the one of :data:`DTYPES` under which most of the first
    ``probes`` whole (replicated) parameters' digests equal the engine's on TP rank 0
    (``held``: ``tp0:NAME`` -> its workers' digests); on a tie (values the dtypes write
    alike, e.g. 2.0 in bfloat16 and float16) every parameter of rank 0 decides. None when no
    dtype explains any digest."""
    ranked = sorted(params.values(), key=lambda p: (p.kind != "whole", _numel(p, pushed), p.name))
    for pool in (ranked[:probes], ranked):
        hits = {
            dtype: sum(
                held.get(f"tp0:{p.name}") == {_sha(held_tensor(p, pushed, 0, tp, dtype))}
                for p in pool
            )
            for dtype in DTYPES
        }
        best = max(hits.values())
        winners = [d for d, n in hits.items() if n == best]
        if best and len(winners) == 1:
            return winners[0]
    return None


def _numel(p: VLLMParam, pushed: Mapping[str, torch.Tensor]) -> int:
    return sum(pushed[n].numel() for n in p.parts)


def held_digests(
    params: Mapping[str, VLLMParam],
    pushed: Mapping[str, torch.Tensor],
    tp: int,
    dtype: torch.dtype,
    only: Collection[str] | None = None,
) -> dict[str, str]:
    """``tp{r}:NAME`` -> the digest TP rank ``r`` of ``tp`` reports for vLLM parameter NAME
    after loading ``pushed`` in ``dtype`` (``only``: just those keys)."""
    out: dict[str, str] = {}
    for p in params.values():
        for r in range(tp):
            key = f"tp{r}:{p.name}"
            if only is None or key in only:
                out[key] = _sha(held_tensor(p, pushed, r, tp, dtype))
    return out


class VLLMDigests:
    """vLLM's ``/weight_checker`` answer compared with the pushed tensors (the family's
    ``compare_digests``); the engine's dtype, once found, is kept."""

    def __init__(self) -> None:
        self.dtype: torch.dtype | None = None

    def __call__(
        self,
        pushed: Mapping[str, torch.Tensor],
        answer: dict[str, str],
        sample: int | None,
        seed: int,
    ) -> DigestReport:
        held: dict[str, set[str]] = {}
        for key, digest in answer.items():
            rank, name = split_key(key)
            if not rank:
                raise LayoutError(f"/weight_checker key {key!r} is not vLLM's dp:pp:pcp:tp:NAME")
            held.setdefault(f"{rank}:{name}", set()).add(digest)
        tp = len({k.split(":", 1)[0] for k in held})
        params = vllm_params(list(pushed))
        if "lm_head.weight" in params and "tp0:lm_head.weight" not in held:
            del params["lm_head.weight"]  # tied: vLLM's lm_head is embed_tokens (qwen2.py:486-487)
        ours = {f"tp{r}:{p}" for p in params for r in range(tp)}
        if ours != set(held):
            extra, missing = sorted(set(held) - ours), sorted(ours - set(held))
            raise LayoutError(
                f"vLLM holds {len(held)} tensors over TP {tp}, asyncrl computes {len(ours)} from "
                f"the pushed ones: held but not computed: {', '.join(extra[:4]) or 'none'}; "
                f"computed but not held: {', '.join(missing[:4]) or 'none'} (asyncrl knows "
                "Qwen2/Llama-style fusions only; see engines/rollout/vllm/layout.py)"
            )
        dtype = self.dtype or engine_dtype(params, pushed, held, tp)
        if dtype is None:  # no dtype explains any digest: every tensor differs
            return DigestReport(len(held), len(held), sorted(held))  # (in any dtype)
        self.dtype = dtype
        keys = sorted(held)
        if sample is not None and sample < len(keys):
            keys = sorted(random.Random(seed).sample(keys, sample))
        want = held_digests(params, pushed, tp, dtype, set(keys))
        wrong = [k for k in keys if held[k] != {want[k]}]
        return DigestReport(len(keys), len(held), wrong)
