"""Where a CUDA run's model set-up goes: cProfile of the engine's load_engine and the trainer's
FSDPEngine on CUDA (the tiny default model), one after the other, in one process."""

import cProfile
import io
import os
import pstats
import time

t0 = time.time()
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from asyncrl.config import load_config  # noqa: E402
from asyncrl.engines.rollout.local.server import load_engine  # noqa: E402
from asyncrl.engines.train.fsdp import FSDPEngine, init_process_group  # noqa: E402
from asyncrl.tasks.tiny_model import default_model_dir, ensure_tiny_model  # noqa: E402

DEV = os.environ.get("DEV", "cuda")
print(f"imports {time.time() - t0:.2f} s", flush=True)
path = str(ensure_tiny_model(default_model_dir()))


def prof(name, fn):
    pr = cProfile.Profile()
    t = time.time()
    pr.enable()
    out = fn()
    torch.cuda.synchronize() if DEV == "cuda" else None
    pr.disable()
    print(f"== {name}: {time.time() - t:.2f} s", flush=True)
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(22)
    print("\n".join(s.getvalue().splitlines()[6:40]), flush=True)
    return out


prof("first cuda matmul", lambda: torch.ones(64, 64, device=DEV) @ torch.ones(64, 64, device=DEV))
prof("load_engine cuda f32", lambda: load_engine(path, DEV, "float32", 64, 0))
prof("load_engine cuda again", lambda: load_engine(path, DEV, "float32", 64, 0))
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29534")
cfg = load_config(None, [f"--trainer.device={DEV}", f"--rollout.device={DEV}"])
prof("init_process_group", lambda: init_process_group(0, 1, device=DEV))
prof("FSDPEngine", lambda: FSDPEngine(path, cfg))
prof("FSDPEngine again", lambda: FSDPEngine(path, cfg))
dist.destroy_process_group()
