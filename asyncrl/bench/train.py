"""Train-step throughput: the FSDP2 engine's ``train_batch`` vs a plain PyTorch step.

``asyncrl bench train [--budgets 512,2048] [--steps 3] [--device cpu] [--json PATH]``

Both sides train the same Hugging Face model (a randomly initialised Qwen2 of
``--hidden``/``--layers`` written to a temporary folder, or ``--model-path``)
on the same batch of variable-length sequences with the same token-mean
policy-gradient loss, AdamW and gradient clipping:

- engine: ``FSDPEngine.train_batch`` at world size 1 (a one-rank process group;
  micro-batches by token budget, packed when the backend allows);
- plain: the unsharded model, the batch cut in order into micro-batches of the
  same token budget, right-padded, full-vocabulary log-softmax, backward,
  ``clip_grad_norm_``, ``AdamW.step``.

Tokens/s counts every prompt + response token of the batch. Steps alternate
between the two sides so that machine load hits both alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from asyncrl.bench import bench_parser
from asyncrl.bench.common import qwen2, save_random_qwen2, write_json


def _make_model(out: Path, hidden: int, layers: int, vocab: int) -> None:
    untied = dict(max_position_embeddings=4096, tie_word_embeddings=False, pad_token_id=0)
    heads = max(1, hidden // 64)
    config = qwen2(hidden, hidden * 11 // 4, layers, heads, heads, vocab, **untied)
    save_random_qwen2(out, config)


def _span(text: str) -> tuple[int, int]:
    """``"min,max"`` as two ints (ValueError unless exactly two)."""
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def _make_batch(n: int, vocab: int, prompt: tuple[int, int], response: tuple[int, int]):
    from asyncrl.engines.train.base import Seq

    g = torch.Generator().manual_seed(0)
    seqs = []
    for _ in range(n):
        p = int(torch.randint(prompt[0], prompt[1] + 1, (1,), generator=g))
        r = int(torch.randint(response[0], response[1] + 1, (1,), generator=g))
        ids = torch.randint(1, vocab, (p + r,), generator=g)
        fields = {"mask": torch.ones(r), "adv": torch.randn(r, generator=g)}
        seqs.append(Seq(ids, p, fields))
    return seqs


class _PGLoss:
    """Token-mean ``-adv * logp`` (the engine's LossFn)."""

    def token_weight(self, seq):
        return seq.fields["mask"]

    def __call__(self, out, mb):
        adv = torch.cat([s.fields["adv"] for s in mb]).to(out.device)
        return -adv * out, {}


class _PlainStep:
    """An unsharded plain-PyTorch training step over padded micro-batches."""

    def __init__(self, model_path: str, device: str, lr: float, budget: int):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        # PreTrainedModel.to is @functools.wraps(nn.Module.to): typeshed types it unbound
        self.model.to(device).train()  # type: ignore[arg-type]
        self.model.config.use_cache = False
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.99))
        self.device, self.budget = device, budget

    def _chunks(self, seqs: list) -> list[list]:
        chunks: list[list] = []
        cur: list = []
        width = 0
        for s in seqs:
            w = max(width, len(s.input_ids))
            if cur and w * (len(cur) + 1) > self.budget:
                chunks.append(cur)
                cur, w = [], len(s.input_ids)
            cur.append(s)
            width = w
        return [*chunks, cur] if cur else chunks

    def step(self, seqs: list) -> None:
        self.opt.zero_grad(set_to_none=True)
        total = sum(float(s.fields["mask"].sum()) for s in seqs)
        for chunk in self._chunks(seqs):
            width = max(len(s.input_ids) for s in chunk)
            ids = torch.zeros((len(chunk), width), dtype=torch.long)
            attn = torch.zeros_like(ids)
            weight = torch.zeros((len(chunk), width - 1))
            adv = torch.zeros((len(chunk), width - 1))
            for i, s in enumerate(chunk):
                n = len(s.input_ids)
                ids[i, :n], attn[i, :n] = s.input_ids, 1
                weight[i, s.prompt_len - 1 : n - 1] = s.fields["mask"]
                adv[i, s.prompt_len - 1 : n - 1] = s.fields["adv"]
            ids, attn = ids.to(self.device), attn.to(self.device)
            logits = self.model(input_ids=ids, attention_mask=attn).logits.float()
            logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
            loss = -(adv.to(self.device) * logp * weight.to(self.device)).sum() / total
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn, device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _bench_budget(args: argparse.Namespace, model_path: str, seqs: list, budget: int) -> dict:
    from asyncrl.config import load_config
    from asyncrl.engines.train.fsdp import FSDPEngine

    over = [f"--trainer.micro_batch_tokens={budget}", f"--trainer.device={args.device}"]
    over += ["--trainer.lr=1e-5", f"--trainer.packing={args.packing}"]
    over += [f"--trainer.mixed_precision={args.mixed_precision}"]
    engine = FSDPEngine(model_path, load_config(None, over))
    plain = _PlainStep(model_path, args.device, 1e-5, budget)
    loss = _PGLoss()
    tokens = sum(len(s.input_ids) for s in seqs)
    eng_t, plain_t = [], []
    for i in range(args.steps + 1):  # step 0 warms up both
        e = _timed(lambda: engine.train_batch(seqs, loss), args.device)
        p = _timed(lambda: plain.step(seqs), args.device)
        if i:
            eng_t.append(e)
            plain_t.append(p)
    print(f"  budget {budget}: engine {eng_t} s, plain {plain_t} s", flush=True)
    eng, pl = tokens / statistics.median(eng_t), tokens / statistics.median(plain_t)
    return {
        "budget": budget,
        "engine_tokens_per_s": eng,
        "plain_tokens_per_s": pl,
        "ratio": eng / pl,
        "engine_step_s": eng_t,
        "plain_step_s": plain_t,
    }


def main(argv: list[str] | None = None) -> None:
    p = bench_parser("train", __doc__.split("\n")[0])
    p.add_argument("--budgets", default="512,2048", help="micro-batch token budgets")
    p.add_argument("--steps", type=int, default=3, help="timed steps per side and budget")
    p.add_argument("--model-path", default="", help="HF folder (default: a random Qwen2)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=16, help="sequences per batch")
    p.add_argument("--prompt", default="16,48", help="prompt length range min,max")
    p.add_argument("--response", default="16,112", help="response length range min,max")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    p.add_argument("--packing", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--mixed-precision", default="none", choices=["none", "bf16"])
    p.add_argument("--json", default="", help="write the results here")
    args = p.parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    torch.set_num_threads(args.threads)
    from asyncrl.engines.train.fsdp import init_process_group
    from asyncrl.procs import free_port

    init_process_group(0, 1, free_port(), args.device)
    seqs = _make_batch(args.batch, args.vocab, _span(args.prompt), _span(args.response))
    with tempfile.TemporaryDirectory() as tmp:
        model_path = args.model_path
        if not model_path:
            model_path = str(Path(tmp) / "model")
            _make_model(Path(model_path), args.hidden, args.layers, args.vocab)
        rows = [_bench_budget(args, model_path, seqs, int(b)) for b in args.budgets.split(",")]
    tokens = sum(len(s.input_ids) for s in seqs)
    print(f"train step, world size 1, {args.device}, {args.batch} seqs, {tokens} tokens per batch")
    print(f"{'budget':>8} {'engine tok/s':>13} {'plain tok/s':>12} {'engine/plain':>13}")
    for r in rows:
        print(
            f"{r['budget']:>8} {r['engine_tokens_per_s']:>13.0f} {r['plain_tokens_per_s']:>12.0f}"
            f" {r['ratio']:>13.2f}"
        )
    best = max(rows, key=lambda r: r["engine_tokens_per_s"])
    result = {
        "engine_tokens_per_s": best["engine_tokens_per_s"],
        "plain_tokens_per_s": best["plain_tokens_per_s"],
        "ratio": best["ratio"],
        "budget": best["budget"],
        "rows": rows,
        "args": vars(args),
        "tokens_per_batch": tokens,
    }
    write_json(args.json, result)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
