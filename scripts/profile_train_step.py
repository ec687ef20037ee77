"""Time or profile GRPO.train_step on the default job's shape (the trainer's train_s).

``python scripts/profile_train_step.py THREADS time|cprof|torch [--key=value ...]``
"""

import os
import statistics
import sys
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
import numpy as np
import torch

from asyncrl.algorithms.base import make_algorithm
from asyncrl.config import load_config
from asyncrl.core import Trajectory
from asyncrl.engines.train.fsdp import FSDPEngine, init_process_group
from asyncrl.procs import free_port
from asyncrl.tasks.tiny_model import ensure_tiny_model

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
mode = sys.argv[2] if len(sys.argv) > 2 else "time"
over = sys.argv[3:]
torch.set_num_threads(threads)
if not os.environ.get("NOPG"):
    init_process_group(0, 1, free_port(), "cpu")
cfg = load_config(None, over)
path = str(ensure_tiny_model())
alg = make_algorithm(cfg, lambda role, c: FSDPEngine(path, c, role=role))
rng = np.random.default_rng(0)


def batch():
    out = []
    for g in range(32):
        d = rng.integers(3, 13, 2)
        p = np.array([1, *d, 13], dtype=np.int32)
        for k in range(8):
            n = int(rng.integers(1, 4)) if rng.random() < 0.3 else 3
            r = rng.integers(2, 13, n).astype(np.int32)
            out.append(
                Trajectory(
                    prompt_ids=p,
                    response_ids=r,
                    behav_logprobs=-rng.random(n).astype(np.float32),
                    versions=np.zeros(n, np.int32),
                    loss_mask=np.ones(n, np.uint8),
                    reward=float(rng.random()),
                    group_id=g,
                    episode_id=g * 8 + k,
                )
            )
    return out


bs = [batch() for _ in range(4)]
for i in range(3):
    alg.train_step(i, bs[i % 4])
if mode == "time":
    ts = []
    for i in range(20):
        t0 = time.perf_counter()
        alg.train_step(i, bs[i % 4])
        ts.append(time.perf_counter() - t0)
    print(f"threads={threads} train_step median {statistics.median(ts):.4f}s min {min(ts):.4f}s")
elif mode == "cprof":
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for i in range(10):
        alg.train_step(i, bs[i % 4])
    pr.disable()
    pstats.Stats(pr).sort_stats("cumulative").print_stats(45)
elif mode == "torch":
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(10):
            alg.train_step(i, bs[i % 4])
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=35))
