"""Addresses of this host: which interface owns an address, and binding Gloo to it.

Gloo picks its address from the hostname unless told otherwise; on hosts whose
name maps to a loopback address (Debian's ``127.0.1.1``) every rank then
advertises loopback and cross-host connections fail. A process that knows the
address it advertises binds Gloo there: explicitly for groups it builds itself
(:func:`gloo_options`), through ``GLOO_SOCKET_IFNAME`` (and
``NCCL_SOCKET_IFNAME``) for groups ``torch.distributed`` builds
(:func:`pin_socket_ifname`; a user's own ``*_SOCKET_IFNAME`` wins there).
:func:`tcp_store` makes a ``TCPStore`` whose server listens on the given address only
(torch's own listens on every interface). This module imports torch only inside
functions.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
from collections.abc import MutableMapping
from datetime import timedelta
from typing import Any

__all__ = ["gloo_options", "iface_of", "pin_socket_ifname", "tcp_store"]

_SIOCGIFADDR = 0x8915


def iface_of(address: str) -> str | None:
    """The network interface whose (primary IPv4) address is ``address`` (Linux); else None.

    A loopback alias such as ``127.0.0.2`` maps to ``lo``, whose address is 127.0.0.1.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        target = socket.gethostbyname(address)
    except OSError:
        return None
    if target.startswith("127."):
        return "lo"
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
            except OSError:
                continue
            if addr == target:
                return name
    return None


def pin_socket_ifname(address: str, env: MutableMapping[str, str] | None = None) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` in ``env`` (default: this
    process's) to the interface of ``address``, unless the user set them; the name, or None.

    Call it before the process's first process group exists.
    """
    target = os.environ if env is None else env
    name = iface_of(address)
    if name is not None:
        target.setdefault("GLOO_SOCKET_IFNAME", name)
        target.setdefault("NCCL_SOCKET_IFNAME", name)
    return name


def gloo_options(address: str, timeout_s: float) -> Any:
    """``ProcessGroupGloo`` options whose one device is bound to ``address`` exactly (an
    interface name would not do: ``lo`` carries every ``127.x`` alias as 127.0.0.1)."""
    import torch.distributed as dist

    # _Options is bound by torch's C extension but missing from its .pyi
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = timedelta(seconds=timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return opts


def tcp_store(host: str, port: int, world_size: int, is_master: bool, timeout_s: float) -> Any:
    """A ``torch.distributed.TCPStore`` at ``host:port``; on the master its server listens on
    ``host`` only (a socket bound here and handed over), never on all interfaces."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(
        host,
        port,
        world_size,
        True,
        timeout,
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )
