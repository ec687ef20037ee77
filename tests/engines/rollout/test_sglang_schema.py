"""Every request the SGLang client sends, checked against SGLang's own request schema.

The schema below is written down, as data, from SGLang's
``python/sglang/srt/managers/io_struct.py`` (``GenerateReqInput`` and the
``BaseReq`` request structs) and ``python/sglang/srt/sampling/sampling_params.py``
(``SamplingParams``). A field the client sends that SGLang does not define, a
wrong JSON type, a missing required field or a wrong HTTP method fails here —
so a drift from the real protocol fails a test even though SGLang cannot be
installed on this machine.
"""

from __future__ import annotations

import contextlib
from typing import Any

from asyncrl.engines.rollout.base import EngineError
from asyncrl.engines.rollout.launcher import LaunchedServer
from asyncrl.engines.rollout.sglang import SGLangClient

# Fields every BaseReq subclass has (io_struct.py: class BaseReq).
BASE_REQ = {"rid": "optional[str]", "http_worker_ipc": "optional[str]"}

# endpoint -> (HTTP methods SGLang serves, io_struct class, {field: type}, required fields)
SCHEMA: dict[str, tuple[set[str], str, dict[str, str], set[str]]] = {
    "/generate": (
        {"POST", "PUT"},
        "GenerateReqInput",
        {
            "rid": "optional[str|list[str]]",
            "text": "optional[str|list[str]]",
            "input_ids": "optional[list[int]|list[list[int]]]",
            "sampling_params": "optional[dict|list[dict]]",
            "return_logprob": "optional[bool|list[bool]]",
            "logprob_start_len": "optional[int|list[int]]",
            "top_logprobs_num": "optional[int|list[int]]",
            "return_text_in_logprobs": "bool",
            "stream": "bool",
            "session_params": "optional[dict]",
            "priority": "optional[int]",
        },
        set(),
    ),
    "/abort_request": (
        {"POST"},
        "AbortReq",
        {
            **BASE_REQ,
            "abort_all": "bool",
            "finished_reason": "optional[dict]",
            "abort_message": "optional[str]",
        },
        set(),
    ),
    "/pause_generation": ({"POST"}, "PauseGenerationReqInput", {**BASE_REQ, "mode": "mode"}, set()),
    "/continue_generation": (
        {"POST"},
        "ContinueGenerationReqInput",
        {**BASE_REQ, "torch_empty_cache": "bool"},
        set(),
    ),
    "/flush_cache": (
        {"GET", "POST"},
        "FlushCacheReqInput",
        {**BASE_REQ, "timeout_s": "optional[float]"},
        set(),
    ),
    "/init_weights_update_group": (
        {"POST"},
        "InitWeightsUpdateGroupReqInput",
        {
            **BASE_REQ,
            "master_address": "str",
            "master_port": "int",
            "rank_offset": "int",
            "world_size": "int",
            "group_name": "str",
            "backend": "str",
        },
        {"master_address", "master_port", "rank_offset", "world_size"},
    ),
    "/update_weights_from_distributed": (
        {"POST"},
        "UpdateWeightsFromDistributedReqInput",
        {
            **BASE_REQ,
            "names": "list[str]",
            "dtypes": "list[str]",
            "shapes": "list[list[int]]",
            "group_name": "str",
            "flush_cache": "bool",
            "abort_all_requests": "bool",
            "weight_version": "optional[str]",
            "load_format": "optional[str]",
            "torch_empty_cache": "bool",
        },
        {"names", "dtypes", "shapes"},
    ),
    "/update_weights_from_tensor": (
        {"POST"},
        "UpdateWeightsFromTensorReqInput",
        {
            **BASE_REQ,
            "serialized_named_tensors": "list[str]",  # base64 over HTTP (Base64Bytes)
            "load_format": "optional[str]",
            "flush_cache": "bool",
            "abort_all_requests": "bool",
            "weight_version": "optional[str]",
            "disable_draft_model": "optional[bool]",
            "torch_empty_cache": "bool",
        },
        {"serialized_named_tensors"},
    ),
    "/update_weight_version": (
        {"POST"},
        "UpdateWeightVersionReqInput",
        {**BASE_REQ, "new_version": "str", "abort_all_requests": "bool"},
        {"new_version"},
    ),
    # read routes: SGLang's, then the fallback a 404 sends the client to (the embedded engine)
    "/model_info": ({"GET"}, "(no body)", {}, set()),
    "/get_model_info": ({"GET"}, "(no body)", {}, set()),
    "/get_weight_version": ({"GET"}, "(no body)", {}, set()),
    "/server_info": ({"GET"}, "(no body)", {}, set()),
    "/get_server_info": ({"GET"}, "(no body)", {}, set()),
}

# sampling_params keys (sampling_params.py: SamplingParams API fields)
SAMPLING: dict[str, str] = {
    "max_new_tokens": "optional[int]",
    "stop": "optional[str|list[str]]",
    "stop_token_ids": "optional[list[int]]",
    "stop_regex": "optional[str|list[str]]",
    "temperature": "float",
    "top_p": "float",
    "top_k": "int",
    "min_p": "float",
    "frequency_penalty": "float",
    "presence_penalty": "float",
    "repetition_penalty": "float",
    "min_new_tokens": "int",
    "n": "int",
    "json_schema": "optional[str]",
    "regex": "optional[str]",
    "ebnf": "optional[str]",
    "structural_tag": "optional[str]",
    "ignore_eos": "bool",
    "skip_special_tokens": "bool",
    "spaces_between_special_tokens": "bool",
    "no_stop_trim": "bool",
    "custom_params": "optional[dict]",
    "stream_interval": "optional[int]",
    "logit_bias": "optional[dict]",
    "sampling_seed": "optional[int]",
}

PAUSE_MODES = ("abort", "retract", "in_place")  # PauseGenerationReqInput.mode: Literal[...]


def conforms(value: Any, spec: str) -> bool:
    """Does the JSON ``value`` match the type ``spec`` (msgspec-strict: bool is not int)?"""
    union = _split(spec)
    if len(union) > 1:
        return any(conforms(value, s) for s in union)
    if spec.startswith("optional[") and spec.endswith("]"):
        return value is None or conforms(value, spec[len("optional[") : -1])
    if spec.startswith("list[") and spec.endswith("]"):
        inner = spec[len("list[") : -1]
        return isinstance(value, list) and all(conforms(v, inner) for v in value)
    return {
        "str": lambda v: isinstance(v, str),
        "int": lambda v: type(v) is int,
        "float": lambda v: type(v) in (int, float),
        "bool": lambda v: type(v) is bool,
        "dict": lambda v: isinstance(v, dict),
        "mode": lambda v: v in PAUSE_MODES,
    }[spec](value)


def _split(spec: str) -> list[str]:
    """Split a union at top-level ``|`` (not inside brackets)."""
    parts, depth, cur = [], 0, ""
    for ch in spec:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "|" and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [*parts, cur]


def violations(method: str, path: str, body: dict[str, Any] | None) -> list[str]:
    """What is wrong with one request against SCHEMA (empty: conforms)."""
    if path not in SCHEMA:
        return [f"{path}: not an SGLang endpoint this schema knows"]
    methods, cls, fields, required = SCHEMA[path]
    out = [] if method in methods else [f"{path}: method {method} not in {sorted(methods)}"]
    body = body or {}
    for key, value in body.items():
        if key not in fields:
            out.append(f"{path}: {cls} has no field {key!r}")
        elif not conforms(value, fields[key]):
            out.append(f"{path}: {cls}.{key}={value!r} is not {fields[key]}")
    out += [f"{path}: {cls}.{k} is required" for k in sorted(required - set(body))]
    sps = body.get("sampling_params") if path == "/generate" else None
    for sp in [sps] if isinstance(sps, dict) else sps or []:  # one, or one per batch item
        for key, value in sp.items():
            if key not in SAMPLING:
                out.append(f"sampling_params has no field {key!r}")
            elif not conforms(value, SAMPLING[key]):
                out.append(f"sampling_params.{key}={value!r} is not {SAMPLING[key]}")
    return out


def test_checker_catches_drift() -> None:
    """The checker itself: it must reject what SGLang would reject."""
    assert violations("POST", "/generate", {"input_ids": [1, 2], "return_logprob": True}) == []
    assert violations("POST", "/generate", {"input_ids": ["1"]})
    assert violations("POST", "/generate", {"prompt_ids": [1]})
    assert violations("POST", "/generate", {"sampling_params": {"max_tokens": 3}})
    assert violations("POST", "/generate", {"sampling_params": {"top_k": True}})
    assert violations("POST", "/generate", {"sampling_params": [{"max_new_tokens": 1}, {"n": "2"}]})
    assert violations("GET", "/pause_generation", {"mode": "abort"})
    assert violations("POST", "/pause_generation", {"mode": "hold"})
    assert violations("POST", "/init_weights_update_group", {"master_address": "h"})
    assert violations("POST", "/update_weight_version", {"version": "1"})
    assert violations(
        "POST",
        "/update_weights_from_distributed",
        {"names": ["a"], "dtypes": ["f"], "shapes": [[1.5]]},
    )


async def test_every_request_the_client_sends_matches_sglang(
    engine_server: LaunchedServer, weight_pusher
) -> None:
    client = SGLangClient(engine_server.url, record=True)
    try:
        sp = {"max_new_tokens": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 5}
        await client.generate([1, 3, 4], {**sp, "stop_token_ids": [2], "ignore_eos": False})
        await client.generate([1, 3], {"max_new_tokens": 2}, rid="r1")
        batch = [{"max_new_tokens": 2}, {"max_new_tokens": 3, "temperature": 0}]
        await client.generate_batch([[1, 3, 4], [1, 3, 4]], batch, ["b1", "b2"])
        await client.abort_request("r1")
        await client.abort_request(abort_all=True)
        for mode in PAUSE_MODES:
            await client.pause_generation(mode)
            await client.continue_generation()
        await client.flush_cache()
        await weight_pusher.connect(client, "schema_group")
        await weight_pusher.push(client, weight_pusher.original, "3")
        with contextlib.suppress(EngineError):  # the payload is not a real tensor handle
            await client.update_weights_from_tensor(["aGVsbG8="], "flattened_bucket", True, "3")
        await client.update_weight_version("4")
        assert await client.get_weight_version() == "4"
        assert await client.health()
        assert (await client.get_server_info())["weight_version"] == "4"
        await client.update_weight_version("0")
    finally:
        await client.close()
    assert client.sent is not None
    sent_paths = {path for _, path, _ in client.sent}
    assert sent_paths == set(SCHEMA), f"not exercised: {set(SCHEMA) - sent_paths}"
    problems = [p for method, path, body in client.sent for p in violations(method, path, body)]
    assert problems == []
    for _, path, body in client.sent:
        if path in ("/update_weight_version", "/update_weights_from_distributed"):
            assert body is not None and body["abort_all_requests"] is False
        if path == "/update_weights_from_distributed":
            assert body is not None and body["load_format"] == "flattened_bucket"
