"""FSDP2 engine on CPU with Gloo: real rank processes at world sizes 1 and 2.

One module-scoped run of ``_ranks.py world1`` (reference results + a checkpoint)
and one of ``_ranks.py world2`` (same batches split over two ranks, resuming the
checkpoint); the tests compare their outputs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from asyncrl.procs import Proc, free_port, python_env, stop
from tests.runs import spawn_shared

RANKS = "tests.engines.train._ranks"  # run with -m: forked from the shared fork server
TIMEOUT_S = 240.0


def _launch(scenario: str, world: int, model: Path, out: Path) -> None:
    port = free_port()
    env = python_env(
        {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    )
    procs: list[Proc] = []
    logs = [out / f"{scenario}_rank{r}.log" for r in range(world)]
    try:
        for r in range(world):
            args = ["-m", RANKS, scenario, "--rank", str(r), "--world", str(world)]
            args += ["--port", str(port), "--model", str(model), "--out", str(out)]
            procs.append(spawn_shared(args, logs[r], env))
        deadline = time.monotonic() + TIMEOUT_S
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
        codes = [p.poll() for p in procs]
        if codes != [0] * world:
            tails = "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs)
            pytest.fail(f"{scenario} ranks exited with {codes}:\n{tails}")
    finally:
        stop(procs)


@pytest.fixture(scope="module")
def results(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("train_engine")
    _launch("world1", 1, tiny_model_dir, out)
    _launch("world2", 2, tiny_model_dir, out)
    return out


def _group(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith(prefix + "/")}


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")


def _plain_outputs(model: Path) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The test batch's log-probs and entropies from a plain ``model(input_ids)`` per sequence."""
    from transformers import AutoModelForCausalLM

    from tests.engines.train._ranks import make_batch

    batch = make_batch(1)
    plain = AutoModelForCausalLM.from_pretrained(model)
    ref, ent = [], []
    with torch.no_grad():
        for s in batch:
            logp = torch.log_softmax(plain(s.input_ids[None]).logits[0].float(), -1)
            targets = s.input_ids[s.prompt_len :, None]
            ref.append(logp[s.prompt_len - 1 : -1].gather(-1, targets)[:, 0])
            ent.append(-(logp.exp() * logp).sum(-1)[s.prompt_len - 1 : -1])
    return ref, ent


def test_gradients_do_not_depend_on_micro_batches(results: Path) -> None:
    w1 = load_file(results / "world1.safetensors")
    for tag in ("tok", "seq", "ent"):
        _assert_close(_group(w1, f"grads_{tag}_1mb"), _group(w1, f"grads_{tag}_many"), atol=1e-6)
    assert (w1["grads_ent_1mb/lm_head.weight"] - w1["grads_tok_1mb/lm_head.weight"]).abs().max() > 0
    # activation checkpointing recomputes the same activations
    _assert_close(_group(w1, "grads_tok_1mb"), _group(w1, "grads_tok_ckpt"), atol=1e-6)


def test_gradients_match_across_world_sizes(results: Path) -> None:
    w1 = load_file(results / "world1.safetensors")
    for rank in (0, 1):
        w2 = load_file(results / f"world2_rank{rank}.safetensors")
        for tag in ("tok", "seq"):
            _assert_close(_group(w1, f"grads_{tag}_many"), _group(w2, f"grads_{tag}"), atol=1e-6)


def test_forward_logprobs_match_plain_model(results: Path, tiny_model_dir: Path) -> None:
    w1 = load_file(results / "world1.safetensors")
    ref, ent = _plain_outputs(tiny_model_dir)
    for packing in ("on", "off", "auto"):
        torch.testing.assert_close(w1[f"logp_{packing}"], torch.cat(ref), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(w1[f"entropy_{packing}"], torch.cat(ent), atol=1e-5, rtol=1e-5)
    # bf16 compute over float32 master weights: close, not equal
    torch.testing.assert_close(w1["logp_bf16"], torch.cat(ref), atol=0.1, rtol=0.05)
    assert torch.isfinite(w1["bf16_step_grad_norm"]) and w1["bf16_step_grad_norm"] > 0
    for rank in (0, 1):  # each rank's shard, in that shard's order
        got = load_file(results / f"world2_rank{rank}.safetensors")["logp"]
        torch.testing.assert_close(got, torch.cat(ref[rank::2]), atol=1e-5, rtol=1e-5)


def test_resume_at_other_world_size_matches_uninterrupted(results: Path) -> None:
    w1 = load_file(results / "world1.safetensors")
    lrs = json.loads((results / "world1.json").read_text())["lr"]
    for rank in (0, 1):
        w2 = load_file(results / f"world2_rank{rank}.safetensors")
        _assert_close(_group(w1, "step2"), _group(w2, "step2"), atol=1e-5)
        assert json.loads((results / f"world2_rank{rank}.json").read_text())["lr2"] == lrs[1]
    assert lrs[0] < lrs[1]  # warm-up, then the peak: the schedule resumed at the right step


def test_named_weights_round_trip_through_export_hf(results: Path) -> None:
    from transformers import AutoModelForCausalLM

    w1 = load_file(results / "world1.safetensors")
    model = AutoModelForCausalLM.from_pretrained(results / "hf")
    _assert_close(_group(w1, "step2"), dict(model.named_parameters()), atol=0.0)


def test_critic_values_align_and_train_toward_returns(results: Path) -> None:
    from transformers import AutoModelForTokenClassification

    from tests.engines.train._ranks import make_batch

    w1 = load_file(results / "world1.safetensors")
    critic = AutoModelForTokenClassification.from_pretrained(results / "critic_hf")
    ref = []
    with torch.no_grad():
        for s in make_batch(1):
            values = critic(s.input_ids[None]).logits[0, :, 0]
            ref.append(values[s.prompt_len - 1 : -1])  # the position predicting each token
    torch.testing.assert_close(w1["critic_values0"], torch.cat(ref), atol=1e-5, rtol=1e-5)
    mse = json.loads((results / "world1.json").read_text())["critic_mse"]
    assert mse[-1] < 0.2 * mse[0], mse
