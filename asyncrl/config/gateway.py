"""The OpenAI-compatible gateway's section (:mod:`asyncrl.gateway`)."""

from __future__ import annotations

from typing import Literal

from asyncrl.config.base import NonNegative, NonNegativeFloat, Positive, PositiveFloat, _Section


class GatewayConfig(_Section, frozen=True):
    enabled: bool = False
    """Whether the run serves the gateway from the controller process: ``task.name =
    "agent"`` does (recorded as true in ``config.json``), and then also accepts sessions
    that clients open themselves (docs/agents.md); no other task serves one."""
    host: str = "127.0.0.1"
    """Address it binds (loopback unless told otherwise; never all interfaces by default)."""
    port: NonNegative = 0
    """TCP port; 0: a free one (written to ``RUN_DIR/gateway.json``)."""
    api_key_env: str = ""
    """Name of an environment variable holding a gateway key of your choosing. Every request,
    on every route, carries the gateway key (or its session's own key) as ``Authorization:
    Bearer``, else 401; without ``api_key_env`` / ``api_key_file`` the gateway key is derived
    from the run secret and ``asyncrl run`` writes it to ``RUN_DIR/gateway.key`` (mode 0600).
    The key itself never appears in a config, a command line or a log."""
    api_key_file: str = ""
    """Path of a file holding a gateway key of your choosing (its first line), as
    ``api_key_env``; at most one of the two."""
    model_name: str = ""
    """The model id ``/v1/models`` lists and responses name; empty: the model folder's name."""
    strict_model: bool = False
    """A request naming another model than ``/v1/models`` lists gets 404 ``model_not_found``
    (OpenAI's answer). Off: any name is served (agents keep the name they were set up with)."""
    admission: Literal["wait", "reject"] = "wait"
    """A new session while the staleness bound admits no episode: ``wait`` (up to
    ``admission_timeout_s``, then 429) or ``reject`` (429 with ``Retry-After`` at once; a
    session that fitted is then admitted, its first request waiting for that)."""
    admission_timeout_s: PositiveFloat = 60.0
    """How long a new session's first request waits for admission before its 429."""
    retry_after_s: Positive = 1
    """``Retry-After`` (seconds) of a 429."""
    session_timeout_s: PositiveFloat = 600.0
    """A client-opened session idle this long (no request, no reward) ends: it is dropped
    (counted ``timed_out``)."""
    agent_timeout_s: NonNegativeFloat = 0.0
    """Longest an agent-mode episode (``task.agent`` function or ``task.agent_command``
    process) may run, from its start to its reward: then the function is cancelled (the
    process killed), its session's engine requests aborted and its sample rejected (logged
    with the sample id; counted ``timed_out``). 0: ``session_timeout_s``."""
    on_disconnect: Literal["keep", "drop"] = "keep"
    """A client that hangs up mid-completion: ``keep`` the session's trajectory up to its last
    full turn (the cut turn is discarded), or ``drop`` the whole session; both counted."""
    max_n: Positive = 16
    """Largest ``n`` (choices per request) accepted."""
    max_tokens: NonNegative = 0
    """Completion budget when a request names none; 0: ``rollout.max_new_tokens`` or the
    engine default."""
