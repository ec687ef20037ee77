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
def test_prepare_gathers_the_positions_predicting_each_response_token(packed, trim) -> None:
    seqs = _seqs()
    mb = prepare_inputs(seqs, packed=packed, trim=trim)
    assert ("position_ids" in mb.inputs) == packed and ("attention_mask" in mb.inputs) != packed
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
