"""The request checks moved to :mod:`asyncrl.engines.rollout.checks` (the weight transport's
receiving side uses them too, and no transport imports an engine family); re-exported."""

from asyncrl.engines.rollout.checks import (
    BadRequest,
    allowed_networks,
    check_master,
    delta,
    integer,
    number,
    shape,
    strings,
    text,
)

__all__ = [
    "BadRequest",
    "allowed_networks",
    "check_master",
    "delta",
    "integer",
    "number",
    "shape",
    "strings",
    "text",
]
