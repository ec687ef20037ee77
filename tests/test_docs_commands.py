"""Every documented command is a test: each shell line of README.md and docs/*.md that starts
with ``asyncrl`` or ``bash scripts/`` runs here, as the docs write it, and a line that fails is
a failing test.

**Which lines.** Code blocks only (prose is prose): fenced blocks (```` ``` ```` / ``~~~``)
whose info string is empty or a shell (``bash``, ``sh``, ``shell``, ``console``), and
indented blocks (4 spaces after a blank line; docs/agents.md writes its commands so). A line
ending in ``\\`` goes on on the next; a ``#`` comment outside quotes is dropped (as bash
drops it); in a block where some lines start with ``$ ``, only those are commands (the rest
is printed output); leading ``VAR=value`` assignments belong to the command. Identical
commands (README and docs/algorithms.md both show ``asyncrl run --algo ppo``) run once,
listed with every place that shows them. Commands in prose (inline code) are not read, nor
``docs/results/`` (dated measurements, not instructions).

**What the harness changes.** Nothing in the line itself. It appends size flags after the
line's own (:data:`SIZE`: steps, batch and group sizes, episodes, repeats; later flags win,
in the config's overrides and in argparse), so that each command takes seconds; a ``run`` or
``bench`` command with no entry there fails instead of running at full size. Each command
runs through ``bash -c`` with the test environment's ``asyncrl`` and ``python`` first on
``PATH``, in a folder of its own (its ``runs/``, ``--json`` files and the files below land
there); ``bash scripts/...`` lines run from the repository root, as README says, and
``bash scripts/run`` also gets ``--run-dir`` (the script changes into the repository, whose
``runs/`` the suite must not fill). Placeholders (:data:`PLACEHOLDERS`) are filled so:

- ``my.toml``: a file the harness writes in the command's folder (:data:`MY_TOML`, a subset
  of the config: README says a TOML file sets any subset);
- ``RUN_DIR``: the run folder of the documented ``asyncrl run`` (the default job, which
  ends with a checkpoint), once that command has finished; a ``--resume`` line gets only
  ``--controller.total_steps``, one past that run's (a resumed run keeps its sizes);
- ``my_pkg.agents:solve`` and ``my_agent.py`` (docs/agents.md): the user's agent function
  and agent command, written in the command's folder (:data:`MY_PKG_AGENTS`,
  :data:`MY_AGENT`): one chat completion each through the episode's session, a reward
  from the answer;
- ``--cluster.secret_file=NAME`` (a key file an earlier line of its block writes): a fresh
  secret in ``NAME`` (mode 0600) in the command's folder.

A line that ends in ``&`` (started in the background in its block) runs in the foreground
here, its size flags before the ``&``'s place: its exit code is what is tested.

**What cannot run here** (:data:`NOT_ON_CPU`, each with its reason): the suite itself, a
Ray cluster to join, a Slurm allocation, engines on other hosts. Every entry must match a
documented command (the list cannot go stale), and everything else runs.

**What it shows.** Each runnable command is one test (``rc == 0``; a run prints its
``done:`` line; a bench writes its ``--json``); the commands run in the background two at a
time, started by one module fixture, each ended by its process group's id, none leaving a
process behind (they carry :data:`tests.runs.MARK`). The module writes
``.pytest_cache/doc-commands.txt``: each command as run, where the docs show it, its exit
code and seconds, and each line not run with why (the suite's terminal summary prints it).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shlex
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from asyncrl.forkserver import ENV_SHARED, ForkServer
from asyncrl.procs import python_env, stop
from tests.conftest import DOC_COMMANDS_REPORT
from tests.runs import MARK, marked_pids

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REPORT = DOC_COMMANDS_REPORT
"""The list of what ran (and what did not), rewritten as each command ends."""

SHELL_BLOCKS = {"", "bash", "sh", "shell", "console", "zsh"}
RUN_SIZE = ["--controller.total_steps=1", "--controller.batch_size=2", "--algo.group_size=2"]
SIZE: dict[tuple[str, ...], list[str]] = {
    # the command's first words -> flags the harness appends (a run: 1 step of 2 groups of 2)
    ("asyncrl", "run"): RUN_SIZE,
    ("bash", "scripts/run"): RUN_SIZE,
    ("asyncrl", "bench", "controller"): ["--episodes=2000", "--repeats=1"],
    ("asyncrl", "bench", "pipeline"): (
        "--steps=1 --warmup=1 --batch-size=2 --group-size=2 --max-len=8 --repeats=1".split()
    ),
    ("asyncrl", "bench", "generation"): (
        "--requests=2 --prompt-len=16 --short-len=2 --long-factor=1".split()
    ),
}
NOT_ON_CPU: dict[str, str] = {
    "bash scripts/test": "the test suite itself: this harness runs inside it",
    "asyncrl run my.toml --cluster.backend=ray": (
        "joins a running Ray cluster (`ray start --head`, ~30 s of the 2-core box to start); "
        "the same run on a local two-node Ray cluster is tests/launchers/test_ray.py"
    ),
    'asyncrl run my.toml --cluster.backend=ray --cluster.address="$ip:6379"': (
        "a Slurm allocation: $ip is the head node's address from srun"
    ),
    "asyncrl run my.toml "
    '--rollout.urls=\'["http://10.0.0.2:30000","http://10.0.0.3:30000"]\' '
    "--weights.master_address=10.0.0.1 --experience.host=10.0.0.1": (
        "engines on other hosts (10.0.0.2, 10.0.0.3) and this host's routable address 10.0.0.1"
    ),
}
MY_TOML = """\
# my.toml (written by tests/test_docs_commands.py): a subset of the config
[trainer]
lr = 2e-3

[controller]
max_staleness = 1
"""
MY_PKG_AGENTS = '''\
"""The user's agent (docs/agents.md): one chat completion, a reward from the answer."""


async def solve(client, sample):
    r = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": sample.prompt}], max_tokens=16
    )
    return float(str(sample.answer) in (r.choices[0].message.content or ""))
'''
MY_AGENT = '''\
"""The user's agent command (docs/agents.md), standard library only: one chat completion on
the episode's session (OPENAI_BASE_URL, OPENAI_API_KEY), its reward posted before it exits."""

import json
import os
import urllib.request


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={
        "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
        "Content-Type": "application/json",
    })
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


sample = json.loads(os.environ["ASYNCRL_SAMPLE"])
msgs = sample.get("messages") or [{"role": "user", "content": sample["prompt"]}]
out = post(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
           {"model": "m", "messages": msgs, "max_tokens": 16})
text = out["choices"][0]["message"]["content"] or ""
post(os.environ["ASYNCRL_REWARD_URL"], {"reward": float(str(sample["answer"]) in text)})
'''
PLACEHOLDERS: dict[str, str] = {
    "my.toml": "MY_TOML, written in the command's folder",
    "RUN_DIR": "the run folder of the documented `asyncrl run` (after it ended)",
    "my_pkg.agents:solve": "MY_PKG_AGENTS as my_pkg/agents.py in the command's folder",
    "my_agent.py": "MY_AGENT, written in the command's folder",
}
RUN_DIR_SOURCE = "asyncrl run"
"""The documented command whose run folder fills ``RUN_DIR``."""
TIMEOUT_S = 180.0
"""Per command (a run takes ~1.5 s forked from the session's fork server; the slowest, the
generation bench, 12-35 s on the 2-core box, idle to loaded)."""
AT_ONCE = 2


@dataclass
class DocCommand:
    """One documented command: its text (comment dropped, continuations joined) and where
    the docs show it (``FILE:LINE``, every place)."""

    text: str
    where: list[str] = field(default_factory=list)

    @property
    def words(self) -> list[str]:
        """The command's words, after any leading ``VAR=value`` assignments."""
        words = shlex.split(self.text)
        while words and re.match(r"^[A-Za-z_]\w*=", words[0]):
            words = words[1:]
        return words

    @property
    def id(self) -> str:
        return self.where[0]


def _strip_comment(line: str) -> str:
    """``line`` without a ``#`` comment (a ``#`` outside quotes that starts a word)."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def _blocks(text: str) -> Iterator[list[tuple[int, str]]]:
    """The shell code blocks of a Markdown text: lists of (line number, line)."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)", lines[i])
        if fence:
            mark, lang = fence.group(1), fence.group(2).lower()
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith(mark):
                j += 1
            if lang in SHELL_BLOCKS:
                yield [(k + 1, lines[k]) for k in range(i + 1, j)]
            i = j + 1
            continue
        if lines[i].startswith("    ") and (i == 0 or not lines[i - 1].strip()):
            j = i
            while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                j += 1
            yield [(k + 1, lines[k][4:]) for k in range(i, j) if lines[k].strip()]
            i = j
            continue
        i += 1


def commands_in(text: str, name: str) -> list[tuple[str, str]]:
    """(command, ``name:LINE``) for each documented command in Markdown ``text``."""
    found = []
    for block in _blocks(text):
        prompted = any(line.lstrip().startswith("$ ") for _, line in block)
        k = 0
        while k < len(block):
            n, line = block[k]
            k += 1
            line = line.strip()
            if prompted:
                if not line.startswith("$ "):
                    continue
                line = line[2:].strip()
            while line.endswith("\\") and k < len(block):  # a continuation
                line = line[:-1].rstrip() + " " + block[k][1].strip()
                k += 1
            line = _strip_comment(line)
            if re.match(r"^([A-Za-z_]\w*=\S*\s+)*(asyncrl\s|asyncrl$|bash\s+scripts/)", line):
                found.append((line, f"{name}:{n}"))
    return found


def doc_commands() -> list[DocCommand]:
    """Every documented command of README.md and docs/*.md, identical ones merged."""
    merged: dict[tuple[str, ...], DocCommand] = {}  # by words: spacing aside, the same
    for path in DOCS:
        for text, where in commands_in(path.read_text(), str(path.relative_to(ROOT))):
            merged.setdefault(tuple(shlex.split(text)), DocCommand(text)).where.append(where)
    return list(merged.values())


COMMANDS = doc_commands()
RUNNABLE = [c for c in COMMANDS if c.text not in NOT_ON_CPU]


def _size(words: list[str]) -> list[str] | None:
    """The size flags of a command (None: it needs some and has none); [] for commands that
    are small as they are (``asyncrl plot``, ``--help``)."""
    for n in (3, 2):
        if tuple(words[:n]) in SIZE:
            return SIZE[tuple(words[:n])]
    heavy = words[:2] in (["asyncrl", "run"], ["asyncrl", "bench"], ["bash", "scripts/run"])
    return None if heavy and "--help" not in words else []


@dataclass
class Outcome:
    """What one command did: the line as run, its exit code, seconds, folder and output."""

    cmd: DocCommand
    line: str = ""
    rc: int | None = None
    seconds: float = 0.0
    folder: Path = Path()
    output: str = ""
    problem: str = ""
    mark: str = ""
    done: threading.Event = field(default_factory=threading.Event)


class _Commands:
    """Runs the documented commands in a background thread, ``AT_ONCE`` at a time, each in
    its own folder and process group; ``RUN_DIR`` users after their source."""

    def __init__(self, base: Path, todo: list[DocCommand]) -> None:
        self.base = base
        self.out = {c.id: Outcome(c) for c in todo}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._stop = threading.Event()
        # the benches (the longest) and RUN_DIR's source first, RUN_DIR's users last
        order = sorted(todo, key=lambda c: ("RUN_DIR" in c.text, _light(c)))
        self._thread = threading.Thread(target=self._run_all, args=(order,), daemon=True)
        self._thread.start()

    def _run_all(self, order: list[DocCommand]) -> None:
        running: list[str] = []
        try:
            for cmd in order:
                while (len(running) >= AT_ONCE or self._waits(cmd)) and not self._stop.is_set():
                    running = [i for i in running if not self._reap(i)]
                    time.sleep(0.05)
                if self._stop.is_set():
                    return
                if self._start(cmd):
                    running.append(cmd.id)
            while running and not self._stop.is_set():
                running = [i for i in running if not self._reap(i)]
                time.sleep(0.05)
        finally:  # a harness error (raised on in this thread) fails what it left undone
            why = f"the harness stopped first ({sys.exc_info()[1]!r})"
            for o in self.out.values():
                if not o.done.is_set():
                    self._end(o.cmd.id, why)

    def _waits(self, cmd: DocCommand) -> bool:
        """Whether ``cmd`` waits for ``RUN_DIR``'s source to end."""
        src = self._source() if "RUN_DIR" in cmd.text else None
        return src is not None and not src.done.is_set()

    def _source(self) -> Outcome | None:
        return next((o for o in self.out.values() if o.cmd.text == RUN_DIR_SOURCE), None)

    def _start(self, cmd: DocCommand) -> bool:
        o = self.out[cmd.id]
        o.folder = self.base / re.sub(r"[^\w.-]+", "_", cmd.id)
        o.folder.mkdir()
        size = _size(cmd.words)
        if size is None:
            return self._end(cmd.id, f"no size flags for {shlex.join(cmd.words[:3])}: add to SIZE")
        line = cmd.text
        if "RUN_DIR" in line:
            src = self._source()
            if src is None:
                return self._end(cmd.id, f"RUN_DIR: no documented `{RUN_DIR_SOURCE}` to take")
            found = re.search(r"writing to (\S+)", src.output)
            if src.rc != 0 or found is None:
                return self._end(cmd.id, f"RUN_DIR: `{RUN_DIR_SOURCE}` failed (rc {src.rc})")
            line = re.sub(r"\bRUN_DIR\b", shlex.quote(str(src.folder / found.group(1))), line)
            if "--resume" in cmd.words:  # the run's own sizes; only its steps may grow
                size = [f"--controller.total_steps={_steps(RUN_SIZE) + 1}"]
        if "my.toml" in cmd.words:
            (o.folder / "my.toml").write_text(MY_TOML)
        if "my_pkg.agents:solve" in line:
            (o.folder / "my_pkg").mkdir()
            (o.folder / "my_pkg" / "__init__.py").write_text("")
            (o.folder / "my_pkg" / "agents.py").write_text(MY_PKG_AGENTS)
        if "my_agent.py" in line:
            (o.folder / "my_agent.py").write_text(MY_AGENT)
        for w in cmd.words:  # a key file an earlier line of the block makes (0600, a secret)
            if w.startswith("--cluster.secret_file=") and "/" not in w:
                key = o.folder / w.partition("=")[2]
                key.touch(mode=0o600)
                key.write_text(secrets.token_urlsafe(32) + "\n")
        if re.search(r"[^&]&$", line):  # started in the background there: here, waited for
            line = line[:-1].rstrip()
        cwd = o.folder
        if cmd.words[:2] == ["bash", "scripts/run"]:
            cwd, size = ROOT, [*size, f"--run-dir={o.folder / 'run'}"]
            if (problem := _setup_stale()) is not None:
                return self._end(cmd.id, problem)
        o.line, o.mark = " ".join([line, *size]), uuid.uuid4().hex
        env = {**os.environ, MARK: o.mark, "PYTHONUNBUFFERED": "1", "TMPDIR": str(o.folder)}
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        with open(o.folder / "output.log", "wb") as log:
            o.seconds = time.monotonic()
            self.procs[cmd.id] = subprocess.Popen(
                ["bash", "-c", o.line],
                cwd=cwd,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return True

    def _reap(self, cmd_id: str) -> bool:
        """Whether the command has ended (recorded) or ran out of time (stopped, recorded)."""
        proc, o = self.procs[cmd_id], self.out[cmd_id]
        late = time.monotonic() - o.seconds > TIMEOUT_S
        if proc.poll() is None and not late:
            return False
        problem = ""
        if proc.poll() is None:
            stop([proc])
            problem = f"still running after {TIMEOUT_S:g} s: stopped"
        deadline = time.monotonic() + 10  # the run ends its children; give them a moment
        while (left := marked_pids(o.mark)) and time.monotonic() < deadline:
            time.sleep(0.1)
        if left:
            problem += f" processes outlived it: {left}"
            for pid in left:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
        o.rc, o.seconds = proc.returncode, time.monotonic() - o.seconds
        o.output = (o.folder / "output.log").read_text(errors="replace")
        self._end(cmd_id, problem)
        return True

    def _end(self, cmd_id: str, problem: str) -> bool:
        o = self.out[cmd_id]
        o.problem = problem
        o.done.set()
        self.report()
        return False

    def report(self) -> None:
        rows = ["# documented commands run by tests/test_docs_commands.py", ""]
        for o in self.out.values():
            state = "running or waiting" if not o.done.is_set() else f"exit {o.rc}"
            took = f" {o.seconds:.1f} s" if o.done.is_set() and o.rc is not None else ""
            rows.append(f"{state}{took}: {o.line or o.cmd.text}   [{', '.join(o.cmd.where)}]")
            if o.done.is_set() and o.problem:
                rows.append(f"    {o.problem}")
        for c in COMMANDS:
            if c.text in NOT_ON_CPU:
                rows.append(f"not run: {c.text}   [{', '.join(c.where)}]: {NOT_ON_CPU[c.text]}")
        REPORT.parent.mkdir(exist_ok=True)
        REPORT.write_text("\n".join(rows) + "\n")

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        stop([p for p in self.procs.values() if p.poll() is None])
        self.report()


def _steps(flags: list[str]) -> int:
    """The last ``--controller.total_steps=N`` of ``flags``."""
    return [int(f.split("=")[1]) for f in flags if f.startswith("--controller.total_steps=")][-1]


def _light(cmd: DocCommand) -> bool:
    """Not a bench and not ``RUN_DIR``'s source: started after those."""
    return cmd.text != RUN_DIR_SOURCE and cmd.words[:2] != ["asyncrl", "bench"]


def _setup_stale() -> str | None:
    """Why ``bash scripts/run``'s set-up would reinstall the packages of the environment the
    suite runs from (its stamp differs from pyproject.toml + setup.sh), or None."""
    want = hashlib.sha256(
        (ROOT / "pyproject.toml").read_bytes() + (ROOT / "scripts" / "setup.sh").read_bytes()
    ).hexdigest()
    stamp = ROOT / ".venv" / ".asyncrl-setup"
    have = stamp.read_text().strip() if stamp.is_file() else ""
    if have != want:
        return "the set-up is out of date (run bash scripts/setup.sh): it would reinstall now"
    return None


def _wait_for_the_shared_fork_server(tmp: Path, timeout_s: float = 120.0) -> None:
    """Until the session's shared fork server (tests/conftest.py) has preloaded: a run that
    comes before it listens, or that waits longer than its connection's 10 s for the preload
    (the box is loaded), starts its processes afresh (~4 CPU-s of imports each). A trivial
    fork (``python -m platform``) waits for it."""
    path = os.environ.get(ENV_SHARED)
    deadline = time.monotonic() + timeout_s
    while path and time.monotonic() < deadline:
        try:
            server = ForkServer.connect(path, timeout_s=max(1.0, deadline - time.monotonic()))
        except OSError:  # not listening yet
            time.sleep(0.1)
            continue
        try:
            server.spawn(["-m", "platform"], tmp / "platform.log", python_env()).wait(30)
        finally:
            server.close()
        return


@pytest.fixture(scope="module")
def ran(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[_Commands]:
    """The commands whose tests this session runs (and ``RUN_DIR``'s source, when a user of
    it is one), started in the background."""
    wanted = {
        item.callspec.params["cmd"].id
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec")
    }
    todo = [c for c in RUNNABLE if c.id in wanted]
    if any("RUN_DIR" in c.text for c in todo):
        todo += [c for c in RUNNABLE if c.text == RUN_DIR_SOURCE and c not in todo]
    base = tmp_path_factory.mktemp("doc-commands")
    _wait_for_the_shared_fork_server(base)
    runs = _Commands(base, todo)
    try:
        yield runs
    finally:
        runs.close()


def test_the_documented_commands_are_found() -> None:
    """The harness reads what the docs show: README's two commands, the agents page's
    indented ones, a continued line joined; every line it does not run is still documented
    (the list of exceptions cannot go stale), and it is short."""
    texts = {c.text for c in COMMANDS}
    assert {"bash scripts/run", "bash scripts/test", "asyncrl run --algo ppo"} <= texts
    assert any("--task.agent=my_pkg.agents:solve" in c.words for c in COMMANDS)
    assert any(c.text == "asyncrl run --resume RUN_DIR" for c in RUNNABLE)
    assert not set(NOT_ON_CPU) - texts, set(NOT_ON_CPU) - texts
    assert len(NOT_ON_CPU) <= len(COMMANDS) // 3
    unused = [p for p in PLACEHOLDERS if not any(p in c.text for c in RUNNABLE)]
    assert not unused, f"placeholders no documented command uses any more: {unused}"


def test_the_parser_reads_blocks_as_a_shell_would() -> None:
    text = (
        "prose `asyncrl run --inline` is not a command\n\n"
        "```bash\n"
        'asyncrl run a.toml --x=\'["p", "q"]\'   # a comment\n'
        "asyncrl run --a=1 \\\n  --b=2\n"
        "```\n\n"
        "```toml\nasyncrl = 1\n```\n\n"
        "```\n$ asyncrl bench controller --json o#1.json   # a comment\n"
        "asyncrl       200000    4.313\n```\n\n"
        "    asyncrl run --task.name=agent\n\n"
        "```sh\nX=1 asyncrl run\nasyncrlx run\n```\n"
    )
    got = [c for c, _ in commands_in(text, "T")]
    assert got == [
        'asyncrl run a.toml --x=\'["p", "q"]\'',
        "asyncrl run --a=1 --b=2",
        "asyncrl bench controller --json o#1.json",
        "asyncrl run --task.name=agent",
        "X=1 asyncrl run",
    ]
    assert DocCommand("X=1 Y='a b' asyncrl run --x").words == ["asyncrl", "run", "--x"]
    assert _strip_comment("a 'b # c' # d") == "a 'b # c'"


@pytest.mark.parametrize("cmd", RUNNABLE, ids=[c.id for c in RUNNABLE])
def test_documented_command_runs(ran: _Commands, cmd: DocCommand) -> None:
    o = ran.out[cmd.id]
    assert o.done.wait(3 * TIMEOUT_S), f"never ran: {cmd.text}"  # pytest-timeout: first
    where = ", ".join(cmd.where)
    assert not o.problem and o.rc == 0, (
        f"{where}: `{o.line or cmd.text}` exited {o.rc} {o.problem}\n{o.output[-3000:]}"
    )
    if cmd.words[:2] in (["asyncrl", "run"], ["bash", "scripts/run"]):
        assert "done: " in o.output, f"{where}: no `done:` line\n{o.output[-3000:]}"
        _what_the_docs_say(cmd, o)
    if "--json" in cmd.words:
        out = cmd.words[cmd.words.index("--json") + 1]
        assert (o.folder / out).is_file(), f"{where}: wrote no {out}\n{o.output[-3000:]}"


def _what_the_docs_say(cmd: DocCommand, o: Outcome) -> None:
    """A run's folder shows what its line promises: command-line overrides win over the TOML
    file (README), a resume continues the run (docs/fault-tolerance.md), and
    ``--logging.trajectories=true`` writes ``trajectories.jsonl`` (docs/agents.md)."""
    found = re.search(r"(?:writing to|resuming) (\S+)", o.output)
    assert found is not None, o.output[-3000:]
    run = o.folder / found.group(1) if cmd.words[:2] == ["asyncrl", "run"] else Path(found[1])
    config = json.loads((run / "config.json").read_text())
    if "my.toml" in cmd.words:  # the file says 1 and 2e-3; the line says 2 and 1e-3
        got = (config["controller"]["max_staleness"], config["trainer"]["lr"])
        assert got == (2, 1e-3), got
    if "--resume" in cmd.words:
        assert "resuming from" in o.output and (run / "resumed.json").is_file()
    if "--logging.trajectories=true" in cmd.words:
        assert (run / "trajectories.jsonl").stat().st_size > 0
