"""Checks a run makes before it starts anything: what the config needs from this host.

:func:`preflight` fails in well under a second, with one line naming the key,
for mistakes that can be known on the host that runs ``asyncrl run``: a device
this machine does not have (``rollout.device``/``trainer.device`` on CUDA, a
CUDA-only weight backend, ``hccl`` without ``torch_npu``), an engine package the run
would start servers from that is not installed (``rollout.backend = "sglang"`` or
``"vllm"`` without ``rollout.urls``), a task file that does not exist, an agent
(``task.agent``) that does not import or is not an ``async def``, a generation budget
that cannot fit the engines' context (every request would be refused with a 400,
forever), and ``rollout.urls`` that refuse connections. Without it these surface only
after engines started, as a child's traceback (14 s for ``rollout.device=cuda`` on a CPU
machine; 16 s and a ``ModuleNotFoundError`` for a missing vLLM), or after the engines'
start timeout (121 s for a URL nothing listens on). Combinations no host can run
(``cuda-ipc`` with SGLang) are refused by the config itself, when loaded.

Device and package checks apply only to processes this host starts (``cluster.backend =
"local"``; under Ray they run on other nodes). Nothing here imports torch (the
controller is torch-free): torch's build is read from its ``version.py`` and the
driver is asked through ``libcuda`` (``cuInit`` / ``cuDeviceGetCount``, which
honour ``CUDA_VISIBLE_DEVICES``); engine packages are looked up, not imported. The
agent's module is imported (the controller imports it to run it anyway).
"""

from __future__ import annotations

import ctypes
import errno
import importlib.metadata
import importlib.util
import json
import re
import socket
import time
from functools import cache
from pathlib import Path
from urllib.parse import urlsplit

from asyncrl.config import CudaIpcWeightsConfig, HcclWeightsConfig, NcclWeightsConfig, RunConfig
from asyncrl.engines.rollout.factory import family
from asyncrl.task_factory import check_task

__all__ = ["REFUSED_S", "cuda_devices", "preflight"]

REFUSED_S = 5.0
"""How long an engine of ``rollout.urls`` may refuse connections before the run is refused
(unless ``rollout.startup_timeout_s`` is set: engines started together with the run)."""


@cache
def cuda_devices() -> tuple[int, str]:
    """(number of CUDA devices torch could use here, why 0 when it is 0)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return 0, "torch is not installed"
    version = Path(spec.origin).parent / "version.py"
    try:
        text = version.read_text()
    except OSError:
        text = ""
    build = re.search(r"^cuda\b[^=\n]*=\s*(.+)$", text, re.M)
    if build is None or build.group(1).strip() in ("None", "''", '""'):
        found = re.search(r"^__version__\b[^=\n]*=\s*['\"]([^'\"]+)", text, re.M)
        return 0, f"torch {found.group(1) if found else ''} here is a CPU build".replace("  ", " ")
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0, "no NVIDIA driver (libcuda.so.1 not found)"
    count = ctypes.c_int(0)
    if (rc := cuda.cuInit(0)) != 0:
        return 0, f"the CUDA driver does not start (cuInit error {rc})"
    if (rc := cuda.cuDeviceGetCount(ctypes.byref(count))) != 0 or count.value == 0:
        return 0, "no CUDA device is visible (CUDA_VISIBLE_DEVICES?)"
    return count.value, ""


def _check_device(key: str, device: str) -> None:
    if not device.startswith("cuda"):
        return
    count, why = cuda_devices()
    if count == 0:
        raise ValueError(f"{key}={device!r}, but this machine has no usable CUDA device: {why}")
    index = device.partition(":")[2]
    if index and (not index.isdigit() or int(index) >= count):
        raise ValueError(f"{key}={device!r}: this machine has CUDA devices 0..{count - 1}")


def preflight(cfg: RunConfig) -> None:
    """Raise ValueError (one line, naming the key) if ``cfg`` cannot run from this host."""
    check_task(cfg)  # the task's own: its files, its agent function
    _check_context(cfg)
    _check_urls(cfg)
    if cfg.cluster.backend != "local":
        return
    family(cfg.rollout).preflight(cfg, _check_device)  # its package, device, trainer side
    _check_device("trainer.device", cfg.trainer.device)
    weights = cfg.weights
    if isinstance(weights, NcclWeightsConfig | CudaIpcWeightsConfig) and not cuda_devices()[0]:
        raise ValueError(
            f"weights.backend={weights.backend!r} needs CUDA, but this machine has none: "
            f"{cuda_devices()[1]} (use 'gloo' or 'auto')"
        )
    if isinstance(weights, HcclWeightsConfig) and importlib.util.find_spec("torch_npu") is None:
        raise ValueError(
            "weights.backend='hccl' needs an Ascend NPU and torch_npu, which is not installed "
            "here (use 'gloo' or 'auto')"
        )


def _check_urls(cfg: RunConfig) -> None:
    """Engines of ``rollout.urls`` that refuse connections (nothing listens there, or the
    host is unknown or unreachable) for :data:`REFUSED_S`: refused, naming the URL, instead of
    waiting out the engines' start timeout. With ``rollout.startup_timeout_s`` set (engines
    that are still starting) that wait decides. A host that does not answer at all is left
    to it too."""
    if not cfg.rollout.urls or cfg.rollout.startup_timeout_s is not None:
        return
    pending = list(cfg.rollout.urls)
    deadline = time.monotonic() + REFUSED_S
    while True:
        why = {}
        for url in pending:
            if (reason := _refused(url)) is not None:
                why[url] = reason
        if not why:
            return
        if time.monotonic() >= deadline:
            break
        pending = list(why)
        time.sleep(0.25)
    url, reason = next(iter(why.items()))
    others = f" (and {len(why) - 1} more)" if len(why) > 1 else ""
    raise ValueError(
        f"rollout.urls: {url}{others}: {reason} (for {REFUSED_S:g} s); start the engine first "
        "(asyncrl serve / sglang serve / vllm serve), or set rollout.startup_timeout_s to wait "
        "for engines that are still starting"
    )


def _refused(url: str) -> str | None:
    """Why ``url``'s host:port refuses a TCP connection, or None (it accepted one, or did
    not answer within a second: not known to be down)."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None  # a malformed URL: the client says what is wrong with it
    if not host:
        return None
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return None
    except socket.gaierror as exc:
        return f"unknown host {host!r} ({exc.strerror})"
    except TimeoutError:
        return None
    except OSError as exc:
        if exc.errno == errno.ECONNREFUSED:
            return "connection refused: nothing listens there"
        if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
            return f"unreachable ({exc.strerror})"
        return None


def _context_length(cfg: RunConfig) -> tuple[int, str] | None:
    """(the context length of the engines this run starts, where it comes from), when this
    host can tell: ``--context-length`` in ``rollout.extra_args``, else the embedded engine's
    rule (the model's ``max_position_embeddings``). None: engines given by URL, or SGLang
    (whose own derivation also reads rope scaling and other keys)."""
    args = list(cfg.rollout.extra_args)
    for i, arg in enumerate(args):
        value = args[i + 1] if arg == "--context-length" and i + 1 < len(args) else None
        value = arg.partition("=")[2] if arg.startswith("--context-length=") else value
        if value is not None and value.isdigit():
            return int(value), "--context-length in rollout.extra_args"
    if cfg.rollout.urls or not family(cfg.rollout).derives_context:
        return None
    if not cfg.model.path and cfg.task.chat_model:  # runner.resolve_model's rule
        from asyncrl.tasks.tiny_chat_model import TINY_CHAT_CONTEXT

        return TINY_CHAT_CONTEXT, "the tiny chat model's"
    if not cfg.model.path:
        from asyncrl.tasks.tiny_model import TINY_CONTEXT

        return TINY_CONTEXT, "the tiny default model's"
    try:
        found = json.loads((Path(cfg.model.path) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # a missing or broken model folder is reported when it loads
    ctx = found.get("max_position_embeddings") if isinstance(found, dict) else None
    return (int(ctx), f"{cfg.model.path}'s max_position_embeddings") if ctx else None


def _check_context(cfg: RunConfig) -> None:
    """A built-in task whose prompt plus generation budget exceeds the engines' context: every
    request would get a 400. Refused, naming the key that sets the budget."""
    found = _context_length(cfg)
    if found is None:
        return
    ctx, source = found
    t = cfg.task
    exact = t.prompt_tokens()  # None: the data's (math, agent): at least 1
    prompt = exact or 1
    budget = cfg.generation_budget()
    if prompt + budget <= ctx:
        return
    key = "rollout.max_new_tokens" if cfg.rollout.max_new_tokens else t.budget_key
    what = f"{prompt} prompt" if exact else "at least 1 prompt"
    fix = "set rollout.max_new_tokens"
    if t.workload:  # a longer context is the way
        need = prompt + budget
        fix = f'lower it, or give the engines rollout.extra_args=["--context-length", "{need}"]'
    raise ValueError(
        f"{key}: {what} + {budget} new tokens exceed the engines' context length of {ctx} "
        f"tokens ({source}); at most {ctx - prompt} new tokens fit ({fix})"
    )
