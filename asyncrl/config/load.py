"""TOML files, recorded config.json trees and dotted CLI overrides into a :class:`RunConfig`."""

from __future__ import annotations

import copy
import difflib
import json
import typing
from functools import cache
from pathlib import Path
from typing import Any, Literal

import msgspec

from asyncrl.config.base import _hints, _limit_message, _section_types
from asyncrl.config.run import RunConfig

_RETIRED = {
    "controller.pause_mode": "rollout.pause_mode (one knob for the run's pushes and "
    "Controller.weight_update; pass mode='wait' to Controller.weight_update for a drain)",
    "algo.behav_mask_low": "algo.behav_mis_low or algo.behav_icepop_low (one band per correction)",
    "algo.behav_mask_high": "algo.behav_mis_high or algo.behav_icepop_high (one band per "
    "correction)",
}
"""Keys of earlier versions -> where they went: named when given, dropped from a recorded
config.json (``--resume`` of a run made by an earlier version)."""


def _tag(cls: type[msgspec.Struct]) -> Any:
    return cls.__struct_config__.tag


def _tag_field(types: tuple[type[msgspec.Struct], ...]) -> str:
    """The key that chooses a tagged union's member: ``backend`` (rollout, weights) or
    ``name`` (task)."""
    return str(types[0].__struct_config__.tag_field)


@cache
def _default_variant(field: str) -> type[msgspec.Struct]:
    """The member of the tagged union ``RunConfig.<field>`` used when its tag is omitted."""
    return type(getattr(RunConfig(), field))


def _variant(tp: Any, node: Any, field: str) -> type[msgspec.Struct] | None:
    """The section type a value of type ``tp`` (the field ``field``) decodes to, ``node`` being
    its tree: a tagged union's member named by the tree's tag (or the default one)."""
    types = _section_types(tp)
    if len(types) <= 1:
        return types[0] if types else None
    tag = node.get(_tag_field(types)) if isinstance(node, dict) else None
    chosen = [t for t in types if _tag(t) == tag]
    return chosen[0] if chosen else _default_variant(field)


def _walk(tree: dict[str, Any], path: list[str]) -> tuple[Any, type[msgspec.Struct] | None]:
    """(the type at ``path``, or None when the path leaves the config; the section type holding
    its last key). A tagged union resolves to the member the tree chooses."""
    tp: Any = RunConfig
    node: Any = tree
    parent: type[msgspec.Struct] | None = None
    for i, part in enumerate(path):
        parent = _variant(tp, node, path[i - 1] if i else "")
        if parent is None or part not in parent.__struct_fields__:
            return None, parent
        tp = _hints(parent)[part]
        node = node.get(part) if isinstance(node, dict) else None
    return tp, parent


def _allowed(tree: dict[str, Any], path: list[str]) -> str:
    """Describe the allowed values (or keys) at a dotted path of RunConfig."""
    tp, parent = _walk(tree, path)
    if tp is None:
        if parent is not None and path[-1] == parent.__struct_config__.tag_field:  # the tag
            union = _section_types(_hints(RunConfig)[path[0]])
            return "allowed values: " + ", ".join(repr(_tag(t)) for t in union)
        if parent is not None and len(path) > 0:
            return "allowed keys: " + ", ".join(_keys(parent))
        return ""
    if typing.get_origin(tp) is Literal:
        return "allowed values: " + ", ".join(repr(a) for a in typing.get_args(tp))
    types = _section_types(tp)
    if len(types) == 1:
        return "allowed keys: " + ", ".join(_keys(types[0]))
    return ""


def _keys(cls: type[msgspec.Struct]) -> tuple[str, ...]:
    tag = cls.__struct_config__.tag_field
    return ((tag,) if tag else ()) + cls.__struct_fields__


def _backend_error(tree: dict[str, Any], path: list[str]) -> str | None:
    """``weights.ipc_copy='foreach' applies to weights.backend = 'cuda-ipc' only; ...``
    (``task.path='f' applies to task.name = 'math' | 'agent' only; ...``): the unknown key
    ``path`` is an option of other members of its tagged union."""
    if len(path) != 2:
        return None
    section, name = path
    types = _section_types(_hints(RunConfig).get(section))
    owners = [repr(_tag(t)) for t in types if name in t.__struct_fields__]
    if len(types) < 2 or not owners:
        return None
    node = tree.get(section, {})
    value, chosen = node.get(name), _variant(_hints(RunConfig)[section], node, section)
    tag = f"{section}.{_tag_field(types)}"
    return (
        f"{section}.{name}={value!r} applies to {tag} = {' | '.join(owners)} only; "
        f"this run has {tag}={_tag(chosen) if chosen else None!r}"
    )


def _fill_backends(tree: dict[str, Any]) -> None:
    """A tagged-union section given without its tag is the default member's."""
    for name, hint in _hints(RunConfig).items():
        node, types = tree.get(name), _section_types(hint)
        if len(types) > 1 and isinstance(node, dict) and _tag_field(types) not in node:
            tree[name] = {_tag_field(types): _tag(_default_variant(name)), **node}


def _drop_recorded_extras(tree: dict[str, Any], given: set[str]) -> None:
    """A recorded config.json (``base``) keeps what still applies: the options of the backend
    now chosen (an override may switch it) and no retired key; keys the user gives are kept
    (and judged)."""
    for key in _RETIRED:
        section, _, name = key.partition(".")
        if key not in given and isinstance(tree.get(section), dict):
            tree[section].pop(name, None)
    for name, hint in _hints(RunConfig).items():
        node = tree.get(name)
        if len(_section_types(hint)) < 2 or not isinstance(node, dict):
            continue
        chosen = _variant(hint, node, name)
        assert chosen is not None
        for key in [k for k in node if k not in _keys(chosen) and f"{name}.{k}" not in given]:
            del node[key]


def _lookup(tree: Any, path: list[str]) -> Any:
    for part in path:
        if isinstance(tree, dict):
            tree = tree.get(part)
        elif isinstance(tree, list | tuple) and part.isdigit() and int(part) < len(tree):
            tree = tree[int(part)]
        else:
            return None
    return tree


def _parse_value(text: str) -> Any:
    """CLI values: JSON when they parse as JSON (numbers, bools, lists), else the raw string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _as_list_if_listed(tree: dict[str, Any], key: str, value: Any) -> Any:
    """A plain string given for a list-valued key (``--rollout.urls=http://a:1,http://b:2``)
    is its comma-separated items; anything else (JSON lists too) is kept."""
    if not isinstance(value, str):
        return value
    tp, _ = _walk(tree, key.split("."))  # None: msgspec names the unknown key
    if typing.get_origin(tp) in (tuple, list):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            node[part] = child = {}
        if not isinstance(child, dict):
            raise ValueError(f"--{'.'.join(parts[: i + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


def workload_defaults(tree: dict[str, Any]) -> dict[str, Any]:
    """The defaults the task ``tree`` chooses (``task.name``) changes in other sections, as
    dotted keys -> values (:meth:`~asyncrl.config.task.LongTailTaskConfig.defaults`): empty
    for most tasks, and for an unknown ``task.name`` (refused when the tree decodes)."""
    task = tree.get("task")
    name = task.get("name") if isinstance(task, dict) else None
    types = _section_types(_hints(RunConfig)["task"])
    chosen = (
        [t for t in types if _tag(t) == name] if name is not None else [_default_variant("task")]
    )
    return chosen[0].defaults(tree) if chosen else {}  # type: ignore[attr-defined]


def _apply_workload_defaults(tree: dict[str, Any]) -> None:
    """Set :func:`workload_defaults` in ``tree`` where the tree gives no value."""
    for key, value in workload_defaults(tree).items():
        if _lookup(tree, key.split(".")) is None:
            _set_dotted(tree, key, value)


def _convert(tree: dict[str, Any]) -> RunConfig:
    _apply_workload_defaults(tree)
    _fill_backends(tree)
    try:
        return msgspec.convert(tree, RunConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ValueError(_error_line(tree, str(exc))) from None


def _error_line(tree: dict[str, Any], msg: str) -> str:
    """msgspec's ``... - at `$.section.key``` as one line that starts with the dotted key."""
    own = msg.split(" - at `$", 1)[0]
    if own.split(".", 1)[0] in RunConfig.__struct_fields__:  # a check of ours names its key
        return own
    path: list[str] = []
    if "at `$." in msg:
        dotted = msg.rsplit("at `$.", 1)[1].rstrip("`")
        path = [p for p in dotted.replace("[", ".").replace("]", "").split(".") if p]
    if "unknown field" in msg:
        path = [*path, msg.split("`")[1]]
        key = ".".join(path)
        if key in _RETIRED:
            return f"{key} is now {_RETIRED[key]}"
        line = _backend_error(tree, path) or _invalid(tree, path, msg)
        return line.replace(": ", f"{_did_you_mean(tree, path)}: ", 1)
    if own.startswith("Expected `") and "` " in own:  # a declared limit: "Expected `int` >= 1"
        tp, _ = _walk(tree, [p for p in path if not p.isdigit()])
        return _limit_message(_dotted(path), _lookup(tree, path), tp)
    return _invalid(tree, path, msg)


def _did_you_mean(tree: dict[str, Any], path: list[str]) -> str:
    """`` (did you mean controller.batch_size?)`` for an unknown key close to a known one."""
    _, parent = _walk(tree, path)
    keys = _keys(parent) if parent is not None else tuple(RunConfig.__struct_fields__)
    close = difflib.get_close_matches(path[-1], keys, n=1, cutoff=0.6)
    return f" (did you mean {_dotted([*path[:-1], close[0]])}?)" if close else ""


def _dotted(path: list[str]) -> str:
    """``["trainer", "adam_betas", "0"]`` -> ``trainer.adam_betas[0]``."""
    return "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in path).lstrip(".")


def _invalid(tree: dict[str, Any], path: list[str], msg: str) -> str:
    hint = _allowed(tree, path)
    return f"invalid config key {_dotted(path) or '<root>'}: {msg}" + (f" ({hint})" if hint else "")


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    base: dict[str, Any] | None = None,
) -> RunConfig:
    """Build a RunConfig from an optional TOML file (or a ``base`` tree, e.g. a run's
    config.json) and ``section.key=value`` overrides.

    Raises ValueError naming the offending key for unknown keys, wrong types,
    out-of-range values, disallowed choices and options of another backend.
    """
    tree: dict[str, Any] = copy.deepcopy(base or {})
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file not found: {p}")
        try:
            tree = msgspec.toml.decode(p.read_bytes())
        except msgspec.DecodeError as exc:
            raise ValueError(f"{p}: not valid TOML: {exc}") from None
    given: set[str] = set()
    for item in overrides or []:
        key, sep, value = item.removeprefix("--").partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} must look like --section.key=value")
        _set_dotted(tree, key, _as_list_if_listed(tree, key, _parse_value(value)))
        given.add(key)
    if base is not None:
        _drop_recorded_extras(tree, given)
    return _convert(tree)


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    """Plain JSON-able dict of a config as the run uses it (config.json in the run folder):
    ``backend`` is written in the ``weights`` and ``rollout`` sections (``name`` in ``task``),
    and what the run derives from other keys is recorded as it holds: ``gateway.enabled`` is
    true for a task that serves the gateway (``task.name = "agent"``)."""
    tree = msgspec.to_builtins(cfg)
    if cfg.task.serves_gateway:
        tree["gateway"]["enabled"] = True
    return tree
