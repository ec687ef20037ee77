"""Pipeline speedup: the same RL workload synchronous (max_staleness=0) vs asynchronous (=2).

``asyncrl bench pipeline [--steps N] [--json PATH]``

Both runs go through ``asyncrl run``'s own code path (``runner.run_job``): the
embedded engine in its own process pinned to one core, the FSDP trainer in its own
process pinned to the other core (as rollout and training get their own GPUs in a
disaggregated deployment), Gloo weight sync after every step, the controller in
this process. Only ``controller.max_staleness`` differs.

The workload (defaults): 20 prompts x 8 samples per step; prompts of 20 tokens
(the reverse task's 5 behind a random digit context, ``--prompt-len``); each
episode's generation length drawn on its own from a Pareto distribution (scale
``--min-len`` 4, shape ``--alpha`` 1.0, capped at ``--max-len`` 512;
``ignore_eos``): half the completions are 8 tokens or fewer, 1 in 128 hits the cap,
so nearly every step has a sequence at or near 512 tokens. The sample stream
(prompts and every episode's length) is identical in both runs. Engine
``max_batch_size`` is the product default (256) in both runs;
``rollout.pause_mode = in_place`` and ``rollout.kv_after_update = keep`` in both
(only the asynchronous run has requests in flight across an update).

Why this workload: it is the *long-tail regime* of reasoning RL, where synchronous
training spends most of each step generating (here the trainer idles ~55 % of a
synchronous step): the batch waits for its longest sequence while the engine
decodes a nearly empty batch. Per step, ``sync = G_sync + T`` and
``async ~ max(T, G_async, straggler)`` with ``T`` the train step, ``G_sync`` the
engine's time for one batch alone (tail-bound: ~max length x the cost of a decode
step), ``G_async`` its time per batch when up to ``max_staleness + 1`` batches share
the running batch, and ``straggler`` ~ half the time a capped sequence takes (at
``max_staleness = 2`` a group admitted at version v must finish while steps v and
v+1 train). So the speedup is bounded by ``1 / (1 - sync trainer idle)`` (printed as
the ceiling) and needs ``T`` close to ``G_async`` — longer prompts add training work
(the trainer runs forward+backward over them) but little generation work, which
balances the two as in real RL. (The default was 32 tokens until the engine learnt to
prefill a GRPO group's prompt once and to take the group in one request: the engine
then kept up with a shorter train step, and 20 tokens restore ``T ~ G_async``; the
numbers for both are in docs/controller.md.) With the old default (5-token prompts, 32 x 8
samples, lengths capped at 64, one length per group) generation was only ~30 % of a
synchronous step and the ceiling 1.4x: the speedup depends on the workload's
generation/training ratio, see docs/controller.md for measurements of both.

Measured over a steady-state window: from the report of step ``--warmup - 1``
to the report of the last step (process start-up and the first pipeline fill
excluded, in both runs alike). ``trainer_idle_frac`` = 1 - (time the trainer
spent in train steps and weight snapshots) / window. ``staleness_violations``
counts trained samples with ``step - version > max_staleness`` (over the whole run).
The whole-run times (controller start to last report) are in the JSON too.
``trainer_cpu_share`` = the trainer's CPU seconds / its busy wall time in the window:
1.0 when its core is really its own, lower when other work on the machine takes it
(the machine load — load average, CPU pressure — is recorded before and after each run).
The CPU bound (``cpu_bound_s_per_step_*``) = every process's CPU seconds per step
(engine, trainer, controller) / the cores this bench may use: a step cannot take less wall
time than that; a run well above it waits on something other than the CPU (a straggler, the
staleness bound).
``--repeats K`` alternates K sync/async pairs and reports the median run of each mode
(this machine's load from other work drifts by tens of percent within minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from asyncrl.bench import bench_parser
from asyncrl.bench.common import write_json
from asyncrl.config import load_config
from asyncrl.controllers.episode import EpisodeContext
from asyncrl.core import Sample, Trajectory


def length_stream(seed: int, min_len: int, alpha: float, max_len: int) -> Iterator[int]:
    """Pareto(alpha) lengths scaled by ``min_len``, capped at ``max_len``."""
    rng = random.Random(seed)
    while True:
        u = rng.random()
        yield min(max_len, math.ceil(min_len * (1.0 - u) ** (-1.0 / alpha)))


def samples(
    model_path: str,
    seed: int,
    min_len: int,
    alpha: float,
    max_len: int,
    group_size: int,
    per_episode: bool = True,
    prompt_len: int = 0,
) -> Iterator[Sample]:
    """The reverse task's prompts, each carrying its group's lengths: ``group_size`` draws
    (``per_episode``: one per episode, as sampled completions of one prompt differ) or one
    draw shared by the whole group. ``answer`` is ``[the task's answer, lengths]``, plain
    lists (a checkpoint stores samples as msgpack). ``prompt_len``: prompts are lengthened
    to this many tokens by a random digit context before the task (real RL prompts — a
    system prompt, a problem statement — are tens to hundreds of tokens, not the task's 5)."""
    from asyncrl.tasks.reverse import ReverseTask

    task = ReverseTask.from_tokenizer_dir(model_path, 3, seed)
    digits = [task.vocab[str(d)] for d in range(10)]
    lengths = length_stream(seed + 1, min_len, alpha, max_len)
    rng = random.Random(seed + 2)
    for s in task.samples():
        ns = [next(lengths) for _ in range(group_size if per_episode else 1)]
        pad = [rng.choice(digits) for _ in range(prompt_len - len(s.prompt_ids))]
        ids = s.prompt_ids[:1] + pad + s.prompt_ids[1:]
        yield Sample(prompt_ids=ids, answer=[s.answer, ns], id=s.id)


async def episode(ctx: EpisodeContext, sample: Sample) -> Trajectory:
    """Generate exactly the episode's length; reward: the reverse task's partial credit.

    A group's episodes have consecutive ids (every group has ``group_size``), so episode
    ``i`` of a group takes the group's ``i``-th length: the same multiset every time the
    group runs, also when it is regenerated or resumed from a checkpoint."""
    answer, lengths = sample.answer
    n = lengths[ctx.episode_id % len(lengths)]
    gen = await ctx.generate(sample.prompt_ids, max_new_tokens=n, ignore_eos=True)
    hits = sum(1 for a, b in zip(gen.output_ids, answer) if a == b)  # noqa: B905
    return ctx.trajectory(sample.prompt_ids, [gen], hits / len(answer))


def measure(rows: list[dict[str, Any]], warmup: int, staleness: int) -> dict[str, float]:
    rows = sorted(rows, key=lambda r: r["step"])
    window = rows[warmup:]
    t_start = rows[warmup - 1]["controller_s"] if warmup > 0 else 0.0
    span = rows[-1]["controller_s"] - t_start
    busy = sum(r.get("train_s", 0.0) + r.get("push_call_s", 0.0) for r in window)
    violations = sum(
        int(r["num_samples"]) for r in rows if r["staleness_max"] > staleness
    )  # a whole batch counts when any of it is too stale: an upper bound
    cpu = {
        k.removeprefix("cpu_").removesuffix("_s"): rows[-1][k] - rows[warmup - 1][k]
        for k in rows[-1]
        if k.startswith("cpu_") and k in rows[warmup - 1]
    }
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    trainer_cpu = sum(v for k, v in cpu.items() if k.startswith("trainer"))
    engine_cpu = sum(v for k, v in cpu.items() if k.startswith("engine"))
    return {
        "seconds": span,
        # per measured step: wall time, trainer busy time (T) and engine CPU time (the
        # engine's work per batch: its core is its own, so this is its busy time, ~G)
        "step_s": span / len(window),
        "train_s_per_step": busy / len(window),
        "engine_s_per_step": engine_cpu / len(window),
        "cpu_s": cpu,  # CPU seconds each process used in the window (runner's cpu_* metrics)
        # every process's CPU per step spread over the cores this bench may use: no schedule
        # on this machine runs a step faster than this (the CPU bound)
        "cpu_s_per_step": sum(cpu.values()) / len(window),
        "cpu_bound_s_per_step": sum(cpu.values()) / len(window) / max(1, cores or 1),
        "cores": cores,
        # the share of its core the trainer got while it was busy: 1.0 on a dedicated core
        "trainer_cpu_share": trainer_cpu / busy if busy > 0 else 0.0,
        "total_s": rows[-1]["controller_s"],
        "steps": len(window),
        "trainer_busy_s": busy,
        "trainer_idle_frac": max(0.0, 1.0 - busy / span),
        "violations": violations,
        "staleness_max": max(r["staleness_max"] for r in rows),
        "reward_last": sum(r["reward_mean"] for r in rows[-5:]) / min(5, len(rows)),
    }


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median window time (its own metrics, not a mix of runs)."""
    return sorted(runs, key=lambda r: r["seconds"])[(len(runs) - 1) // 2]


def run_once(staleness: int, a: argparse.Namespace, model_path: str, out: Path) -> dict[str, Any]:
    from asyncrl.runner import run_job

    overrides = [
        f"--controller.max_staleness={staleness}",
        f"--controller.batch_size={a.batch_size}",
        f"--controller.total_steps={a.steps + a.warmup}",
        f"--algo.group_size={a.group_size}",
        f"--rollout.max_new_tokens={a.max_len}",
        f"--rollout.max_batch_size={a.engine_batch}",
        f"--rollout.pause_mode={a.pause_mode}",
        f"--rollout.kv_after_update={a.kv_after_update}",
        "--trainer.threads=1",
        # the tiny model's own context (64) is shorter than a capped episode: its engine
        # serves a longer one (rotary positions), as the engine tests do
        f'--rollout.extra_args=["--context-length", "{max(a.prompt_len, 16) + a.max_len}"]',
    ]
    cfg = load_config(None, overrides)
    load_before = machine_load()
    stream = samples(
        model_path,
        a.seed,
        a.min_len,
        a.alpha,
        a.max_len,
        a.group_size,
        a.lengths == "episode",
        a.prompt_len,
    )
    pin = {"engine": {a.engine_core}, "trainer": {a.trainer_core}} if a.pin else None
    run_dir = out / f"staleness{staleness}"

    async def go() -> list[dict[str, Any]]:
        return await run_job(cfg, run_dir, quiet=True, episode=episode, samples=stream, pin=pin)

    try:
        import uvloop

        rows = uvloop.run(go())
    except ImportError:
        rows = asyncio.run(go())
    res: dict[str, Any] = measure(rows, a.warmup, staleness)
    res["load"] = {"before": load_before, "after": machine_load()}
    return res


def machine_load() -> dict[str, float]:
    """1-minute load average and CPU pressure (PSI ``some`` avg10, %), where Linux has them."""
    out = {"loadavg_1m": os.getloadavg()[0]} if hasattr(os, "getloadavg") else {}
    try:
        with open("/proc/pressure/cpu") as f:
            some = f.readline().split()
        out["cpu_pressure_some_avg10"] = float(some[1].split("=")[1])
    except (OSError, IndexError, ValueError):
        pass
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = _parser()
    a = p.parse_args(argv)
    if a.warmup < 1:
        p.error("--warmup must be >= 1")
    from asyncrl.config import RunConfig
    from asyncrl.runner import resolve_model

    model_path = resolve_model(RunConfig())
    out = Path(a.out or tempfile.mkdtemp(prefix="asyncrl-pipeline-"))
    syncs, asyns = [], []
    for i in range(a.repeats):  # alternate, so both modes see the same drift in machine load
        syncs.append(run_once(0, a, model_path, out / f"r{i}"))
        asyns.append(run_once(a.async_staleness, a, model_path, out / f"r{i}"))
    sync, asyn = _median(syncs), _median(asyns)
    res = _result(a, sync, asyn, syncs, asyns, out)
    _report(a, res, sync, asyn, syncs + asyns)
    write_json(a.json, res)
    return res


def _parser() -> argparse.ArgumentParser:
    p = bench_parser("pipeline", __doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12, help="measured train steps per run")
    p.add_argument("--warmup", type=int, default=2, help="steps before the measured window")
    p.add_argument("--batch-size", type=int, default=20, help="groups per step")
    p.add_argument("--group-size", type=int, default=8, help="samples per group")
    p.add_argument("--min-len", type=int, default=4, help="Pareto scale of generation lengths")
    p.add_argument("--alpha", type=float, default=1.0, help="Pareto shape (smaller: longer tail)")
    p.add_argument("--max-len", type=int, default=512, help="cap of generation lengths")
    p.add_argument(
        "--prompt-len", type=int, default=20, help="prompt tokens (0: the task's own, 5)"
    )
    p.add_argument(
        "--lengths",
        default="episode",
        choices=["episode", "group"],
        help="one length draw per episode, or one shared by a group's episodes",
    )
    p.add_argument(
        "--engine-batch", type=int, default=256, help="engine max_batch_size (product default)"
    )
    p.add_argument("--pause-mode", default="in_place", choices=["abort", "in_place"])
    p.add_argument(
        "--kv-after-update",
        default="keep",
        choices=["recompute", "keep"],
        help="rollout.kv_after_update: re-prefill requests in flight after each weight update",
    )
    p.add_argument("--async-staleness", type=int, default=2)
    p.add_argument("--engine-core", type=int, default=0)
    p.add_argument("--trainer-core", type=int, default=1)
    p.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin processes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="alternating sync/async pairs")
    p.add_argument("--out", default=None, help="folder for the two runs (default: a temp dir)")
    p.add_argument("--json", default=None, help="write results here")
    return p


def _result(
    a: argparse.Namespace,
    sync: dict[str, Any],
    asyn: dict[str, Any],
    syncs: list[dict[str, Any]],
    asyns: list[dict[str, Any]],
    out: Path,
) -> dict[str, Any]:
    """The JSON result: each mode's median run (``sync``, ``asyn``), their ratios, each
    pair's (``syncs``, ``asyns``) and the settings."""
    return {
        "sync_s": sync["seconds"],
        "async_s": asyn["seconds"],
        "speedup": sync["seconds"] / asyn["seconds"],
        "trainer_idle_frac_sync": sync["trainer_idle_frac"],
        "trainer_idle_frac_async": asyn["trainer_idle_frac"],
        "staleness_violations": sync["violations"] + asyn["violations"],
        # the trainer's busy time bounds any overlap: async_s >= (1 - idle_sync) * sync_s
        "overlap_ceiling": 1.0 / max(1e-9, 1.0 - sync["trainer_idle_frac"]),
        "sync_total_s": sync["total_s"],
        "async_total_s": asyn["total_s"],
        "speedup_total": sync["total_s"] / asyn["total_s"],
        "staleness_max_async": asyn["staleness_max"],
        "steps": a.steps,
        "samples_per_step": a.batch_size * a.group_size,
        "max_staleness_async": a.async_staleness,
        "lengths": {"pareto_alpha": a.alpha, "min": a.min_len, "max": a.max_len},
        "prompt_len": a.prompt_len,
        "pinned": bool(a.pin),
        "repeats": a.repeats,
        "speedups_each": [s["seconds"] / x["seconds"] for s, x in zip(syncs, asyns)],  # noqa: B905
        "step_s_sync": sync["step_s"],
        "step_s_async": asyn["step_s"],
        "train_s_per_step_sync": sync["train_s_per_step"],
        "train_s_per_step_async": asyn["train_s_per_step"],
        "engine_s_per_step_sync": sync["engine_s_per_step"],
        "engine_s_per_step_async": asyn["engine_s_per_step"],
        "engine_batch": a.engine_batch,
        "kv_after_update": a.kv_after_update,
        "lengths_per": a.lengths,
        "trainer_cpu_share_sync": sync["trainer_cpu_share"],
        "trainer_cpu_share_async": asyn["trainer_cpu_share"],
        "cpu_bound_s_per_step_sync": sync["cpu_bound_s_per_step"],
        "cpu_bound_s_per_step_async": asyn["cpu_bound_s_per_step"],
        "cpu_s_sync": sync["cpu_s"],
        "cpu_s_async": asyn["cpu_s"],
        "load_each": [[s["load"], x["load"]] for s, x in zip(syncs, asyns)],  # noqa: B905
        "cpus": os.cpu_count(),
        "runs": str(out),
    }


def _report(
    a: argparse.Namespace,
    res: dict[str, Any],
    sync: dict[str, Any],
    asyn: dict[str, Any],
    runs: list[dict[str, Any]],
) -> None:
    """The table of the median runs, the speedup against its ceiling, the CPU bound and each
    pair's ratio (with the load before each of ``runs``)."""
    print(
        f"{'mode':<22} {'window s':>9} {'total s':>8} {'s/step':>7} {'train s/step':>13}"
        f" {'engine s/step':>14} {'trainer idle':>13} {'max stale':>10} {'trainer cpu share':>18}"
    )
    for name, r in (
        ("sync  (staleness 0)", sync),
        (f"async (staleness {a.async_staleness})", asyn),
    ):
        print(
            f"{name:<22} {r['seconds']:>9.2f} {r['total_s']:>8.2f} {r['step_s']:>7.3f}"
            f" {r['train_s_per_step']:>13.3f} {r['engine_s_per_step']:>14.3f}"
            f" {r['trainer_idle_frac']:>13.2f} {r['staleness_max']:>10d}"
            f" {r['trainer_cpu_share']:>18.2f}"
        )
    print(
        f"speedup {res['speedup']:.2f}x (whole run {res['speedup_total']:.2f}x; ceiling for this "
        f"workload {res['overlap_ceiling']:.2f}x = 1 / (1 - sync trainer idle)), "
        f"staleness violations {res['staleness_violations']}"
    )
    print(
        f"CPU bound: async {asyn['cpu_s_per_step']:.3f} CPU-s per step (engine + trainer + "
        f"controller) / {asyn['cores']} cores = {asyn['cpu_bound_s_per_step']:.3f} s/step "
        f"against {asyn['step_s']:.3f} measured (sync {sync['cpu_bound_s_per_step']:.3f} "
        f"against {sync['step_s']:.3f})"
    )
    loads = [round(x["load"]["before"].get("loadavg_1m", -1.0), 1) for x in runs]
    print(f"pairs: {', '.join(f'{x:.2f}x' for x in res['speedups_each'])}; load avg {loads}")


if __name__ == "__main__":
    main()
