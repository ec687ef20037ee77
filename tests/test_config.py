"""Config: defaults, TOML, dotted overrides, and errors that name the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from asyncrl.config import (
    CollectiveWeightsConfig,
    ControllerConfig,
    CudaIpcWeightsConfig,
    GlooWeightsConfig,
    LocalRolloutConfig,
    RunConfig,
    SGLangRolloutConfig,
    TrainerConfig,
    load_config,
    to_dict,
)


def test_defaults_are_the_embedded_job() -> None:
    cfg = load_config()
    assert cfg == RunConfig()
    assert cfg.rollout.backend == "local" and cfg.controller.max_staleness == 1
    with pytest.raises(AttributeError):
        cfg.seed = 3  # type: ignore[misc]  # frozen


def test_each_backend_pauses_without_re_prefilling_where_it_can() -> None:
    """The embedded engine pauses in place and keeps its KV cache (docs/algorithms.md,
    "Pausing for an update"), vLLM keeps; SGLang aborts (per-token versions on every SGLang)."""
    local = load_config().rollout
    assert isinstance(local, LocalRolloutConfig)
    assert (local.pause_mode, local.kv_after_update) == ("in_place", "keep")
    assert load_config(None, ["--rollout.backend=sglang"]).rollout.pause_mode == "abort"
    assert load_config(None, ["--rollout.backend=vllm"]).rollout.pause_mode == "keep"
    cfg = load_config(None, ["--rollout.pause_mode=abort", "--rollout.kv_after_update=recompute"])
    assert (cfg.rollout.pause_mode, cfg.rollout.kv_after_update) == ("abort", "recompute")


def test_toml_then_overrides(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('seed = 7\n[controller]\nbatch_size = 4\n[rollout]\nurls = ["http://h:1"]\n')
    cfg = load_config(
        f, ["--controller.batch_size=2", "--weights.backend=gloo", "--algo.clip_eps=0.3"]
    )
    assert cfg.seed == 7
    assert cfg.controller.batch_size == 2
    assert cfg.weights.backend == "gloo"
    assert cfg.algo.clip_eps == 0.3
    assert cfg.rollout.urls == ("http://h:1",)
    assert msgspec.convert(msgspec.to_builtins(cfg), RunConfig) == cfg


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("--controller.nope=1", "controller.nope"),
        ("--weights.backend=tcp", "allowed values: 'auto', 'gloo', 'nccl', 'hccl', 'cuda-ipc'"),
        ("--controller.batch_size=many", "controller.batch_size"),
        ("--controller.batch_size=0", "controller.batch_size must be > 0, got 0"),
        ("--controller.max_staleness=-1", "controller.max_staleness"),
        ("--bogus.key=1", "allowed keys"),
        ("controller.batch_size", "--section.key=value"),
    ],
)
def test_errors_name_the_key(override: str, needle: str) -> None:
    with pytest.raises(ValueError, match=None) as info:
        load_config(None, [override])
    assert needle in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["--weights.ipc_copy=foreach"], "weights.ipc_copy='foreach' applies to weights.backend = "
         "'cuda-ipc' only; this run has weights.backend='auto'"),
        (["--weights.backend=gloo", "--weights.ipc_verify=true"], "'cuda-ipc' only"),
        (["--weights.backend=cuda-ipc", "--weights.delta=auto"],
         "weights.delta='auto' applies to weights.backend = 'auto' | 'gloo' | 'nccl' | 'hccl'"),
        (["--rollout.tp_size=2"],
         "rollout.tp_size=2 applies to rollout.backend = 'sglang' | 'vllm' only"),
        (["--rollout.backend=sglang", "--rollout.kv_after_update=keep"],
         "applies to rollout.backend = 'local' only; this run has rollout.backend='sglang'"),
    ],
)  # fmt: skip
def test_an_option_of_another_backend_is_refused(overrides: list[str], needle: str) -> None:
    """Not silently ignored: the message names the backend(s) the option belongs to."""
    with pytest.raises(ValueError) as info:
        load_config(None, overrides)
    assert needle in str(info.value)
    assert "invalid config key" not in str(info.value)  # one line, the key first


def test_options_of_the_chosen_backend_are_taken() -> None:
    cfg = load_config(None, ["--weights.backend=cuda-ipc", "--weights.ipc_copy=foreach"])
    assert cfg.weights.ipc_copy == "foreach"
    cfg = load_config(None, ["--rollout.backend=sglang", "--rollout.tp_size=2"])
    assert cfg.rollout.tp_size == 2
    cfg = load_config(None, ["--weights.backend=gloo", "--weights.delta=auto"])
    assert isinstance(cfg.weights, GlooWeightsConfig) and cfg.weights.delta == "auto"


def test_one_config_type_per_backend(tmp_path: Path) -> None:
    """The tag picks the type; omitting ``backend`` keeps the default one; config.json keeps
    the tag, so what a run records loads back as the same type."""
    cfg = load_config()
    assert isinstance(cfg.weights, CollectiveWeightsConfig) and cfg.weights.backend == "auto"
    assert isinstance(cfg.rollout, LocalRolloutConfig)
    f = tmp_path / "c.toml"
    f.write_text('[weights]\nbucket_mb = 64\n[rollout]\nbackend = "sglang"\ntp_size = 2\n')
    cfg = load_config(f)
    assert isinstance(cfg.weights, CollectiveWeightsConfig) and cfg.weights.backend == "auto"
    assert cfg.weights.bucket_mb == 64
    assert isinstance(cfg.rollout, SGLangRolloutConfig) and cfg.rollout.tp_size == 2
    cfg = load_config(None, ["--weights.backend=cuda-ipc", "--weights.ipc_verify=true"])
    assert isinstance(cfg.weights, CudaIpcWeightsConfig) and cfg.weights.ipc_verify
    tree = to_dict(cfg)
    assert tree["weights"]["backend"] == "cuda-ipc" and "verify" not in tree["weights"]
    assert load_config(None, [], base=tree) == cfg


def test_a_config_json_of_an_earlier_version_still_resumes() -> None:
    """Before one type per backend, config.json held every backend's options (the defaults of
    those not chosen) and ``controller.pause_mode``: they are dropped from a recorded base,
    also when an override switches the backend; given by the user they are judged."""
    old = to_dict(RunConfig())
    old["weights"].update(ipc_verify=False, ipc_copy="graph")
    old["rollout"].update(tp_size=1, dtype="auto", mem_fraction_static=0.0)
    old["controller"]["pause_mode"] = "abort"
    assert load_config(None, [], base=old) == RunConfig()
    cfg = load_config(None, ["--weights.backend=cuda-ipc"], base=old)
    assert isinstance(cfg.weights, CudaIpcWeightsConfig)
    with pytest.raises(ValueError, match=r"^controller\.pause_mode is now rollout\.pause_mode"):
        load_config(None, ["--controller.pause_mode=wait"])
    with pytest.raises(ValueError, match=r"^weights\.ipc_copy='foreach' applies to"):
        load_config(None, ["--weights.ipc_copy=foreach"], base=old)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--trainer.adam_betas=[0.9, 1.0]", "trainer.adam_betas[1] must be in [0, 1), got 1.0"),
        ("--algo.lam=1.5", "algo.lam must be in [0, 1], got 1.5"),
        ("--weights.min_buckets=0", "weights.min_buckets must be > 0, got 0"),
        ("--rollout.top_p=0", "rollout.top_p must be in (0, 1], got 0"),
        ("--checkpoint.keep=0", "checkpoint.keep must be > 0, got 0"),
        ("--logging.trace.every=0", "logging.trace.every must be > 0, got 0"),
        ("--trainer.lr=inf", "trainer.lr must be a finite number, got 'inf'"),
        ("--cluster.cpus_per_engine=-1", "cluster.cpus_per_engine must be >= 0, got -1"),
    ],
)
def test_declared_limits_name_the_dotted_key(override: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        load_config(None, [override])
    assert str(info.value) == message


def test_declared_limits_hold_for_sections_built_in_python() -> None:
    """msgspec checks ``Meta`` limits when decoding; a section built in Python is checked too."""
    with pytest.raises(ValueError, match=r"^controller\.batch_size must be > 0, got 0$"):
        ControllerConfig(batch_size=0)
    with pytest.raises(ValueError, match=r"^trainer\.adam_betas\[0\] must be in \[0, 1\)"):
        TrainerConfig(adam_betas=(-0.1, 0.9))
    with pytest.raises(ValueError, match=r"^weights\.timeout_s must be a finite number"):
        GlooWeightsConfig(timeout_s=float("nan"))
    with pytest.raises(ValueError, match=r"cuda-ipc.*rollout\.backend='local' only"):
        RunConfig(rollout=SGLangRolloutConfig(), weights=CudaIpcWeightsConfig())


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not found"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[controller\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_config(bad)


def test_help_and_config_import_no_torch() -> None:
    code = "import sys, asyncrl.cli, asyncrl; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    out = subprocess.run([sys.executable, "-m", "asyncrl.cli", "--help"], capture_output=True)
    assert out.returncode == 0 and b"run" in out.stdout


def test_cli_rejects_bad_override_before_starting_anything(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "asyncrl.cli", "run", "--controller.batch_size=x"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 2
    assert "controller.batch_size" in out.stderr
    assert not (tmp_path / "runs").exists()


def test_a_typo_gets_did_you_mean() -> None:
    with pytest.raises(
        ValueError, match=r"controller\.batch_sise \(did you mean controller\.batch_size\?\)"
    ):
        load_config(None, ["--controller.batch_sise=3"])
    with pytest.raises(ValueError, match=r"\(did you mean controller\?\)"):
        load_config(None, ["--contrller.batch_size=3"])


def test_config_json_records_the_gateway_an_agent_run_serves() -> None:
    """Issue 37 item 10: an agent run's recorded config says ``gateway.enabled = true`` (the
    gateway runs), and a resume reading it back gets the same config."""
    cfg = load_config(None, ["--task.name=agent", "--task.agent=pkg.mod:fn"])
    tree = to_dict(cfg)
    assert tree["gateway"]["enabled"] is True
    assert load_config(None, [], base=tree).task.name == "agent"
    assert to_dict(RunConfig())["gateway"]["enabled"] is False


ROOT = Path(__file__).resolve().parents[1]


def _leaf_keys(cls: type, prefix: str = "") -> set[str]:
    """Every dotted key of ``cls`` (a tagged union's members' keys all)."""
    from asyncrl.config.base import _hints, _section_types

    keys = set()
    for name in cls.__struct_fields__:
        members = _section_types(_hints(cls)[name])
        if members:
            for m in members:
                keys |= _leaf_keys(m, f"{prefix}{name}.")
        else:
            keys.add(prefix + name)
    return keys


def test_config_reference_is_generated_from_the_code_and_checked_in() -> None:
    """docs/config.md is what ``asyncrl config`` prints (issue 37: a config reference outside
    the source): every key with its default and meaning, every field documented."""
    from asyncrl.config.reference import render, undocumented

    assert undocumented() == [], "give these config fields a docstring"
    page = render()
    assert (ROOT / "docs" / "config.md").read_text() == page, (
        "docs/config.md is out of date: asyncrl config > docs/config.md"
    )
    for key in _leaf_keys(RunConfig):
        assert f"| `{key}` |" in page, key
    assert "| `controller.total_steps` | int > 0 | `120` | Train steps of the run. |" in page
    assert '`"in_place"` (sglang: `"abort"`; vllm: `"keep"`)' in page  # per backend defaults


def test_asyncrl_config_prints_the_reference_and_one_section() -> None:
    run = [sys.executable, "-m", "asyncrl.cli", "config"]
    whole = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert whole.returncode == 0 and whole.stdout == (ROOT / "docs" / "config.md").read_text()
    one = subprocess.run([*run, "rollout"], capture_output=True, text=True, timeout=60)
    assert one.returncode == 0 and "`rollout.pause_mode`" in one.stdout
    assert "`model.path`" not in one.stdout
    bad = subprocess.run([*run, "nope"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "sections: model, task" in bad.stderr
