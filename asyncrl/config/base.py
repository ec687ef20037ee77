"""The base of every config section: declared limits, checked on decode and on construction."""

from __future__ import annotations

import math
import sys
import typing
from functools import cache
from typing import Annotated, Any, TypeAlias

import msgspec

# Declared limits (msgspec checks them on decode; _Section.__post_init__ on construction).
# Every float is bounded, which refuses NaN and infinities (NaN would reach config.json as null).
_MAX = sys.float_info.max
Positive: TypeAlias = Annotated[int, msgspec.Meta(gt=0)]
NonNegative: TypeAlias = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat: TypeAlias = Annotated[float, msgspec.Meta(gt=0, le=_MAX)]
NonNegativeFloat: TypeAlias = Annotated[float, msgspec.Meta(ge=0, le=_MAX)]
Finite: TypeAlias = Annotated[float, msgspec.Meta(ge=-_MAX, le=_MAX)]
Fraction: TypeAlias = Annotated[float, msgspec.Meta(ge=0, le=1)]
OpenFraction: TypeAlias = Annotated[float, msgspec.Meta(ge=0, lt=1)]
"""In [0, 1)."""


class _Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every config section: frozen, unknown keys rejected, declared limits checked.

    msgspec passes ``frozen`` and ``forbid_unknown_fields`` down to subclasses at runtime, but a
    type checker reads a ``dataclass_transform`` class's own keywords only (PEP 681), so every
    section restates ``frozen=True``: without it mypy takes the section for a mutable class.
    (``kw_only`` is not inherited by msgspec: a section's own fields may be passed by position.)

    msgspec checks a field's ``msgspec.Meta`` limits when it decodes, not when a section is
    built in Python (``ControllerConfig(batch_size=0)``): ``__post_init__`` checks them then,
    so a section that exists is within its limits. Subclasses with their own
    ``__post_init__`` call this one first.
    """

    def __post_init__(self) -> None:
        for name, tp in _limited_fields(type(self)):
            value = getattr(self, name)
            try:
                msgspec.convert(value, tp)
            except msgspec.ValidationError as exc:
                where = str(exc).partition(" - at `$")[2].rstrip("`")  # e.g. "[0]" in a tuple
                if where:
                    value = value[int(where.strip("[]"))]
                key = f"{_section_key(type(self))}.{name}{where}"
                raise ValueError(_limit_message(key, value, tp)) from None


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def _section_types(tp: Any) -> tuple[type[msgspec.Struct], ...]:
    """The section type(s) a field's type holds: itself, a tagged union's members, or ()."""
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return (tp,)
    args = typing.get_args(tp)
    if args and all(isinstance(a, type) and issubclass(a, msgspec.Struct) for a in args):
        return args
    return ()


@cache
def _section_key(cls: type) -> str:
    """The dotted key of the section type ``cls`` in RunConfig (``logging.trace``)."""

    def find(tp: type, prefix: str) -> str | None:
        for name, hint in _hints(tp).items():
            for member in _section_types(hint):
                if issubclass(member, cls):
                    return prefix + name
                found = find(member, f"{prefix}{name}.")
                if found:
                    return found
        return None

    from asyncrl.config.run import RunConfig  # the root: run.py imports this module

    return find(RunConfig, "") or cls.__name__


def _has_limit(tp: Any) -> bool:
    if typing.get_origin(tp) is Annotated:
        return True
    return any(_has_limit(a) for a in typing.get_args(tp) if not isinstance(a, str))


@cache
def _limited_fields(cls: type) -> tuple[tuple[str, Any], ...]:
    """The fields of ``cls`` with declared limits, and their (annotated) types."""
    return tuple((n, tp) for n, tp in _hints(cls).items() if _has_limit(tp))


def _limit_message(key: str, value: Any, tp: Any) -> str:
    """One line for ``value`` outside the limits declared on its field's type ``tp``."""
    try:
        finite = math.isfinite(float(value))
    except (TypeError, ValueError):
        finite = True
    meta = _meta(tp)
    if not finite or meta is None:
        return f"{key} must be a finite number, got {value!r}"
    return f"{key} must be {_bounds(meta)}, got {value!r}"


def _meta(tp: Any) -> msgspec.Meta | None:
    """The ``msgspec.Meta`` declared in ``tp`` (``Annotated``, also inside ``X | None`` and
    ``tuple[X, X]``)."""
    if typing.get_origin(tp) is Annotated:
        return next((m for m in tp.__metadata__ if isinstance(m, msgspec.Meta)), None)
    metas = (_meta(a) for a in typing.get_args(tp) if not isinstance(a, str))
    return next((m for m in metas if m is not None), None)


def _bounds(meta: msgspec.Meta) -> str:
    """``> 0``, ``>= 1``, ``in [0, 1)``: the limits of ``meta`` (the float range's own ends,
    which only keep out infinities, left unsaid)."""
    lo = f"[{meta.ge:g}" if meta.ge is not None and meta.ge > -_MAX else None
    lo = f"({meta.gt:g}" if meta.gt is not None else lo
    hi = f"{meta.le:g}]" if meta.le is not None and meta.le < _MAX else None
    hi = f"{meta.lt:g})" if meta.lt is not None else hi
    if lo and hi:
        return f"in {lo}, {hi}"
    if lo:
        return (">= " if lo[0] == "[" else "> ") + lo[1:]
    if hi:
        return ("<= " if hi[-1] == "]" else "< ") + hi[:-1]
    return "a finite number"
