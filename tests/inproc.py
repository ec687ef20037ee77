"""The embedded engine in the test process (:class:`~asyncrl.engines.rollout.local.inproc.
InProcEngine`): what the controller, episode and gateway tests generate with when their
subject is not the engine process or its HTTP (those keep a real server: test_batching,
test_agent_command, test_run_agent, tests/engines/rollout)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncrl.engines.rollout.local.inproc import InProcEngine


@contextmanager
def inproc_engine(model_dir: Path, **engine_args: Any) -> Iterator[InProcEngine]:
    """A new engine on ``model_dir`` in this process (``engine_args`` as
    ``InProcEngine.load``), stopped on exit. Torch runs on one intra-op thread here, as the
    engine server process does (``asyncrl serve --threads 1``): the same numbers, and four
    test workers on two cores do not each start a thread per core."""
    import torch

    from asyncrl.engines.rollout.local.inproc import InProcEngine

    torch.set_num_threads(1)
    engine = InProcEngine.load(str(model_dir), **engine_args)
    try:
        yield engine
    finally:
        engine.stop()
