"""The SGLang server command line, judged by each covered version's own code.

``tests/engines/rollout/sglang/launch_args.py`` runs with SGLang V's source and
dist-info first on the path (scripts/setup.sh unpacks both): asyncrl's launcher
picks the entry point from V's metadata, and V's ``ServerArgs.add_cli_args``
parser (the one ``prepare_server_args`` builds, srt/server_args.py) parses the
flags. Without SGLang: the start-timeout and dtype rules, and the entry-point
choice when no SGLang is installed here.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any

import pytest

from asyncrl.config import LocalRolloutConfig, LoraConfig, SGLangRolloutConfig
from asyncrl.engines.rollout.launcher import engine_spec, launch_command, startup_timeout
from asyncrl.engines.rollout.sglang.launcher import SGLANG_CLI, sglang_dtype, sglang_entry_point
from tests.engines.rollout.sglang.code import VERSIONS, sglang_src
from tests.engines.rollout.sglang.forks import probe

ROLLOUT = {
    "backend": "sglang",
    "tp_size": 2,
    "mem_fraction_static": 0.8,
    "extra_args": ["--skip-tokenizer-init"],
}
KEY = "-k3y-of-the-run-0123456789abcdefghij"  # a leading "-", as 1 in 64 run secrets has


def _judge(version: str, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    sglang_src(version)
    return list(probe(version, "tests.engines.rollout.sglang.launch_args", {"cases": cases}))


def _bf16_model(tmp: Path) -> Path:
    folder = tmp / "bf16"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    return folder


@pytest.mark.parametrize("version", VERSIONS)
def test_command_line_parses_with_sglangs_parser(
    version: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    model = str(tiny_model_dir)
    cases = [
        {"rollout": ROLLOUT, "model_path": model, "i": 1},
        {"rollout": {**ROLLOUT, "sglang_entrypoint": "launch_server"}, "model_path": model},
        {"rollout": {"backend": "sglang"}, "model_path": str(_bf16_model(tmp_path))},
        {"rollout": {"backend": "sglang", "dtype": "float32"}, "model_path": model},
        {"rollout": {"backend": "sglang", "extra_args": ["--no-such-flag"]}, "model_path": model},
        {"rollout": {"backend": "sglang"}, "model_path": model, "lora": {"rank": 8}, "capacity": 2},
    ]
    serve, module, bf16, fp32, bad, lora = _judge(version, [{**c, "api_key": KEY} for c in cases])
    # the key reaches SGLang's argv in memory, never the command line (entrypoints/keyed.py)
    assert serve["keyed"] and module["keyed"]
    assert not any(KEY in a for a in serve["cmdline"] + module["cmdline"])
    assert serve["args"][-1] == f"--api-key={KEY}"
    # V's wheel declares the `sglang` console script (entry_points.txt) and ships cli/serve.py
    # (cli/main.py dispatches `serve` to it): asyncrl starts `sglang serve`
    assert serve["entry"]["kind"] == "script", serve["entry"]
    assert serve["entry"]["target"] == SGLANG_CLI and serve["entry"]["callable"]
    assert serve["entry"]["sub"] == "serve" and serve["args"][2] == "serve"
    # the fallback every version has: python -m sglang.launch_server, same flags
    assert module["entry"] == {"kind": "module", "module": "sglang.launch_server", "found": True}
    assert module["flags"][:10] == serve["flags"][:10]  # model, tp, host, port, mem fraction
    p = serve["parsed"]
    if p is None:  # V's parser module does not import on this machine
        assert version == "0.5.10" and "torchvision" in serve["error"], serve
        pytest.skip(
            "SGLang 0.5.10's srt/server_args.py imports srt/utils/common.py, whose line 90 "
            "imports torchvision (its PyPI build does not load beside a CPU torch): the entry "
            "point is checked, the flags cannot be parsed by 0.5.10's parser here"
        )
    assert isinstance(p, dict), p
    assert p["model_path"] == model and p["tp_size"] == 2 and p["mem_fraction_static"] == 0.8
    assert p["host"] == "127.0.0.1" and p["port"] == 30000
    assert p["dtype"] == "bfloat16"  # the tiny model is stored in float32
    assert p["random_seed"] == 1001 and p["base_gpu_id"] == 2 and p["skip_tokenizer_init"] is True
    assert p["api_key"] == KEY and module["parsed"]["api_key"] == KEY  # server_args.py:4435
    assert isinstance(module["parsed"], dict) and module["parsed"]["tp_size"] == 2
    assert bf16["parsed"]["dtype"] == "auto"  # stored in bf16: SGLang's auto keeps it
    assert fp32["parsed"]["dtype"] == "float32"
    assert isinstance(bad["parsed"], str) and "--no-such-flag" in bad["parsed"], bad["parsed"]
    lp = lora["parsed"]  # a LoRA run: no adapter at start, room for 2 versions + the base model
    assert lp["enable_lora"] is True and lp["max_lora_rank"] == 8 and lp["lora_paths"] is None
    assert lp["lora_target_modules"] == list(LoraConfig().target_modules)
    assert lp["max_loras_per_batch"] == 3 and lp["max_loaded_loras"] is None


def test_entry_point_without_sglang_installed_here() -> None:
    """No SGLang distribution in this environment (the test venv): the module form, which
    every version has; ``serve`` forced: SGLang's console-script target."""
    try:
        importlib.metadata.distribution("sglang")
        pytest.skip("SGLang is installed in this environment")
    except importlib.metadata.PackageNotFoundError:
        pass
    assert sglang_entry_point("auto") == ()
    assert sglang_entry_point("launch_server") == ()
    assert sglang_entry_point("serve") == (SGLANG_CLI, "serve")
    spec = engine_spec(SGLangRolloutConfig(sglang_entrypoint="serve"), "/m", 0, port=1)
    cmdline = launch_command(spec)
    assert cmdline[:4] == ["-m", "asyncrl.entrypoints.keyed", "--api-key", "--"]
    args = cmdline[4:]
    assert args[:3] == [
        "-c",
        "import sys; from sglang.cli.main import main; sys.exit(main())",
        "serve",
    ]
    assert args[3:7] == ["--model-path", "/m", "--tp-size", "1"]


def test_dtype_default(tiny_model_dir: Path, tmp_path: Path) -> None:
    rc = SGLangRolloutConfig()
    assert sglang_dtype(rc, str(tiny_model_dir)) == "bfloat16"  # stored in float32
    assert sglang_dtype(rc, str(_bf16_model(tmp_path))) == "auto"
    assert sglang_dtype(rc, "Qwen/Qwen2-7B") == "bfloat16"  # not a folder: dtype unknown
    assert sglang_dtype(SGLangRolloutConfig(dtype="float16"), "/x") == "float16"
    local = engine_spec(LocalRolloutConfig(), str(tiny_model_dir), 0, "float32", port=1)
    assert local.extra_args[:4] == ("--device", "cpu", "--dtype", "float32")  # model.dtype


def test_start_timeout_scales_with_the_model(tmp_path: Path) -> None:
    big = tmp_path / "big"
    big.mkdir()
    for k in range(2):  # 2 x 7 GiB of weights (sparse: no disk used), a 7B model in bf16
        with open(big / f"model-{k}.safetensors", "wb") as f:
            os.truncate(f.fileno(), 7 << 30)
    (big / "tokenizer.json").write_text("{}")  # not weights
    sg = SGLangRolloutConfig()
    assert startup_timeout(sg, str(big)) == pytest.approx(300 + 20 * 14)
    assert startup_timeout(sg, "Qwen/Qwen2-7B") == 900  # nothing found here
    assert startup_timeout(LocalRolloutConfig(), str(big)) == 120  # the embedded engine
    assert startup_timeout(SGLangRolloutConfig(startup_timeout_s=42), str(big)) == 42
    with pytest.raises(ValueError, match=r"rollout\.startup_timeout_s"):
        from asyncrl.config import load_config

        load_config(None, ["--rollout.startup_timeout_s=-1"])
