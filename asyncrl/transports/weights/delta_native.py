"""The delta loops in C, compiled on first use (CPU buffers only; see ``delta``).

Finding the changed words of a bucket with numpy or torch takes several passes over it
(compare into a mask, the mask's nonzero indices, a gather, a scatter into the base), and
the index passes branch on every changed word: at a few percent of changed words that is
most of a delta push's CPU time on a 2-core machine. These two loops do it in one
pass each, with no branch per word:

- ``encode``: compare words ``[start, n)`` of a packed bucket with its base (8 at a time: a
  block equal to its base costs one vectorised compare); each changed word's value and
  index are appended to ``vals``/``idx`` and written into the base; stops before ``cap``
  changed words (the caller grows its buffers and resumes).
- ``apply``: write ``c`` (value, index) pairs into a bucket, refusing an index outside it.

The source is compiled with the system C compiler (``$CC``, else ``cc``/``gcc``) into a
shared object kept in ``$XDG_CACHE_HOME/asyncrl`` (``~/.cache/asyncrl``), named by a hash
of the source and the compiler, written under a temporary name and renamed (processes
compiling at once do not see each other's half-written file). No compiler, a failed
compile, or ``ASYNCRL_DELTA_NATIVE=0``: :func:`kernels` returns None and ``delta`` uses
its torch/numpy path (same payloads, bit for bit; slower).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

__all__ = ["Kernels", "kernels"]

log = logging.getLogger("asyncrl.weights")

SOURCE = r"""
#include <stdint.h>

/* Words [i, n) of new against base: each differing word's value to vals[c], its index to
   idx[c], and into base. Stops before c would exceed cap; returns the word it stopped at
   (n when done) and leaves the count in *count. Blocks of 8 words that equal their base are
   skipped after one vectorised compare; in the others every word writes vals[c], idx[c] and
   base[i] and the count moves on only when it differs (no branch per word). */
int64_t asyncrl_delta_encode(const uint64_t *restrict new_, uint64_t *restrict base,
                             int64_t i, int64_t n, uint64_t *restrict vals,
                             uint32_t *restrict idx, int64_t *count, int64_t cap) {
    int64_t c = *count;
    while (i + 8 <= n && c + 8 <= cap) {
        uint64_t d = 0;
        for (int k = 0; k < 8; k++) d |= new_[i + k] ^ base[i + k];
        if (d) {
            for (int k = 0; k < 8; k++) {
                uint64_t x = new_[i + k], o = base[i + k];
                vals[c] = x;
                idx[c] = (uint32_t)(i + k);
                base[i + k] = x;
                c += x != o;
            }
        }
        i += 8;
    }
    for (; i < n && c < cap; i++) {
        uint64_t x = new_[i], o = base[i];
        vals[c] = x;
        idx[c] = (uint32_t)i;
        base[i] = x;
        c += x != o;
    }
    *count = c;
    return i;
}

/* dst[idx[j]] = vals[j] for j < c; returns c, or -1 - j at the first index >= n (the words
   before it are written). */
int64_t asyncrl_delta_apply(uint64_t *restrict dst, int64_t n, const uint64_t *restrict vals,
                            const uint32_t *restrict idx, int64_t c) {
    for (int64_t j = 0; j < c; j++) {
        uint32_t i = idx[j];
        if ((int64_t)i >= n) return -1 - j;
        dst[i] = vals[j];
    }
    return c;
}
"""


class Kernels:
    """The compiled loops (ctypes releases the GIL while they run)."""

    def __init__(self, lib: ctypes.CDLL):
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self.encode = lib.asyncrl_delta_encode
        self.encode.restype = i64
        self.encode.argtypes = [ptr, ptr, i64, i64, ptr, ptr, ctypes.POINTER(i64), i64]
        self.apply = lib.asyncrl_delta_apply
        self.apply.restype = i64
        self.apply.argtypes = [ptr, i64, ptr, ptr, i64]


_lock = threading.Lock()
_loaded: list[Kernels | None] = []  # [] until the first call


def kernels() -> Kernels | None:
    """The compiled loops, or None (no compiler, a failed compile, or disabled)."""
    with _lock:
        if not _loaded:
            _loaded.append(_load())
        return _loaded[0]


def _load() -> Kernels | None:
    if os.environ.get("ASYNCRL_DELTA_NATIVE", "1") == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        log.info("delta pushes: no C compiler found, using the torch/numpy path")
        return None
    try:
        return Kernels(ctypes.CDLL(str(_compiled(cc))))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("delta pushes: compiling the C loops failed (%s); torch/numpy path", exc)
        return None


def _compiled(cc: str) -> Path:
    """The shared object of :data:`SOURCE` built by ``cc`` (compiled when not cached)."""
    version = subprocess.run(
        [cc, "--version"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    key = hashlib.sha256(f"{SOURCE}\0{cc}\0{version}".encode()).hexdigest()[:16]
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "asyncrl"
    out = root / f"delta-{key}.so"
    if out.exists():
        return out
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        src = Path(tmp) / "delta.c"
        src.write_text(SOURCE)
        built = Path(tmp) / "delta.so"
        cmd = [cc, "-O3", "-std=c99", "-fPIC", "-shared", "-o", str(built), str(src)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise subprocess.SubprocessError(f"{' '.join(cmd)}: {done.stderr.strip()[-500:]}")
        os.replace(built, out)
    return out
