"""Checks of request fields (the embedded engine's HTTP API, the collective weight
receiver): a client mistake is a ``BadRequest`` (HTTP 400) naming the field, never an
exception from deeper down (HTTP 500).

What the HTTP API trusts: any client that reaches the engine's address may
generate, abort, pause and push weights — bind it to an address only the
run's own processes reach (loopback by default). It may not make the engine
connect anywhere: ``/init_weights_update_group`` joins a group only at a
master address inside ``allowed_masters`` (loopback by default; the run
passes the trainer's ``weights.master_address``), on a real port, with a
bounded timeout, and weight announcements are checked against the model
(names, dtypes, sizes) before any memory is allocated for them.
"""

from __future__ import annotations

import ipaddress
import math
import socket
from collections.abc import Sequence
from typing import Any

__all__ = [
    "BadRequest",
    "allowed_networks",
    "check_master",
    "delta",
    "integer",
    "number",
    "text",
]

LOOPBACK = ("127.0.0.0/8", "::1/128")
MAX_DIMS = 8


class BadRequest(ValueError):
    """A client mistake in a request (answered with HTTP 400 and this message)."""


def integer(body: dict[str, Any], key: str, lo: int, hi: int, default: Any = ...) -> int:
    """``body[key]`` as an int in ``[lo, hi]`` (JSON integers only, not booleans or 1.5)."""
    value = body.get(key, default)
    if value is ...:
        raise BadRequest(f"{key} is required")
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise BadRequest(f"{key} must be an integer in [{lo}, {hi}], got {value!r}"[:300])
    return value


def number(body: dict[str, Any], key: str, lo: float, hi: float, default: Any = ...) -> float:
    """``body[key]`` as a finite float in ``(lo, hi]``."""
    value = body.get(key, default)
    if value is ...:
        raise BadRequest(f"{key} is required")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"{key} must be a number, got {value!r}"[:300])
    if not (math.isfinite(value) and lo < value <= hi):
        raise BadRequest(f"{key} must be a finite number in ({lo:g}, {hi:g}], got {value!r}")
    return float(value)


def text(body: dict[str, Any], key: str, default: Any = ..., choices: Sequence[str] = ()) -> str:
    """``body[key]`` as a non-empty string (of at most 256 characters; one of ``choices``)."""
    value = body.get(key, default)
    if value is ...:
        raise BadRequest(f"{key} is required")
    if not isinstance(value, str) or not value or len(value) > 256:
        raise BadRequest(f"{key} must be a non-empty string, got {value!r}"[:300])
    if choices and value not in choices:
        raise BadRequest(f"{key} must be one of {', '.join(choices)}, got {value!r}"[:300])
    return value


def allowed_networks(spec: str) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """Networks from a comma-separated list of addresses, CIDRs or host names (resolved now);
    ``loopback`` is 127.0.0.0/8 and ::1. ValueError names a bad entry."""
    nets: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        for one in LOOPBACK if item == "loopback" else (item,):
            try:
                nets.append(ipaddress.ip_network(one, strict=False))
                continue
            except ValueError:
                pass
            try:  # a host name: the addresses it resolves to now
                infos = socket.getaddrinfo(one, None, proto=socket.IPPROTO_TCP)
            except (OSError, UnicodeError):
                raise ValueError(
                    f"allowed weight-sync master {item!r} is not an address, CIDR or host name"
                ) from None
            # sockaddr[0] is the address string for AF_INET/AF_INET6 (typeshed also allows int)
            nets += [ipaddress.ip_network(str(i[4][0]).split("%")[0]) for i in infos]
    return nets


def check_master(address: str, networks: Sequence[Any]) -> None:
    """BadRequest unless every address ``address`` resolves to lies in ``networks`` (a
    hostname that does not resolve is refused too). Blocking: resolves names."""
    try:
        infos = socket.getaddrinfo(address, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError) as exc:
        raise BadRequest(f"master_address {address!r} does not resolve: {exc}") from None
    ips = {ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos}
    outside = sorted(str(ip) for ip in ips if not any(ip in n for n in networks))
    if outside or not ips:
        allowed = ", ".join(str(n) for n in networks) or "nothing"
        raise BadRequest(
            f"master_address {address!r} ({', '.join(outside)}) is not an allowed weight-sync "
            f"master (allowed: {allowed}; the engine's --weight-masters sets them)"
        )


def shape(value: Any, key: str) -> tuple[int, ...]:
    """A tensor shape: a list of at most MAX_DIMS non-negative ints."""
    if not isinstance(value, list | tuple) or len(value) > MAX_DIMS:
        raise BadRequest(f"{key} must be a list of at most {MAX_DIMS} sizes, got {value!r}"[:300])
    for x in value:
        if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < 1 << 48:
            raise BadRequest(f"{key} holds a bad size {x!r} (non-negative integers)"[:300])
    return tuple(value)


def strings(value: Any, key: str) -> list[str]:
    """A non-empty list of strings."""
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise BadRequest(f"{key} must be a non-empty list of strings, got {value!r}"[:300])
    return value


def delta(value: Any, nbytes: int) -> tuple[int, int, int | None] | None:
    """A bucket's ``delta`` field (``weights.delta``): None, or ``[base, nbytes, checksum]``
    whose payload size fits a bucket of ``nbytes`` bytes as ``12 * words + nbytes % 8`` with
    at most every word changed (see ``transports/weights/delta.py``); checksum a signed int64
    or null. Checked before the payload's buffer is allocated."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) not in (2, 3):
        raise BadRequest(f"delta must be [base, nbytes, checksum], got {value!r}"[:300])
    fields = dict(zip(("base", "nbytes", "checksum"), value, strict=False))
    base = integer(fields, "base", -(1 << 62), 1 << 62)
    tail = nbytes % 8
    size = integer(fields, "nbytes", tail, 12 * (nbytes // 8) + tail)
    if (size - tail) % 12:
        raise BadRequest(
            f"delta nbytes {size} is not 12 * words + {tail} for a {nbytes} B bucket"[:300]
        )
    value_ = fields.get("checksum")
    sum_ = None if value_ is None else integer(fields, "checksum", -(1 << 63), (1 << 63) - 1)
    return base, size, sum_
