"""Shared fixtures: free loopback ports, the tiny model, and GPU skipping."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.procs import free_port as _free_port
from tests import runs
from tests.session_forks import SessionForkServer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _session_secret() -> None:
    """One run secret for this test process and every process it starts: in a 0600 file
    named by ASYNCRL_SECRET_FILE (children started by ``procs.spawn`` get it through their
    pipe first; ``asyncrl run`` subprocesses and engines started by hand read the file)."""
    import atexit
    import tempfile

    from asyncrl import secret

    if os.environ.get(secret.ENV_FILE):
        return
    fd, path = tempfile.mkstemp(prefix="asyncrl-test-", suffix=".secret")
    with os.fdopen(fd, "w") as f:  # mkstemp: mode 0600
        f.write(secret.generate())
    os.environ[secret.ENV_FILE] = path
    atexit.register(os.unlink, path)  # the process that made it; workers share it
    secret.load()


_session_secret()


def _children_die_with_this_process() -> None:
    """Every process a test starts from this process's main thread (``subprocess.Popen``:
    ``asyncrl run``, stand-in servers, clusters, ``asyncio`` subprocesses) is SIGKILLed when
    this test process dies, however it dies (Linux ``PR_SET_PDEATHSIG``, armed in the child
    unless the caller gave a ``preexec_fn`` of its own; ``asyncrl run``'s guardian then ends
    the run's own children, and the shared fork server ends by ``--exit-with``): a SIGKILLed
    xdist worker leaves nothing behind. Children started from other threads are not armed
    (the signal follows the thread that forked them, and pool threads end before the test
    does); nor those whose ``preexec_fn`` is set (``procs.spawn(die_with_parent=...)``)."""
    import functools
    import subprocess
    import sys
    import threading

    from asyncrl.procs import die_with_parent_fn

    if not sys.platform.startswith("linux"):
        return
    popen_init = subprocess.Popen.__init__

    @functools.wraps(popen_init)
    def init(self: subprocess.Popen, *args: object, **kwargs: object) -> None:
        if (
            kwargs.get("preexec_fn") is None
            and threading.current_thread() is threading.main_thread()
        ):
            kwargs["preexec_fn"] = die_with_parent_fn()  # per call: this process's pid
        popen_init(self, *args, **kwargs)  # type: ignore[arg-type]

    subprocess.Popen.__init__ = init  # type: ignore[method-assign]


_children_die_with_this_process()


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    return _free_port()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny default model (Qwen2 architecture, digit tokenizer) in Hugging Face format."""
    from asyncrl.tasks.tiny_model import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


# What is truly long (over ~10 s each on the 2-core box, `pytest --durations=40`): whole runs of
# `asyncrl run`, killed and resumed, on Ray, through the SGLang stand-in, the wheel. They carry the
# ``slow`` mark, so `bash scripts/test -m "not slow"` is a quick focused pass (CI runs them all).
_SLOW_FILES = (
    "tests/test_resume.py",
    "tests/test_wheel.py",
    "tests/test_observability.py",
    "tests/launchers/test_ray.py",
    "tests/launchers/test_local.py",
    "tests/bench/test_faults.py",
    "tests/engines/rollout/test_sglang_standin.py",
)
_SLOW_TESTS = (
    "tests/engines/rollout/test_vllm_trainer_nccl.py::test_trainer_side_rendezvous_against_the_standin",
    "tests/test_run.py::test_short_run_end_to_end",
    "tests/test_run.py::test_sigint_stops_every_process_and_nothing_listened_beyond_loopback",
    "tests/controllers/test_schedules.py::test_random_schedules_respect_bound_and_lose_nothing",
    "tests/engines/train/test_fsdp.py::test_gradients_do_not_depend_on_micro_batches",
    "tests/engines/rollout/test_engine_failures.py::test_a_failing_prefill_answers_its_requests",
    "tests/transports/weights/test_timeouts.py::test_engine_stopped_mid_push_is_reported_in_time",
    "tests/tasks/test_workloads.py::test_longtail_run_learns",
    "tests/tasks/test_workloads.py::test_agentic_run_learns",
    "tests/engines/rollout/test_vllm_verify.py::test_sampled_verify_finds_a_silent_fault",
    "tests/bench/test_smoke.py::test_weight_sync_into_the_vllm_standin",
    "tests/engines/rollout/test_lora_ring_repair.py::test_a_replaced_engine_gets_back",
)


def _mark_slow(items: list[pytest.Item]) -> None:
    slow = pytest.mark.slow
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        if path in _SLOW_FILES or item.nodeid.startswith(_SLOW_TESTS):
            item.add_marker(slow)


_SESSION_START = time.time()
DOC_COMMANDS_REPORT = Path(__file__).resolve().parents[1] / ".pytest_cache" / "doc-commands.txt"
"""What tests/test_docs_commands.py ran (each documented command, its exit code)."""


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The documented commands' list, when this session ran them (on any worker)."""
    report = DOC_COMMANDS_REPORT
    if report.is_file() and report.stat().st_mtime >= _SESSION_START:
        terminalreporter.write_sep("-", f"documented commands ({report})")
        terminalreporter.write(report.read_text())


# Test-seconds per file (idle box, 4 workers, `pytest --durations=0`; docs/results/test-suite.md,
# session 11), the heaviest first. `--dist loadfile` gives each worker a whole
# file at a time, in collection order (`pytest_configure` turns off xdist's own order, by
# number of tests): a heavy file started last would run alone at the end while the other
# workers idle.
_FILE_SECONDS = {
    "tests/launchers/test_ray.py": 117,
    "tests/test_resume.py": 83,
    "tests/test_run.py": 63,
    "tests/bench/test_smoke.py": 56,
    "tests/engines/rollout/test_vllm_standin_runs.py": 45,
    "tests/test_cli_mistakes.py": 32,
    "tests/test_examples.py": 31,
    "tests/engines/rollout/test_sglang_standin.py": 27,
    "tests/tasks/test_workloads.py": 26,
    "tests/test_docs_commands.py": 25,
    "tests/bench/test_faults.py": 24,
    "tests/engines/rollout/test_vllm_verify.py": 24,
    "tests/engines/rollout/test_vllm_standin.py": 23,
    "tests/engines/rollout/test_vllm_lora.py": 23,
    "tests/test_wheel.py": 23,
    "tests/controllers/test_schedules.py": 22,
    "tests/gateway/test_run_agent.py": 21,
    "tests/test_forkserver.py": 18,
    "tests/engines/rollout/test_sglang_lora.py": 17,
    "tests/engines/rollout/test_vllm_standin_two_engines.py": 16,
    "tests/engines/rollout/test_standin_auth.py": 16,
    "tests/test_lora_run.py": 15,
    "tests/bench/test_killed.py": 14,
    "tests/engines/rollout/test_vllm_client.py": 14,
    "tests/transports/weights/test_delta_native.py": 14,
    "tests/engines/rollout/test_launcher.py": 12,
    "tests/test_layout.py": 10,
    "tests/bench/test_controller_cpu.py": 10,
    "tests/test_observability.py": 10,
    "tests/engines/rollout/test_sglang_schema.py": 9,
}


@pytest.hookimpl(trylast=True)  # after the tmp_path plugin's: its factory is needed
def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order made below
        config.option.loadscopereorder = False
    if not hasattr(config, "workerinput"):
        _start_the_shared_fork_server(config)


_PRELOAD = (
    "asyncrl.entrypoints.trainer",
    "asyncrl.entrypoints.engine",
    "transformers.models.qwen2.modeling_qwen2",  # the tiny models' class
)
"""What the session's shared asyncrl fork server imports before it forks."""


def _asyncrl_fork_server() -> SessionForkServer:
    return SessionForkServer("asyncrl", dict, _PRELOAD)


def _start_the_shared_fork_server(config: pytest.Config) -> None:
    """The session's main process starts the shared asyncrl fork server (``shared_fork_server``)
    at once, so that it imports while the xdist workers start and collect: a run that came
    before it listened would start a fork server of its own (~5 CPU-s)."""
    from asyncrl.forkserver import ENV_SHARED
    from tests import session_forks

    factory = getattr(config, "_tmp_path_factory", None)
    off = os.environ.get("ASYNCRL_TEST_SHARED_FORK_SERVER", "1") == "0"
    if off or factory is None or ENV_SHARED in os.environ or config.option.collectonly:
        return
    session_forks.allow(factory.getbasetemp(), os.getpid())
    _asyncrl_fork_server().started()


def pytest_unconfigure(config: pytest.Config) -> None:
    """The session's main process (the xdist controller, or pytest alone) ends the session's
    fork servers (``session_fork_servers``) before it exits."""
    factory = getattr(config, "_tmp_path_factory", None)
    if hasattr(config, "workerinput") or factory is None or factory._basetemp is None:
        return
    from tests.session_forks import stop_all

    stop_all(factory.getbasetemp())


def _heaviest_files_first(items: list[pytest.Item]) -> None:
    """Stable: tests keep their order inside a file, unlisted files theirs after the listed."""
    items.sort(key=lambda item: -_FILE_SECONDS.get(item.nodeid.split("::", 1)[0], 0))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _mark_slow(items)
    _heaviest_files_first(items)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def session_fork_servers(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The vLLM and SGLang test servers, ranks and probes are forked from one server per
    upstream environment for the whole session (tests/session_forks.py), each started by
    the first worker that needs it, in the folder every worker shares, and ending with the
    session's main process (the xdist controller, whose child each worker is; else this
    one). ``ASYNCRL_TEST_SHARED_FORK_SERVER=0`` turns them off too."""
    from tests import session_forks

    if os.environ.get("ASYNCRL_TEST_SHARED_FORK_SERVER", "1") == "0":
        return
    if session_forks.ENV in os.environ:  # a test session started by a test: its own servers
        os.environ.pop(session_forks.ENV)
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        session_forks.allow(base.parent, os.getppid())
    else:
        session_forks.allow(base, os.getpid())


@pytest.fixture(scope="session", autouse=True)
def shared_fork_server(session_fork_servers: None) -> Iterator[str | None]:
    """One fork server for the whole session, shared by every `asyncrl run` the tests start
    on any worker (``ASYNCRL_FORK_SERVER``, docs/cluster.md): a run's trainer and engine are
    forked from it instead of from a server of the run's own, saving each run ~5 CPU-s of
    imports. Started by the session's main process at ``pytest_configure`` (else by the first
    worker; tests/session_forks.py: it ends with the main process); each worker waits for it
    to listen before its first test (a run that came before would start its own server).
    ``ASYNCRL_TEST_SHARED_FORK_SERVER=0`` turns it off. Tests that look at a
    run's own process tree are marked ``own_fork_server``; tests that look for what a run
    left among the server's children tell theirs apart by working directory
    (:func:`tests.runs.forked_by_shared_server`)."""
    from asyncrl.forkserver import ENV_SHARED

    if ENV_SHARED in os.environ:  # a test session started by a test: the outer session's
        yield None
        return
    server = _asyncrl_fork_server()
    got = server.started()
    if got is None:
        yield None
        return
    server.wait_listening(120.0)  # started at pytest_configure: imports while workers collect
    os.environ[ENV_SHARED], runs.shared_server_pid = got
    try:
        yield got[0]
    finally:
        runs.shared_server_pid = None
        os.environ.pop(ENV_SHARED, None)


@pytest.fixture(autouse=True)
def _own_fork_server(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """``@pytest.mark.own_fork_server``: runs of this test start their own fork server (the
    test checks the run's process tree: descendants, environments, processes.json)."""
    if request.node.get_closest_marker("own_fork_server") is not None:
        from asyncrl.forkserver import ENV_SHARED

        monkeypatch.delenv(ENV_SHARED, raising=False)
