"""verl 0.9.1's and TRL 1.16's own loss and advantage functions, loaded one by one from their
wheels' source (unpacked by ``scripts/setup.sh`` under ``.cache/verl/0.9.1`` and
``.cache/trl/1.16.0``, not installed).

Neither package imports here: ``verl.trainer.ppo.core_algos`` needs ``omegaconf``,
``tensordict`` and ``verl.workers.config``; ``trl.trainer.grpo_trainer`` needs ``datasets``
and a model. So :func:`load` compiles just the named functions from the file, as written
there (their decorators, which only register or profile them, dropped; line numbers kept),
into a namespace that supplies what their bodies use: ``torch``, ``numpy``, verl's
``verl_F`` (its ``masked_*`` functions, loaded the same way from
``verl/utils/torch_functional.py``) and TRL's ``nanstd``/``nanmin``/``nanmax`` (from
``trl/trainer/utils.py``). The stand-ins are only containers the functions read settings
from: :class:`VerlActorConfig` (verl's ``ActorConfig`` fields the losses read) and
:class:`TrlTrainer` (the ``GRPOTrainer`` attributes ``_compute_loss`` reads, an identity
``accelerator`` for one process, and the per-token log-probs/entropies the model would give).
"""

from __future__ import annotations

import ast
import math
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2] / ".cache"
VERL = ROOT / "verl" / "0.9.1"
TRL = ROOT / "trl" / "1.16.0"
CORE_ALGOS = VERL / "verl" / "trainer" / "ppo" / "core_algos.py"
GRPO_TRAINER = TRL / "trl" / "trainer" / "grpo_trainer.py"


def load(path: Path, names: list[str], namespace: dict[str, Any]) -> dict[str, Any]:
    """Compile the functions ``names`` (``"f"`` or ``"Class.f"``) of ``path`` into ``namespace``
    exactly as the file defines them, minus their decorators; returns ``namespace``."""
    if not path.is_file():
        pytest.skip(f"{path} is missing: run scripts/setup.sh (it unpacks verl/TRL sources)")
    tree = ast.parse(path.read_text(), str(path))
    for name in names:
        cls, _, fn = name.rpartition(".")
        body = tree.body
        if cls:
            body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
        node = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == fn)
        node.decorator_list = []
        exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)
    return namespace


class VerlAlgoConfig(SimpleNamespace):
    """verl's ``AlgoConfig`` as the estimators read it (``gamma``)."""


class VerlActorConfig(SimpleNamespace):
    """verl's ``ActorConfig`` as the policy losses read it (``clip_ratio*``, ``tau_*``,
    ``global_batch_info``: empty = one process, the micro-batch is the batch)."""

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)


def verl() -> SimpleNamespace:
    """verl 0.9.1's ``core_algos`` functions the tests compare against."""
    torch_functional = load(
        VERL / "verl" / "utils" / "torch_functional.py",
        ["masked_sum", "masked_mean", "masked_var", "masked_whiten"],
        {"torch": torch},
    )
    ns: dict[str, Any] = {
        "torch": torch,
        "np": np,
        "defaultdict": defaultdict,
        "Optional": Optional,
        "Any": Any,
        "verl_F": SimpleNamespace(**torch_functional),
        "AlgoConfig": VerlAlgoConfig,
        "ActorConfig": VerlActorConfig,
        "DictConfig": dict,
    }
    names = [
        "agg_loss",
        "compute_policy_loss_vanilla",
        "compute_policy_loss_gspo",
        "compute_policy_loss_sapo",
        "compute_policy_loss_cispo",
        "compute_grpo_outcome_advantage",
        "compute_rloo_outcome_advantage",
        "compute_reinforce_plus_plus_outcome_advantage",
        "compute_reinforce_plus_plus_baseline_outcome_advantage",
    ]
    return SimpleNamespace(**load(CORE_ALGOS, names, ns))


class _Accelerator:
    """One process: gathering, padding and reducing leave a tensor as it is."""

    num_processes = 1

    def pad_across_processes(self, x: torch.Tensor, dim: int = 0, pad_index: float = 0) -> Any:
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x

    gather_for_metrics = gather

    def reduce(self, x: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return x


def trl_namespace() -> dict[str, Any]:
    utils = load(
        TRL / "trl" / "trainer" / "utils.py", ["nanstd", "nanmin", "nanmax"], {"torch": torch}
    )
    ns = {"torch": torch, "math": math, **utils}
    return load(
        GRPO_TRAINER,
        ["GRPOTrainer._compute_loss", "GRPOTrainer.get_high_entropy_mask"],
        ns,
    )


class TrlTrainer:
    """The ``GRPOTrainer`` attributes ``_compute_loss`` reads, for one training micro-batch on
    one process; the model's output (per-token log-probs, entropies) is given."""

    def __init__(
        self,
        loss_type: str,
        logp: torch.Tensor,
        entropies: torch.Tensor | None = None,
        level: str = "token",
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        top_entropy_quantile: float = 1.0,
        max_completion_length: int = 0,
        tau: tuple[float, float] = (1.0, 1.05),
    ):
        ns = trl_namespace()
        self._compute = ns["_compute_loss"]
        self.get_high_entropy_mask = ns["get_high_entropy_mask"].__get__(self)
        self._logp = logp
        self._entropies = torch.zeros_like(logp) if entropies is None else entropies
        self.loss_type = loss_type
        self.importance_sampling_level = level
        self.epsilon_low = epsilon
        self.epsilon_high = epsilon if epsilon_high is None else epsilon_high
        self.top_entropy_quantile = top_entropy_quantile
        self.max_completion_length = max_completion_length
        self.off_policy_mask_threshold = None
        self.beta = 0.0
        self.use_vllm = True  # the behaviour policy's log-probs came from an engine:
        self.vllm_importance_sampling_correction = True  # weight by inputs' IS ratio
        self._entropy_bonus_enabled = False
        self.aux_loss_enabled = False
        self.current_gradient_accumulation_steps = 1
        self.model = SimpleNamespace(training=True)
        self.accelerator = _Accelerator()
        self._metrics: defaultdict[str, defaultdict[str, list[float]]] = defaultdict(
            lambda: defaultdict(list)
        )
        self.args = SimpleNamespace(
            delta=None,
            sapo_temperature_pos=tau[0],
            sapo_temperature_neg=tau[1],
            use_bias_correction_kl=False,
            steps_per_generation=1,
        )

    def _get_per_token_logps_and_entropies(
        self, model: Any, input_ids: Any, attention_mask: Any, logits_to_keep: int, **_: Any
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        return self._logp, self._entropies, None

    def loss(
        self,
        completion_mask: torch.Tensor,
        advantages: torch.Tensor,
        old: torch.Tensor,
        is_ratio: torch.Tensor,
    ) -> torch.Tensor:
        b, t = completion_mask.shape
        inputs = {
            "prompt_ids": torch.zeros((b, 1), dtype=torch.long),
            "prompt_mask": torch.ones((b, 1), dtype=torch.long),
            "completion_ids": torch.zeros((b, t), dtype=torch.long),
            "completion_mask": completion_mask,
            "advantages": advantages,
            "old_per_token_logps": old,
            "importance_sampling_ratio": is_ratio,
            "num_items_in_batch": completion_mask.sum(),
        }
        return self._compute(self, self.model, inputs)
