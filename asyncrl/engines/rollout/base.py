"""The RolloutEngine seam: what the controller needs from a generation server.

Contract: ``generate`` returns the sampled token ids, the log-prob of each under
the sampling distribution, the engine's weight version and the finish reason
(``"stop"``, ``"length"`` or ``"abort"``; an aborted request returns the tokens
generated so far). ``pause_generation(mode)`` stops scheduling (``abort``:
in-flight requests return at once with ``finish_reason == "abort"``;
``in_place``: they wait), ``continue_generation`` resumes. Weight updates
switch ``weight_version`` only once the whole update is loaded.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

__all__ = [
    "EngineBadRequest",
    "EngineError",
    "EngineUnavailable",
    "GenerateResult",
    "RolloutEngine",
]


class EngineError(RuntimeError):
    """The engine answered with an error (HTTP >= 400, or ``success: false`` with HTTP 200).

    ``message`` is the server's own message (``error.message`` or ``message`` of its
    JSON body, else the body text); ``status`` the HTTP status; ``path`` the endpoint.
    """

    def __init__(self, path: str, status: int, message: str, answered: bool = True):
        super().__init__(f"{path} -> {status}: {message}")
        self.path = path
        self.status = status
        self.message = message
        self.answered = answered
        """The engine's own handler answered (a JSON object body, e.g. SGLang's
        ``{"success": false, "message": ...}`` with HTTP 400): it ran, and for a weight update
        it may have received and loaded data before failing. False: a proxy's or framework's
        error page."""


class EngineBadRequest(EngineError):
    """The engine rejected the request as malformed (HTTP 4xx): retrying it cannot help."""


class EngineUnavailable(ConnectionError):
    """The engine could not be reached or timed out (recoverable: retry elsewhere)."""


class GenerateResult(msgspec.Struct, frozen=True, gc=False):
    output_ids: list[int]
    logprobs: list[float]
    weight_version: int
    finish_reason: str
    prompt_tokens: int = 0
    versions: list[int] | None = None
    """The weight version of each output token, when the server reported spans (SGLang >=
    0.5.22's ``meta_info.weight_versions``); None: every token has ``weight_version``."""

    def token_versions(self) -> list[int]:
        """The weight version of every output token."""
        if self.versions is not None:
            return self.versions
        return [self.weight_version] * len(self.output_ids)

    @classmethod
    def from_sglang(cls, out: Any) -> GenerateResult:
        """Parse SGLang's /generate response (single request, return_logprob=True)."""
        if not isinstance(out, dict) or "meta_info" not in out:
            raise EngineError("/generate", 200, f"unexpected response: {str(out)[:200]}")
        meta = out["meta_info"]
        ids = list(out.get("output_ids", []))
        lps = [float(x[0]) for x in meta.get("output_token_logprobs", [])]
        if len(lps) != len(ids):
            raise EngineError("/generate", 200, f"{len(ids)} tokens but {len(lps)} log-probs")
        fr = meta.get("finish_reason") or {}
        reason = fr.get("type", "length") if isinstance(fr, dict) else str(fr)
        version = _parse_version(meta.get("weight_version", "0"))
        return cls(
            output_ids=ids,
            logprobs=lps,
            weight_version=version,
            finish_reason=reason,
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            versions=_expand_spans(meta.get("weight_versions"), len(ids), version),
        )


def _expand_spans(spans: Any, n: int, last: int) -> list[int] | None:
    """SGLang's ``meta_info.weight_versions`` (``[{version, start, end}]``, output-token
    ranges, 0.5.23 srt/utils/weight_versions.py:63-108) as one version per token; None when
    absent or a single span (every token has ``last``). Tokens no span covers (none in
    SGLang's output) get the version of the span before them."""
    if not isinstance(spans, list) or len(spans) <= 1:
        return None
    out = [last] * n
    try:
        for span in spans:
            v = _parse_version(span["version"])
            start, end = max(0, int(span["start"])), min(n, int(span["end"]))
            out[start:end] = [v] * max(0, end - start)
            out[end:] = [v] * (n - end)  # until a later span says otherwise
    except (KeyError, TypeError, ValueError) as exc:
        raise EngineError("/generate", 200, f"malformed weight_versions {spans!r:.200}") from exc
    return out


def _parse_version(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0  # SGLang's "default" before any update


class RolloutEngine(Protocol):
    """A generation server as the controller sees it (module docstring: the contract).

    The receiving side of weight sync (``init_weights_update_group``,
    ``update_weights_from_distributed``, ``update_weights_from_tensor``) is driven
    by the weight transport through :class:`~asyncrl.engines.rollout.sglang.client.SGLangClient`.
    """

    url: str

    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str | None = None
    ) -> GenerateResult:
        """Complete ``input_ids``. Raises EngineError (server said no) or EngineUnavailable."""
        ...

    async def generate_batch(
        self,
        input_ids: list[list[int]],
        sampling_params: list[dict[str, Any]],
        rids: list[str] | None = None,
    ) -> list[GenerateResult]:
        """Several completions in one request (SGLang's list-form ``/generate``), answered in
        order once all finished; errors as :meth:`generate`, once for the whole batch."""
        ...

    async def pause_generation(self, mode: str = "abort") -> None:
        """Stop scheduling. ``abort`` returns in-flight requests; other modes keep them."""
        ...

    async def continue_generation(self) -> None:
        """Resume scheduling after a pause."""
        ...

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """Finish request ``rid`` (or all) now; its ``generate`` returns the partial output."""
        ...

    async def get_weight_version(self) -> str:
        """The version of the weights now loaded."""
        ...

    async def health(self) -> bool:
        """True when the server answers a cheap liveness probe; never raises."""
        ...

    async def close(self) -> None:
        """Release the client's connections (the server keeps running)."""
        ...
