"""A lean decode step for Llama-style models: one token per row against the cached past.

The engine's decode step is one new token per running row. Through the transformers
model it pays the generic forward's per-call work — mask preparation, output
records, keyword plumbing, module hooks, rotary tables recomputed per step, an
attention call per layer through the attention interface — which on a small model
or a nearly empty batch (the long tail of a batch) is most of the step. Here the
same arithmetic runs as plain tensor ops on the model's own parameters:

- embedding, then per layer: RMSNorm, q/k/v projections (Qwen3's per-head q/k
  norms), rotary embedding, the cache write (:meth:`GrowingLayer.update`),
  attention, output projection, residual, RMSNorm, SwiGLU MLP, residual; final
  RMSNorm and the LM head — the order and formulas of transformers' Llama, Mistral,
  Qwen2 and Qwen3 (float32 results equal the stock forward's up to the attention's
  summation order);
- rotary cos/sin come from the model's own rotary module, computed once for a range
  of positions and reused (static rope types only: ``default``, ``linear``,
  ``llama3``);
- attention for one query token is a batched matmul over each bucket's last ``n``
  columns (the engine's :mod:`~asyncrl.engines.rollout.local.attention` plan),
  an additive padding mask, softmax (float32) and a matmul with the values; GQA
  without repeating keys (the query heads of one key/value head share its rows).

Parameters are read from the modules at every step, so a weight load (in place or by
swapping ``.data``) is seen by the next step. :meth:`LeanDecoder.build` returns None
for anything else (another architecture, sliding-window layers, a non-SiLU MLP, a
dynamic rope, LoRA-wrapped or otherwise replaced linear layers): the engine then uses
the model's forward. Prefill always uses the model's forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncrl.engines.rollout.local.attention import Plan

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from asyncrl.engines.rollout.local.kv import GrowingLayer

__all__ = ["LeanDecoder"]

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
STATIC_ROPES = ("default", "linear", "llama3")


def _rms(x: torch.Tensor, norm: Any) -> torch.Tensor:
    """transformers' Llama/Qwen RMSNorm (float32 inside, weight times the input dtype); in
    float32 torch's ``rms_norm`` (the same formula in one call instead of six: on a CPU a
    composite kernel, ~11 us against ~15 us at 15 x 64)."""
    dtype = x.dtype
    if dtype == torch.float32 and norm.weight.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], norm.weight, norm.variance_epsilon)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(dtype)


def _linear(x: torch.Tensor, m: nn.Linear) -> torch.Tensor:
    return F.linear(x, m.weight, m.bias)


def _residual(h: torch.Tensor, x: torch.Tensor, m: nn.Linear) -> torch.Tensor:
    """``h + m(x)``; in float32 without a bias one ``addmm`` (no separate add; in half
    precision it would round once where the model's forward rounds the product, then the sum)."""
    if m.bias is None and h.dtype == torch.float32:
        return torch.addmm(h, x, m.weight.t())
    return h + F.linear(x, m.weight, m.bias)


def _is_rms(m: object) -> bool:
    return type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon")


def _supported(model: PreTrainedModel) -> bool:
    cfg = model.config
    inner = getattr(model, "model", None)
    if cfg.model_type not in MODEL_TYPES or inner is None:
        return False
    if getattr(cfg, "hidden_act", None) != "silu":
        return False
    if getattr(getattr(inner, "rotary_emb", None), "rope_type", None) not in STATIC_ROPES:
        return False
    types = getattr(cfg, "layer_types", None)
    if any(t != "full_attention" for t in types or ()):
        return False
    if not types and getattr(cfg, "sliding_window", None) is not None:
        return False
    linears = [model.lm_head]
    for layer in inner.layers:
        a, m = layer.self_attn, layer.mlp
        linears += [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [getattr(a, n) for n in ("q_norm", "k_norm") if hasattr(a, n)]
        if not all(_is_rms(n) for n in norms):
            return False
    plain = all(type(m) is nn.Linear for m in linears)
    return plain and type(inner.embed_tokens) is nn.Embedding and _is_rms(inner.norm)


class LeanDecoder:
    """The decode forward of a supported model (see the module docstring)."""

    def __init__(self, model: PreTrainedModel):
        inner = model.model
        self.model, self.inner = model, inner
        attn = inner.layers[0].self_attn
        self.head_dim = int(attn.head_dim)
        self.kv_heads = int(model.config.num_key_value_heads)
        self.heads = int(model.config.num_attention_heads)
        self.group = self.heads // self.kv_heads
        self.scaling = float(attn.scaling)
        self._table = torch.empty(0)  # rotary (cos, folded sin) of positions [0, len): (len, 2, d)

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.embed_tokens.weight.dtype

    @classmethod
    def build(cls, model: PreTrainedModel) -> LeanDecoder | None:
        """A decoder for ``model``, or None when it is not one this module reproduces."""
        return cls(model) if _supported(model) else None

    def _rotary(self, positions: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin (``rotate_half``'s minus on the first half) per row."""
        if top >= self._table.shape[0]:
            n = max(64, 2 * top)
            weight = self.inner.embed_tokens.weight
            pos = torch.arange(n, device=weight.device)[None]
            cos, sin = self.inner.rotary_emb(weight[:1], pos)
            half = self.head_dim // 2
            folded = torch.cat((-sin[0, :, :half], sin[0, :, half:]), -1)
            self._table = torch.stack((cos[0], folded), 1)
        both = self._table.index_select(0, positions)  # one gather for cos and sin
        return both[:, :1], both[:, 1:]

    def __call__(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        top: int,
        bias: torch.Tensor,
        layers: list[GrowingLayer],
        plan: Plan | None,
    ) -> torch.Tensor:
        """Logits ``(rows, vocab)`` of one new token per row: ``ids`` ``(rows,)`` the tokens,
        ``positions`` ``(rows,)`` their positions (``top`` the largest), ``bias`` ``(rows,
        width + 1)`` the additive padding mask (0 attend, -inf not) of the cache after this
        step's write, ``layers`` the cache, ``plan`` the attention buckets (None: one)."""
        rows, d, half = ids.shape[0], self.head_dim, self.head_dim // 2
        cos, sin = self._rotary(positions, top)
        masks = self._masks(bias, plan)
        h = F.embedding(ids, self.inner.embed_tokens.weight)
        for layer, cache in zip(self.inner.layers, layers, strict=True):
            a = layer.self_attn
            x = _rms(h, layer.input_layernorm)
            q = _linear(x, a.q_proj).view(rows, self.heads, d)
            k = _linear(x, a.k_proj).view(rows, self.kv_heads, d)
            v = _linear(x, a.v_proj).view(rows, self.kv_heads, 1, d)
            if hasattr(a, "q_norm"):
                q, k = _rms(q, a.q_norm), _rms(k, a.k_norm)
            qk = torch.cat((q, k), 1)  # rotary of the query and key heads at once
            qk = qk * cos + qk.roll(half, -1) * sin
            keys, values = cache.update(qk[:, self.heads :, None], v)
            o = self._attend(qk[:, : self.heads].contiguous(), keys, values, masks, plan)
            h = _residual(h, o, a.o_proj)
            x = _rms(h, layer.post_attention_layernorm)
            m = layer.mlp
            h = _residual(h, F.silu(_linear(x, m.gate_proj)) * _linear(x, m.up_proj), m.down_proj)
        return _linear(_rms(h, self.inner.norm), self.model.lm_head)

    def _masks(self, bias: torch.Tensor, plan: Plan | None) -> list[torch.Tensor]:
        """Each bucket's mask in the batched matmul's layout ``(rows x kv heads, group, n)``."""
        buckets = plan or [(0, bias.shape[0], bias.shape[1])]
        out = []
        for a, b, n in buckets:
            m = bias[a:b, None, None, -n:].expand(b - a, self.kv_heads, self.group, n)
            out.append(m.reshape((b - a) * self.kv_heads, self.group, n))
        return out

    def _attend(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        masks: list[torch.Tensor],
        plan: Plan | None,
    ) -> torch.Tensor:
        """Attention of one query per row, ``(rows, heads x head_dim)``."""
        rows, d = q.shape[0], self.head_dim
        buckets = plan or [(0, rows, keys.shape[2])]
        out = q.new_empty(rows, self.heads * d)  # each bucket's bmm writes its rows here
        for (a, b, n), mask in zip(buckets, masks, strict=True):
            kv = (b - a) * self.kv_heads
            qb = q[a:b].reshape(kv, self.group, d)
            kb = keys[a:b, :, -n:].reshape(kv, n, d)
            vb = values[a:b, :, -n:].reshape(kv, n, d)
            s = torch.baddbmm(mask, qb, kb.transpose(1, 2), alpha=self.scaling)
            p = torch.softmax(s, -1, dtype=torch.float32).to(q.dtype)
            torch.bmm(p, vb, out=out[a:b].view(kv, self.group, d))
        return out
