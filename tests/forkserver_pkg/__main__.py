"""``python -m tests.forkserver_pkg OUT``: writes which process imported the package (a fork
of a server that preloaded it keeps the server's copy, as ``python -m`` keeps its own)."""

from __future__ import annotations

import json
import os
import sys

import tests.forkserver_pkg as pkg

if __name__ == "__main__":
    seen = {"pid": os.getpid(), "imported_by": pkg.IMPORTED_BY, "main": __name__}
    with open(sys.argv[1], "w") as f:
        json.dump(seen, f)
