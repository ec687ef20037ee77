"""Check asyncrl's requests and SGLang-shaped answers against one SGLang version's own code.

Run as ``python -m tests.engines.rollout.sglang.wire_schema`` with that version's
source first on ``PYTHONPATH`` (``code.sglang_env``); reads JSON from stdin:
``{"requests": [[method, path, body], ...], "answers": [[path, answer], ...]}``
(what :class:`~asyncrl.engines.rollout.sglang.client.SGLangClient` sent and got with
``record=True``), writes one JSON report to stdout. Nothing here restates
SGLang's schema: every judgment is SGLang's.

- Routes: the decorators of ``srt/entrypoints/http_server.py`` read with ``ast``
  (``@app.get/post/put(path)``, ``@app.api_route(path, methods=[...])``; the file
  cannot be imported here: FastAPI, uvicorn and the GPU stack are not installed).
  Each route's body class is its handler's first parameter annotation
  (``obj: GenerateReqInput`` or ``obj: Annotated[X, Body()]``); a handler without
  one takes no body.
- Bodies: parsed into that class from ``srt/managers/io_struct.py`` (see
  :func:`load_io_struct` for how it loads here) by pydantic's
  ``TypeAdapter(cls).validate_python`` -- what FastAPI does with a dataclass body
  parameter, and what SGLang's own ``__get_pydantic_core_schema__`` hook serves
  for its msgspec request structs (0.5.22+). Keys the class does not define are
  reported (FastAPI drops them). ``/generate`` bodies then go through
  ``GenerateReqInput.normalize_batch_and_arguments()`` (the tokenizer manager's
  first step), each ``sampling_params`` dict through SGLang's ``SamplingParams``
  (constructor, ``normalize``, ``verify``), and, where the version has it, the HTTP
  contract gate ``srt/entrypoints/api_contract.generate_contract_error`` (0.5.22+).
- Answers: where the version ships its API types (``sglang/api/v1/api_types.py``,
  0.5.22+), ``/generate``, ``/model_info`` and ``/server_info`` answers are decoded
  by ``GenerateResponse`` / ``GetModelInfoResponse`` / ``GetServerInfoResponse``,
  and asyncrl's parse of each ``/generate`` answer must not change when the answer
  is first narrowed to SGLang's contract (``from_json_value(...).to_json_value()``):
  asyncrl reads nothing SGLang does not promise. Per-token versions are checked on
  a response built from SGLang's own ``WeightVersionSpan`` type (0.5.23+). Before 0.5.22:
  the keys asyncrl reads are looked up among the string constants of the code that
  builds them (``tokenizer_manager.py`` for ``meta_info``, the ``/model_info``
  handler, ``ServerArgs`` fields for ``/server_info``), read with ``ast``.

torchvision's PyPI build does not load beside a CPU torch ("operator torchvision::nms
does not exist"), and ``io_struct.py`` reaches it in every covered version. Its classes
are then built by its own statements (:func:`load_io_struct`); the one that cannot be
used, ``GenerateReqInput`` (it needs ``schedule_batch`` names), is reported as left out
(``cls_left_out``), and ``/generate`` bodies are judged by its field names read from
its source, by ``SamplingParams`` and, 0.5.22+, by the contract gate.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import json
import sys
import types
from pathlib import Path
from typing import Any

READ_META = ("output_token_logprobs", "finish_reason", "weight_version", "prompt_tokens")


def routes(http_server: Path) -> dict[str, dict[str, Any]]:
    """path -> {"methods", "cls" (None: no body), "line"} from the module's decorators."""
    out: dict[str, dict[str, Any]] = {}
    for node in ast.walk(ast.parse(http_server.read_text())):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for dec in node.decorator_list:
            got = _route_of(dec)
            if got is None:
                continue
            path, methods = got
            entry = out.setdefault(path, {"methods": [], "cls": _body_class(node)})
            entry["methods"] = sorted({*entry["methods"], *methods})
            entry.setdefault("line", node.lineno)
    return out


def _route_of(dec: ast.expr) -> tuple[str, list[str]] | None:
    if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)):
        return None
    if not (isinstance(dec.func.value, ast.Name) and dec.func.value.id == "app"):
        return None
    kind = dec.func.attr
    if not dec.args or not isinstance(dec.args[0], ast.Constant):
        return None  # a path from the environment (e.g. the Vertex route): not ours
    path = dec.args[0].value
    if kind in ("get", "post", "put", "delete"):
        return path, [kind.upper()]
    if kind == "api_route":
        for kw in dec.keywords:
            if kw.arg == "methods" and isinstance(kw.value, ast.List):
                return path, [str(e.value) for e in kw.value.elts if isinstance(e, ast.Constant)]
        return path, ["GET"]
    return None


def _body_class(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    for arg in fn.args.args:
        ann = arg.annotation
        if isinstance(ann, ast.Subscript) and getattr(ann.value, "id", "") == "Annotated":
            elts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
            ann = elts[0]
        if isinstance(ann, ast.Name) and ann.id.endswith(("ReqInput", "Req", "Input")):
            return ann.id
    return None


def load_io_struct(src: Path) -> tuple[Any, list[str]]:
    """SGLang's ``srt/managers/io_struct.py``: imported, or, where its imports reach a
    module that cannot load here (``schedule_batch`` -> model configs -> torchvision in
    0.5.22/0.5.23; ``srt/utils/common.py:90`` -> torchvision in 0.5.10), its own top-level
    statements run one by one, unchanged, in a module of that name, the ones that fail
    (those imports, and what needs their names) left out and listed."""
    name = "sglang.srt.managers.io_struct"
    try:
        return importlib.import_module(name), []
    except ImportError:
        pass
    path = src / "sglang" / "srt" / "managers" / "io_struct.py"
    module = types.ModuleType(name)
    module.__file__ = str(path)
    sys.modules[name] = module
    left_out = []
    for node in ast.parse(path.read_text()).body:
        try:
            exec(compile(ast.Module([node], []), str(path), "exec"), module.__dict__)
        except Exception as exc:  # an import that cannot load here, or a name it defines
            what = getattr(node, "name", type(node).__name__)
            left_out.append(f"io_struct.py:{node.lineno} {what}: {type(exc).__name__}: {exc}")
    return module, left_out


def _source_fields(path: str, name: str) -> set[str]:
    """The fields class ``name`` declares in ``path`` (read with ``ast``), its bases' too."""
    classes = {
        n.name: n for n in ast.parse(Path(path).read_text()).body if isinstance(n, ast.ClassDef)
    }
    out: set[str] = set()
    todo = [name]
    while todo:
        node = classes.get(todo.pop())
        if node is None:
            continue
        out |= {
            n.target.id
            for n in node.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
        }
        todo += [b.id for b in node.bases if isinstance(b, ast.Name)]
    return out


def _fields(cls: type) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    import msgspec

    return {f.name for f in msgspec.structs.fields(cls)}


def check_request(
    method: str, path: str, body: Any, table: dict[str, dict[str, Any]], io: Any
) -> dict[str, Any]:
    """One request judged by SGLang's code (see the module docstring)."""
    from pydantic import PydanticUserError, TypeAdapter

    route = table.get(path)
    if route is None:
        return {"path": path, "route": False}
    got: dict[str, Any] = {"path": path, "route": True, "line": route["line"], "problems": []}
    if method not in route["methods"]:
        got["problems"].append(f"{method} {path}: SGLang serves {route['methods']}")
    name = route["cls"]
    got["cls"] = name
    if name is None:
        if body:
            got["problems"].append(f"{path} takes no body, got {sorted(body)}")
        return got
    cls = getattr(io, name, None)
    why = f"{name} not defined (see io_struct_left_out)"
    obj: Any = None
    if cls is not None:
        try:
            obj = TypeAdapter(cls).validate_python(body if body is not None else {})
        except PydanticUserError as exc:  # its annotations name what could not load here
            why = str(exc).splitlines()[0]
        except Exception as exc:  # pydantic's ValidationError, or a hook's own error
            got["problems"].append(f"{name}: {type(exc).__name__}: {exc}")
            return got
    if obj is None and name == "GenerateReqInput":  # see load_io_struct
        got["cls_left_out"] = why
        got["ignored"] = sorted(set(body or {}) - _source_fields(io.__file__, name))
        got["problems"] += _check_sampling(body) + _check_contract(body)
        return got
    if obj is None:
        got["problems"].append(f"could not be loaded from io_struct.py here: {why}")
        return got
    got["ignored"] = sorted(set(body or {}) - _fields(cls))
    if path == "/generate":
        got["problems"] += _check_generate(obj, body)
    return got


def _check_generate(obj: Any, body: dict[str, Any]) -> list[str]:
    out: list[str] = []
    try:
        obj.normalize_batch_and_arguments()
    except Exception as exc:  # SGLang raises ValueError (or others) on a bad shape
        out.append(f"GenerateReqInput.normalize_batch_and_arguments: {exc}")
    return out + _check_sampling(body) + _check_contract(body)


def _check_contract(body: dict[str, Any]) -> list[str]:
    """0.5.22+: the HTTP contract gate every ``/generate`` body passes first
    (``srt/entrypoints/api_contract.py``, called by ``generate_request`` in http_server.py)."""
    try:
        contract = importlib.import_module("sglang.srt.entrypoints.api_contract")
    except ImportError:  # before 0.5.22: no contract gate
        return []
    err = contract.generate_contract_error(json.loads(json.dumps(body)))
    return [] if err is None else [f"generate_contract_error: {err}"]


def _check_sampling(body: dict[str, Any]) -> list[str]:
    """Each ``sampling_params`` dict through SGLang's ``SamplingParams`` (unknown keys are a
    TypeError there), its ``normalize`` and ``verify``."""
    out: list[str] = []
    sp_mod = importlib.import_module("sglang.srt.sampling.sampling_params")
    sps = body.get("sampling_params") or {}
    for sp in [sps] if isinstance(sps, dict) else sps:
        try:
            params = sp_mod.SamplingParams(**sp)
            params.normalize(None)
            verify = params.verify
            n = len(inspect.signature(verify).parameters)
            verify(*([32000] * n))  # vocab_size (and max context, where asked)
        except Exception as exc:
            out.append(f"SamplingParams({sp}): {type(exc).__name__}: {exc}")
    return out


def check_answers(answers: list[list[Any]], src: Path) -> dict[str, Any]:
    """SGLang's API types decode the answers, and asyncrl reads only what they keep."""
    from asyncrl.engines.rollout.base import parse_sglang_generate

    try:
        api = importlib.import_module("sglang.api.v1.api_types")
    except ImportError:
        return {"api_types": False, "problems": _keys_in_source(src)}
    problems: list[str] = []
    types = {
        "/generate": api.GenerateResponse,
        "/model_info": api.GetModelInfoResponse,
        "/server_info": api.GetServerInfoResponse,
    }
    seen = set()
    for path, answer in answers:
        typ = types.get(path)
        if typ is None:
            continue
        seen.add(path)
        for one in answer if isinstance(answer, list) else [answer]:
            try:
                narrowed = typ.from_json_value(one).to_json_value()
            except Exception as exc:
                problems.append(f"{typ.__name__}: {type(exc).__name__}: {exc}")
                continue
            if path == "/generate":
                mine, theirs = parse_sglang_generate(one), parse_sglang_generate(narrowed)
                if mine != theirs:
                    problems.append(f"/generate read differs once narrowed: {mine} vs {theirs}")
    if not hasattr(api, "WeightVersionSpan"):  # 0.5.22: spans are not in its contract yet
        return {"api_types": True, "spans": False, "checked": sorted(seen), "problems": problems}
    spans = api.GenerateResponse(
        output_ids=[5, 6, 7, 8, 9],
        meta_info=api.GenerateMetaInfo(
            weight_version="4",
            output_token_logprobs=[api.LogprobEntry(logprob=-0.5, token_id=t) for t in range(5)],
            weight_versions=[
                api.WeightVersionSpan(version="3", start=0, end=2),
                api.WeightVersionSpan(version="4", start=2, end=5),
            ],
            finish_reason=api.FinishLength(length=5),
        ),
    ).to_json_value()
    got = parse_sglang_generate(spans)
    if got.token_versions() != [3, 3, 4, 4, 4] or got.finish_reason != "length":
        problems.append(f"spans {spans['meta_info']} read as {got}")
    return {"api_types": True, "spans": True, "checked": sorted(seen), "problems": problems}


def _keys_in_source(src: Path) -> list[str]:
    """Before SGLang's API types: the keys asyncrl reads, among the string constants of the
    code that builds them."""
    srt = src / "sglang" / "srt"
    tm = _constants(srt / "managers" / "tokenizer_manager.py")
    out = [
        f"meta_info key {k!r} not built by tokenizer_manager.py" for k in READ_META if k not in tm
    ]
    server = ast.parse((srt / "entrypoints" / "http_server.py").read_text())
    info = [
        n
        for n in ast.walk(server)
        if isinstance(n, ast.AsyncFunctionDef | ast.FunctionDef) and n.name == "model_info"
    ]
    if not info or "weight_version" not in _constants_of(info[0]):
        out.append("/model_info's handler builds no 'weight_version'")
    tree = ast.parse((srt / "server_args.py").read_text())  # imports torchvision in 0.5.10
    cls = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "ServerArgs"]
    fields = {
        n.target.id
        for n in (cls[0].body if cls else [])
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    if "tp_size" not in fields:  # /server_info is the server args (http_server.py)
        out.append("ServerArgs has no tp_size (read from /server_info)")
    return out


def _constants(path: Path) -> set[str]:
    return _constants_of(ast.parse(path.read_text()))


def _constants_of(tree: ast.AST) -> set[str]:
    return {
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


def main() -> None:
    """stdin to stdout; or ``IN OUT``: from and to those files (``forks.probe``)."""
    from tests.session_forks import as_imported

    as_imported()
    files = sys.argv[1:] if len(sys.argv) == 3 else None
    if files:
        with open(files[0]) as rx:
            got = json.load(rx)
    else:
        got = json.load(sys.stdin)
    import sglang

    src = Path(sglang.__file__).resolve().parents[1]
    table = routes(src / "sglang" / "srt" / "entrypoints" / "http_server.py")
    io, left_out = load_io_struct(src)
    report = {
        "io_struct_left_out": left_out,
        "contract_gate": importlib.util.find_spec("sglang.srt.entrypoints.api_contract")
        is not None,
        "routes": table,
        "requests": [check_request(m, p, b, table, io) for m, p, b in got["requests"]],
        "answers": check_answers(got["answers"], src),
    }
    if files:
        with open(files[1], "w") as tx:
            json.dump(report, tx)
    else:
        json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
