"""Named algorithm recipes: ``asyncrl run --algo NAME`` sets the ``[algo]`` keys of
:data:`RECIPES`' row ``NAME`` (one table, here; docs/algorithms.md shows the same rows and a
test checks they agree). The recipe's keys are command-line overrides placed before the
user's: a key given on the command line wins over the recipe's, the recipe's over the config
file's.

Each recipe is the configuration its paper and the reference implementations (verl 0.9.1's
recipes, TRL 1.16's ``loss_type``) name, in asyncrl's keys; what a recipe cannot set for every
job (DAPO's overlong buffer, a length in tokens of the job's own budget) is said in its
summary. Plain data, no imports: ``asyncrl run --help`` lists them before anything loads.
"""

from __future__ import annotations

__all__ = ["RECIPES", "recipe_overrides"]

RECIPES: dict[str, tuple[str, dict[str, str]]] = {
    "grpo": ("GRPO (the default)", {"name": "grpo"}),
    "ppo": ("PPO with a critic and GAE", {"name": "ppo"}),
    "rloo": ("RLOO: leave-one-out baseline", {"name": "rloo"}),
    "reinforce_plus_plus": (
        "REINFORCE++: discounted returns whitened over the batch",
        {"name": "reinforce_plus_plus"},
    ),
    "reinforce_plus_plus_baseline": (
        "REINFORCE++-baseline: group-mean baseline, whitened over the batch",
        {"name": "reinforce_plus_plus_baseline"},
    ),
    "dr_grpo": (
        "Dr.GRPO: no std scaling, constant length normaliser (TRL loss_type=dr_grpo)",
        {"name": "grpo", "scale_rewards": "none", "loss_agg": "token-sum-norm"},
    ),
    "dapo": (
        "DAPO: clip-higher 0.2/0.28, token-mean, dynamic sampling (add the overlong buffer, "
        "algo.overlong_buffer_len, for the job's budget)",
        {
            "name": "grpo",
            "clip_eps_low": "0.2",
            "clip_eps_high": "0.28",
            "loss_agg": "token-mean",
            "filter_groups": "true",
        },
    ),
    "gspo": (
        "GSPO: sequence-level ratio, the paper's clip 3e-4/4e-4, seq-mean",
        {
            "name": "grpo",
            "policy_loss": "gspo",
            "clip_eps_low": "0.0003",
            "clip_eps_high": "0.0004",
            "loss_agg": "seq-mean",
        },
    ),
    "luspo": (
        "LUSPO: length-unbiased GSPO (TRL loss_type=luspo)",
        {
            "name": "grpo",
            "policy_loss": "gspo",
            "clip_eps_low": "0.0003",
            "clip_eps_high": "0.0004",
            "loss_agg": "seq-mean-token-sum",
        },
    ),
    "cispo": (
        "CISPO: clipped, detached IS weight, upper clip only at 5 (TRL loss_type=cispo)",
        {
            "name": "grpo",
            "policy_loss": "cispo",
            "clip_eps_low": "1",
            "clip_eps_high": "4",
            "loss_agg": "token-mean",
        },
    ),
    "sapo": (
        "SAPO: soft sigmoid gate, temperatures 1 / 1.05, seq-mean (TRL loss_type=sapo)",
        {"name": "grpo", "policy_loss": "sapo", "loss_agg": "seq-mean"},
    ),
}
"""Recipe name -> (one line on what it is, the ``[algo]`` keys it sets -> their values as
the command line writes them)."""


def recipe_overrides(name: str) -> list[str]:
    """The ``--algo.key=value`` overrides of recipe ``name``; ValueError listing the known
    recipes for another name."""
    if name not in RECIPES:
        raise ValueError(f"unknown --algo recipe {name!r} (known: {', '.join(RECIPES)})")
    return [f"--algo.{k}={v}" for k, v in RECIPES[name][1].items()]
