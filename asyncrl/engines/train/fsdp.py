"""FSDP2 training engine: a Hugging Face actor (causal LM) or critic (value head), sharded
with ``fully_shard`` per decoder layer plus the root.

Runs one process per rank over the default process group (Gloo on CPU, NCCL on
CUDA; :func:`init_process_group` makes one). Without a process group the model
stays a plain (unsharded) module at world size 1, for tools and tests. Every
rank runs the same number of micro-batches (padded with empty ones when its
shard is smaller), so the collectives inside FSDP always line up. See
``asyncrl.engines.train.base`` for the contract; checkpoints and Hugging Face
export live in ``checkpoint.py``.
"""

from __future__ import annotations

import datetime
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Literal, cast

import msgspec
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from asyncrl import trace
from asyncrl.config import RunConfig
from asyncrl.engines.train import checkpoint, lora
from asyncrl.engines.train.base import LossFn, Role, Seq, all_reduce_floats
from asyncrl.engines.train.micro_batch import (
    MicroBatch,
    micro_batch_overhead,
    packing_pays,
    prepare_inputs,
    response_entropy,
    response_logprobs,
    response_values,
    split_by_cost,
    split_by_tokens,
    token_cost,
)
from asyncrl.engines.train.schedule import lr_schedule

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["FSDPEngine", "init_process_group"]

Output = Literal["logp", "entropy"]
# Output preparation never writes into the model's outputs in place.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
_PACKABLE = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
_VARLEN = ("flash_attention_2", "flash_attention_3", "flex_attention")
"""Backends whose packed attention costs what each sequence's own would (no whole-row square)."""


def init_process_group(
    rank: int,
    world_size: int,
    port: int = 0,
    device: str = "cpu",
    store: dist.Store | None = None,
) -> None:
    """The trainer's default process group (Gloo on CPU, NCCL on CUDA; 10-minute timeout):
    rendezvous through ``store`` when given, else a TCP store on 127.0.0.1:``port``."""
    dist.init_process_group(
        "nccl" if device.startswith("cuda") else "gloo",
        init_method=None if store is not None else f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(minutes=10),
        store=store,
    )


def _build_model(model_path: str, role: Role, dtype: torch.dtype, seed: int) -> PreTrainedModel:
    """The HF model of ``role``; fresh heads are initialised identically on every rank."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if role == "actor":
            return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        if role == "critic":
            cfg = AutoConfig.from_pretrained(model_path, num_labels=1)
            cfg.classifier_dropout = 0.0  # values must be deterministic in train mode
            return AutoModelForTokenClassification.from_pretrained(
                model_path, config=cfg, dtype=dtype
            )
    raise ValueError(f"role must be 'actor' or 'critic', got {role!r}")


class FSDPEngine:
    """TrainEngine + EngineState over FSDP2 (see ``asyncrl.engines.train.base``).

    ``role="actor"``: per-token outputs are response log-probs; ``role="critic"``: the
    same HF directory loaded with a one-output token-classification head
    (``score``, new unless the folder is a critic export), outputs are values.
    """

    def __init__(self, model_path: str, config: RunConfig, role: Role = "actor"):
        self.config, self.role, self.model_path = config, role, model_path
        tc = config.trainer
        self.device = torch.device(tc.device)
        grouped = dist.is_initialized()
        if self.device.type == "cuda" and self.device.index is None and grouped:
            # one GPU per rank: the rank's local GPU
            self.device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        self.world = dist.get_world_size() if grouped else 1
        if not grouped and tc.mixed_precision != "none":
            raise ValueError("trainer.mixed_precision needs a process group (init_process_group)")
        # One rank alone has nothing to shard or reduce: the model stays a plain module (no
        # FSDP hooks, no all-gather copies), unless FSDP's mixed precision is asked for.
        # Without a process group (tools, tests) it is a plain module at world size 1 too.
        self.sharded = grouped and (self.world > 1 or tc.mixed_precision != "none")
        self.dtype = getattr(torch, config.model.dtype)
        model = _build_model(model_path, role, self.dtype, config.seed)
        self.hf_class = type(model).__name__
        model.config.use_cache = False
        self.pad_id = model.config.pad_token_id or 0
        attn = getattr(model.config, "_attn_implementation", None) or "eager"
        self.packed = tc.packing == "on" or (
            tc.packing == "auto" and attn in _PACKABLE and _packing_supported()
        )
        """Whether micro-batches may be packed; with ``packing = "auto"`` each one is packed
        only where that costs less compute than padding (:func:`packing_pays`)."""
        self.choose_layout = tc.packing == "auto" and self.packed
        self.varlen = attn in _VARLEN
        self.token_cost = token_cost(model.config)
        self.overhead = micro_batch_overhead(model.config)
        self.by_cost = not self.packed or (self.choose_layout and not self.varlen)
        """Whether micro-batches are cut by modelled cost (:func:`split_by_cost`: similar
        lengths together), i.e. wherever they may go padded and a packed row would not
        attend per sequence; else balanced by tokens (:func:`split_by_tokens`)."""
        self.causal = _causal(model)
        if tc.activation_checkpointing:
            _enable_activation_checkpointing(model)
        self.lora = config.lora.enabled and role == "actor"
        """Only a LoRA adapter trains (PEFT); ``named_weights`` yields the adapter alone."""
        if self.lora:
            # a PeftModel: a torch Module that forwards what it lacks to the HF model
            model = cast("PreTrainedModel", lora.wrap(model, config.lora))
        # PreTrainedModel.to is @functools.wraps(nn.Module.to): typeshed types it unbound
        self.units = self._shard(model.to(self.device))  # type: ignore[arg-type]
        self.model = model
        trainable = [p for p in model.parameters() if p.requires_grad]
        # foreach: one multi-tensor kernel per update term, bit-identical to the per-tensor
        # loop torch picks by default on a CPU (a Python loop over every parameter)
        self.optimizer = torch.optim.AdamW(
            trainable, lr=tc.lr, weight_decay=tc.weight_decay, betas=tc.adam_betas, foreach=True
        )
        if self.lora and config.lora.lr > 0:  # the adapter's own rate (lora.lr)
            tc = msgspec.structs.replace(tc, lr=config.lora.lr)
        self.lr_at = lr_schedule(tc, config.controller.total_steps)
        self.step = 0
        self.offloaded = False

    def _shard(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """``fully_shard`` every decoder layer (HF ``_no_split_modules``), then the root."""
        if not self.sharded:
            return [("", model)]
        tc = self.config.trainer
        mp = MixedPrecisionPolicy()
        if tc.mixed_precision == "bf16":
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        reshard = tc.reshard_after_forward
        after_forward = self.world > 1 if reshard is None else reshard
        blocks = set(getattr(model, "_no_split_modules", None) or ())
        units = [(n, m) for n, m in model.named_modules() if type(m).__name__ in blocks]
        if not units:
            raise ValueError(f"{type(model).__name__} names no decoder layer (_no_split_modules)")
        for _, m in units:
            fully_shard(m, mp_policy=mp, reshard_after_forward=after_forward)
        fully_shard(model, mp_policy=mp, reshard_after_forward=after_forward)
        return [*units, ("", model)]

    # -- one execution path ------------------------------------------------------------
    def forward_backward_batch(
        self,
        seqs: Sequence[Seq],
        loss_fn: LossFn | None,
        forward_only: bool = False,
        output: Output = "logp",
    ) -> tuple[list[torch.Tensor], dict[str, float]]:
        if output == "entropy" and self.role != "actor":
            raise ValueError("output='entropy' needs an actor (a critic outputs values)")
        if any(s.prompt_len < 1 for s in seqs):
            raise ValueError(
                "every Seq needs prompt_len >= 1 (a position predicts each response token)"
            )
        if not forward_only and loss_fn is None:
            raise ValueError("forward_backward_batch needs a loss_fn unless forward_only=True")
        lengths = [s.input_ids.shape[0] for s in seqs]
        groups = self._split(lengths)
        count = int(all_reduce_floats(len(groups), op=dist.ReduceOp.MAX)[0])
        if count > len(groups):  # every rank runs as many micro-batches as the busiest
            groups = self._split(lengths, count)
        denom = 1.0
        weights: list[torch.Tensor] = []
        if loss_fn is not None and not forward_only:
            weights = [loss_fn.token_weight(s) for s in seqs]  # once per sequence
            total = float(torch.cat(weights).sum()) if weights else 0.0
            (denom,) = all_reduce_floats(total)
        # FSDP averages gradients over ranks; undo that so the sum over ranks is global.
        scale = self.world / max(denom, 1e-12)
        outputs: list[torch.Tensor | None] = [None] * len(seqs)
        stats: dict[str, float] = {}
        self.model.train(not forward_only)
        with torch.set_grad_enabled(not forward_only):
            for g, idx in enumerate(groups):
                if not forward_only and self.sharded and self.world == 1:
                    # nothing to reduce at world size 1: accumulate unsharded, sync once
                    # fully_shard swapped the model's class for an FSDPModule subclass
                    cast(FSDPModule, self.model).set_requires_gradient_sync(g == len(groups) - 1)
                mb = [seqs[i] for i in idx]
                w = torch.cat([weights[i] for i in idx]) if weights and idx else None
                outs = self._micro_batch(mb, loss_fn, scale, forward_only, output, stats, w)
                for i, out in zip(idx, outs, strict=True):
                    outputs[i] = out
        if forward_only and self.sharded:  # no backward reshards what forward kept gathered
            for _, unit in self.units:
                cast(FSDPModule, unit).reshard()  # sharded: every unit is an FSDPModule
        done = [o for o in outputs if o is not None]
        assert len(done) == len(outputs)
        return done, stats

    def _split(self, lengths: list[int], min_count: int = 1) -> list[list[int]]:
        budget = self.config.trainer.micro_batch_tokens
        if self.by_cost:
            return split_by_cost(lengths, budget, self.token_cost, self.overhead, min_count)
        return split_by_tokens(lengths, budget, min_count)

    def _micro_batch(
        self,
        seqs: list[Seq],
        loss_fn: LossFn | None,
        scale: float,
        forward_only: bool,
        output: Output,
        stats: dict[str, float],
        weight: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Input preparation -> model -> output preparation (-> loss, backward) of a micro-batch
        (``weight``: the loss's token weights of its sequences, concatenated)."""
        if not seqs:  # an empty micro-batch still joins the collectives
            ids = torch.full((1, 1), self.pad_id, dtype=torch.long, device=self.device)
            out = self.model(input_ids=ids).logits
            if not forward_only:
                (out.sum() * 0.0).backward()
            return []
        packed = self.packed
        if self.choose_layout:
            lens = [s.input_ids.shape[0] for s in seqs]
            packed = packing_pays(lens, self.token_cost, self.varlen)
        trim = self.role == "actor"
        mb = prepare_inputs(seqs, packed, trim, pad_id=self.pad_id, causal=self.causal)
        logits = self._run_model(mb)
        if self.role == "critic":
            outs = response_values(logits, mb)
        elif output == "entropy":
            outs = response_entropy(logits, mb)
        else:
            outs = response_logprobs(logits, mb)
        if not forward_only:
            assert loss_fn is not None
            if self.role == "actor" and getattr(loss_fn, "needs_entropy", False):
                for s, ent in zip(mb.seqs, response_entropy(logits, mb), strict=True):
                    s.fields["entropy"] = ent  # on the micro-batch's copies, with grad
            loss, info = loss_fn(torch.cat(outs), mb.seqs)
            if weight is None:
                weight = torch.cat([loss_fn.token_weight(s) for s in mb.seqs])
            ((loss * weight.to(loss.device)).sum() * scale).backward()
            if info:  # one device-to-host copy for every stat
                vals = [torch.as_tensor(v, device=loss.device).detach() for v in info.values()]
                got = torch.stack([v.double().reshape(()) for v in vals])
                for k, v in zip(info, got.tolist(), strict=True):
                    stats[k] = stats.get(k, 0.0) + v
        return [o.detach() for o in outs]

    def _run_model(self, mb: MicroBatch) -> torch.Tensor:
        inputs = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in mb.inputs.items()}
        return self.model(**inputs).logits

    def train_batch(self, seqs: Sequence[Seq], loss_fn: LossFn) -> dict[str, float]:
        tracer = trace.get()
        self.optimizer.zero_grad(set_to_none=True)
        with tracer.span(f"{self.role} forward/backward", "trainer", {"seqs": len(seqs)}):
            _, stats = self.forward_backward_batch(seqs, loss_fn)
        with tracer.span(f"{self.role} optimizer step", "trainer"):
            stats.update(self.optimizer_step())
        return stats

    def forward_batch(self, seqs: Sequence[Seq], output: Output = "logp") -> list[torch.Tensor]:
        with trace.get().span(f"{self.role} forward ({output}, no grad)", "trainer"):
            outputs, _ = self.forward_backward_batch(seqs, None, forward_only=True, output=output)
        return outputs

    def optimizer_step(self) -> dict[str, float]:
        """Clip, step (unless the grad norm is non-finite), advance the LR schedule."""
        clip = self.config.trainer.grad_clip
        lr = self.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(
            params, clip if clip > 0 else float("inf"), foreach=True
        )
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        grad_norm = float(norm)
        self.step += 1
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            return {"grad_norm": grad_norm, "lr": lr, "skipped": 1.0}
        self.optimizer.step()
        return {"grad_norm": grad_norm, "lr": lr, "skipped": 0.0}

    # -- state -------------------------------------------------------------------------
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors under HF names, gathered one FSDP unit (decoder layer) at a time; with
        LoRA only the adapter's, under PEFT's saved names (``engines.train.lora``)."""
        if not self.lora:
            yield from self.named_parameters_full()
            return
        for name, t in self.named_parameters_full(lora.is_adapter_param):
            yield lora.saved_name(name), t

    def named_parameters_full(
        self, keep: Callable[[str], bool] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter (those whose name ``keep`` accepts) as a full tensor under the
        model's own names, gathered one FSDP unit at a time (collective: every rank)."""
        for prefix, unit in self.units:
            owned = [(n, p) for n, p in unit.named_parameters() if not _in_child(n, unit)]
            named = [(f"{prefix}.{n}" if prefix else n, p) for n, p in owned]
            full = [(n, _full(p)) for n, p in named if keep is None or keep(n)]
            for name, t in full:
                yield name, t.detach()

    def save(self, path: str, async_group: dist.ProcessGroup | None = None) -> Future | None:
        """Collective; see :func:`asyncrl.engines.train.checkpoint.save` (``async_group``:
        write in the background, the future completes when the files are complete)."""
        return checkpoint.save(self, path, async_group)

    def load(self, path: str) -> None:
        checkpoint.load(self, path)

    def export_hf(self, path: str) -> None:
        checkpoint.export_hf(self, path)

    def offload(self) -> None:
        """Parameters, gradients and optimizer state to CPU (colocated runs free the GPU)."""
        self._place(torch.device("cpu"))
        self.offloaded = True

    def onload(self) -> None:
        self._place(self.device)
        self.offloaded = False

    def _place(self, device: torch.device) -> None:
        if self.device.type == "cpu":
            return
        self.model.to(device)  # type: ignore[arg-type]  # as in __init__: a wraps()-typed .to
        for state in self.optimizer.state.values():
            for k, v in state.items():
                if torch.is_tensor(v) and k != "step":
                    state[k] = v.to(device, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        else:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def _full(p: torch.Tensor) -> torch.Tensor:
    """A full copy of a (possibly sharded) parameter that outlives FSDP's buffers."""
    return p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()


def _enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Non-reentrant activation checkpointing of every decoder layer (HF's own switch)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _causal(model: nn.Module) -> bool:
    """Whether every attention module of ``model`` says it attends causally (Hugging Face
    attention modules carry ``is_causal``), and it has at least one."""
    flags = [getattr(m, "is_causal", None) for m in model.modules()]
    said = [f for f in flags if isinstance(f, bool)]
    return bool(said) and all(said)


def _packing_supported() -> bool:
    """Whether this transformers derives a block-diagonal mask from restarting position ids."""
    try:
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
    except ImportError:
        return False
    return True


def _in_child(name: str, unit: nn.Module) -> bool:
    """Whether parameter ``name`` of ``unit`` belongs to a nested FSDP unit (gathered there)."""
    parts = name.split(".")[:-1]
    mod = unit
    for part in parts:
        mod = getattr(mod, part)
        if isinstance(mod, FSDPModule):
            return True
    return False
