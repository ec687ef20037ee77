"""The delta loops in C, compiled on first use (CPU buffers only; see ``delta``).

Finding the changed words of a bucket with numpy or torch takes several passes over it
(compare into a mask, the mask's nonzero indices, a gather, a scatter into the base), and
the index passes branch on every changed word: at a few percent of changed words that is
most of a delta push's CPU time on a 2-core machine. These loops do it in one pass each,
with no branch on the data (a branch taken at random costs more than the work it skips):

- ``encode``: compare words ``[start, n)`` of a packed bucket with its base, 8 at a time;
  each changed word's value and index are appended to ``vals``/``idx`` and written into
  the base; stops before ``cap`` changed words (the caller grows its buffers and resumes).
  With AVX-512 a block is one compare into a mask and two register compresses.
- ``encode_bf16``: the same for a bucket of fp32 values synced as bf16, cast while
  compared (torch's cast, bit for bit: see the C source and ``delta_pack.bf16_nan``), so
  the bf16 bucket is never written anywhere but where its words changed in the base.
- ``apply``: write ``c`` (value, index) pairs into a bucket, refusing an index outside it.

The source is compiled with the system C compiler (``$CC``, else ``cc``/``gcc``) with
``-march=native`` when the compiler takes it, into a shared object kept in
``$XDG_CACHE_HOME/asyncrl`` (``~/.cache/asyncrl``), named by a hash of the source, the
compiler and what ``-march=native`` means on this CPU (the compiler's predefined macros for
it), written under a temporary name and renamed (processes compiling at once do not see
each other's half-written file). No compiler, a failed compile, or
``ASYNCRL_DELTA_NATIVE=0``: :func:`kernels` returns None and ``delta`` uses its torch/numpy
path (same payloads, bit for bit; slower).
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
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512VL__)
#include <immintrin.h>
#endif

/* One block of 8 words w (new) against base[i, i + 8): each differing word's value to
   vals[c], its index to idx[c]; the block into base. Needs room for 8 more in vals/idx.
   Returns the new count. No branch on the data: with AVX-512 a compare into a mask and two
   register compresses (a compress *to memory* is microcoded and slow on some CPUs); else a
   store of every word that moves the count on only when it differs. */
static inline int64_t collect8(const uint64_t *restrict w, uint64_t *restrict base, int64_t i,
                               uint64_t *restrict vals, uint32_t *restrict idx, int64_t c) {
#if defined(__AVX512F__) && defined(__AVX512VL__)
    __m512i wv = _mm512_loadu_si512(w);
    __mmask8 m = _mm512_cmpneq_epi64_mask(wv, _mm512_loadu_si512(base + i));
    _mm512_mask_storeu_epi64(base + i, m, wv);
    _mm512_storeu_si512(vals + c, _mm512_maskz_compress_epi64(m, wv));
    __m256i at = _mm256_add_epi32(_mm256_set1_epi32((int32_t)i),
                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    _mm256_storeu_si256((__m256i *)(idx + c), _mm256_maskz_compress_epi32(m, at));
    return c + __builtin_popcount((unsigned)m);
#else
    for (int k = 0; k < 8; k++) {
        uint64_t x = w[k], o = base[i + k];
        vals[c] = x;
        idx[c] = (uint32_t)(i + k);
        base[i + k] = x;
        c += x != o;
    }
    return c;
#endif
}

static inline int64_t collect1(uint64_t x, uint64_t *restrict base, int64_t i,
                               uint64_t *restrict vals, uint32_t *restrict idx, int64_t c) {
    uint64_t o = base[i];
    vals[c] = x;
    idx[c] = (uint32_t)i;
    base[i] = x;
    return c + (x != o);
}

/* Words [i, n) of new against base: each differing word's value to vals[c], its index to
   idx[c], and into base. Stops before c would exceed cap; returns the word it stopped at
   (n when done) and leaves the count in *count. */
int64_t asyncrl_delta_encode(const uint64_t *restrict new_, uint64_t *restrict base,
                             int64_t i, int64_t n, uint64_t *restrict vals,
                             uint32_t *restrict idx, int64_t *count, int64_t cap) {
    int64_t c = *count;
    for (; i + 8 <= n && c + 8 <= cap; i += 8) c = collect8(new_ + i, base, i, vals, idx, c);
    for (; i < n && c < cap; i++) c = collect1(new_[i], base, i, vals, idx, c);
    *count = c;
    return i;
}

/* fp32 (as bits) to bf16 as torch's vectorised CPU cast does it (c10/util/BFloat16.h's
   round_to_nearest_even on the bits: add 0x7fff plus the lowest kept bit, keep the high
   half), every NaN to the word `nan` (the vectorised cast's 0xffff, the scalar one's
   0x7fc0: the caller passes the one its torch gives). Branch-free; vectorises. */
static inline void bf16_words(const uint32_t *restrict s, uint64_t *restrict w, int words,
                              uint16_t nan) {
    uint16_t h[32];
    for (int k = 0; k < 4 * words; k++) {
        uint32_t u = s[k];
        uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        h[k] = (u & 0x7fffffffu) > 0x7f800000u ? nan : (uint16_t)r;
    }
    memcpy(w, h, 8 * (size_t)words);
}

/* asyncrl_delta_encode of the words that fp32 elements src[4 i ...] cast to bf16 make
   (word i: elements 4i .. 4i + 3), cast while compared: nothing but the base and the
   changed words is written. */
int64_t asyncrl_delta_encode_bf16(const uint32_t *restrict src, uint64_t *restrict base,
                                  int64_t i, int64_t n, uint64_t *restrict vals,
                                  uint32_t *restrict idx, int64_t *count, int64_t cap,
                                  uint32_t nan) {
    int64_t c = *count;
    uint64_t w[8];
    for (; i + 8 <= n && c + 8 <= cap; i += 8) {
        bf16_words(src + 4 * i, w, 8, (uint16_t)nan);
        c = collect8(w, base, i, vals, idx, c);
    }
    for (; i < n && c < cap; i++) {
        bf16_words(src + 4 * i, w, 1, (uint16_t)nan);
        c = collect1(w[0], base, i, vals, idx, c);
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
        self.encode_bf16 = lib.asyncrl_delta_encode_bf16
        self.encode_bf16.restype = i64
        self.encode_bf16.argtypes = [*self.encode.argtypes, ctypes.c_uint32]
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


def _native_target(cc: str) -> tuple[list[str], str]:
    """``-march=native`` and what it means on this machine (the compiler's predefined macros
    for it: the CPU's instruction sets), or no flags when the compiler does not take it."""
    probe = [cc, "-march=native", "-dM", "-E", "-x", "c", os.devnull]
    done = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        return [], ""
    return ["-march=native"], "\n".join(sorted(done.stdout.splitlines()))


def _compiled(cc: str) -> Path:
    """The shared object of :data:`SOURCE` built by ``cc`` (compiled when not cached) for
    this machine's CPU: the cache key holds what ``-march=native`` means here, so a cache
    shared with another CPU never hands it code for instructions it lacks."""
    version = subprocess.run(
        [cc, "--version"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    flags, target = _native_target(cc)
    key = hashlib.sha256(f"{SOURCE}\0{cc}\0{version}\0{target}".encode()).hexdigest()[:16]
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "asyncrl"
    out = root / f"delta-{key}.so"
    if out.exists():
        return out
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        src = Path(tmp) / "delta.c"
        src.write_text(SOURCE)
        built = Path(tmp) / "delta.so"
        for tries in ([*flags], []) if flags else ([],):  # no -march=native: portable code
            cmd = [cc, "-O3", *tries, "-std=c99", "-fPIC", "-shared", "-o", str(built), str(src)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if done.returncode == 0:
                break
        if done.returncode != 0:
            raise subprocess.SubprocessError(f"{' '.join(cmd)}: {done.stderr.strip()[-500:]}")
        os.replace(built, out)
    return out
