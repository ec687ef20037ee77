"""User mistakes on the command line fail fast, with one line naming the key, no traceback."""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import resource
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.preflight import REFUSED_S, cuda_devices, preflight
from asyncrl.procs import python_env
from asyncrl.tasks.tiny_chat_model import TINY_CHAT_CONTEXT
from tests.runs import MARK, forked_by_shared_server, marked_pids

WEATHER_AGENT = f"{Path(__file__).resolve().parents[1] / 'examples' / 'agents.py'}:weather_agent"
"""The weather task's example agent (examples/agents.py), by file: any working directory."""


def _cli(*args: str, python: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *python, "-m", "asyncrl.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("--weights.timeout_s=nan", "weights.timeout_s"),
        ("--rollout.temperature=NaN", "rollout.temperature"),
        ("--rollout.request_timeout_s=-1", "rollout.request_timeout_s"),
        ("--controller.health_interval_s=0", "controller.health_interval_s"),
        ("--trainer.lr=-1", "trainer.lr"),
    ],
)
def test_non_finite_floats_and_non_positive_timeouts_are_refused(override: str, key: str) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_top_level_override_with_equals_sign() -> None:
    out = _cli("run", "--seed=abc")
    assert out.returncode == 2 and "seed" in out.stderr and "Traceback" not in out.stderr
    assert "unrecognized arguments" not in out.stderr


def test_an_override_takes_its_value_from_the_next_argument(tmp_path: Path) -> None:
    """``--controller.total_steps 5`` is ``--controller.total_steps=5`` (issue 37 item 10: it
    was "config file not found: 5"), after a config file too; without a value, one line
    naming the key. (Values chosen invalid: each check ends before anything starts.)"""
    out = _cli("run", "--controller.total_steps", "0")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "controller.total_steps must be > 0, got 0" in out.stderr, out.stderr
    cfg = tmp_path / "my.toml"
    cfg.write_text("[controller]\nbatch_size = 0\n")
    out = _cli("run", str(cfg), "--controller.batch_size", "4", "--seed", "x", "--quiet")
    assert out.returncode == 2 and "seed" in out.stderr, out.stderr  # both given, the file read
    out = _cli("run", "--controller.total_steps", "--quiet")
    assert out.returncode == 2, out.stderr
    assert "--controller.total_steps needs a value" in out.stderr, out.stderr


def test_serve_takes_the_engine_arguments() -> None:
    """``asyncrl serve --help`` lists every engine flag with its help, and imports no torch
    to say it (the flags are parsed before the engine is imported)."""
    args = ("serve", "--model-path", "/nonexistent", "--port", "1", "--help")
    out = _cli(*args, python=("-X", "importtime"))
    imported = {ln.rsplit("|", 1)[-1].strip() for ln in out.stderr.splitlines() if "|" in ln}
    assert "asyncrl.entrypoints.engine_args" in imported, sorted(imported)
    assert "torch" not in imported and "asyncrl.entrypoints.engine" not in imported
    assert out.returncode == 0 and "--model-path" in out.stdout and "--port" in out.stdout
    assert out.stdout.startswith("usage: asyncrl serve")
    options = out.stdout.split("options:", 1)[1]
    # every flag has a help text: no option line stands alone before the next option line
    lines = [ln for ln in options.splitlines() if ln.strip()]
    bare = [a for a, b in itertools.pairwise(lines) if a.lstrip().startswith("--") and
            b.lstrip().startswith("-") and "  " not in a.strip()]  # fmt: skip
    assert not bare, bare


def test_serve_without_a_model_serves_the_tiny_default(
    tmp_path: Path, tiny_model_dir: Path, free_port: int
) -> None:
    from asyncrl.engines.rollout.sglang import SGLangClient
    from asyncrl.procs import stop
    from asyncrl.tasks.tiny_model import TINY_VERSION
    from tests.runs import spawn_shared

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / TINY_VERSION).symlink_to(tiny_model_dir)  # built already
    env = python_env({"ASYNCRL_CACHE": str(tmp_path)})
    # `python -m asyncrl.cli serve`, forked from the session's fork server (torch imported)
    args = ["-m", "asyncrl.cli", "serve", "--port", str(free_port)]
    proc = spawn_shared(args, tmp_path / "log", env)
    try:

        async def generate() -> list[int]:
            client = SGLangClient(f"http://127.0.0.1:{free_port}")
            try:
                await client.wait_healthy(60)
                out = await client.generate([1, 5, 6, 13], {"max_new_tokens": 2})
                return out.output_ids
            finally:
                await client.close()

        assert 1 <= len(asyncio.run(generate())) <= 2
    finally:
        stop([proc])


def _timed_run(
    tmp_path: Path, *overrides: str
) -> tuple[subprocess.CompletedProcess[str], float, float]:
    """``asyncrl run`` with ``overrides``: its output, wall time and CPU seconds (of the
    ``asyncrl run`` process: what it did, whatever the machine's load; wall time bounds only
    from below). Every process it started (marked through the environment its children
    inherit, and those the session's shared fork server forked for it, in its working
    directory ``tmp_path``) has ended when it returns."""
    mark = uuid.uuid4().hex
    run = ["run", "--run-dir", str(tmp_path / "run"), "--quiet", *overrides]
    forked_before = forked_by_shared_server(tmp_path)
    t0, before = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", *run],
        capture_output=True,
        text=True,
        timeout=300,  # a hang: no run here needs more than seconds of CPU
        check=False,
        env=python_env({MARK: mark}),
        cwd=tmp_path,
    )
    took, after = time.monotonic() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert marked_pids(mark) == [], "a process of the run outlived it"
    # what the session's shared fork server forked for the run (their environment is the
    # server's, unmarked; their working directory the run's): the run ended them; the
    # server reaps them (poll, 10 s)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not (left := forked_by_shared_server(tmp_path) - forked_before):
            break
        time.sleep(0.05)
    assert not left, f"processes forked for the run outlived it: {sorted(left)}"
    return out, took, cpu


def _no_cuda() -> bool:
    return cuda_devices()[0] == 0


@pytest.mark.parametrize(
    ("override", "key", "runs_here"),
    [
        ("--task.name=math", "task.path", lambda: True),  # and no file
        (  # the tiny model's context is 64 tokens: every request would get a 400, forever
            "--rollout.max_new_tokens=100",
            "rollout.max_new_tokens: 4 prompt + 100 new tokens exceed the engines' context length",
            lambda: True,
        ),
        ("--rollout.device=cuda", "rollout.device", _no_cuda),
        ("--trainer.device=cuda:0", "trainer.device", _no_cuda),
        ("--weights.backend=nccl", "weights.backend='nccl' needs CUDA", _no_cuda),
        ("--weights.backend=cuda-ipc", "weights.backend='cuda-ipc' needs CUDA", _no_cuda),
        (
            "--weights.backend=hccl",
            "weights.backend='hccl' needs an Ascend NPU and torch_npu",
            lambda: importlib.util.find_spec("torch_npu") is None,
        ),
        (  # the run would start vLLM servers from this Python: 16 s and a traceback before
            "--rollout.backend=vllm",
            "vllm is not installed here: pip install 'asyncrl[vllm-trainer]'",
            lambda: importlib.util.find_spec("vllm") is None,
        ),
        (
            "--rollout.backend=sglang",
            "sglang is not installed here: pip install 'asyncrl[sglang]'",
            lambda: importlib.util.find_spec("sglang") is None,
        ),
        (  # no host can run it: refused by the config itself
            "--rollout.backend=sglang --weights.backend=cuda-ipc",
            "weights.backend='cuda-ipc' works with rollout.backend='local' only",
            lambda: True,
        ),
    ],
)
def test_what_this_host_lacks_is_refused_before_anything_starts(
    tmp_path: Path, override: str, key: str, runs_here: Callable[[], bool]
) -> None:
    """Refused when the config is loaded: exit 2, one line naming the key, no run folder,
    no process left; in the CPU time of an interpreter start and asyncrl's imports (~1 CPU-s;
    the check itself < 1 ms). Wall time is the machine's load's: not bounded (a load average
    of 12-18 on the two cores took 5-7 s)."""
    if not runs_here():
        pytest.skip("this machine has what the override needs")
    math = [f"--task.path={tmp_path / 'x.jsonl'}"] if "task.name=math" in override else []
    out, _, cpu = _timed_run(tmp_path, *override.split(), *math)  # task.path: math's key only
    assert out.returncode == 2, out.stderr
    assert key in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()  # nothing started, nothing written
    assert cpu < 5  # interpreter + imports; nothing started


def test_unreachable_rollout_urls_reported_within_the_startup_timeout(
    tmp_path: Path, free_port: int
) -> None:
    url = f"http://127.0.0.1:{free_port}"  # nothing listens there
    out, took, cpu = _timed_run(tmp_path, f"--rollout.urls={url}", "--rollout.startup_timeout_s=3")
    assert out.returncode == 1, out.stderr
    assert url in out.stderr and "rollout.urls" in out.stderr and "Traceback" not in out.stderr
    assert took >= 3 and cpu < 10  # waited out the timeout, started nothing
    pids = tmp_path / "run" / "processes.json"
    assert not pids.exists() or json.loads(pids.read_text()) == {}  # no trainer was started


def test_a_url_nothing_listens_on_is_refused_within_seconds(tmp_path: Path, free_port: int) -> None:
    """Connection refused on a ``rollout.urls`` engine (no ``rollout.startup_timeout_s``):
    refused after ``REFUSED_S`` of refusals, naming the URL, before anything starts (it was
    121 s of silence: the engines' start timeout)."""
    url = f"http://127.0.0.1:{free_port}"  # nothing listens there
    out, took, cpu = _timed_run(tmp_path, f"--rollout.urls={url}")
    assert out.returncode == 2, out.stderr
    assert f"rollout.urls: {url}: connection refused" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert took >= REFUSED_S and cpu < 5  # probed for REFUSED_S, started nothing
    assert not (tmp_path / "run").exists()


def test_a_url_is_probed_until_it_listens_and_an_answering_one_costs_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The probe behind the check above, in this process: a port that starts listening within
    ``REFUSED_S`` passes (engines coming up beside the run), one already listening passes at
    once (one probe, no wait), and a wait the user set (``rollout.startup_timeout_s``) skips
    the probe (none at all). Counted, not timed: a loaded machine changes neither count."""
    import socket
    import threading

    from asyncrl import preflight as pf

    probes: list[str | None] = []  # what each probe of the URL found (None: accepted)

    def counted(url: str, probe: Callable[[str], str | None] = pf._refused) -> str | None:
        probes.append(probe(url))
        return probes[-1]

    monkeypatch.setattr(pf, "_refused", counted)
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{lsock.getsockname()[1]}"
    cfg = load_config(None, [f"--rollout.urls={url}"])
    probing = threading.Event()
    timer = threading.Timer(1.0, lambda: (lsock.listen(), probing.set()))
    timer.start()
    try:
        preflight(cfg)  # refused for ~1 s, then accepted (a refusal past REFUSED_S raises)
        assert probing.is_set() and len(probes) >= 2 and probes[-1] is None, probes
        assert all(p is not None and "connection refused" in p for p in probes[:-1]), probes
        probes.clear()
        preflight(cfg)
        assert probes == [None]  # accepted at the first probe: no wait between probes
    finally:
        timer.cancel()
        lsock.close()
    probes.clear()  # closed: it would be refused again, but the user set a start timeout
    preflight(load_config(None, [f"--rollout.urls={url}", "--rollout.startup_timeout_s=3"]))
    assert probes == []  # not probed at all


SYNC_AGENT = """def solve(client, sample):
    return 1.0


async def one_arg(client):
    return 1.0
"""


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("--task.agent=nosuchmod:solve", "task.agent 'nosuchmod:solve': cannot import 'nosuchmod'"),
        ("--task.agent=AGENTS:solve", "solve is not an async function"),
        ("--task.agent=AGENTS:one_arg", "one_arg cannot be called with (client, sample)"),
        (  # a file that is not there (the weather agent itself is fine)
            f"--task.agent={WEATHER_AGENT} --task.path=nothere.jsonl",
            "task.path 'nothere.jsonl' is not a file (task.name='agent')",
        ),
        ("", "task.name='agent' needs task.agent="),  # neither agent nor agent_command
    ],
)
def test_agent_mode_mistakes_name_the_key_before_anything_starts(
    tmp_path: Path, override: str, said: str
) -> None:
    """Agent-mode input errors (were: "task.reward_fn ..." after 5 s, a 20-line traceback
    after 6.4 s, "object float can't be used in 'await' expression" at run time): exit 2, one
    line naming ``task.agent`` / ``task.path``, no run folder, in the time of an interpreter
    start."""
    (tmp_path / "agents.py").write_text(SYNC_AGENT)
    override = override.replace("AGENTS", str(tmp_path / "agents.py"))
    out, _, cpu = _timed_run(tmp_path, "--task.name=agent", *override.split())
    assert out.returncode == 2, out.stderr
    assert said in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert "async def" in out.stderr or "async" not in said
    assert len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()
    assert cpu < 5


def test_the_agent_run_fits_the_tiny_chat_model() -> None:
    """``--task.name=agent`` without ``model.path`` runs on the tiny chat model (4096
    positions), not the 64-position digits model: the default budget (128) fits; the limit
    is the chat model's."""
    agent = f"--task.agent={WEATHER_AGENT}"
    preflight(load_config(None, ["--task.name=agent", agent]))
    too_many = ["--task.name=agent", agent, f"--task.max_new_tokens={TINY_CHAT_CONTEXT}"]
    with pytest.raises(ValueError, match=f"context length of {TINY_CHAT_CONTEXT} tokens"):
        preflight(load_config(None, too_many))


def test_unbindable_experience_endpoint_is_one_line(tmp_path: Path) -> None:
    # 192.0.2.1 (TEST-NET-1, RFC 5737) is no address of this host: bind fails at once
    out, _, cpu = _timed_run(tmp_path, "--experience.endpoint=tcp://192.0.2.1:5555")
    assert out.returncode == 1, out.stderr
    assert "experience.endpoint" in out.stderr and "Traceback" not in out.stderr
    assert cpu < 10


def test_a_run_whose_every_request_gets_a_4xx_stops_with_that_error(tmp_path: Path) -> None:
    """The engine refuses every prompt (``--max-prompt-tokens 2``; the task's have 4 tokens):
    a "bad request" is not retried, and after ``controller.max_failed_groups`` groups in a row
    failed the run stops with exit 1 and the engine's own message, its folder small."""
    out, _, cpu = _timed_run(
        tmp_path,
        '--rollout.extra_args=["--max-prompt-tokens", "2"]',
        "--controller.max_failed_groups=6",
        "--controller.batch_size=2",
        "--algo.group_size=2",
    )
    assert out.returncode == 1, out.stderr[-2000:]
    assert "6 groups in a row failed" in out.stderr and "controller.max_failed_groups" in out.stderr
    assert "400" in out.stderr, out.stderr[-2000:]  # the engine's answer, named
    size = sum(f.stat().st_size for f in (tmp_path / "run").rglob("*") if f.is_file())
    assert size < 5 << 20, size
    assert cpu < 30  # it stopped, not retrying on (the controller's CPU; engine and trainer apart)


REWARD = """calls = []


def fn(sample, ids, *, text):
    calls.append(len(ids))
    if len(calls) > 8:  # only after step 0 trained: admission holds 4 groups of 2 before it
        return [][len(ids)]
    return float(text.split()[-1:] == [str(sample.answer)])
"""


def test_math_trains_on_the_default_model_and_a_raising_reward_is_named(tmp_path: Path) -> None:
    """``asyncrl run --task.name=math --task.path=F.jsonl --task.reward_fn=myreward:fn`` from
    the folder of ``myreward.py`` (no PYTHONPATH) trains on the tiny default model (a raw
    prompt, a budget within its context); when the reward function then raises, the run
    stops (exit 1) naming the function, the sample and the line, and RUN_DIR/controller.log
    holds the traceback."""
    (tmp_path / "myreward.py").write_text(REWARD)
    rows = [{"question": f"{a} + {b}", "answer": a + b} for a in range(3) for b in range(3)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    args = ["--task.name=math", "--task.path=train.jsonl", "--task.reward_fn=myreward:fn"]
    args += ["--controller.batch_size=2", "--algo.group_size=2", "--controller.max_staleness=1"]
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "run", "--run-dir", str(run), "--quiet", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
        env=python_env(),
    )
    assert out.returncode == 1, out.stderr[-2000:]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[:1] == [0], steps  # the math task trained on the default model
    last = out.stderr.strip().splitlines()[-1]
    assert "reward function myreward.fn raised IndexError" in last, last
    assert f"{tmp_path / 'myreward.py'}:7" in last and "sample id" in last, last
    log = (run / "controller.log").read_text()
    assert "Traceback" in log and "return [][len(ids)]" in log
    # issue 37 item 5: one traceback for every episode in flight hitting the same bug, in
    # controller.log only; the console has the one line
    assert log.count("Traceback (most recent call last)") == 1, log[-4000:]
    assert "Traceback" not in out.stderr, out.stderr[-4000:]
    assert len(out.stderr.strip().splitlines()) <= 3, out.stderr[-4000:]


def test_a_reward_returning_none_is_named_at_once(tmp_path: Path) -> None:
    """A reward function returning None (a forgotten ``return``): the run stops (exit 1) with
    one line naming the function and what it returned; no traceback anywhere."""
    (tmp_path / "noreward.py").write_text("def fn(sample, ids):\n    pass\n")
    run = tmp_path / "run"
    args = ["--task.reward_fn=noreward:fn", "--controller.batch_size=8", "--algo.group_size=4"]
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "run", "--run-dir", str(run), "--quiet", *args],
        capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path, env=python_env(),
    )  # fmt: skip
    assert out.returncode == 1, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert "reward function noreward.fn returned None for sample id" in last, last
    assert "must return a number" in last, last
    log = (run / "controller.log").read_text()
    assert "Traceback" not in out.stderr + log, (out.stderr + log)[-4000:]
    assert log.count("noreward.fn returned None") <= 2, log[-4000:]  # once, and the stop
