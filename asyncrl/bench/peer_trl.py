"""The TRL side of ``asyncrl bench peer``: TRL's ``GRPOTrainer`` on asyncrl's default job.

Run by ``asyncrl bench peer`` in a process of its own (``python -m asyncrl.bench.peer_trl
--out PATH ...``), with ``--threads`` torch threads. Written from TRL's documented API
(``GRPOConfig``, ``GRPOTrainer(model, reward_funcs, args, train_dataset,
processing_class)``, ``TrainerCallback``): the same tiny Qwen2 folder, the same prompt
stream (``ReverseTask``'s, in order, no shuffling), the same reward function, 32 prompts x 8
completions per optimizer step, one step per generation, AdamW, constant LR, no KL and no
reference model, float32 on the CPU.

Per step it records the batch's mean reward (computed by the reward function TRL calls, the
reverse task's own), the time of the step's end since ``trainer.train()`` was called, the
step's wall time (``on_step_begin`` -> ``on_step_end``: generation, scoring, forward,
backward and the optimizer step) and its generation part (``_generate_and_score_completions``:
``generate``, rewards, advantages); ``train_s`` = step - generation, the part comparable
with asyncrl's trainer step. Stops early once the 10-step mean reward reaches ``--stop-at``.
Writes ``{"settings": ..., "steps": [...], "import_s", "load_s"}`` as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time
from pathlib import Path
from typing import Any

T_START = time.perf_counter()


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of TRL's ``GRPOConfig`` for asyncrl's default job; every value
    ``asyncrl bench peer`` compares is read back from the built config, not from here."""
    return {
        "output_dir": args.workdir,
        "seed": args.seed,
        "max_steps": args.steps,
        "per_device_train_batch_size": args.prompts * args.group_size,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": 1,
        "num_generations": args.group_size,
        "num_iterations": 1,
        "max_completion_length": args.max_new_tokens,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "learning_rate": args.lr,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "adam_beta1": args.betas[0],
        "adam_beta2": args.betas[1],
        "weight_decay": args.weight_decay,
        "max_grad_norm": args.grad_clip,
        "beta": 0.0,
        "epsilon": args.clip_eps,
        "loss_type": "dapo",
        "scale_rewards": "group",
        "shuffle_dataset": False,
        "bf16": False,
        "fp16": False,
        "use_cpu": True,
        "gradient_checkpointing": False,
        "logging_steps": 10,
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }


def build_dataset(model_dir: str, args: argparse.Namespace) -> Any:
    """``args.steps x args.prompts`` rows of the reverse task's prompt stream (seed
    ``args.seed``): ``prompt`` (its tokens as text: the tiny tokenizer splits on spaces)
    and ``answer`` (the reversed digits' ids)."""
    Dataset = importlib.import_module("datasets").Dataset  # the peer extra's; no stubs

    from asyncrl.tasks.reverse import ReverseTask
    from asyncrl.tasks.tiny_model import TINY_VOCAB

    task = ReverseTask.from_tokenizer_dir(model_dir, args.num_digits, args.seed)
    rows: dict[str, list[Any]] = {"prompt": [], "answer": []}
    for sample, _ in zip(task.samples(), range(args.steps * args.prompts), strict=False):
        rows["prompt"].append(" ".join(TINY_VOCAB[i] for i in sample.prompt_ids))
        rows["answer"].append(list(sample.answer))
    return Dataset.from_dict(rows), task


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

    import torch

    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    trl = importlib.import_module("trl")  # the peer extra's
    GRPOConfig, GRPOTrainer = trl.GRPOConfig, trl.GRPOTrainer

    from asyncrl.core import Sample

    t_imported = time.perf_counter()
    dataset, task = build_dataset(args.model_dir, args)
    rewards: list[float] = []
    record = _recorder(TrainerCallback, rewards, args.stop_at)
    config = GRPOConfig(**settings(args))
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    trainer = _timed(GRPOTrainer)(
        model=model,
        reward_funcs=_reward_function(task, Sample, rewards),
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[record],
    )
    record.trainer = trainer
    t_loaded = time.perf_counter()
    t_train = record.t_train = time.perf_counter()
    trainer.train()
    report = {
        "torch_threads": torch.get_num_threads(),
        "config": _config_view(config, trainer),
        "steps": record.steps,
        "import_s": t_imported - T_START,
        "load_s": t_loaded - t_imported,
        "process_to_train_s": t_train - T_START,
        "versions": {
            "trl": _version("trl"),
            "transformers": _version("transformers"),
            "torch": torch.__version__,
        },
    }
    Path(args.out).write_text(json.dumps(report))


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="TRL GRPOTrainer on asyncrl's default job")
    p.add_argument("--out", required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--stop-at", type=float, default=0.9)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--num-digits", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=3)
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--betas", type=float, nargs=2, default=[0.9, 0.99])
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--clip-eps", type=float, default=0.2)
    return p.parse_args(argv)


def _reward_function(task: Any, Sample: type, rewards: list[float]) -> Any:
    """The reward function TRL calls: the reverse task's reward of each completion; appends
    the batch's mean to ``rewards``."""

    def reverse_reward(prompts: Any, completions: Any, completion_ids: Any, answer: Any, **_: Any):
        out = [
            task.reward(Sample([], a), list(ids))
            for ids, a in zip(completion_ids, answer, strict=True)
        ]
        rewards.append(sum(out) / len(out))
        return out

    return reverse_reward


def _timed(base: Any) -> Any:
    """``base`` (TRL's ``GRPOTrainer``) that sums in ``gen_s`` the seconds spent in
    ``_generate_and_score_completions`` (the step's recorder zeroes it at each step's begin)."""

    class Timed(base):
        gen_s = 0.0

        def _generate_and_score_completions(self, *a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return super()._generate_and_score_completions(*a, **k)
            finally:
                self.gen_s += time.perf_counter() - t0

    return Timed


def _recorder(callback: Any, rewards: list[float], stop_at: float) -> Any:
    """A ``TrainerCallback`` (the class ``callback``) that appends one row per step to its
    ``steps``, and stops training once the last 10 steps' mean reward reaches ``stop_at``.
    Its ``trainer`` (a :func:`_timed` one) and ``t_train`` (when ``train()`` was called) are
    set before training."""

    class Record(callback):
        t_begin = 0.0
        t_train = 0.0
        trainer: Any = None

        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.t_begin = time.perf_counter()
            self.trainer.gen_s = 0.0

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            now = time.perf_counter()
            step_s, steps, gen_s = now - self.t_begin, self.steps, self.trainer.gen_s
            steps.append(
                {
                    "step": len(steps),
                    "reward_mean": rewards[-1],
                    "wall_s": now - self.t_train,
                    "step_s": step_s,
                    "gen_s": gen_s,
                    "train_s": step_s - gen_s,
                    "cpu_trl_s": time.process_time(),  # every thread of this process
                }
            )
            last = [r["reward_mean"] for r in steps[-10:]]
            if len(last) == 10 and sum(last) / 10 >= stop_at:
                control.should_training_stop = True

    return Record()


def _config_view(config: Any, trainer: Any) -> dict[str, Any]:
    """What the run used, read back from TRL's own objects."""
    opt = trainer.optimizer
    group = opt.param_groups[0] if opt is not None else {}
    keys = ("per_device_train_batch_size", "num_generations", "generation_batch_size",
            "steps_per_generation", "num_iterations", "max_completion_length", "temperature",
            "top_p", "top_k", "learning_rate", "lr_scheduler_type", "adam_beta1", "adam_beta2",
            "adam_epsilon", "weight_decay", "max_grad_norm", "beta", "epsilon", "loss_type",
            "scale_rewards", "bf16", "gradient_checkpointing", "optim", "seed")  # fmt: skip
    view = {k: _plain(getattr(config, k, None)) for k in keys}
    view["optimizer"] = type(opt.optimizer if hasattr(opt, "optimizer") else opt).__name__
    view["optimizer_betas"] = list(group.get("betas", ()))
    view["optimizer_eps"] = group.get("eps")
    view["ref_model"] = trainer.ref_model is not None
    view["dtype"] = str(next(trainer.model.parameters()).dtype).removeprefix("torch.")
    return view


def _plain(v: Any) -> Any:
    return v if isinstance(v, (bool, int, float, str, type(None))) else str(v)


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    main()
