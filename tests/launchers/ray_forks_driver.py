"""A small Ray driver for ``test_ray_forks.py``: ``python -m tests.launchers.ray_forks_driver
ADDRESS RUN_DIR [SHARED_SOCKET]``.

It places one :class:`~asyncrl.launchers.ray_actor.ProcActor` on each of the two nodes of
``tests/launchers/cluster.py`` and has each fork a sleeper (``python -m timeit ...``) from
its node's fork server (:class:`~asyncrl.launchers.ray_forks.NodeForks`, importing
nothing), and, with ``SHARED_SOCKET``, one more actor on the head that forks its sleeper
from that shared server. It prints one JSON line of what it started, then answers one JSON
line per command read on stdin: ``kill-shared`` (kill the shared server's actor),
``restart`` (start the head's sleeper again in its actor), ``stop`` (the launcher's stop
path: processes, actors, node servers; then it exits).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import ray

from asyncrl import secret
from asyncrl.launchers.ray_actor import ProcActor
from asyncrl.launchers.ray_forks import NodeForks
from tests.launchers.cluster import HEAD, WORKER

SLEEPER = ["-m", "timeit", "-n", "1", "-r", "1", "import time; time.sleep(600)"]


def _actor(address: str, run_dir: str) -> Any:
    opts = {"resources": {f"node:{address}": 0.001}, "num_cpus": 0, "max_restarts": 0}
    return ray.remote(ProcActor).options(**opts).remote(run_dir)


def _call(ref: Any, what: str = "", timeout_s: float = 60.0) -> Any:
    return ray.get(ref, timeout=timeout_s)


def main() -> None:
    address, run_dir, shared = sys.argv[1], sys.argv[2], (sys.argv[3:] or [""])[0]
    ray.init(address=address, _node_ip_address=HEAD, namespace="asyncrl", log_to_driver=False)
    key = secret.generate()
    forks = NodeForks(Path(run_dir), [], _call)
    actors: dict[str, Any] = {}
    out: dict[str, dict[str, Any]] = {}
    for node in (HEAD, WORKER):
        actors[node] = _actor(node, run_dir)
        info = _call(actors[node].node.remote(shared), "node()")
        forks.start(info["node_id"], "")
        sock = forks.socket(info["node_id"], node)
        ref = actors[node].start.remote(f"sleeper-{node}", SLEEPER, {}, {}, key, sock)
        pid = _call(ref, "start()")
        out[node] = {"socket": sock, "child": pid, "node_id": info["node_id"]}
    if shared:
        actors["shared"] = _actor(HEAD, run_dir)
        ref = actors["shared"].start.remote("sleeper-shared", SLEEPER, {}, {}, key, shared)
        out["shared"] = {"child": _call(ref, "start()")}
    print(json.dumps(out), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "kill-shared":
            ray.kill(actors.pop("shared"), no_restart=True)
            reply: Any = "killed"
        elif cmd == "restart":
            sock = out[HEAD]["socket"]
            reply = _call(actors[HEAD].start.remote(f"sleeper-{HEAD}", SLEEPER, {}, {}, key, sock))
        elif cmd == "stop":
            ray.wait([a.stop.remote(5.0) for a in actors.values()], num_returns=len(actors))
            for a in actors.values():
                ray.kill(a, no_restart=True)
            forks.stop()
            print(json.dumps("stopped"), flush=True)
            return
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
