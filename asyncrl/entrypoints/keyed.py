"""Start a server that takes its API key as a flag (SGLang, vLLM) with the run secret as that
key, without the key on any command line or in any log.

``python -m asyncrl.entrypoints.keyed FLAG -- -m MODULE ARGS...`` (or ``-- -c CODE ARGS...``):
reads the run secret (:func:`asyncrl.secret.load`, the pipe the launcher handed over),
then runs ``MODULE`` (or ``CODE``) in this very process as ``python`` would, with
``FLAG SECRET`` appended to its ``sys.argv`` (:func:`keyed_argv`). ``sys.argv`` is this
process's memory: ``/proc/PID/cmdline`` still shows the command line above, without the
key; the server's own worker processes (multiprocessing) get their arguments over pipes.

The server may print its arguments: SGLang logs its whole ``ServerArgs``, ``api_key``
included (0.5.10 srt/entrypoints/engine.py:181 ``logger.info(f"{server_args=}")``; vLLM
redacts it, 0.33 entrypoints/common/startup.py:50). So this process's stdout and stderr
(and its children's, which inherit them) go through a pipe to a thread that writes them
on with the key replaced by ``***`` (:class:`Redactor`).
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys
import threading

from asyncrl import secret

__all__ = ["Redactor", "keyed_argv", "main"]

MASK = b"***"


def keyed_argv(args: list[str], flag: str, key: str) -> tuple[str, str, list[str]]:
    """``(kind, target, argv)`` to run ``args`` (``-m MODULE ...`` or ``-c CODE ...``, as after
    ``python``) with ``flag=key`` appended: ``kind`` is ``"-m"`` or ``"-c"``, ``argv`` what
    ``sys.argv`` is set to (``python`` sets ``argv[0]`` to the module name / ``-c``)."""
    if len(args) < 2 or args[0] not in ("-m", "-c"):
        raise ValueError(f"keyed: expected '-m MODULE ...' or '-c CODE ...', got {args[:2]!r}")
    kind, target, rest = args[0], args[1], args[2:]
    argv0 = target if kind == "-m" else "-c"
    # one ``FLAG=KEY`` word: a key that starts with "-" (token_urlsafe's alphabet has it, 1 in
    # 64 secrets) would be read by argparse as the next flag after a separate ``FLAG``
    return kind, target, [argv0, *rest, f"{flag}={key}"]


class Redactor:
    """Copies what is written to this process's fds 1 and 2 (and so its children's) to the
    original stdout, with every occurrence of ``key`` replaced by ``***``."""

    def __init__(self, key: str):
        self.key = key.encode()
        self.out = os.dup(1)
        r, w = os.pipe()
        os.dup2(w, 1)
        os.dup2(w, 2)
        os.close(w)
        self._r = r
        self._thread = threading.Thread(target=self._copy, name="redact", daemon=True)
        self._thread.start()

    def _copy(self) -> None:
        keep = len(self.key) - 1  # a key cut between two reads is joined before replacing
        buf = b""
        while chunk := os.read(self._r, 1 << 16):
            buf = (buf + chunk).replace(self.key, MASK)  # what is left: no whole key
            cut = buf.rfind(b"\n") + 1 or max(0, len(buf) - keep)  # keep a key's start
            self._write(buf[:cut])
            buf = buf[cut:]
        self._write(buf.replace(self.key, MASK))

    def _write(self, data: bytes) -> None:
        while data:
            data = data[os.write(self.out, data) :]

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop copying: fds 1 and 2 point at the original stdout again; what was written
        before is copied first (within ``timeout_s``: children may still hold the pipe)."""
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except (OSError, ValueError):
                pass
        os.dup2(self.out, 1)
        os.dup2(self.out, 2)
        self._thread.join(timeout_s)


def main(argv: list[str] | None = None) -> None:
    """``FLAG -- ARGS...``: run ARGS with ``FLAG <run secret>`` (module docstring)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[1] != "--":
        raise SystemExit("usage: python -m asyncrl.entrypoints.keyed FLAG -- -m MODULE ARGS...")
    key = secret.load()
    kind, target, sys.argv = keyed_argv(args[2:], args[0], key)
    atexit.register(Redactor(key).close)
    if kind == "-m":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})


if __name__ == "__main__":
    main()
