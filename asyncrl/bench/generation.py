"""Generation throughput: the embedded engine (continuous batching, KV cache) vs HF ``generate``.

Both run the same model, prompts and sampling (temperature 1, no truncation,
EOS ignored so output lengths are exactly the requested ones). Output lengths
are long-tailed: most requests are short, ``--long-frac`` of them are
``--long-factor`` times longer. All requests arrive at once (``--arrival-s``
spreads their arrival uniformly over that many seconds).

- engine: a real ``asyncrl.entrypoints.engine`` process (started by
  the launcher), driven over HTTP by the SGLang client, one concurrent
  ``/generate`` per request.
- hf_generate: one batched ``model.generate`` over all prompts (left-padded)
  with ``max_new_tokens`` = the longest request — what a static batch must do
  when it cannot know lengths in advance (as with EOS): short rows keep being
  computed until the longest finishes. Only the requested tokens count.

Throughput = requested output tokens / wall time (from the first request to the
last result). The default model is a randomly initialised Qwen2 of ~35M
parameters, written once to a local folder (no download).

``asyncrl bench generation [--json PATH] [--device cuda] [--model-path DIR]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncrl.bench import bench_parser, log_dir
from asyncrl.bench.common import qwen2, save_random_qwen2, start, write_json

BENCH_MODEL = "bench-qwen2-35m-v1"


def _bench_model_dir() -> Path:
    root = os.environ.get("ASYNCRL_CACHE") or Path.home() / ".cache" / "asyncrl"
    return Path(root) / "models" / BENCH_MODEL


def ensure_bench_model(path: Path | None = None) -> Path:
    """A random-init Qwen2 (hidden 512, 8 layers, vocab 8192) in HF format, built once."""
    path = Path(path or _bench_model_dir())
    if (path / "config.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    more = dict(max_position_embeddings=2048, tie_word_embeddings=False)
    config = qwen2(512, 1408, 8, 8, 4, 8192, **more, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".building-"))
    save_random_qwen2(tmp, config, safe_serialization=True)
    try:
        tmp.rename(path)
    except OSError:
        if not (path / "config.json").is_file():
            raise
    return path


def workload(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) per request: long-tailed lengths, fixed by ``--seed``."""
    rng = random.Random(args.seed)
    n_long = max(1, round(args.requests * args.long_frac))
    reqs = []
    for i in range(args.requests):
        prompt = [1] + [rng.randrange(3, vocab) for _ in range(rng.randint(16, args.prompt_len))]
        short = rng.randint(int(args.short_len * 0.75), int(args.short_len * 1.25))
        reqs.append((prompt, short * args.long_factor if i < n_long else short))
    rng.shuffle(reqs)
    return reqs


async def _engine_run(url: str, reqs: list[tuple[Any, ...]], arrival_s: float) -> float:
    """Wall seconds of ``reqs`` (``(prompt, n)``, or ``(prompt, n, lora_path)``: naming an
    adapter version) sent at once (or spread over ``arrival_s``)."""
    from asyncrl.engines.rollout.sglang import SGLangClient

    client = SGLangClient(url, timeout_s=3600)
    try:
        await client.generate([1, 5, 6], {"max_new_tokens": 4, "ignore_eos": True})  # warm-up

        async def one(i: int, prompt: list[int], n: int, lora: str | None = None) -> int:
            await asyncio.sleep(arrival_s * i / max(1, len(reqs) - 1))
            params: dict[str, Any] = {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True}
            if lora is not None:
                params["lora_path"] = lora
            res = await client.generate(prompt, params)
            assert len(res.output_ids) == n, (len(res.output_ids), n)
            return n

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, *r) for i, r in enumerate(reqs)))
        return time.perf_counter() - t0
    finally:
        await client.close()


def bench_engine(args: argparse.Namespace, model_dir: Path, reqs: list) -> dict[str, Any]:
    from asyncrl.engines.rollout.launcher import (
        LOCAL_SERVER,
        LaunchSpec,
        launch,
        stop_servers,
        wait_healthy,
    )
    from asyncrl.procs import free_port

    extra: tuple[str, ...] = ("--device", args.device, "--threads", str(args.threads))
    extra += ("--max-batch-size", str(args.max_batch_size), "--dtype", args.dtype)
    spec = LaunchSpec(str(model_dir), free_port(), module=LOCAL_SERVER, extra_args=extra)
    with log_dir("asyncrl-bench-gen-") as logs:
        server = launch(spec, logs / "engine.log", spawner=start)
        try:
            asyncio.run(wait_healthy([server], timeout_s=300))
            wall = asyncio.run(_engine_run(server.url, reqs, args.arrival_s))
        finally:
            stop_servers([server])
    tokens = sum(n for _, n in reqs)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall}


def bench_hf(args: argparse.Namespace, model_dir: Path, reqs: list) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
    width = max(len(p) for p, _ in reqs)
    ids = torch.zeros(len(reqs), width, dtype=torch.long)
    mask = torch.zeros(len(reqs), width, dtype=torch.long)
    for i, (p, _) in enumerate(reqs):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(args.device), mask.to(args.device)
    longest = max(n for _, n in reqs)
    kw: dict[str, Any] = {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0}
    kw["pad_token_id"] = 0
    kw["eos_token_id"] = None
    with torch.no_grad():
        model.generate(ids[:2, -4:], attention_mask=mask[:2, -4:], max_new_tokens=4, **kw)
        _sync(args.device)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=longest, **kw)
        _sync(args.device)
        wall = time.perf_counter() - t0
    assert out.shape[1] == width + longest
    tokens = sum(n for _, n in reqs)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    model_dir = Path(args.model_path) if args.model_path else ensure_bench_model()
    cfg = json.loads((model_dir / "config.json").read_text())
    reqs = workload(args, int(cfg["vocab_size"]))
    lengths = sorted(n for _, n in reqs)
    print(
        f"generation bench: {len(reqs)} requests, output lengths {lengths[0]}..{lengths[-1]} "
        f"(median {lengths[len(lengths) // 2]}), {sum(lengths)} tokens, device {args.device}, "
        f"threads {args.threads}, model {model_dir.name}",
        flush=True,
    )
    engine = bench_engine(args, model_dir, reqs)
    lora: dict[str, Any] = {}
    if args.lora_rank:
        from asyncrl.bench.generation_lora import bench_lora

        lora = bench_lora(args, model_dir, reqs)
    hf = bench_hf(args, model_dir, reqs)
    result = {
        "engine_tokens_per_s": engine["tokens_per_s"],
        "hf_generate_tokens_per_s": hf["tokens_per_s"],
        "speedup": engine["tokens_per_s"] / hf["tokens_per_s"],
        "engine_wall_s": engine["wall_s"],
        "hf_generate_wall_s": hf["wall_s"],
        "output_tokens": engine["tokens"],
        "requests": len(reqs),
        "output_len_min": lengths[0],
        "output_len_max": lengths[-1],
        "device": args.device,
        "dtype": args.dtype,
        "threads": args.threads,
        "model": str(model_dir),
        "argv": sys.argv[1:] if argv is None else list(argv),
    }
    _report(result, engine, lora, hf, args)
    write_json(args.json, result)
    return result


def _parser() -> argparse.ArgumentParser:
    p = bench_parser("generation", __doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--model-path", default=None, help="HF model folder (default: random Qwen2)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=1, help="torch threads of each side (CPU)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64, help="longest prompt (shortest 16)")
    p.add_argument("--short-len", type=int, default=16, help="typical short output length")
    p.add_argument("--long-factor", type=int, default=8, help="long outputs = this x short")
    p.add_argument("--long-frac", type=float, default=0.125, help="fraction of long requests")
    p.add_argument("--arrival-s", type=float, default=0.0, help="spread arrivals over this")
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="also the engine serving LoRA adapters of this rank: one version, and two mixed "
        "in every batch (rows lora, lora-mixed; docs/rollout-engines.md, LoRA)",
    )
    return p


def _report(
    result: dict[str, Any],
    engine: dict[str, Any],
    lora: dict[str, dict[str, Any]],
    hf: dict[str, Any],
    args: argparse.Namespace,
) -> None:
    """Adds the LoRA rows' keys to ``result`` (relative to the plain engine) and prints the
    table: the engine, its LoRA rows, HF ``generate`` and the speedup."""
    for name, r in lora.items():  # the same engine serving LoRA, same workload
        key = name.replace("-", "_")
        result[f"{key}_tokens_per_s"] = r["tokens_per_s"]
        result[f"{key}_vs_base"] = r["tokens_per_s"] / engine["tokens_per_s"]
    if lora:
        result["lora_rank"] = args.lora_rank
    print(f"{'':16}{'tokens/s':>12}{'wall s':>10}")
    print(f"{'engine':16}{engine['tokens_per_s']:12.1f}{engine['wall_s']:10.2f}")
    for name, r in lora.items():
        print(f"{'engine ' + name:16}{r['tokens_per_s']:12.1f}{r['wall_s']:10.2f}")
    print(f"{'hf generate':16}{hf['tokens_per_s']:12.1f}{hf['wall_s']:10.2f}")
    print(f"speedup engine / hf generate: {result['speedup']:.2f}x")


if __name__ == "__main__":
    main()
