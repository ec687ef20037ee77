"""SGLang's release rules for weight sync (``SGLangWeights.check``, ``sglang/family.py``)."""

from __future__ import annotations

from typing import Any

__all__ = ["sglang_check", "sglang_release"]


def sglang_release(info: dict[str, Any]) -> tuple[int, ...]:
    """The SGLang version in a ``/server_info`` answer (``version``); the embedded engine,
    which has none, counts as the newest."""
    text = str(info.get("version", ""))
    parts = [int(p) for p in text.split(".")[:3] if p.isdigit()]
    return tuple(parts) if len(parts) >= 2 else (99,)


def sglang_check(infos: list[dict[str, Any]], pause_mode: str) -> bool:
    """Refuse what an engine's SGLang version cannot do exactly; answer ``flush_cache``.

    SGLang < 0.5.22 reports one version per request (no spans): only ``abort`` keeps
    every token's version exact. ``flush_cache`` fails unless the engine is idle: with
    ``in_place`` always (0.5.22+: 400 "weights updated, cache not flushed",
    scheduler_components/weight_updater.py:120-133; 0.5.10: an assertion kills the
    scheduler, scheduler_update_weights_mixin.py:80-82), with ``retract`` before 0.5.22
    (retracted requests wait in the queue, scheduler.py:2900-2918 in 0.5.10).
    """
    oldest = min(sglang_release(i) for i in infos)
    if oldest < (0, 5, 22) and pause_mode != "abort":
        raise ValueError(
            f"rollout.pause_mode={pause_mode!r} needs SGLang >= 0.5.22 (per-token "
            f"version spans); an engine runs {'.'.join(map(str, oldest))}: use 'abort'"
        )
    return pause_mode == "abort" or (pause_mode == "retract" and oldest >= (0, 5, 22))
