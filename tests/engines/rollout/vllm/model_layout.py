"""The parameters a vLLM 0.33 worker holds for a Qwen2 checkpoint, loaded as vLLM's loader does.

The stand-in's receiving ranks (``rank.py``) keep what they received by Hugging Face name
(the live model generates with it); what vLLM's ``/weight_checker`` hashes is something else:
the parameters of vLLM's ``Qwen2ForCausalLM`` on that TP rank, in the served dtype
(model_loader/weight_checksum.py:32-38 hashes ``model.named_parameters()``). This module builds
those parameters the way vLLM creates them and loads every received tensor into them through
an imitation of vLLM's weight loaders (``qwen2`` = model_executor/models/qwen2.py, ``linear``
= model_executor/layers/linear.py, ``vocab`` = model_executor/layers/vocab_parallel_embedding.py,
vLLM 0.33.0):

- parameters (qwen2.py:81-117, 118-176, 324-386, 458-487): ``embed_tokens`` and ``lm_head``
  with the vocabulary padded to a multiple of 64 and split over TP (vocab:36, 95-97, 286-305);
  ``qkv_proj`` (weight and bias: rows ``num_heads/tp`` q heads, then ``max(1, kv/tp)`` k and v
  heads, linear.py:1060-1078) and ``gate_up_proj`` (``2 * intermediate/tp`` rows), ``o_proj``
  and ``down_proj`` with their input split over TP (``RowParallelLinear``), norms whole;
  ``lm_head`` is ``embed_tokens`` when tied (qwen2.py:486-487: one parameter, hashed once).
  All in ``params_dtype`` = the served dtype (vocab:335-336; ``--dtype auto`` serves a
  float32 checkpoint in bfloat16, config/model.py:2440-2442).
- loading (``AutoWeightsLoader`` with the stacked mapping, qwen2.py:325-333): ``q``/``k``/``v``
  into their offsets of ``qkv_proj`` (linear.py:1101-1107), this rank's shard of the loaded
  tensor (q: ``tp_rank``, k/v: ``tp_rank // replicas``; linear.py:1312-1320); ``gate``/``up``
  at ``shard_id * intermediate/tp`` (the merged loader); row-parallel: this rank's columns;
  vocab tables: this rank's rows of the vocabulary, the rest of the shard zero
  (vocab:490-519); every copy a ``param.data.copy_`` (a cast into the served dtype).

Written from that source, not from asyncrl's ``engines/rollout/vllm/layout.py`` (which
computes the same digests its own way, by slicing and concatenating): the test compares two
independent readings of vLLM.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

__all__ = ["VLLMQwen2", "served_dtype"]

_STACKED = {  # qwen2.py:325-333: weight_name -> (param_name, shard_id)
    ".q_proj": (".qkv_proj", "q"),
    ".k_proj": (".qkv_proj", "k"),
    ".v_proj": (".qkv_proj", "v"),
    ".gate_proj": (".gate_up_proj", 0),
    ".up_proj": (".gate_up_proj", 1),
}


def served_dtype(model_path: str, dtype: str) -> torch.dtype:
    """vLLM's ``--dtype`` resolved (config/model.py:2384-2390, 2440-2445; bfloat16 first among
    a GPU's supported dtypes): ``auto`` is the checkpoint's, float32 served in bfloat16."""
    if dtype != "auto":
        return {"half": torch.float16, "float": torch.float32}.get(dtype) or getattr(torch, dtype)
    config = json.loads((Path(model_path) / "config.json").read_text())
    stored = getattr(torch, str(config.get("dtype") or config.get("torch_dtype") or "float32"))
    return torch.bfloat16 if stored == torch.float32 else stored


class VLLMQwen2:
    """vLLM's ``Qwen2ForCausalLM`` parameters on TP rank ``rank`` of ``tp`` (module docstring)."""

    def __init__(self, model_path: str, rank: int, tp: int, dtype: torch.dtype):
        c: dict[str, Any] = json.loads((Path(model_path) / "config.json").read_text())
        self.rank, self.tp = rank, tp
        hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
        heads = c["num_attention_heads"]
        kv = c.get("num_key_value_heads") or heads
        self.head_dim = hidden // heads
        self.q_heads = heads // tp  # qwen2.py:136-137
        self.kv_heads = max(1, kv // tp)  # linear.py:1066-1071
        self.kv_replicas = max(1, tp // kv)
        self.inter = inter // tp
        self.vocab = vocab
        padded = -(-vocab // 64) * 64  # pad_vocab_size, vocab:95-97
        self.vocab_rows = padded // tp
        qkv_rows = (self.q_heads + 2 * self.kv_heads) * self.head_dim

        def new(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype)

        p: dict[str, torch.Tensor] = {"model.embed_tokens.weight": new(self.vocab_rows, hidden)}
        for i in range(c["num_hidden_layers"]):
            pre = f"model.layers.{i}."
            p[pre + "self_attn.qkv_proj.weight"] = new(qkv_rows, hidden)
            p[pre + "self_attn.qkv_proj.bias"] = new(qkv_rows)  # bias=True, qwen2.py:158-165
            p[pre + "self_attn.o_proj.weight"] = new(hidden, heads * self.head_dim // tp)
            p[pre + "mlp.gate_up_proj.weight"] = new(2 * self.inter, hidden)
            p[pre + "mlp.down_proj.weight"] = new(hidden, self.inter)
            p[pre + "input_layernorm.weight"] = new(hidden)
            p[pre + "post_attention_layernorm.weight"] = new(hidden)
        p["model.norm.weight"] = new(hidden)
        self.tied = bool(c.get("tie_word_embeddings"))
        if not self.tied:  # tied: lm_head is embed_tokens (qwen2.py:486-487)
            p["lm_head.weight"] = new(self.vocab_rows, hidden)
        self.params = p

    def load(self, name: str, w: torch.Tensor) -> None:
        """One checkpoint tensor through vLLM's loader (module docstring)."""
        if name == "lm_head.weight" and self.tied:
            return  # AutoWeightsLoader skips it (the tied head is embed_tokens)
        for part, (fused, shard) in _STACKED.items():
            if part in name:
                param = self.params[name.replace(part, fused)]
                if isinstance(shard, str):  # QKVParallelLinear.weight_loader
                    self._load_qkv(param, w, shard)
                else:  # MergedColumnParallelLinear.weight_loader
                    dst = param.narrow(0, shard * self.inter, self.inter)
                    dst.copy_(w.narrow(0, self.rank * self.inter, self.inter))
                return
        param = self.params[name]
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            start = min(self.rank * self.vocab_rows, self.vocab)  # vocab:398-402
            end = min((self.rank + 1) * self.vocab_rows, self.vocab)
            loaded = w.narrow(0, start, end - start)
            param[: loaded.shape[0]].data.copy_(loaded)  # vocab:517-519
            param[loaded.shape[0] :].data.fill_(0)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):  # RowParallelLinear
            cols = param.shape[1]
            param.copy_(w.narrow(1, self.rank * cols, cols))
        else:
            param.copy_(w)

    def _load_qkv(self, param: torch.Tensor, w: torch.Tensor, shard: str) -> None:
        q, kv = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard]  # linear:1101-1115
        shard_rank = self.rank if shard == "q" else self.rank // self.kv_replicas  # :1313-1317
        param.narrow(0, offset, size).copy_(w.narrow(0, shard_rank * size, size))  # :1312-1337

    def digests(self) -> dict[str, str]:
        """sha256 of each parameter's bytes, by vLLM name (weight_checksum.py:32-38)."""
        return {
            n: hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
            for n, t in self.params.items()
        }
