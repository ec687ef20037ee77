"""The run secret: one key for every endpoint of a run (see docs/security.md).

Engines require it as an HTTP Bearer key; the experience channel derives its ZeroMQ
CURVE keys from it (:func:`curve_keys`). One process holds one secret (:func:`load`).

Where a process's secret comes from, first found:

1. ``ASYNCRL_SECRET_FD``: the number of a pipe its parent wrote the secret into (a child
   of a run: :func:`handoff`). The child reads the pipe once, closes it and drops the
   variable; the number itself is no secret.
2. ``ASYNCRL_SECRET``: the secret itself (engines started by hand). Dropped from
   ``os.environ`` when read, so no child inherits it; prefer a file.
3. A file: ``cluster.secret_file`` or ``ASYNCRL_SECRET_FILE``; it must be readable by its
   owner only (mode 0600 or stricter), else ValueError.
4. None of these: a fresh one, ``secrets.token_urlsafe(32)`` (256 bits).

``cluster.secret_file`` of a config wins over all of these in the process that runs the
config (``asyncrl run``, and an embedding program's :class:`~asyncrl.Controller` and
:class:`~asyncrl.WeightPusher`): :func:`adopt` makes the file's secret the process's.
:func:`source` says where the process's secret came from (for error messages; never the
secret).

How it travels: to a child process through an inherited pipe (:func:`handoff`), to a Ray
actor as a method argument (Ray's own channel), to an SGLang or vLLM server through
:mod:`asyncrl.entrypoints.keyed` (which adds ``--api-key`` to the server's own argument
list in memory, never to a command line). It is never written on a command line, in an
environment value a child inherits, in ``config.json``, ``processes.json``, logs,
metrics, the trace or a checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "ENV_FD",
    "ENV_FILE",
    "ENV_SECRET",
    "adopt",
    "auth_headers",
    "check_bearer",
    "curve_keys",
    "generate",
    "handoff",
    "held",
    "load",
    "read_file",
    "refused",
    "source",
    "use",
]

ENV_FD = "ASYNCRL_SECRET_FD"
ENV_SECRET = "ASYNCRL_SECRET"
ENV_FILE = "ASYNCRL_SECRET_FILE"
MIN_CHARS = 16
"""A secret shorter than this is refused (a typo, not a key)."""

_current: str | None = None
_source = ""


def generate() -> str:
    """A fresh secret: 32 random bytes, URL-safe base64 (43 characters)."""
    return secrets.token_urlsafe(32)


def _valid(secret: str, where: str) -> str:
    secret = secret.strip()
    if len(secret) < MIN_CHARS or any(c.isspace() for c in secret):
        raise ValueError(
            f"the run secret from {where} must be at least {MIN_CHARS} characters without "
            "spaces (make one: python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    return secret


def read_file(path: str | Path) -> str:
    """The secret in the file ``path``; ValueError when the file is missing, readable by
    its group or others, or holds no valid secret."""
    p = Path(path).expanduser()
    try:
        mode = p.stat().st_mode
        text = p.read_text()
    except OSError as exc:
        raise ValueError(f"run secret file {p}: {exc.strerror or exc}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(
            f"run secret file {p} is readable by other users (mode {oct(mode & 0o777)}): "
            f"chmod 600 {p}"
        )
    return _valid(text, str(p))


def _from_pipe() -> str | None:
    global _source
    fd = os.environ.pop(ENV_FD, "")
    if not fd:
        return None
    _source = "handed over by the parent process"
    try:
        with os.fdopen(int(fd), "rb") as f:
            data = f.read(4096)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{ENV_FD}={fd}: cannot read the run secret from it: {exc}") from None
    return _valid(data.decode(errors="replace"), "the parent's pipe")


def _from_user(path: str = "") -> str | None:
    global _source
    value = os.environ.pop(ENV_SECRET, "")
    if value:
        _source = f"from {ENV_SECRET}"
        return _valid(value, ENV_SECRET)
    if path:
        _source = f"from the file {path}"
    elif os.environ.get(ENV_FILE):
        path = os.environ[ENV_FILE]
        _source = f"from the file {path} ({ENV_FILE})"
    return read_file(path) if path else None


def load(path: str = "") -> str:
    """This process's secret: read once (module docstring's order; ``path``: a file to read
    when neither the parent's pipe nor ``ASYNCRL_SECRET`` gives one), then the same."""
    global _current, _source
    if _current is None:
        _current = held(path)
        if _current is None:
            _current = generate()
            _source = f"a fresh one: no cluster.secret_file, {ENV_FILE} or {ENV_SECRET} given"
    return _current


def held(path: str = "") -> str | None:
    """This process's secret as :func:`load` finds it, but never a fresh one: None when
    neither this process, its parent's pipe, ``ASYNCRL_SECRET`` nor a file gives one (a
    server guarded by a key nobody holds, :mod:`asyncrl.engines.rollout.vllm.auth`)."""
    global _current
    if _current is None:
        _current = _from_pipe() or _from_user(path)
    return _current


def use(secret: str, where: str = "given by use()") -> None:
    """Make ``secret`` this process's secret (a Ray actor handed its run's); ``where``: how
    :func:`source` describes it."""
    global _current, _source
    _current = _valid(secret, "use()")
    _source = where


def adopt(path: str) -> str:
    """Make the secret in the file ``path`` (a config's ``cluster.secret_file``) this
    process's, whatever it held before, and return it; ``""``: this process's secret as
    :func:`load` finds it. ValueError as :func:`read_file`."""
    if path:
        use(read_file(path), f"from the file {path} (cluster.secret_file)")
    return load()


def source() -> str:
    """Where this process's secret came from, for messages (``"from the file F
    (cluster.secret_file)"``, ``"a fresh one: ..."``); never the secret itself."""
    load()
    return _source


def refused(url: str) -> str:
    """The message for an engine at ``url`` that answered 401 to this process's secret: what
    was sent (its :func:`source`) and the two ways to make the keys agree."""
    return (
        f"engine {url} refused this process's run secret ({source()}): the engine holds "
        "another key. Start the engine with this secret (asyncrl serve --secret-file F; "
        "SGLang/vLLM --api-key) or give this process the engine's (cluster.secret_file=F in "
        f"its config, or {ENV_FILE}=F); docs/security.md"
    )


def auth_headers(secret: str | None = None) -> dict[str, str]:
    """The HTTP headers every request to an engine of the run carries: the one place a
    client's ``Authorization: Bearer`` is built (``secret``: default this process's)."""
    return {"Authorization": f"Bearer {secret or load()}"}


def check_bearer(header: str | None, secret: str) -> bool:
    """Whether an ``Authorization`` header value carries ``secret`` as its Bearer token
    (scheme case-insensitive, constant-time comparison, as SGLang's and vLLM's servers)."""
    if not header:
        return False
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.encode(), secret.encode())


def curve_keys(secret: str | None = None) -> tuple[bytes, bytes, bytes, bytes]:
    """ZeroMQ CURVE keys derived from the secret: ``(server_public, server_secret,
    client_public, client_secret)``, Z85-encoded. Every holder of the run secret derives
    the same pairs; without it neither the server's public key (a client needs it to say
    Hello) nor the client's key pair (the server admits only it) can be had."""
    import zmq
    from zmq.utils import z85

    key = (secret or load()).encode()
    out: list[bytes] = []
    for role in (b"server", b"client"):
        raw = hmac.new(key, b"asyncrl zmq curve " + role, hashlib.sha256).digest()
        sec = z85.encode(raw)
        out += [zmq.curve_public(sec), sec]
    return out[0], out[1], out[2], out[3]


@contextlib.contextmanager
def handoff(secret: str | None = None) -> Iterator[tuple[dict[str, str], tuple[int, ...]]]:
    """Hand ``secret`` (default this process's) to one child process: yields the environment
    entry and the ``pass_fds`` to start it with. The secret waits in a pipe only that child
    inherits (readable by no other user: /proc/PID/fd of another user's process cannot be
    opened); the read end is closed here when the block ends, the child reads it at start."""
    data = (secret or load()).encode()
    r, w = os.pipe()
    try:
        os.write(w, data)  # far below a pipe's capacity: never blocks
    finally:
        os.close(w)
    try:
        yield {ENV_FD: str(r)}, (r,)
    finally:
        os.close(r)
