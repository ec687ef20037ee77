"""The gateway's keys: one gateway key, and a key per session derived from it.

- The **gateway key** opens any session, names any, reads ``/stats``: a client harness's
  key. It is the user's (``gateway.api_key_env`` / ``gateway.api_key_file``) or, by
  default, derived from the run secret (:func:`gateway_key`: HMAC-SHA256 of the secret; the
  secret cannot be had back from it). ``asyncrl run`` writes it to ``RUN_DIR/gateway.key``
  (mode 0600) beside the address in ``RUN_DIR/gateway.json``.
- A **session key** (:func:`session_key`) is ``sk-asyncrl-{SID}~{MAC}``, MAC an HMAC of the
  session id under the gateway key: it opens and names session ``SID`` only (as Bearer,
  with or without ``/sessions/SID`` in the path) and nothing else. An agent-mode episode
  hands its agent function (or command) its own session's key only; a harness holding the
  gateway key can derive one per session it runs and hand each agent just that.

Every comparison is constant-time. No key is ever logged or echoed in an error.
"""

from __future__ import annotations

import base64
import hashlib
import hmac

__all__ = ["gateway_key", "session_key", "session_of"]

_PREFIX = "sk-asyncrl-"
_SEP = "~"  # in no session id (GROUP.K: letters, digits, '-', '_', '.'; agent ids: hex)


def _mac(key: str, message: bytes) -> str:
    raw = hmac.new(key.encode(), message, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def gateway_key(run_secret: str) -> str:
    """The gateway key a run's secret gives (the same for every holder of the secret)."""
    return _PREFIX + _mac(run_secret, b"asyncrl gateway")


def session_key(gateway_key: str, sid: str) -> str:
    """The key of session ``sid`` under ``gateway_key``: it opens and names that session only."""
    return f"{_PREFIX}{sid}{_SEP}{_mac(gateway_key, b'asyncrl session ' + sid.encode())}"


def session_of(gateway_key: str, token: str | None) -> str | None:
    """The session id ``token`` is the key of (under ``gateway_key``), or None when it is no
    valid session key."""
    if not token or not token.startswith(_PREFIX) or _SEP not in token:
        return None
    sid = token[len(_PREFIX) :].rpartition(_SEP)[0]
    if not sid:
        return None
    good = session_key(gateway_key, sid)
    return sid if hmac.compare_digest(good.encode(), token.encode(errors="replace")) else None
