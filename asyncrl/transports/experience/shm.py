"""Same-host fast path of the experience channel: a shared-memory ring per (producer, rank).

The producer owns one POSIX shared-memory segment (a file in ``/dev/shm``) per
consumer rank, announces it with a :class:`~asyncrl.transports.experience.wire.Ring`
message and writes each message's arrays straight into it (one copy, 64-byte
aligned, the payload layout of ``codec.py``); ZeroMQ then carries only the small
header with the payload's ``offset``. The consumer maps the segment read-only and
hands out ``np.frombuffer`` views of it (no copy at all).

Ownership and lifetime:

- :class:`RingWriter` (producer) allocates ring space per message seq and frees it
  when the consumer acks that seq; the bytes of a message are never overwritten
  before its ack, so a delivered trajectory's arrays stay valid until the
  consumer acks its delivery (and may change at any time after that).
- Allocation is a FIFO ring that wraps to the start as soon as the free prefix
  holds the live bytes plus the new message, so the bytes in use cycle over about
  twice the in-flight window (hot in the CPU caches) rather than the whole segment.
- Liveness is an ``flock``: the producer holds a shared lock on its segment for
  as long as it lives (the kernel drops it when the process dies, even by
  SIGKILL). Anyone who gets an exclusive lock knows the owner is gone and may
  unlink the segment: the consumer does so when idle and on close
  (:meth:`RingReader.reap`), and every new producer sweeps such orphans
  (:func:`sweep_orphans`). A segment is created under a hidden temporary name,
  locked, then renamed, so no visible segment is ever unlocked while its owner
  lives.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import sys
import weakref
from collections.abc import Sequence
from pathlib import Path

from asyncrl.core import ARRAY_FIELDS, Trajectory

__all__ = [
    "ALIGN",
    "SHM_DIR",
    "RingReader",
    "RingWriter",
    "host_token",
    "shm_available",
    "sweep_orphans",
]

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
"""Where POSIX shared memory lives on Linux (a tmpfs)."""
ALIGN = 64
"""Every message starts at a multiple of this many bytes in its ring (a cache line)."""
PREFAULT = 16 << 20
"""Bytes at the start of a ring whose pages are allocated up front (where the allocator keeps
the in-flight window): a first write to a tmpfs page costs ~15x a later one."""
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14
PREFIX = "asyncrl-xp-"
NAME_RE = re.compile(r"asyncrl-xp-[0-9]{1,10}-[0-9a-f]{16}")
"""Names a consumer accepts (no path separators, nothing outside the prefix)."""
_NAMES = list(ARRAY_FIELDS)


def shm_available() -> bool:
    """True where the ring can be used: Linux with a writable ``/dev/shm``."""
    return sys.platform.startswith("linux") and os.access(SHM_DIR, os.W_OK | os.X_OK)


def host_token() -> str:
    """Who can share rings with us: boot id, device and inode of ``/dev/shm``, user id.

    Two processes with the same token see the same shared-memory files as the same user
    (same machine, same boot, same tmpfs mount; not two containers with private
    ``/dev/shm``), so one can map the other's rings. Empty where rings cannot be used."""
    if not shm_available():
        return ""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        st = os.stat(SHM_DIR)
    except OSError:
        return ""
    return f"{boot}:{st.st_dev}:{st.st_ino}:{os.getuid()}"


def _lock_free(fd: int) -> bool:
    """True if nobody holds a lock on ``fd``'s file (its producer is gone); then we hold it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    return True


def _unlink_if_same(name: str, fd: int) -> bool:
    """Unlink ``SHM_DIR/name`` if it still is the file open as ``fd``."""
    path = SHM_DIR / name
    try:
        if os.stat(path).st_ino != os.fstat(fd).st_ino:
            return False
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def _prefault(mm: mmap.mmap, nbytes: int) -> None:
    """Allocate the pages of the first ``nbytes`` now (about 10 ms for 16 MiB)."""
    try:
        mm.madvise(_MADV_POPULATE_WRITE, 0, nbytes)
    except OSError:  # older kernel: write zeros
        zeros = bytes(1 << 20)
        for start in range(0, nbytes, len(zeros)):
            end = min(nbytes, start + len(zeros))
            mm[start:end] = zeros[: end - start]


def _release(name: str, fd: int) -> None:
    _unlink_if_same(name, fd)
    os.close(fd)


def sweep_orphans() -> list[str]:
    """Unlink ring segments of this user whose producer died (nobody holds their lock).

    Returns the names removed. Segments of live producers are left alone."""
    removed: list[str] = []
    if not shm_available():
        return removed
    for path in SHM_DIR.glob(PREFIX + "*"):
        if not NAME_RE.fullmatch(path.name):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_uid == os.getuid() and _lock_free(fd):
                if _unlink_if_same(path.name, fd):
                    removed.append(path.name)
        finally:
            os.close(fd)
    if removed:
        log.warning("removed %d orphaned experience ring(s): %s", len(removed), removed)
    return removed


class RingWriter:
    """Producer side of one ring: a segment of ``nbytes`` it alone writes.

    ``write(seq, trajs)`` copies the trajectories' arrays into free space and returns
    the offset (or None when they do not fit now: send that message as frames);
    ``free(seq)`` releases a message's space once acked. ``close()`` unlinks.
    """

    def __init__(self, nbytes: int):
        if nbytes < ALIGN:
            raise ValueError(f"experience ring of {nbytes} bytes is too small (experience.shm_mb)")
        self.nbytes = nbytes
        self.name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        tmp = SHM_DIR / f".{self.name}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # held until this process closes it or dies
            os.ftruncate(fd, nbytes)  # sparse: pages are allocated on first write
            self._mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            _prefault(self._mm, min(nbytes, PREFAULT))
            os.rename(tmp, SHM_DIR / self.name)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        self._fd = fd
        # unlinks at close(), when garbage collected, or when the interpreter exits
        self._finalizer = weakref.finalize(self, _release, self.name, fd)
        # live allocations in allocation order: seq -> [start, end, freed]
        self._live: collections.OrderedDict[int, list] = collections.OrderedDict()
        self._head = 0  # where the next allocation starts (if it fits)

    @property
    def used(self) -> int:
        """Bytes between the oldest live allocation and the newest (what cannot be reused)."""
        if not self._live:
            return 0
        tail = next(iter(self._live.values()))[0]
        return self._head - tail if self._head > tail else self.nbytes - tail + self._head

    def write(self, seq: int, trajs: Sequence[Trajectory], size: int) -> int | None:
        """Copy the payload (``size`` bytes, codec layout) of ``trajs`` into the ring.

        Returns its offset, or None if ``size`` bytes are not free now. ``size > 0``. Raises
        TypeError (and leaves the ring as it was) if the arrays do not add up to ``size``
        bytes (an array replaced by one of another dtype after construction)."""
        head = self._head
        off = self._alloc(size)
        if off is None:
            return None
        mm, pos, end = self._mm, off, off + size
        try:
            for name in _NAMES:
                for t in trajs:
                    a = getattr(t, name)
                    n = a.nbytes
                    if pos + n > end:
                        break
                    mm[pos : pos + n] = a
                    pos += n
            if pos != end:
                raise TypeError(
                    f"trajectory arrays hold {pos - off}+ bytes, their lengths imply {size}: "
                    f"each must be 1-D, C-contiguous, of dtype {dict(ARRAY_FIELDS)}"
                )
        except BaseException:
            self._head = head  # nothing was allocated
            raise
        self._live[seq] = [off, end, False]
        return off

    def read(self, offset: int, size: int) -> bytes:
        """A copy of ``size`` bytes at ``offset`` (to resend a message as frames)."""
        return self._mm[offset : offset + size]

    def free(self, seq: int) -> None:
        """``seq`` is acked: its space may be reused (once all older ones are free too)."""
        item = self._live.get(seq)
        if item is None:
            return
        item[2] = True
        while self._live and next(iter(self._live.values()))[2]:
            self._live.popitem(last=False)

    def close(self) -> None:
        """Unlink the segment and unmap it (views the producer may still hold stay valid)."""
        if self._fd < 0:
            return
        self._finalizer()
        self._fd = -1
        try:
            self._mm.close()
        except BufferError:  # someone still holds a view: the mapping goes with it
            pass

    def _alloc(self, size: int) -> int | None:
        """Start of ``size`` free bytes (FIFO ring that wraps to 0 early, see below)."""
        assert size > 0, "empty payloads do not use the ring"
        size = -(-size // ALIGN) * ALIGN
        if not self._live:
            self._head = 0
        if self._live:
            tail = next(iter(self._live.values()))[0]
            if self._head > tail:
                # live bytes are [tail, head): free space is [head, end) and [0, tail).
                # Wrap as soon as the free prefix holds the live bytes plus this message:
                # the bytes in use then cycle over about twice the in-flight window (hot in
                # the caches), not the whole ring, and the wrapped ring still has room.
                fits_end = size <= self.nbytes - self._head
                if size <= tail and (tail >= self._head - tail + size or not fits_end):
                    return self._take(0, size)
                if not fits_end:
                    return None
            elif size > tail - self._head:  # wrapped: free space is [head, tail)
                return None
        elif size > self.nbytes:
            return None
        return self._take(self._head, size)

    def _take(self, start: int, size: int) -> int:
        self._head = start + size
        return start


class RingReader:
    """Consumer side of one ring: the producer's segment, mapped read-only after validation.

    ``view(offset, size)`` is a read-only memoryview of the message's bytes, valid
    (and unchanged) until the consumer acks that message."""

    def __init__(self, name: str, nbytes: int):
        """Map ``name`` (announced by the producer); ValueError if it is not acceptable."""
        if not NAME_RE.fullmatch(name):
            raise ValueError(f"ring name {name!r} is not an asyncrl ring")
        if not 0 < nbytes <= 1 << 40:
            raise ValueError(f"ring size {nbytes} out of range")
        try:
            fd = os.open(SHM_DIR / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise ValueError(f"cannot open ring {name!r}: {exc} (not on this host?)") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise ValueError(f"ring {name!r} is not a regular file of this user")
            if st.st_size < nbytes:
                raise ValueError(f"ring {name!r} has {st.st_size} bytes, announced {nbytes}")
            self._mm = mmap.mmap(fd, nbytes, access=mmap.ACCESS_READ)  # read-only buffers
        except BaseException:
            os.close(fd)
            raise
        self.name, self.nbytes, self._fd = name, nbytes, fd
        self._view = memoryview(self._mm)

    def view(self, offset: int, size: int) -> memoryview:
        """The ``size`` bytes at ``offset``; ValueError if outside the ring or misaligned."""
        if offset % ALIGN or offset < 0 or size < 0 or offset + size > self.nbytes:
            raise ValueError(
                f"[{offset}, {offset + size}) is not an aligned range of ring {self.name} "
                f"({self.nbytes} bytes)"
            )
        return self._view[offset : offset + size]

    def reap(self) -> bool:
        """If the producer is gone (its lock is free), unlink the segment; True if gone."""
        if self._fd < 0:
            return True
        if not _lock_free(self._fd):
            return False
        if _unlink_if_same(self.name, self._fd):
            log.warning("experience ring %s: its producer is gone; unlinked it", self.name)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        return True

    def close(self) -> None:
        """Unlink the segment if its producer is gone, then drop our handle of it (views that
        are still referenced keep the mapping alive)."""
        if self._fd < 0:
            return
        self.reap()
        os.close(self._fd)
        self._fd = -1
        self._view.release()
        try:
            self._mm.close()
        except BufferError:
            pass
