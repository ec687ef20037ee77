"""Long runs survive: checkpoints, the final policy, stop + resume, a killed `asyncrl run`.

Every test drives the real `asyncrl run` CLI (controller, embedded engine, trainer
processes) on the tiny default model and checks what a user would: files on disk,
metrics rows, processes and shared-memory rings left behind.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.controllers import checkpoints as ckpts
from asyncrl.procs import finish, free_port, pid_alive, python_env
from asyncrl.secret import auth_headers
from tests.runs import metrics_rows, wait_checkpoint, wait_rows

_SMALL = ("--controller.batch_size=4", "--controller.max_staleness=2")
_SINKS = (
    "--logging.tensorboard.enabled=true",
    "--logging.wandb.enabled=true",
    "--logging.wandb.mode=offline",
)


def _cli(*args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "asyncrl.cli", "run", "--quiet", *args]
    return subprocess.Popen(
        cmd, env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _check_exactly_once(rows: list[dict], steps: int, batch: int) -> None:
    assert [r["step"] for r in rows] == list(range(steps))  # no step twice, none missing
    ids = [i for r in rows for i in r["sample_ids"]]
    assert len(ids) == len(set(ids)) == steps * batch  # no sample trained twice
    assert max(ids) < steps * batch + 3 * batch  # none skipped beyond the staleness window


def _check_sinks(run: Path, rows: list[dict], redone_from: int) -> None:
    """TensorBoard shows each step once with its last training's values. W&B: one run id
    across attempts; the last attempt logged each step from ``redone_from`` on, once, in
    order; an earlier attempt's history is in order, and its values before ``redone_from``
    equal metrics.jsonl (a SIGKILLed attempt may not have written its last records: W&B's
    writer died with it)."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb.sdk.internal.datastore")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.test_observability import _wandb_records

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    got = acc.Scalars("reward/reward_mean")
    assert [e.step for e in got] == [r["step"] for r in rows]
    assert [e.value for e in got] == pytest.approx([r["reward_mean"] for r in rows], rel=1e-6)
    run_id = (run / "wandb-run-id").read_text().strip()
    by_step = {r["step"]: r for r in rows}
    *earlier, last = [_wandb_records(d, "run-*.wandb") for d in sorted(run.glob("wandb/off*"))]
    history, record = last
    assert record is not None and record.run_id == run_id
    first = redone_from if earlier else 0  # offline, a resumed W&B run knows no steps
    assert [h["_step"] for h in history] == [r["step"] for r in rows if r["step"] >= first]
    for h, rec in earlier:
        assert rec is None or rec.run_id == run_id
        assert [x["_step"] for x in h] == sorted({x["_step"] for x in h})
        assert all(x["reward/reward_mean"] == by_step[x["_step"]]["reward_mean"]
                   for x in h if x["_step"] < redone_from)  # fmt: skip


def greedy_reward(model_dir: Path, n: int = 64) -> float:
    """Mean task reward of the folder's greedy answers on the default task's prompts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.config import ReverseTaskConfig, RunConfig
    from asyncrl.tasks import make_task

    AutoTokenizer.from_pretrained(str(model_dir))  # the tokenizer came along
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    cfg = RunConfig(task=ReverseTaskConfig(seed=12345))
    task = make_task(cfg.task, str(model_dir))
    samples = [s for _, s in zip(range(n), task.samples(), strict=False)]
    ids = torch.tensor([s.prompt_ids for s in samples])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=cfg.generation_budget(),
            pad_token_id=0,
        )
    answers = out[:, ids.shape[1] :].tolist()
    return sum(task.reward(s, a) for s, a in zip(samples, answers, strict=True)) / n


def test_default_job_checkpoints_and_exports_a_policy_that_answers(tmp_path: Path) -> None:
    run = tmp_path / "run"
    rc, out = finish(_cli("--run-dir", str(run), "--controller.total_steps=70"), 400)
    assert rc == 0, out[-3000:]
    done = ckpts.complete_checkpoints(run)
    assert [s for s, _ in done] == [60, 70]  # every 20 steps + the end, checkpoint.keep = 2
    assert ckpts.latest_checkpoint(run) == done[-1]  # checksums verified
    stalls = [
        json.loads(ln)["stall_s"] for ln in (run / "checkpoints.jsonl").read_text().splitlines()
    ]
    assert len(stalls) == 4 and all(s >= 0 for s in stalls)
    last = sum(r["reward_mean"] for r in metrics_rows(run)[-5:]) / 5
    greedy = greedy_reward(run / "final")
    assert last > 0.5, "the default job should have learned by step 70"
    assert greedy >= last - 0.1, (greedy, last)  # greedy answers do what sampling did


def test_sigterm_checkpoints_then_resume_continues_exactly(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = _cli("--run-dir", str(run), "--controller.total_steps=1000", *_SMALL)
    wait_rows(run, proc, 4)
    proc.send_signal(signal.SIGTERM)
    rc, out = finish(proc, 60)
    assert rc == 143, out[-3000:]
    assert "--resume" in out
    stopped_at, _ = ckpts.latest_checkpoint(run)
    assert stopped_at >= 4
    steps = stopped_at + 5
    rc, out = finish(_cli("--resume", str(run), f"--controller.total_steps={steps}"), 300)
    assert rc == 0, out[-3000:]
    _check_exactly_once(metrics_rows(run), steps, 4)
    refused = finish(_cli("--resume", str(run), "--algo.group_size=4"), 60)
    assert refused[0] == 2 and "algo.group_size" in refused[1]
    recorded = (run / "config.json").read_bytes()
    started = {f: (run / f).stat().st_mtime_ns for f in ("pids.json", "processes.json")}
    rc, out = finish(_cli("--resume", str(run), f"--controller.total_steps={steps}"), 60)
    assert rc == 1 and "nothing to do" in out and f"step {steps}" in out, out[-2000:]
    # said at once: no process was started (a start rewrites pids.json for its guardian
    # before anything else, then processes.json once its processes run)
    assert {f: (run / f).stat().st_mtime_ns for f in started} == started
    # a resume that fails before it started leaves the run's config as it was
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    bad = (f"--rollout.urls={url}", "--rollout.startup_timeout_s=1")
    rc, out = finish(_cli("--resume", str(run), *bad, f"--controller.total_steps={steps + 3}"), 60)
    assert rc == 1 and url in out, out[-2000:]
    assert (run / "config.json").read_bytes() == recorded


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_sigkilled_run_leaves_nothing_and_resumes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = _cli(
        "--run-dir",
        str(run),
        "--controller.total_steps=1000",
        "--checkpoint.every_steps=3",
        "--logging.trajectories=true",
        *_SMALL,
        *_SINKS,
    )
    wait_rows(run, proc, 7)  # at least two checkpoints asked for
    wait_checkpoint(run, proc)  # ... one of them complete
    pids = json.loads((run / "processes.json").read_text())
    rings = [p for p in Path("/dev/shm").glob(f"asyncrl-xp-{proc.pid}-*")]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = [n for n, pid in pids.items() if pid_alive(pid)]
        left += [str(p) for p in Path("/dev/shm").glob(f"asyncrl-xp-{proc.pid}-*")]
        if not left:
            break
        time.sleep(0.1)
    assert not left, f"left after 10 s: {left}"
    assert rings or not Path("/dev/shm").is_dir(), "the run should have used a ring"
    resumed_from, _ = ckpts.latest_checkpoint(run)
    steps = resumed_from + 4
    rc, out = finish(_cli("--resume", str(run), f"--controller.total_steps={steps}"), 300)
    assert rc == 0, out[-3000:]
    _check_exactly_once(metrics_rows(run), steps, 4)
    _check_sinks(run, metrics_rows(run), resumed_from)
    # trajectories.jsonl: each trained step's trajectories once (the steps the killed attempt
    # trained after the checkpoint were trained again: their first lines are dropped)
    lines = (run / "trajectories.jsonl").read_text().splitlines()
    per_step = collections.Counter(json.loads(line)["step"] for line in lines)
    assert {r["step"]: r["num_samples"] for r in metrics_rows(run)} == dict(per_step)


def test_trainer_sigkilled_restarts_from_checkpoint_and_trains_each_sample_once(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    steps = 14
    args = (f"--controller.total_steps={steps}", "--checkpoint.every_steps=4", *_SMALL, *_SINKS)
    proc = _cli("--run-dir", str(run), *args)
    wait_rows(run, proc, 6)  # the checkpoint of step 4 is asked for; steps past it trained
    wait_checkpoint(run, proc)  # ... and complete (a loaded box writes it steps later)
    pids = json.loads((run / "processes.json").read_text())
    os.kill(pids["trainer0"], signal.SIGKILL)
    rc, out = finish(proc, 300)
    assert rc == 0, out[-3000:]
    rec = [json.loads(ln) for ln in (run / "recoveries.jsonl").read_text().splitlines()]
    assert len(rec) == 1 and rec[0]["from_step"] >= 4 and rec[0]["steps_redone"] >= 1
    rows = metrics_rows(run)
    _check_exactly_once(rows, steps, 4)
    assert max(r["staleness_max"] for r in rows) <= 2
    assert ckpts.latest_checkpoint(run)[0] == steps
    _check_sinks(run, rows, rec[0]["from_step"])


def test_ppo_run_exports_its_critic_and_resumes_with_it(tmp_path: Path) -> None:
    """PPO: the critic is checkpointed with the actor, exported beside it as a folder that
    loads as a critic with the checkpoint's weights, and a resumed run goes on from it."""
    import torch

    from asyncrl.config import load_config
    from asyncrl.engines.train.fsdp import FSDPEngine

    run = tmp_path / "run"
    ppo = ("--algo.name=ppo", "--checkpoint.every_steps=2", *_SMALL)
    rc, out = finish(_cli("--run-dir", str(run), "--controller.total_steps=4", *ppo), 300)
    assert rc == 0, out[-3000:]
    assert [s for s, _ in ckpts.complete_checkpoints(run)] == [2, 4]
    cfg = load_config(None, ["--algo.name=ppo"])
    exported = FSDPEngine(str(run / "final" / "critic"), cfg, role="critic")
    restored = FSDPEngine(str(run / "final"), cfg, role="critic")  # the actor: a new head
    fresh = dict(restored.named_weights())
    restored.load(str(run / "checkpoints" / "step-4" / "trainer" / "critic"))
    got, want = dict(exported.named_weights()), dict(restored.named_weights())
    assert got.keys() == want.keys() and any("score" in k for k in got)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, atol=0, rtol=0)
    assert any(not torch.equal(fresh[k], want[k]) for k in want if "score" in k)  # trained
    rc, out = finish(_cli("--resume", str(run), "--controller.total_steps=6"), 300)
    assert rc == 0, out[-3000:]
    rows = metrics_rows(run)
    _check_exactly_once(rows, 6, 4)
    assert all("critic_vf_loss" in r for r in rows)


_LONG = 400


async def _long_answer(ctx, sample):  # type: ignore[no-untyped-def]
    gen = await ctx.generate(sample.prompt_ids, max_new_tokens=_LONG, ignore_eos=True)
    return ctx.trajectory(sample.prompt_ids, [gen], sum(gen.output_ids[:3]) / 100)


def _prompts(n: int = 10_000):  # type: ignore[no-untyped-def]
    from asyncrl.core import Sample

    return (Sample(prompt_ids=[1, 3 + i % 10, 4, 14], id=i) for i in range(n))


def test_a_stop_keeps_the_tokens_in_flight_and_the_resume_does_not_regenerate_them(
    tmp_path: Path,
) -> None:
    """Stopped while the engine decodes: the stop aborts the requests in flight, so their
    tokens (log-probs, versions) are in the checkpoint's journals; the resumed run replays
    them (``kept_tokens``) and trains each sample once."""
    import asyncio

    import aiohttp

    from asyncrl.config import load_config
    from asyncrl.runner import RunStopped, run_job

    run = tmp_path / "run"
    args = ["--controller.batch_size=2", "--algo.group_size=2", "--controller.max_staleness=1",
            "--controller.batch_requests=false", f"--rollout.max_new_tokens={_LONG}",
            "--rollout.pause_mode=in_place",  # weight pushes abort nothing: only the stop does
            '--rollout.extra_args=["--context-length", "100000"]']  # fmt: skip

    async def first() -> int:
        stop = asyncio.Event()
        cfg = load_config(None, [*args, "--controller.total_steps=1000"])

        async def stop_mid_decode() -> None:
            while not ((run / "metrics.jsonl").is_file() and len(metrics_rows(run)) >= 2):
                await asyncio.sleep(0.05)
            url = json.loads((run / "resume.json").read_text())["engines"][0]
            async with aiohttp.ClientSession(headers=auth_headers()) as http:
                count, base = -1, 0
                while True:  # the engine is early in decoding the requests it holds
                    async with http.get(url + "/get_server_info") as resp:
                        info = await resp.json()
                    n, tokens = info["num_requests"], info["tokens"]
                    if n != count:  # requests came or went: count from here
                        count, base = n, tokens
                    elif n > 0 and 0 < tokens - base < n * _LONG // 4:
                        break  # each has most of its budget ahead: none ends before the stop
                    await asyncio.sleep(0.01)
            stop.set()

        watcher = asyncio.ensure_future(stop_mid_decode())
        try:
            await run_job(cfg, run, True, _long_answer, _prompts(), stop_event=stop)
        except RunStopped as exc:
            assert exc.step is not None
            return exc.step
        finally:
            watcher.cancel()
        raise AssertionError("the run was not stopped")

    stopped = asyncio.run(asyncio.wait_for(first(), 240))
    step, folder = ckpts.latest_checkpoint(run)
    assert step == stopped
    state = ckpts.load_controller_state(folder)
    assert state.running and state.kept_tokens > 0, state
    cfg = load_config(None, [*args, f"--controller.total_steps={step + 2}"])
    asyncio.run(
        asyncio.wait_for(run_job(cfg, run, True, _long_answer, _prompts(), resume=True), 240)
    )
    resumed = json.loads((run / "resumed.json").read_text())
    assert resumed["kept_tokens"] == state.kept_tokens > 0, resumed
    rows = metrics_rows(run)
    _check_exactly_once(rows, step + 2, 2)  # 2 groups (samples) a step
