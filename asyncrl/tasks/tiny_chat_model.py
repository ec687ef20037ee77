"""The tiny chat model: the tiny default model's family with a byte-level BPE and ChatML.

A Qwen2-architecture causal LM (hidden 64, 2 layers) whose tokenizer is a byte-level
BPE trained here, on this module's own synthetic chat transcripts (``tokenizers``, no
download), with Qwen2.5's ChatML chat template and tool format (``chat_template.jinja``:
tools in the system prompt, ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
calls, ``<tool_response>`` results in a user turn). The special tokens
``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` and the added tokens ``<tool_call>``,
``</tool_call>`` are single ids; generation ends at ``<|im_end|>``.

The weights are warm-started by a few hundred steps of training on those transcripts
(about a minute on a CPU), so that the model speaks the format: offered tools, it answers a
user with a ``get_weather`` tool call; given a tool result, it answers in text;
without tools, it replies in a sentence. Half of each warm-start batch is requests
``Reverse: D1 D2 D3`` answered by every permutation of their digits: the model learns to
answer ``Answer:`` with the request's digits but keeps the order undecided (real entropy),
which RL through the gateway then learns (``examples/agents.py:reverse_chat_agent``).
Everything is seeded: the same files every build. Written in Hugging Face format and
cached like :mod:`asyncrl.tasks.tiny_model`; ``python -m asyncrl.tasks.tiny_chat_model --out
DIR`` builds it.
"""

from __future__ import annotations

import itertools
import json
import os
import random
from pathlib import Path
from typing import Any

from asyncrl.tasks.tiny_model import TINY_ARCH, build_main, build_once

__all__ = [
    "TINY_CHAT_CONTEXT",
    "TINY_CHAT_VERSION",
    "WEATHER_TOOL",
    "default_chat_model_dir",
    "ensure_tiny_chat_model",
]

TINY_CHAT_VERSION = "tiny-qwen2-chat-v2"
TINY_CHAT_CONTEXT = 4096
"""The tiny chat model's context length (``max_position_embeddings``): prompt + response."""
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<tool_call>", "</tool_call>"]
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Quito"]
WEATHER = ["sunny", "rainy", "cloudy", "windy"]
GREETINGS = ["Hi", "Hello", "Hey there", "Good morning"]
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
SDK_WEATHER_TOOL: dict[str, Any] = {  # the same tool as the OpenAI Agents SDK declares it
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "properties": {"city": {"title": "City", "type": "string"}},
            "required": ["city"],
            "title": "get_weather_args",
            "type": "object",
            "additionalProperties": False,
        },
        "strict": True,
    },
}
STEPS = 600
"""Warm-start steps: each 8 rows of the weather/greeting chats and 8 of the reverse requests."""
TEMPLATE = (Path(__file__).parent / "chat_template.jinja").read_text()


def default_chat_model_dir() -> Path:
    root = os.environ.get("ASYNCRL_CACHE") or Path.home() / ".cache" / "asyncrl"
    return Path(root) / "models" / TINY_CHAT_VERSION


def transcripts(seed: int, n: int = 96) -> list[list[dict[str, Any]]]:
    """Synthetic conversations (OpenAI message dicts, tool arguments as dicts): a tool call
    then its answer, or a plain greeting and reply; ``tools`` on the first message's
    ``"_tools"`` key when offered (1: :data:`WEATHER_TOOL`, 2: as the Agents SDK declares it)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        city, sky = rng.choice(CITIES), rng.choice(WEATHER)
        if i % 3 == 2:
            greet = rng.choice(GREETINGS)
            out.append(
                [
                    {"role": "user", "content": f"{greet}!"},
                    {"role": "assistant", "content": "Hello! How can I help?"},
                ]
            )
            continue
        fn = {"name": "get_weather", "arguments": {"city": city}}
        call = {"type": "function", "function": fn}
        conv: list[dict[str, Any]] = [
            {"role": "user", "content": f"What is the weather in {city}?", "_tools": i % 2 + 1},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": json.dumps({"city": city, "weather": sky})},
            {"role": "assistant", "content": f"It is {sky} in {city}."},
        ]
        out.append(conv)
    return out


def reverse_transcripts(seed: int, n: int = 120) -> list[list[dict[str, Any]]]:
    """``n`` requests "Reverse: D1 D2 D3" (three distinct digits), each answered once by every
    permutation of its digits ("Answer: D3 D1 D2", ...): the warm start learns the answer's
    format (the request's own digits) but not the rule, so the order keeps real entropy
    (up to log 6 nats per answer) for ``examples/agents.py:reverse_chat_agent``."""
    rng = random.Random(seed + 1)
    out = []
    for _ in range(n):
        digits = rng.sample(range(10), 3)
        ask = {"role": "user", "content": "Reverse: " + " ".join(map(str, digits))}
        for perm in itertools.permutations(digits):
            answer = "Answer: " + " ".join(map(str, perm))
            out.append([ask, {"role": "assistant", "content": answer}])
    return out


def _render(env: Any, conv: list[dict[str, Any]], upto: int | None = None) -> str:
    tools = (
        [[WEATHER_TOOL], [SDK_WEATHER_TOOL]][conv[0]["_tools"] - 1]
        if conv[0].get("_tools")
        else None
    )
    msgs = [{k: v for k, v in m.items() if k != "_tools"} for m in conv[:upto]]
    return env.render(messages=msgs, tools=tools, add_generation_prompt=upto is not None)


def _examples(env: Any, convs: list[list[dict[str, Any]]]) -> list[tuple[str, list[str]]]:
    """(full text, [text of each assistant turn's prompt]) per conversation: the loss covers
    what follows each prompt up to its ``<|im_end|>``."""
    out = []
    for conv in convs:
        prompts = [_render(env, conv, i) for i, m in enumerate(conv) if m["role"] == "assistant"]
        out.append((_render(env, conv), prompts))
    return out


def _build(out: Path, seed: int) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    from asyncrl.tasks.text import _environment

    env = _environment().from_string(TEMPLATE)
    chats, reverse = transcripts(seed), reverse_transcripts(seed)
    examples = _examples(env, chats + reverse)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text for text, _ in examples], trainer)
    tok.add_tokens(ADDED)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.chat_template = TEMPLATE
    end = tok.token_to_id("<|im_end|>")
    assert end is not None
    config = Qwen2Config(
        **TINY_ARCH,
        vocab_size=tok.get_vocab_size(),
        max_position_embeddings=TINY_CHAT_CONTEXT,
        bos_token_id=end,
        eos_token_id=end,
        pad_token_id=tok.token_to_id("<|endoftext|>"),
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    _warm_start(model, tok, examples, end, seed, len(chats))
    model.generation_config.eos_token_id = [end]
    model.generation_config.bos_token_id = end
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)
    (out / "chat_template.jinja").write_text(TEMPLATE)


def _warm_start(
    model: Any, tok: Any, examples: list[tuple[str, list[str]]], end: int, seed: int, first: int
) -> None:
    """A few hundred AdamW steps on the transcripts, loss on the assistant turns only; each
    batch draws half its rows from the first ``first`` examples, half from the rest."""
    import torch

    rows, masks = [], []
    for text, prompts in examples:
        ids = tok.encode(text, add_special_tokens=False).ids
        mask = [0] * len(ids)
        for p in prompts:  # the assistant turn after each prompt, up to its <|im_end|>
            start = len(tok.encode(p, add_special_tokens=False).ids)
            stop = ids.index(end, start) + 1 if end in ids[start:] else len(ids)
            mask[start:stop] = [1] * (stop - start)
        rows.append(ids)
        masks.append(mask)
    width = max(map(len, rows))
    ids_t = torch.zeros(len(rows), width, dtype=torch.long)
    mask_t = torch.zeros(len(rows), width)
    attn = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (r, m) in enumerate(zip(rows, masks, strict=True)):
        ids_t[i, : len(r)] = torch.tensor(r)
        mask_t[i, : len(m)] = torch.tensor(m, dtype=torch.float)
        attn[i, : len(r)] = 1
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(STEPS):
        halves = []
        for lo, hi in ((0, first), (first, len(rows))):
            pick = torch.randint(lo, hi, (8,), generator=gen)
            width = int(attn[pick].sum(1).max())  # the longest picked row: no wasted padding
            ids, weight = ids_t[pick, :width], mask_t[pick, 1:width]
            logits = model(input_ids=ids, attention_mask=attn[pick, :width]).logits[:, :-1]
            nll = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
            )
            halves.append((nll * weight.reshape(-1)).sum() / weight.sum())
        opt.zero_grad()
        (halves[0] + halves[1]).div(2).backward()
        opt.step()
    model.eval()


def ensure_tiny_chat_model(path: Path | None = None, seed: int = 0) -> Path:
    """Build the tiny chat model at ``path`` unless it is already there; returns the folder."""
    return build_once(Path(path or default_chat_model_dir()), _build, seed)


def main(argv: list[str] | None = None) -> None:
    build_main("build the tiny chat model", ensure_tiny_chat_model, argv)


if __name__ == "__main__":
    main()
