"""Parse the command line asyncrl builds for an SGLang server with that version's own parser.

Run as ``python -m tests.engines.rollout.sglang.launch_args`` with SGLang ``V``'s
source (and its dist-info, so ``importlib.metadata`` sees V's console scripts)
first on ``PYTHONPATH``; reads ``{"cases": [{"rollout": {...}, "model_path": P, "i": N}, ...]}``
(a case's optional ``lora`` section and ``capacity`` add the run's LoRA flags)
from stdin, writes one JSON report per case to stdout:

- ``args``: what :func:`asyncrl.engines.rollout.launcher.launch_command` builds
  here (the entry point chosen from V's metadata);
- ``entry``: for ``-c`` (``sglang serve``), whether the entry point it names
  imports and is callable in V (``sglang.cli.main:main``), and the flags after
  ``serve`` as V's ``cli/serve.py`` passes them on (its own argv filters, where
  the version has them); for ``-m``, whether the module exists in V;
- ``cmdline``: :func:`launch_command` itself (the process's command line, key-free) and
  ``keyed``: it starts the server through ``asyncrl.entrypoints.keyed``, whose
  :func:`keyed_argv` appends ``--api-key=<case's api_key>`` in memory (``args``);
- ``parsed``: V's ``ServerArgs.add_cli_args`` parser (as ``prepare_server_args``
  builds it, srt/server_args.py) applied to those flags: every destination's
  value, or the parser's error.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import json
import sys
from typing import Any

import msgspec

from asyncrl.config import LoraConfig, RolloutConfig
from asyncrl.engines.rollout.launcher import KEYED, engine_spec, launch_command
from asyncrl.engines.rollout.sglang.launcher import sglang_lora_args
from asyncrl.entrypoints.keyed import keyed_argv
from tests.session_forks import as_imported


def _entry(args: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Where the command line enters SGLang, and the server flags it passes on."""
    if args[0] == "-m":
        found = importlib.util.find_spec(args[1]) is not None
        return {"kind": "module", "module": args[1], "found": found}, args[2:]
    code, sub, flags = args[1], args[2], args[3:]
    target = code.split("from ", 1)[1].split(";", 1)[0]  # "MOD import FN"
    mod, fn = (x.strip() for x in target.split(" import "))
    main = getattr(importlib.import_module(mod), fn, None)
    info = {"kind": "script", "target": f"{mod}:{fn}", "callable": callable(main), "sub": sub}
    with contextlib.suppress(ImportError):  # cli/serve.py needs srt.utils (0.5.10: torchvision)
        serve = importlib.import_module("sglang.cli.serve")
        if hasattr(serve, "_extract_model_type_override"):
            info["model_type"], flags = serve._extract_model_type_override(flags)
        if hasattr(serve, "_normalize_positional_model_path"):
            flags, _ = serve._normalize_positional_model_path(flags)
        info["serve_filters"] = True
    return info, flags


def build_and_parse(case: dict[str, Any]) -> dict[str, Any]:
    """One case: asyncrl's command line for ``case`` and what V's parser makes of it."""
    rc = msgspec.convert(case["rollout"], RolloutConfig)
    lora = ()  # a LoRA run's flags (``lora``: the section, ``capacity``: its ring)
    if case.get("lora"):
        lora = sglang_lora_args(msgspec.convert(case["lora"], LoraConfig), case["capacity"])
    port = int(case.get("port", 30000))
    spec = engine_spec(rc, case["model_path"], case.get("i", 0), port=port, lora=lora)
    cmdline = launch_command(spec)  # what /proc/PID/cmdline shows: no key
    keyed = cmdline[:2] == ["-m", KEYED] and cmdline[3] == "--"
    args = cmdline
    if keyed:  # the server's argv as asyncrl.entrypoints.keyed sets it, key appended
        kind, target, argv = keyed_argv(cmdline[4:], cmdline[2], case["api_key"])
        args = [kind, target, *argv[1:]]
    entry, flags = _entry(args)
    built = {"args": args, "cmdline": cmdline, "keyed": keyed, "entry": entry, "flags": flags}
    try:
        from sglang.srt.server_args import ServerArgs
    except ImportError as exc:  # 0.5.10: srt/utils/common.py:90 imports torchvision
        return {**built, "parsed": None, "error": str(exc)}
    parser = argparse.ArgumentParser(prog="sglang serve")  # as prepare_server_args builds it
    ServerArgs.add_cli_args(parser)
    err = io.StringIO()
    parsed: dict[str, Any] | str
    try:
        with contextlib.redirect_stderr(err):
            ns = parser.parse_args(flags)
        parsed = {k: v for k, v in vars(ns).items() if _jsonable(v)}
    except SystemExit:
        parsed = err.getvalue()
    return {**built, "parsed": parsed}


def main() -> None:
    """stdin to stdout; or ``IN OUT``: from and to those files (``forks.probe``)."""
    as_imported()
    if len(sys.argv) == 3:
        with open(sys.argv[1]) as rx, open(sys.argv[2], "w") as tx:
            json.dump([build_and_parse(c) for c in json.load(rx)["cases"]], tx)
        return
    cases = json.load(sys.stdin)["cases"]
    json.dump([build_and_parse(c) for c in cases], sys.stdout)


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
    except TypeError:
        return False
    return True


if __name__ == "__main__":
    main()
