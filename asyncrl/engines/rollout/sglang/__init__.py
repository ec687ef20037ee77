"""The SGLang engine family: ``client`` (the HTTP client, also the embedded engine's),
``launcher`` (``sglang serve`` flags). ``SGLangClient`` and ``make_client`` are re-exported
here (``from asyncrl.engines.rollout.sglang import SGLangClient`` keeps working)."""

from asyncrl.engines.rollout.sglang.client import SGLangClient, make_client

__all__ = ["SGLangClient", "make_client"]
