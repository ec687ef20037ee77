"""Run by tests/test_forkserver.py as ``python -m tests.forkserver_child OUT MODE``: writes
what it sees of itself to OUT (JSON), then ends as MODE says."""

from __future__ import annotations

import json
import os
import sys
import time

from asyncrl import secret

if __name__ == "__main__":
    out, mode = sys.argv[1], sys.argv[2]
    seen = {
        "argv": sys.argv,
        "env": dict(os.environ),
        "sid": os.getsid(0),
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "cwd": os.getcwd(),
        "cmdline": open("/proc/self/cmdline", "rb").read().decode().split("\0"),
        "comm": open("/proc/self/comm").read().strip(),
        "cores": sorted(os.sched_getaffinity(0)),
        "secret": secret.load(),
        "preloaded": "xml.dom.minidom" in sys.modules,
        "itself_imported": "tests.forkserver_child" in sys.modules,  # python -m: never
        "threads": sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None,
    }
    with open(out + ".tmp", "w") as f:
        json.dump(seen, f)
    os.replace(out + ".tmp", out)
    print(f"child {os.getpid()} says hello")
    if mode == "raise":
        raise ValueError("the child raised")
    if mode == "sleep":
        time.sleep(120)
    sys.exit(int(mode))
