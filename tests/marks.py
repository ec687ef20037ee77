"""Skip marks for optional packages, decided without importing them: a module-level
``pytest.importorskip`` imports the package in every test worker's collection (peft: ~1.8 s
each, with the transformers modules it pulls in)."""

from __future__ import annotations

import importlib.util

import pytest


def needs(package: str) -> pytest.MarkDecorator:
    """Skip unless ``package`` is installed (found, not imported)."""
    missing = importlib.util.find_spec(package) is None
    return pytest.mark.skipif(missing, reason=f"needs {package} (pip install {package})")


needs_peft = needs("peft")
