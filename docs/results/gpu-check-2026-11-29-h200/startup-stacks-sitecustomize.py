"""Probe only: every Python process dumps all its threads' stacks to stderr each second for
its first 30 s (where does a CUDA run's start-up go?)."""

import faulthandler
import sys
import threading

faulthandler.dump_traceback_later(1.0, repeat=True, file=sys.stderr)
_t = threading.Timer(30.0, faulthandler.cancel_dump_traceback_later)
_t.daemon = True
_t.start()
