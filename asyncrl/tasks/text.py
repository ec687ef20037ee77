"""Text side of a Hugging Face model folder without transformers (so without torch).

``ChatTokenizer`` encodes and decodes with ``tokenizer.json`` (the ``tokenizers``
library) and renders the model's chat template (``chat_template.jinja`` or
``tokenizer_config.json``'s ``chat_template``) with a sandboxed Jinja2
environment set up as transformers sets its own (``trim_blocks``,
``lstrip_blocks``, loop controls, a ``tojson`` filter that is ``json.dumps``), the
way ``apply_chat_template(..., tools=..., add_generation_prompt=True)`` does; the
rendered text is tokenized without adding special tokens again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["ChatTokenizer"]


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
        return str(value.get("content", ""))
    return "" if value is None else str(value)


class ChatTokenizer:
    """Tokenizer + chat template of a local model folder."""

    def __init__(self, model_path: str | Path):
        from tokenizers import Tokenizer

        root = Path(model_path)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{path} not found: the task needs the model's tokenizer.json")
        self.tokenizer = Tokenizer.from_file(str(path))
        conf_path = root / "tokenizer_config.json"
        conf = json.loads(conf_path.read_text()) if conf_path.is_file() else {}
        template = conf.get("chat_template")
        if (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default")
        self.template: str | None = template
        self._compiled: Any = None
        self.special = {k: _token_text(conf.get(k)) for k in ("bos_token", "eos_token")}
        self.eos_id = self.tokenizer.token_to_id(self.special["eos_token"] or "")

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; ValueError naming the words the vocabulary cannot spell
        (a word-level tokenizer maps them to its unknown token: a prompt silently turned
        into ``<pad>`` would train on nonsense)."""
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        unk = getattr(self.tokenizer.model, "unk_token", None)
        unk_id = self.tokenizer.token_to_id(unk) if unk else None
        if unk_id is not None and unk_id in enc.ids:
            spans = zip(enc.ids, enc.offsets, strict=True)
            words = [text[a:b] for i, (a, b) in spans if i == unk_id]
            if any(w != unk for w in words):
                raise ValueError(
                    f"the model's tokenizer cannot spell {words[:5]!r} of the text {text[:80]!r} "
                    f"(they would become {unk!r}); a word-level vocabulary needs the words "
                    "separated by spaces, or use a model whose tokenizer covers the text"
                )
        return enc.ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The chat template applied to ``messages`` (and ``tools``, JSON schemas as
        transformers takes them), with the generation prompt added unless told not to."""
        if not self.template:
            raise ValueError(
                "the model's tokenizer has no chat template (tokenizer_config.json "
                "'chat_template' or chat_template.jinja): set task.prompt_format='raw' (or "
                "'auto') for a plain-text prompt"
            )
        if self._compiled is None:
            self._compiled = _environment().from_string(self.template)
        return self._compiled.render(
            messages=messages,
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            **self.special,
        )

    def chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode(self.render(messages))

    def raw_ids(self, text: str) -> list[int]:
        """``text`` as a base model's prompt: its ids after the BOS token, when the model has
        one (``tokenizer_config.json``'s ``bos_token``)."""
        ids = self.encode(text)
        name = self.special["bos_token"]
        bos = self.tokenizer.token_to_id(name) if name else None
        return [bos, *ids] if bos is not None else ids


def _environment() -> Any:
    """A sandboxed Jinja2 environment as transformers' ``apply_chat_template`` builds it."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env
