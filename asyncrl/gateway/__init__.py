"""OpenAI-compatible gateway: agents' API calls become exact trajectories (controller side).

See :mod:`asyncrl.gateway.app` (server, sessions by URL or key, the episode),
:mod:`~asyncrl.gateway.transcript` (token-exact branches), :mod:`~asyncrl.gateway.chat`
(turns), :mod:`~asyncrl.gateway.stream` (answers), :mod:`~asyncrl.gateway.protocol`
(requests), :mod:`~asyncrl.gateway.auth` (keys) and docs/agents.md.
"""

from asyncrl.gateway.app import AgentFn, Gateway
from asyncrl.gateway.auth import gateway_key, session_key
from asyncrl.gateway.sessions import Session, SessionSample

__all__ = ["AgentFn", "Gateway", "Session", "SessionSample", "gateway_key", "session_key"]
