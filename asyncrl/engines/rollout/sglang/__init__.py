"""The SGLang engine family: ``client`` (the HTTP client, also the embedded engine's),
``launcher`` (``sglang serve`` flags). ``SGLangClient`` is re-exported
here (``from asyncrl.engines.rollout.sglang import SGLangClient`` keeps working)."""

from asyncrl.engines.rollout.sglang.client import SGLangClient

__all__ = ["SGLangClient"]
