"""The suite's own scheduling (tests/conftest.py): heavy files first for ``--dist loadfile``."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def conftest(pytestconfig: pytest.Config) -> ModuleType:
    """tests/conftest.py as pytest loaded it (importing it again would run it twice)."""
    for plugin in pytestconfig.pluginmanager.get_plugins():
        if getattr(plugin, "__file__", None) == str(ROOT / "tests" / "conftest.py"):
            return plugin
    raise AssertionError("tests/conftest.py is not loaded")


def test_every_file_in_the_cost_table_exists(conftest: ModuleType) -> None:
    """A renamed or split file would silently lose its place at the front."""
    missing = [f for f in conftest._FILE_SECONDS if not (ROOT / f).is_file()]
    assert missing == []


def test_heavy_files_go_first_and_each_file_stays_whole_and_in_order(conftest: ModuleType) -> None:
    heavy, second = list(conftest._FILE_SECONDS)[:2]
    ids = ["tests/a.py::t1", f"{second}::x1", "tests/a.py::t2", f"{heavy}::y1", f"{heavy}::y2"]
    ids += [f"{second}::x2", "tests/b.py::u1"]
    items = [SimpleNamespace(nodeid=i) for i in ids]
    conftest._heaviest_files_first(items)  # type: ignore[arg-type]
    assert [i.nodeid for i in items] == [
        f"{heavy}::y1",
        f"{heavy}::y2",
        f"{second}::x1",
        f"{second}::x2",
        "tests/a.py::t1",
        "tests/a.py::t2",
        "tests/b.py::u1",
    ]


def test_xdist_keeps_the_collection_order(pytestconfig: pytest.Config) -> None:
    """xdist's own reorder (by number of tests per file) would undo the order above."""
    pytest.importorskip("xdist")
    assert pytestconfig.option.loadscopereorder is False
