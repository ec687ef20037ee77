"""An emulated network link for benchmarks: a network namespace joined to this one by a
veth pair whose rate is shaped with ``tc``'s token-bucket filter (``tbf``).

``asyncrl bench weight-sync --link-gbit N`` runs its receiving processes (the engines and
the floor's peer) inside the namespace, so every byte they exchange with the sender
crosses the shaped pair: the push and the link's floor are measured on a link of ``N``
Gbit/s (what engines on another node see) instead of loopback's memory bandwidth.

Contract:

- Root only (namespaces and qdiscs need ``CAP_NET_ADMIN``): :func:`refusal` says why
  not otherwise, before anything is made.
- Only the bench's own traffic crosses it: the namespace has no other interface but its
  loopback, the pair's addresses are a private /30 not otherwise in use on this host, and
  nothing routes beyond the pair.
- Both ends are shaped (``tbf`` on each veth's egress), so each direction runs at ``N``.
- :class:`EmulatedLink` removes what it made on exit, however the block ends; a namespace
  left by a bench that was SIGKILLed (named after a pid no longer alive) is removed by the
  next one (:func:`sweep_stale`).
- :func:`enter` moves the calling process into the namespace (``setns``); call it first
  thing in a receiving process, before any socket or thread exists.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from types import TracebackType

__all__ = ["EmulatedLink", "enter", "refusal", "sweep_stale"]

_PREFIX = "asyncrl-link-"
_NAME_RE = re.compile(rf"{re.escape(_PREFIX)}(\d+)-(\d+)$")
_CLONE_NEWNET = 0x40000000


def refusal() -> str:
    """Why an emulated link cannot be made here ("" when it can)."""
    if not hasattr(os, "geteuid") or not os.path.isdir("/proc/sys/net"):
        return "--link-gbit needs Linux (network namespaces and tc)"
    if os.geteuid() != 0:
        return "--link-gbit needs root (it makes a network namespace and shapes a veth pair)"
    for tool in ("ip", "tc"):
        if _which(tool) is None:
            return f"--link-gbit needs the '{tool}' command (Debian: iproute2)"
    return ""


def _which(tool: str) -> str | None:
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    return shutil.which(tool, path=path)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _cmd("ip", *args, check=check)


def _cmd(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    exe = _which(args[0]) or args[0]
    done = subprocess.run([exe, *args[1:]], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"emulated link: `{' '.join(args)}` failed: {done.stderr.strip()}")
    return done


def sweep_stale() -> list[str]:
    """Remove namespaces of emulated links whose bench process is gone; their names."""
    gone = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = _NAME_RE.fullmatch(name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _ip("netns", "del", name, check=False)  # its veth end goes, and with it the pair
            gone.append(name)
    return gone


def _used_subnets() -> set[int]:
    """Third octets of the 10.213.X.0/24 nets that already have an address on this host."""
    out = _ip("-4", "-o", "addr", "show", check=False).stdout
    return {int(m.group(1)) for m in re.finditer(r"inet 10\.213\.(\d+)\.", out)}


class EmulatedLink:
    """A namespace ``name`` reached over a veth pair shaped to ``gbit`` Gbit/s each way:
    this side is ``host_addr``, the namespace's side ``ns_addr``."""

    def __init__(self, gbit: float, latency_ms: float = 20.0) -> None:
        why = refusal()
        if why:
            raise PermissionError(why)
        if not gbit > 0:
            raise ValueError(f"--link-gbit must be > 0, not {gbit}")
        self.gbit = gbit
        self.latency_ms = latency_ms
        self.name = f"{_PREFIX}{os.getpid()}-{id(self) % 100000}"
        tag = f"{os.getpid() % 100000}{id(self) % 100}"
        self.here, self.there = f"arl{tag}a"[:15], f"arl{tag}b"[:15]
        self.host_addr = self.ns_addr = ""
        self.made = False

    def __enter__(self) -> EmulatedLink:
        sweep_stale()
        used = _used_subnets()
        net = next((x for x in range(os.getpid() % 200 + 1, 255) if x not in used), None)
        if net is None:
            raise RuntimeError("emulated link: no free 10.213.X.0/24 subnet on this host")
        self.host_addr, self.ns_addr = f"10.213.{net}.1", f"10.213.{net}.2"
        _ip("netns", "add", self.name)
        self.made = True
        try:
            self._wire()
        except BaseException:
            self.close()
            raise
        return self

    def _wire(self) -> None:
        ns = ("ip", "netns", "exec", self.name)
        _ip("link", "add", self.here, "type", "veth", "peer", "name", self.there)
        _ip("link", "set", self.there, "netns", self.name)
        _ip("addr", "add", f"{self.host_addr}/30", "dev", self.here)
        _ip("link", "set", self.here, "up")
        _cmd(*ns, "ip", "addr", "add", f"{self.ns_addr}/30", "dev", self.there)
        _cmd(*ns, "ip", "link", "set", self.there, "up")
        _cmd(*ns, "ip", "link", "set", "lo", "up")
        rate_bytes = self.gbit * 1e9 / 8
        burst = max(256 * 1024, int(rate_bytes / 1000))  # 1 ms at the rate, at least 256 KiB
        tbf = ["root", "tbf", "rate", f"{self.gbit:g}gbit", "burst", str(burst)]
        tbf += ["latency", f"{self.latency_ms:g}ms"]
        _cmd("tc", "qdisc", "add", "dev", self.here, *tbf)
        _cmd(*ns, "tc", "qdisc", "add", "dev", self.there, *tbf)

    def close(self) -> None:
        """Remove the namespace (and with it the pair); idempotent."""
        if self.made:
            _ip("netns", "del", self.name, check=False)
            _ip("link", "del", self.here, check=False)  # gone with its peer already, normally
            self.made = False

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def enter(name: str) -> None:
    """Move this process into the network namespace ``name`` (``ip netns``'s)."""
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)
