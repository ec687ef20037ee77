"""Several reward functions with weights (``task.rewards``): config errors, each function's
value on the trajectory and the weighted sum as its reward, per-component rows of a whole
``asyncrl run`` (metrics.jsonl, trajectories.jsonl, eval rows, TensorBoard, W&B offline)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import RunConfig, load_config
from asyncrl.config import task as T
from asyncrl.core import Batch, Trajectory
from asyncrl.procs import python_env
from asyncrl.run_steplog import component_means
from asyncrl.task_factory import build_task, check_task, eval_samples

BREVITY = "def brevity(sample, response_ids):\n    return 1.0 / (1 + len(response_ids))\n"
SHOUT = "def shout(sample, response_ids, *, text):\n    return float(text.count('1'))\n"


def _specs(tmp_path: Path) -> list[dict]:
    (tmp_path / "my_rewards.py").write_text(BREVITY + SHOUT)
    return [
        {"fn": "task", "name": "correct"},
        {"fn": f"{tmp_path / 'my_rewards.py'}:brevity", "weight": 0.5},
        {"fn": f"{tmp_path / 'my_rewards.py'}:shout", "weight": -0.25, "name": "ones"},
    ]


def test_rewards_config_errors_name_the_key(tmp_path: Path) -> None:
    spec = T.RewardSpec(fn="task")
    with pytest.raises(ValueError, match=r"task\.reward_fn and task\.rewards are exclusive"):
        T.ReverseTaskConfig(reward_fn="m:f", rewards=[spec])
    with pytest.raises(ValueError, match=r"names \['f'\] more than once"):
        T.ReverseTaskConfig(rewards=[T.RewardSpec(fn="a:f"), T.RewardSpec(fn="b.f")])
    with pytest.raises(ValueError, match=r"weights \[1.0, -1.0\] sum to 0"):
        T.MathTaskConfig(rewards=[spec, T.RewardSpec(fn="a:f", weight=-1.0)])
    with pytest.raises(ValueError, match=r"sum to -2"):
        T.ReverseTaskConfig(rewards=[T.RewardSpec(fn="task", weight=-2.0)])
    with pytest.raises(ValueError, match=r"normalize_then_sum.*name the functions"):
        T.ReverseTaskConfig(reward_aggregation="normalize_then_sum")
    with pytest.raises(ValueError, match=r"hold no '/'"):
        T.ReverseTaskConfig(rewards=[T.RewardSpec(fn="task", name="a/b")])
    # a negative weight beside a positive one is a penalty; a zero weight is logged only
    T.ReverseTaskConfig(rewards=[spec, T.RewardSpec(fn="a:f", weight=-0.5, name="pen")])
    # from the command line (JSON) and refused there with the key
    cfg = load_config(None, ['--task.rewards=[{"fn": "task"}, {"fn": "m:g", "weight": 2}]'])
    assert isinstance(cfg.task, T.ReverseTaskConfig)
    assert [(r.label, r.weight) for r in cfg.task.rewards] == [("task", 1.0), ("g", 2.0)]
    with pytest.raises(ValueError, match=r"task\.reward_aggregation"):
        load_config(None, ["--task.reward_aggregation=mean"])
    with pytest.raises(ValueError, match=r"rewards"):
        load_config(None, ["--task.name=longtail", '--task.rewards=[{"fn": "task"}]'])


def test_an_unknown_reward_function_fails_when_built_naming_its_entry(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model = str(tiny_model_dir)
    bad = [{"fn": "task"}, {"fn": "nosuchmod_xyz:f"}]
    cfg = load_config(None, [f"--task.rewards={json.dumps(bad)}"])
    with pytest.raises(ValueError, match=r"task\.rewards\[1\]\.fn 'nosuchmod_xyz:f': cannot"):
        build_task(cfg, model)
    (tmp_path / "r.py").write_text("def three(a, b, c, d):\n    return 0\n")
    bad = [{"fn": f"{tmp_path / 'r.py'}:nope"}]
    with pytest.raises(ValueError, match=r"task\.rewards\[0\]\.fn .* has no function 'nope'"):
        build_task(load_config(None, [f"--task.rewards={json.dumps(bad)}"]), model)
    bad = [{"fn": f"{tmp_path / 'r.py'}:three"}]
    with pytest.raises(ValueError, match=r"task\.rewards\[0\]\.fn .* cannot be called"):
        build_task(load_config(None, [f"--task.rewards={json.dumps(bad)}"]), model)


def test_normalize_then_sum_is_refused_where_it_defines_no_advantage(tmp_path: Path) -> None:
    specs = json.dumps(_specs(tmp_path))
    base = [f"--task.rewards={specs}", "--task.reward_aggregation=normalize_then_sum"]
    check_task(load_config(None, base))  # grpo: fine
    with pytest.raises(ValueError, match=r"not algo\.name='rloo'"):
        check_task(load_config(None, [*base, "--algo.name=rloo"]))
    with pytest.raises(ValueError, match=r"algo\.overlong_buffer_len"):
        check_task(load_config(None, [*base, "--algo.overlong_buffer_len=1"]))


def test_each_function_is_kept_on_the_trajectory_and_the_reward_is_their_weighted_sum(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from asyncrl.tasks.rewards import WeightedRewards

    cfg = RunConfig(task=T.ReverseTaskConfig(rewards=[T.RewardSpec(**s) for s in _specs(tmp_path)]))
    built = build_task(cfg, str(tiny_model_dir))
    task = built.task
    assert isinstance(task, WeightedRewards) and task.names == ["correct", "brevity", "ones"]
    sample = next(built.samples)
    ids = [*sample.answer, task.task.eos_id]  # the right answer: the task's reward is 1
    total, parts = asyncio.run(task.score(sample, ids))
    assert parts["correct"] == 1.0 == task.task.reward(sample, ids)
    from asyncrl.tasks.text import ChatTokenizer

    assert parts["ones"] == float(ChatTokenizer(str(tiny_model_dir)).decode(ids).count("1"))
    assert parts["brevity"] == 1.0 / (1 + len(ids))
    assert total == pytest.approx(1.0 + 0.5 * parts["brevity"] - 0.25 * parts["ones"], abs=1e-12)
    assert asyncio.run(task(sample, ids)) == total  # the object is a reward function too
    # the episode the factory chose is the weighted one; evals score with the object
    assert built.episode.__qualname__.startswith("WeightedRewards.episode")
    samples, reward = eval_samples(RunConfig(task=cfg.task, eval=cfg.eval), str(tiny_model_dir))
    assert isinstance(reward, WeightedRewards) and samples


def _traj(reward: float, rewards: dict[str, float], group: int = 0) -> Trajectory:
    z = [0]
    return Trajectory(
        prompt_ids=z, response_ids=z, behav_logprobs=[0.0], versions=z, loss_mask=[1],
        reward=reward, group_id=group, episode_id=0, rewards=rewards,
    )  # fmt: skip


def test_the_step_row_has_each_components_mean() -> None:
    batch = Batch(
        step=0,
        groups=[
            [_traj(1.0, {"a": 1.0, "b": 0.0}), _traj(0.5, {"a": 0.0, "b": 1.0})],
            [_traj(0.0, {"a": 0.5}), _traj(0.0, {})],
        ],
    )
    assert component_means(batch) == {"reward/a_mean": 0.5, "reward/b_mean": 0.5}
    assert component_means(Batch(step=0, groups=[[_traj(1.0, {})]])) == {}


def test_a_run_with_two_reward_functions_logs_each(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A whole ``asyncrl run`` (the reverse task, its own reward plus a brevity reward at
    weight 0.5): every step row has ``reward/<name>_mean`` of each function and a
    ``reward_mean`` equal to their weighted sum; each trajectory carries both; the eval row
    has ``eval/reward/<name>_mean``; TensorBoard and W&B (offline) get the same values."""
    pytest.importorskip("tensorboard")
    (tmp_path / "my_rewards.py").write_text(BREVITY)
    specs = [{"fn": "task", "name": "correct"}, {"fn": "my_rewards:brevity", "weight": 0.5}]
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "asyncrl.cli", "run", "--run-dir", str(run), "--quiet"]
    cmd += [f"--model.path={tiny_model_dir}", "--controller.total_steps=4"]
    cmd += ["--controller.batch_size=4", f"--task.rewards={json.dumps(specs)}"]
    cmd += ["--logging.trajectories=true", "--eval.at_end=true", "--eval.num_prompts=4"]
    cmd += ["--logging.tensorboard.enabled=true"]
    cmd += ["--logging.wandb.enabled=true", "--logging.wandb.mode=offline"]
    out = subprocess.run(
        cmd, env=python_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in lines if "reward_mean" in r]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        combined = r["reward/correct_mean"] + 0.5 * r["reward/brevity_mean"]
        assert r["reward_mean"] == pytest.approx(combined, abs=1e-9)
        assert 0 < r["reward/brevity_mean"] <= 1
    trajs = [json.loads(x) for x in (run / "trajectories.jsonl").read_text().splitlines()]
    assert trajs and all(set(t["rewards"]) == {"correct", "brevity"} for t in trajs)
    for t in trajs:
        n = sum(t["loss_mask"])
        assert t["rewards"]["brevity"] == pytest.approx(1 / (1 + n))
        assert t["reward"] == pytest.approx(t["rewards"]["correct"] + 0.5 / (1 + n))
    (ev,) = [r for r in lines if "eval/reward_mean" in r]
    combined = ev["eval/reward/correct_mean"] + 0.5 * ev["eval/reward/brevity_mean"]
    assert ev["eval/reward_mean"] == pytest.approx(combined, abs=1e-9)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    for name in ("correct", "brevity"):
        got = acc.Scalars(f"reward/{name}_mean")
        assert [e.step for e in got] == [0, 1, 2, 3]
        assert [e.value for e in got] == pytest.approx([r[f"reward/{name}_mean"] for r in rows])
        (e,) = acc.Scalars(f"eval/reward/{name}_mean")
        assert e.value == pytest.approx(ev[f"eval/reward/{name}_mean"])
    if _has_wandb():
        history = _wandb_history(run)
        got = [h["reward/brevity_mean"] for h in history if "reward/brevity_mean" in h]
        assert got == pytest.approx([r["reward/brevity_mean"] for r in rows])
        assert any("eval/reward/correct_mean" in h for h in history)


def _has_wandb() -> bool:
    try:
        import wandb.sdk.internal.datastore  # noqa: F401
    except ImportError:
        return False
    return True


def _wandb_history(run_dir: Path) -> list[dict]:
    from wandb.proto import wandb_internal_pb2 as pb
    from wandb.sdk.internal.datastore import DataStore

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    store = DataStore()
    store.open_for_scan(str(path))
    history = []
    while (data := store.scan_data()) is not None:
        rec = pb.Record()
        rec.ParseFromString(data)
        if rec.WhichOneof("record_type") == "history":
            items = rec.history.item
            history.append(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
            )
    return history
