"""The configuration reference (``docs/config.md``, ``asyncrl config``), generated from the
config structs themselves: every key, its type and limits, its default and its docstring.

A field's docstring is the string literal under it in its class's source (read with
:mod:`ast`, as Sphinx reads attribute docstrings). A section that is one type per backend
(``rollout``, ``weights``; or per task: ``task``) lists the keys every backend takes once
(defaults per backend where they differ), then each backend's own keys. :func:`undocumented`
lists the fields without a docstring (a test keeps it empty); ``tests/test_config.py``
regenerates the page and compares it with ``docs/config.md``.
"""

from __future__ import annotations

import ast
import inspect
import json
import sys
import typing
from functools import cache
from typing import Annotated, Any, Literal

import msgspec

from asyncrl.config.base import _bounds, _hints, _meta, _section_types
from asyncrl.config.run import RunConfig

__all__ = ["render", "sections", "undocumented"]

HEADER = """# Configuration reference

Every key of `asyncrl run`'s configuration: its type (and limits), default and meaning,
generated from the config structs' docstrings in `asyncrl/config/` (`asyncrl config` prints
this page, `asyncrl config SECTION` one section; `tests/test_config.py` checks that this file
is what the code generates: after changing a config field, `asyncrl config > docs/config.md`).

Set any subset in a TOML file (`[section]` tables, `[section.sub]` for nested ones) and
override on the command line with `--section.key=value` or `--section.key value` (values
parse as JSON when they can: numbers, `true`, lists; a plain `a,b` for a list key is its
items). Unknown keys, wrong types, values outside the limits and options of another backend
are refused before anything starts, naming the key.
"""


@cache
def _class_docs(module: str) -> dict[str, tuple[str | None, dict[str, str]]]:
    """Per class of ``module``: its docstring and its fields' docstrings."""
    tree = ast.parse(inspect.getsource(sys.modules[module]))
    out: dict[str, tuple[str | None, dict[str, str]]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields: dict[str, str] = {}
        body = node.body
        for stmt, nxt in zip(body, [*body[1:], None], strict=True):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                fields[stmt.target.id] = inspect.cleandoc(nxt.value.value)
        out[node.name] = (ast.get_docstring(node), fields)
    return out


def _field_doc(cls: type, name: str) -> str:
    """The docstring of field ``name`` of ``cls``: its own class's, else a base class's."""
    for klass in cls.__mro__:
        if klass.__module__.startswith("asyncrl.config"):
            doc = _class_docs(klass.__module__).get(klass.__name__, (None, {}))[1].get(name)
            if doc:
                return doc
    return ""


def _class_doc(cls: type) -> str:
    return _class_docs(cls.__module__).get(cls.__name__, (None, {}))[0] or ""


def _text(doc: str) -> str:
    """A docstring as one Markdown table cell: paragraphs joined, reST literals as code."""
    text = " ".join(doc.split())
    return (
        text.replace("``", "`")
        .replace("|", "\\|")
        .replace(":class:", "")
        .replace(":meth:", "")
        .replace(":func:", "")
        .replace(":data:", "")
    )


def _type(tp: Any) -> str:
    """A field's type as a reader needs it: ``int > 0``, ``"a" | "b"``, ``list of str``."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base = _type(typing.get_args(tp)[0])
        meta = _meta(tp)
        return f"{base} {_bounds(meta)}" if meta is not None else base
    if origin is Literal:
        return " \\| ".join(json.dumps(a) for a in typing.get_args(tp))
    args = typing.get_args(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        parts = [a for a in args if a is not type(None)]
        rendered = " \\| ".join(_type(a) for a in parts)
        return f"{rendered} (or unset)" if len(parts) < len(args) else rendered
    if origin in (tuple, list):
        if origin is tuple and args and args[-1] is not Ellipsis:
            return "[" + ", ".join(_type(a) for a in args) + "]"
        return f"list of {_type(args[0])}" if args else "list"
    if origin is dict:
        return f"table of {_type(args[0])} → {_type(args[1])}"
    if isinstance(tp, type):
        return tp.__name__
    return str(tp)


def _default(cls: type[msgspec.Struct], name: str) -> Any:
    for f in msgspec.structs.fields(cls):
        if f.name == name:
            if f.default is not msgspec.NODEFAULT:
                return f.default
            if f.default_factory is not msgspec.NODEFAULT:
                return f.default_factory()
    return msgspec.NODEFAULT


def _value(value: Any) -> str:
    if value is msgspec.NODEFAULT:
        return "(required)"
    if value is None:
        return "unset"
    return "`" + json.dumps(msgspec.to_builtins(value)) + "`"


def _row(key: str, tp: Any, default: str, doc: str) -> str:
    return f"| `{key}` | {_type(tp)} | {default} | {_text(doc)} |"


_TABLE = "| key | type | default | meaning |\n|---|---|---|---|"


def _section(
    prefix: str, cls: type[msgspec.Struct], out: list[tuple[str, str]], field_doc: str = ""
) -> None:
    """Append ``(dotted section, Markdown)`` for ``cls`` at ``prefix`` and its subsections
    (``field_doc``: the docstring of the field holding it, shown first)."""
    rows, subs = [], []
    hints = _hints(cls)
    for name in cls.__struct_fields__:
        tp = hints[name]
        members = _section_types(tp)
        if len(members) == 1:
            subs.append((f"{prefix}.{name}", members[0], _field_doc(cls, name)))
            continue
        doc = _field_doc(cls, name)
        rows.append(_row(f"{prefix}.{name}", tp, _value(_default(cls, name)), doc))
    parts = [f"## `{prefix}`"]
    parts += [_text(d) for d in (field_doc, _class_doc(cls)) if d]
    if rows:
        parts.append(_TABLE + "\n" + "\n".join(rows))
    out.append((prefix, "\n\n".join(parts)))
    for sub_prefix, sub, doc in subs:
        _section(sub_prefix, sub, out, doc)


def _union(
    prefix: str, members: tuple[type[msgspec.Struct], ...], doc: str
) -> list[tuple[str, str]]:
    """A section that is one type per backend (or task): the shared keys once, then each
    one's own keys (with its docstring when it is the only one to have them), then the
    subsections of a member (``task.longtail``)."""
    tags = [str(m.__struct_config__.tag) for m in members]
    default_member = type(getattr(RunConfig(), prefix))
    shared = [
        n for n in members[0].__struct_fields__ if all(n in m.__struct_fields__ for m in members)
    ]
    lines = [f"## `{prefix}`"]
    if doc:
        lines.append(_text(doc))
    tag_field = members[0].__struct_config__.tag_field
    what = "backend" if tag_field == "backend" else prefix
    lines.append(
        f"`{prefix}.{tag_field}` chooses the {what}: "
        + ", ".join(f"`{json.dumps(t)}`" for t in tags)
        + f" (default `{json.dumps(default_member.__struct_config__.tag)}`); an option of "
        f"another {what} is refused, naming the {what} it belongs to."
    )
    common = next(c for c in members[0].__mro__ if all(issubclass(m, c) for m in members))
    main_tag = str(default_member.__struct_config__.tag)
    rows = []
    for name in shared:
        values = {t: _value(_default(m, name)) for t, m in zip(tags, members, strict=True)}
        types = {t: _type(_hints(m)[name]) for t, m in zip(tags, members, strict=True)}
        default = _per_backend(values, main_tag)
        kind = _per_backend(types, main_tag)
        doc = _field_doc(common, name) or _field_doc(default_member, name)  # the general word
        rows.append(f"| `{prefix}.{name}` | {kind} | {default} | {_text(doc)} |")
    lines.append(f"Every {what}:\n\n{_TABLE}\n" + "\n".join(rows))
    groups: dict[tuple[str, ...], list[type[msgspec.Struct]]] = {}
    for m in members:
        own = tuple(n for n in m.__struct_fields__ if n not in shared)
        groups.setdefault(own, []).append(m)
    subs: list[tuple[str, str]] = []
    for own, group in groups.items():
        if not own:
            continue
        names = " \\| ".join(f"`{json.dumps(m.__struct_config__.tag)}`" for m in group)
        first = group[0]
        rows = []
        for n in own:
            tp = _hints(first)[n]
            if len(_section_types(tp)) == 1:  # a subsection of this member: its own table
                _section(f"{prefix}.{n}", _section_types(tp)[0], subs, _field_doc(first, n))
                continue
            rows.append(_row(f"{prefix}.{n}", tp, _value(_default(first, n)), _field_doc(first, n)))
        head = f"Only with `{prefix}.{tag_field}` = {names}:"
        if len(group) == 1 and _class_doc(first):
            head += " " + _text(_class_doc(first))
        lines.append(f"{head}\n\n{_TABLE}\n" + "\n".join(rows))
    return [(prefix, "\n\n".join(lines)), *subs]


def _per_backend(values: dict[str, str], main: str) -> str:
    """The default backend's value, then the others' where they differ."""
    others = [f"{t}: {v}" for t, v in values.items() if v != values[main]]
    return values[main] + (f" ({'; '.join(others)})" if others else "")


def sections() -> list[tuple[str, str]]:
    """``(dotted section, its Markdown)`` in RunConfig's order; top-level keys last."""
    out: list[tuple[str, str]] = []
    top = []
    for name in RunConfig.__struct_fields__:
        tp = _hints(RunConfig)[name]
        members = _section_types(tp)
        doc = _field_doc(RunConfig, name)
        if len(members) == 1:
            _section(name, members[0], out, doc)
        elif members:
            out.extend(_union(name, members, doc))
        else:
            top.append(_row(name, tp, _value(_default(RunConfig, name)), doc))
    out.append(("(top level)", "## Top-level keys\n\n" + _TABLE + "\n" + "\n".join(top)))
    return out


def render(section: str = "") -> str:
    """The reference as Markdown: the whole page, or the sections under ``section``."""
    chosen = [
        t for k, t in sections() if not section or k == section or k.startswith(section + ".")
    ]
    if section:
        return "\n\n".join(chosen) + "\n"
    return HEADER + "\n" + "\n\n".join(chosen) + "\n"


def undocumented() -> list[str]:
    """Dotted keys of fields that have no docstring (none should)."""
    missing = []

    def walk(prefix: str, cls: type[msgspec.Struct]) -> None:
        for name in cls.__struct_fields__:
            key = f"{prefix}{name}"
            members = _section_types(_hints(cls)[name])
            if not _field_doc(cls, name):
                missing.append(key)
            for m in members:
                walk(f"{key}.", m)

    walk("", RunConfig)
    return sorted(set(missing))
