"""Run by tests/test_forkserver.py as ``python -m tests.forkserver_pkg OUT`` (a package with a
``__main__``): notes which process imported it."""

from __future__ import annotations

import os

IMPORTED_BY = os.getpid()
