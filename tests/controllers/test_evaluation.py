"""Evaluation during training (``[eval]``, asyncrl/controllers/evaluation.py): the unbiased
pass@k against brute-force enumeration, and a real short ``asyncrl run`` (engine, trainer,
controller processes) whose evals land in metrics.jsonl without training or taking staleness
slots."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.controllers.evaluation import by_source, pass_at_k
from asyncrl.procs import finish, python_env
from asyncrl.task_factory import eval_samples
from asyncrl.tasks.data import DataSample


@pytest.mark.parametrize(("n", "k"), [(1, 1), (4, 1), (4, 2), (5, 3), (6, 6)])
def test_pass_at_k_is_the_chance_a_random_k_subset_holds_a_pass(n: int, k: int) -> None:
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        subsets = list(itertools.combinations(range(n), k))
        want = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)
    with pytest.raises(ValueError, match="pass@3 needs at least 3"):
        pass_at_k(2, 1, 3)


def test_eval_split_and_refusals(tiny_model_dir: Path) -> None:
    cfg = load_config(None, ["--eval.at_end=true", "--eval.num_prompts=5"])
    held_out, reward = eval_samples(cfg, str(tiny_model_dir))
    train = load_config(None, []).task
    from asyncrl.tasks.base import make_task

    first = list(itertools.islice(make_task(train, str(tiny_model_dir)).samples(), 5))
    assert len(held_out) == 5 and [s.prompt_ids for s in held_out] != [s.prompt_ids for s in first]
    assert reward(held_out[0], held_out[0].answer) == 1.0  # the task's own reward
    bad = load_config(None, ["--eval.at_end=true", "--eval.path=x.jsonl"])
    with pytest.raises(ValueError, match=r"eval\.path"):
        eval_samples(bad, str(tiny_model_dir))
    agentic = load_config(None, ["--eval.at_end=true", "--task.name=agentic"])
    with pytest.raises(ValueError, match=r"eval\.every_steps=0"):
        eval_samples(agentic, str(tiny_model_dir))


def test_per_source_breakdowns_score_each_source_on_its_own() -> None:
    a, b = DataSample([1], source="gsm"), DataSample([2], source="aime")
    samples = [a, b, a]  # k = 2 results each: (reward, length, versions...)
    sampled = [(1, 4, 0, 0), (0, 2, 0, 0), (0, 6, 0, 0), (0, 8, 0, 0), (1, 2, 0, 0), (1, 2, 0, 0)]
    out = by_source(samples, sampled, [1.0, 0.0, 0.0], 2, 1.0)
    assert out == {
        "eval/aime/reward_mean": 0.0,
        "eval/aime/pass@1": 0.0,
        "eval/aime/pass@2": 0.0,
        "eval/aime/response_len": 7.0,
        "eval/aime/num_prompts": 1.0,
        "eval/aime/greedy_pass": 0.0,
        "eval/gsm/reward_mean": 0.75,
        "eval/gsm/pass@1": (0.5 + 1.0) / 2,
        "eval/gsm/pass@2": 1.0,
        "eval/gsm/response_len": 2.5,
        "eval/gsm/num_prompts": 2.0,
        "eval/gsm/greedy_pass": 0.5,
    }
    # one source (or samples without one): no breakdown, the overall keys say it all
    assert by_source([a, a], sampled[:4], [], 2, 1.0) == {}


def test_eval_sources_are_drawn_by_weight_and_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    for name, answer in (("easy", 1), ("hard", 2)):
        rows = [{"question": f"{answer} + 0", "answer": answer}] * 4
        (tmp_path / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"question": "1", "answer": 1}))
    sources = json.dumps(
        [{"path": f"{tmp_path}/easy.jsonl"}, {"path": f"{tmp_path}/hard.jsonl", "weight": 2}]
    )
    cfg = load_config(None, [
        "--task.name=math", f"--task.path={train}", "--eval.at_end=true",
        "--eval.num_prompts=60", f"--eval.sources={sources}",
    ])  # fmt: skip
    held_out, _ = eval_samples(cfg, str(tiny_model_dir))
    names = [s.source for s in held_out]
    assert len(held_out) == 60 and {"easy", "hard"} == set(names)
    assert names.count("hard") > names.count("easy")
    assert all(s.answer == (1 if s.source == "easy" else 2) for s in held_out)
    with pytest.raises(ValueError, match=r"eval\.path and eval\.sources are exclusive"):
        load_config(None, [f"--eval.path={train}", f"--eval.sources={sources}"])


def test_short_run_evaluates_before_during_and_after(tmp_path: Path, tiny_model_dir: Path) -> None:
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "asyncrl.cli", "run", "--run-dir", str(run), "--quiet"]
    cmd += [
        f"--model.path={tiny_model_dir}",
        "--controller.total_steps=4",
        "--controller.batch_size=4",
        "--controller.max_staleness=1",
        "--eval.before_train=true",
        "--eval.every_steps=2",
        "--eval.at_end=true",
        "--eval.num_prompts=3",
        "--eval.k=2",
    ]
    proc = subprocess.Popen(cmd, env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    rc, out = finish(proc, 300)
    assert rc == 0, out[-3000:]
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln]
    train = [r for r in rows if "eval/reward_mean" not in r]
    evals = [r for r in rows if "eval/reward_mean" in r]
    assert [r["step"] for r in train] == [0, 1, 2, 3]
    # before the first step (version 0), at versions 2 and 4 (every 2); the end's version 4
    # is not evaluated twice. An eval still running when a version comes skips it (counted).
    asked = sorted(r["step"] for r in evals)
    assert asked[0] == 0 and asked[-1] == 4, asked
    assert len(asked) + int(evals[-1]["eval/skipped"]) == 3, evals
    for r in evals:
        assert 0.0 <= r["eval/reward_mean"] <= 1.0
        assert 0.0 <= r["eval/pass@1"] <= r["eval/pass@2"] <= 1.0
        assert r["eval/num_prompts"] == 3 and r["eval/response_len"] > 0
        assert 0.0 <= r["eval/greedy_reward"] <= 1.0
        # tagged with the versions that generated its tokens: never older than asked
        assert r["step"] <= r["eval/weight_version"] <= r["eval/weight_version_max"] <= 4
    # evals took no staleness slot and trained nothing: every step trained batch_size groups,
    # every admission was a training group (admitted = trained + ready + running + ...)
    assert all(r["num_samples"] == 4 * 8 for r in train)
    c = {k.removeprefix("ctl_"): v for k, v in train[-1].items() if k.startswith("ctl_")}
    ended = ("trained", "ready", "running", "rejected", "failed", "stale_dropped", "filtered")
    assert c["groups_admitted"] == sum(c[k] for k in (*ended, "stale_regenerated"))
    assert c["episodes"] == 8 * (c["groups_admitted"] - c["running"])


class _HeldEvals:
    """A controller whose ``evaluate`` runs until the test lets that version's eval end."""

    def __init__(self) -> None:
        self.release: dict[int, asyncio.Event] = {}
        self.asked: list[int] = []

    async def evaluate(self, samples: object, reward: object, **kw: object) -> dict[str, float]:
        v = len(self.asked)
        self.asked.append(v)
        self.release[v] = asyncio.Event()
        await self.release[v].wait()
        return {"eval/reward_mean": 0.0}


@pytest.mark.parametrize("slow", [0, 2])
def test_eval_skipped_counts_the_versions_never_evaluated(slow: int) -> None:
    """Versions 0 (before training), 2 and 4 (every 2), 4 again at the end: with the eval of
    ``slow`` still running when the next version comes, that version is skipped. Skipped 2
    stays skipped (1 in the last row); skipped 4 is evaluated at the end after all (0)."""
    from asyncrl.controllers.evaluation import Evaluator

    flags = ["--eval.before_train=true", "--eval.every_steps=2", "--eval.at_end=true"]
    cfg = load_config(None, flags)
    rows: list[dict] = []

    async def main() -> None:
        ctl = _HeldEvals()
        ev = Evaluator(cfg, ctl, [], lambda *a: 0.0, rows.append)  # type: ignore[arg-type]
        ev.start()  # version 0's eval runs
        for v, before in ((2, 0), (4, 2)):
            await asyncio.sleep(0)  # the running eval reaches its wait
            if before != slow:  # it ends before version v comes
                ctl.release[len(ctl.asked) - 1].set()
                await ev.running  # type: ignore[misc]
            ev.version(v)
        end = asyncio.ensure_future(ev.finish(4))
        while not end.done():  # every eval may end now
            for e in ctl.release.values():
                e.set()
            await asyncio.sleep(0)
        await end

    asyncio.run(asyncio.wait_for(main(), 30))
    steps = [r["step"] for r in rows]
    if slow == 0:  # 2 skipped, 4 evaluated by the schedule
        assert steps == [0, 4] and rows[-1]["eval/skipped"] == 1.0
    else:  # 4 skipped by the schedule, evaluated at the end
        assert steps == [0, 2, 4] and rows[-1]["eval/skipped"] == 0.0
