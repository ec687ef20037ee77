"""``asyncrl run --algo RECIPE``: each recipe of ``RECIPES`` is the row docs/algorithms.md
shows, and resolves to the config that row says (its keys set, every other key the
default); a command-line key wins over the recipe's; the CLI lists the recipes."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest

from asyncrl.config import AlgoConfig, load_config
from asyncrl.config.algo_recipes import RECIPES, recipe_overrides
from asyncrl.entrypoints.run import _load

DOC = Path(__file__).resolve().parents[2] / "docs" / "algorithms.md"


def _doc_rows() -> dict[str, dict[str, str]]:
    """The Recipes table of docs/algorithms.md: recipe -> {key: value} of its second column."""
    text = DOC.read_text()
    table = text.split("### Recipes (`asyncrl run --algo RECIPE`)", 1)[1].split("\n### ", 1)[0]
    rows = {}
    for line in table.splitlines():
        m = re.match(r"\| `(\w+)` \| (.+?) \| ", line)
        if m:
            pairs = re.findall(r"`algo\.(\w+)=([^`]+)`", m.group(2))
            rows[m.group(1)] = dict(pairs)
    return rows


def _typed(field: str, value: str) -> Any:
    """``value`` as the command line means it, typed like ``AlgoConfig.field``."""
    default = getattr(AlgoConfig(), field)
    if isinstance(default, bool):
        return {"true": True, "false": False}[value]
    if isinstance(default, float):
        return float(value)
    return value


def test_the_docs_table_is_the_recipes_table() -> None:
    assert _doc_rows() == {name: keys for name, (_, keys) in RECIPES.items()}


@pytest.mark.parametrize("name", list(RECIPES))
def test_each_recipe_resolves_to_the_config_its_row_says(name: str) -> None:
    keys = RECIPES[name][1]
    cfg = load_config(None, recipe_overrides(name))
    want = msgspec.structs.replace(AlgoConfig(), **{k: _typed(k, v) for k, v in keys.items()})
    assert cfg.algo == want
    # as `asyncrl run --algo NAME` loads it, a command-line key winning over the recipe's
    ns = argparse.Namespace(algo=name, config=None, resume=None, run_dir=None)
    cfg, _ = _load(ns, ["--algo.group_size=4", "--algo.clip_eps_high=0.5"])
    assert cfg.algo == msgspec.structs.replace(want, group_size=4, clip_eps_high=0.5)


def test_an_unknown_recipe_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown --algo recipe 'dpo' \(known: grpo, ppo, rloo"):
        recipe_overrides("dpo")
