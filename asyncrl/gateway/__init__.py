"""OpenAI-compatible gateway: agents' API calls become exact trajectories (controller side).

See :mod:`asyncrl.gateway.app` (server, sessions by URL or key, the episode),
:mod:`~asyncrl.gateway.transcript` (token-exact branches), :mod:`~asyncrl.gateway.chat`
(turns), :mod:`~asyncrl.gateway.stream` (answers), :mod:`~asyncrl.gateway.protocol`
(requests) and docs/agents.md.
"""

from asyncrl.gateway.app import AgentFn, Gateway
from asyncrl.gateway.sessions import Session, SessionSample

__all__ = ["AgentFn", "Gateway", "Session", "SessionSample"]
