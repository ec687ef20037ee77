"""Micro-batch splitting, input/output preparation and LR schedules (in-process, no model)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.config import load_config
from asyncrl.engines.train.base import Seq
from asyncrl.engines.train.micro_batch import (
    prepare_inputs,
    response_logprobs,
    response_values,
    split_by_cost,
    split_by_tokens,
)
from asyncrl.engines.train.schedule import lr_schedule


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 50), max_size=30), st.integers(1, 120), st.integers(1, 6))
def test_split_covers_every_index_once_within_budget(lengths, budget, min_count) -> None:
    groups = split_by_tokens(lengths, budget, min_count=min_count)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert len(groups) >= (min_count if lengths or min_count > 1 else 0)
    for g in groups:
        assert g == sorted(g)
        if len(g) > 1:
            assert len(g) * max(lengths[i] for i in g) <= budget


def _cost(groups: list[list[int]], lengths: list[int], tc: float, overhead: float) -> float:
    """The modelled cost :func:`split_by_cost` minimises, of any split."""
    widths = [(len(g), max(lengths[i] for i in g)) for g in groups if g]
    return sum(overhead + n * w * (tc + w) for n, w in widths)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.integers(1, 60), max_size=40),
    st.integers(1, 200),
    st.integers(1, 6),
    st.sampled_from([0.0, 8.0, 512.0]),
    st.sampled_from([0.0, 100.0, 1e5]),
)
def test_cost_split_covers_every_index_once_within_budget_in_length_runs(
    lengths, budget, min_count, tc, overhead
) -> None:
    groups = split_by_cost(lengths, budget, tc, overhead, min_count=min_count)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert len(groups) >= min_count
    real = [g for g in groups if g]
    assert groups[: len(real)] == real  # empty groups last
    for g in real:
        assert g == sorted(g)
        if len(g) > 1:
            assert len(g) * max(lengths[i] for i in g) <= budget
    # groups are runs of the lengths sorted longest first: no length of another group lies
    # strictly inside a group's range
    spans = [(min(lengths[i] for i in g), max(lengths[i] for i in g)) for g in real]
    for k, (lo, hi) in enumerate(spans):
        assert all(not lo < lengths[i] < hi for j, g in enumerate(real) if j != k for i in g)
    # never costlier (by its model) than the balanced split by tokens
    balanced = split_by_tokens(lengths, budget)
    assert _cost(groups, lengths, tc, overhead) <= _cost(balanced, lengths, tc, overhead) + 1e-6


def test_cost_split_is_optimal_among_runs_of_sorted_lengths() -> None:
    """Against every cut of the sorted lengths into runs (brute force, 9 sequences)."""
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        lengths = torch.randint(1, 40, (9,), generator=g).tolist()
        budget, tc, overhead = (40, 120, 400)[trial % 3], 16.0, float(trial % 4) * 300
        order = sorted(range(9), key=lambda i: -lengths[i])
        best = math.inf
        for cuts in itertools.product([0, 1], repeat=8):
            groups, cur = [], [order[0]]
            for c, i in zip(cuts, order[1:], strict=True):
                if c:
                    groups.append(cur)
                    cur = []
                cur.append(i)
            groups.append(cur)
            if all(len(x) == 1 or len(x) * lengths[x[0]] <= budget for x in groups):
                best = min(best, _cost(groups, lengths, tc, overhead))
        got = split_by_cost(lengths, budget, tc, overhead)
        assert math.isclose(_cost(got, lengths, tc, overhead), best, rel_tol=1e-12)


def test_cost_split_groups_similar_lengths_where_the_balanced_split_mixes_them() -> None:
    """The pipeline bench's kind of batch: one long sequence among many short ones goes
    alone (the balanced split pads a group of short ones to its width)."""
    lengths = [500] + [24] * 40 + [60] * 10
    groups = split_by_cost(lengths, 2048, token_cost=512.0, overhead=60_000.0)
    assert [0] in groups
    pad = sum(len(g) * max(lengths[i] for i in g) for g in groups) - sum(lengths)
    balanced = split_by_tokens(lengths, 2048)
    pad_balanced = sum(len(g) * max(lengths[i] for i in g) for g in balanced) - sum(lengths)
    assert pad == 0 < pad_balanced


def _seqs() -> list[Seq]:
    g = torch.Generator().manual_seed(0)
    out = []
    for p, r in ((3, 2), (1, 4), (5, 1), (2, 3)):
        out.append(Seq(torch.randint(0, 20, (p + r,), generator=g), p, {"x": torch.zeros(r)}))
    return out


def _fake_logits(inputs: dict, vocab: int = 20) -> torch.Tensor:
    """A 'model' whose logits at each position one-hot encode (token id, position)."""
    ids = inputs["input_ids"]
    pos = inputs.get("position_ids", torch.arange(ids.shape[1])[None].expand_as(ids))
    logits = torch.nn.functional.one_hot(ids, vocab).float() * 10 + pos[..., None] * 0.01
    keep = inputs.get("logits_to_keep", 0)
    if isinstance(keep, torch.Tensor):
        return logits[:, keep]
    return logits[:, -keep:] if keep else logits


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("trim", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_prepare_gathers_the_positions_predicting_each_response_token(packed, trim, causal) -> None:
    seqs = _seqs()
    mb = prepare_inputs(seqs, packed=packed, trim=trim, causal=causal)
    assert ("position_ids" in mb.inputs) == packed
    # padded rows of a causal model go without a mask (right padding: nothing real sees it)
    assert ("attention_mask" in mb.inputs) == (not packed and not causal)
    logits = _fake_logits(mb.inputs)
    rows = logits.reshape(-1, logits.shape[-1])[mb.gather]
    expected = torch.cat([s.input_ids[s.prompt_len - 1 : -1] for s in seqs])
    assert torch.equal(rows.argmax(-1), expected)  # the row of token t-1 predicts token t
    assert torch.equal(mb.targets, torch.cat([s.input_ids[s.prompt_len :] for s in seqs]))
    logp = response_logprobs(logits, mb)
    values = response_values(logits[..., :1], mb)
    assert [len(x) for x in logp] == [len(x) for x in values] == [s.response_len for s in seqs]


def test_micro_batch_metadata_is_copied() -> None:
    seqs = _seqs()
    mb = prepare_inputs(seqs, packed=True, trim=False)
    mb.seqs[0].fields["new"] = torch.ones(1)
    assert "new" not in seqs[0].fields and mb.seqs[0] is not seqs[0]


def test_lr_schedules() -> None:
    def lrs(*over: str, n: int = 10) -> list[float]:
        cfg = load_config(None, ["--trainer.lr=1.0", *over]).trainer
        f = lr_schedule(cfg, total_steps=n)
        return [f(s) for s in range(n + 2)]

    assert lrs() == [1.0] * 12
    warm = lrs("--trainer.warmup_steps=3")
    assert warm[:4] == [0.25, 0.5, 0.75, 1.0] and warm[4:] == [1.0] * 8
    lin = lrs("--trainer.lr_schedule=linear", "--trainer.min_lr_ratio=0.1")
    assert lin[0] == 1.0 and math.isclose(lin[9], 0.1) and lin[11] == lin[9]
    assert all(a >= b for a, b in itertools.pairwise(lin))
    cos = lrs("--trainer.lr_schedule=cosine", "--trainer.warmup_steps=2", "--trainer.decay_steps=6")
    assert cos[2] == 1.0 and math.isclose(cos[5], 0.0, abs_tol=1e-12) and cos[3] > 0.5 > cos[4]


def test_trainer_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="min_lr_ratio"):
        load_config(None, ["--trainer.min_lr_ratio=2"])
    with pytest.raises(ValueError, match="packing"):
        load_config(None, ["--trainer.packing=maybe"])


def test_padded_rows_without_a_mask_give_a_causal_models_log_probs(tiny_model_dir) -> None:
    """Right-padded rows of the tiny (causal) model: the same log-probs and gradients with
    and without the padding mask, with a non-zero pad token's embedding in the padding."""
    from transformers import AutoModelForCausalLM

    from asyncrl.engines.train.fsdp import _causal

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert _causal(model)
    # a model with no attention module saying so, or one attending both ways, keeps its mask
    assert not _causal(torch.nn.Linear(2, 2))
    model.model.layers[1].self_attn.is_causal = False
    assert not _causal(model)
    model.model.layers[1].self_attn.is_causal = True
    seqs = [
        Seq(torch.randint(3, 15, (p + r,)), p, {}) for p, r in ((3, 40), (7, 2), (1, 9), (2, 1))
    ]
    outs, grads = [], []
    for causal in (False, True):
        model.zero_grad()
        mb = prepare_inputs(seqs, packed=False, trim=True, pad_id=5, causal=causal)
        logp = torch.cat(response_logprobs(model(**mb.inputs).logits, mb))
        logp.sum().backward()
        outs.append(logp.detach())
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-5)
