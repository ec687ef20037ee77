"""The session's fork servers with SGLang's code imported, one per covered version
(``tests/session_forks.py``), for the receiving ranks (``rank.py``) and the probes that judge
asyncrl's wire and command line (``wire_schema.py``, ``launch_args.py``): importing a
version's ``sglang`` package and server modules costs ~4-6 CPU-s (torch, transformers), paid
by each of them as a fresh interpreter. Each server's environment is ``code.sglang_env``
(that version's source first on the path, as a fresh process of it has it); where there
is none, they run as fresh interpreters, as before."""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path
from typing import Any

from asyncrl.procs import finish
from tests.engines.rollout.sglang.code import sglang_env
from tests.session_forks import SessionForkServer

__all__ = ["probe", "server"]


@functools.cache
def server(version: str) -> SessionForkServer:
    """SGLang ``version``'s session fork server (``preload.py`` lists what it imports)."""
    preload = ("tests.engines.rollout.sglang.preload",)
    return SessionForkServer(f"sglang-{version}", lambda: sglang_env(version), preload)


def probe(version: str, module: str, payload: Any, timeout_s: float = 240.0) -> Any:
    """Run ``python -m MODULE IN OUT`` with SGLang ``version``'s source (forked from its
    session fork server, else a fresh interpreter): ``payload`` as JSON in the file IN, its
    JSON report from the file OUT. RuntimeError with its output if it fails."""
    with tempfile.TemporaryDirectory(prefix="asyncrl-sglang-probe-") as tmp:
        src, out, log = Path(tmp) / "in.json", Path(tmp) / "out.json", Path(tmp) / "log"
        src.write_text(json.dumps(payload))
        args = ["-m", module, str(src), str(out)]
        proc = server(version).spawn(args, log, sglang_env(version), fresh=True)
        code, _ = finish(proc, timeout_s)
        if code or not out.is_file():
            raise RuntimeError(f"{module} (SGLang {version}) rc {code}: {log.read_text()[-4000:]}")
        return json.loads(out.read_text())
