"""The embedded engine's sampler: equal sampling dicts parse to one object, and rows that
share one params object are sampled exactly as rows with equal params of their own."""

from __future__ import annotations

import pytest
import torch

from asyncrl.engines.rollout.local.sampling import SamplingParams, _draw, sample


def test_equal_dicts_parse_to_one_object() -> None:
    a = SamplingParams.from_dict({"temperature": 0.7, "max_new_tokens": 5})
    assert SamplingParams.from_dict({"temperature": 0.7, "max_new_tokens": 5}) is a
    assert SamplingParams.from_dict({"max_new_tokens": 5, "temperature": 0.7}) == a
    assert SamplingParams.from_dict({"temperature": 0.7, "max_new_tokens": 6}) != a
    # a list value is parsed each time (equal, not one object)
    s1 = SamplingParams.from_dict({"stop_token_ids": [3, 4]})
    s2 = SamplingParams.from_dict({"stop_token_ids": [3, 4]})
    assert s1 == s2 and s1.stop_token_ids == (3, 4)


def test_a_parsed_dict_does_not_answer_for_an_equal_one_of_another_type() -> None:
    """``1 == True`` and ``3 == 3.0`` in Python: the cache keys on the values' types too, so
    a bad value is refused after an equal good one was parsed (and the reverse)."""
    assert SamplingParams.from_dict({"ignore_eos": True}).ignore_eos
    with pytest.raises(ValueError, match="ignore_eos must be true or false"):
        SamplingParams.from_dict({"ignore_eos": 1})
    with pytest.raises(ValueError, match="ignore_eos must be true or false"):
        SamplingParams.from_dict({"ignore_eos": 1})
    assert SamplingParams.from_dict({"max_new_tokens": 3.0}).max_new_tokens == 3
    with pytest.raises(ValueError, match="max_new_tokens must be an integer"):
        SamplingParams.from_dict({"max_new_tokens": 3.5})
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams.from_dict({"top_p": 0})


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_k": 5},
        {"temperature": 1.3, "top_p": 0.8},
        {"temperature": 0.9, "top_k": 4, "top_p": 0.9},
        {"temperature": 0.0},
    ],
)
def test_rows_sharing_params_sample_as_rows_with_their_own(kw: dict[str, float]) -> None:
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(1)) * 3
    shared = SamplingParams(**kw)  # type: ignore[arg-type]
    own = [SamplingParams(**kw) for _ in range(64)]  # type: ignore[arg-type]  # equal, distinct
    t1, l1 = sample(logits, [shared] * 64, torch.Generator().manual_seed(7))
    t2, l2 = sample(logits, own, torch.Generator().manual_seed(7))
    assert torch.equal(t1, t2) and torch.equal(l1, l2)
    assert len(set(t1.tolist())) > (1 if kw["temperature"] > 0 else 0)


def test_mixed_rows_keep_their_own_settings() -> None:
    """Greedy rows among sampled ones take the arg-max; a top-k row never leaves its k."""
    logits = torch.randn(32, 50, generator=torch.Generator().manual_seed(2)) * 3
    greedy, top2 = SamplingParams(temperature=0.0), SamplingParams(temperature=2.0, top_k=2)
    params = [greedy if i % 2 else top2 for i in range(32)]
    tokens, logp = sample(logits, params, torch.Generator().manual_seed(3))
    best2 = logits.topk(2, dim=-1).indices
    for i, t in enumerate(tokens.tolist()):
        assert t == best2[i, 0] if i % 2 else t in best2[i].tolist()
    want = torch.log_softmax(
        logits / torch.tensor([1.0 if i % 2 else 2.0 for i in range(32)])[:, None], -1
    )
    assert torch.equal(logp, want.gather(-1, tokens[:, None]).squeeze(-1))


@pytest.mark.parametrize("seed", range(5))
def test_the_draw_is_multinomials(seed: int) -> None:
    """``_draw`` takes the same tokens as ``torch.multinomial(probs, 1)`` from the same
    generator state, zero-probability entries (top-k) included, and leaves the generator
    where multinomial does."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(37, 151, generator=g) * 4
    logits[::3, 10:] = float("-inf")  # rows with most entries at zero probability
    probs = torch.softmax(logits, -1)
    mine, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    for _ in range(20):
        want = torch.multinomial(probs, 1, generator=theirs).squeeze(-1)
        assert torch.equal(_draw(probs, mine), want)
    assert torch.equal(mine.get_state(), theirs.get_state())


def test_a_row_that_is_not_a_distribution_raises() -> None:
    logits = torch.randn(4, 9)
    logits[2, 3] = float("nan")
    with pytest.raises(ValueError, match="probability tensor contains"):
        sample(logits, [SamplingParams()] * 4, torch.Generator().manual_seed(0))
    logits[2, 3] = float("inf")
    with pytest.raises(ValueError, match="probability tensor contains"):
        sample(logits, [SamplingParams(temperature=0.5)] * 4, torch.Generator().manual_seed(0))
