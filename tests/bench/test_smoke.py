"""Every benchmark of ``asyncrl bench`` runs at a tiny size through the real CLI, prints its
table and writes its JSON with its key columns.

``faults`` and ``fuzz`` have tests of their own (``test_faults.py``, ``test_fuzz.py``);
``weight-sync``'s full-push rows run from the installed wheel (``tests/test_wheel.py``) and
across two nodes (``tests/launchers/test_ray.py``), its delta rows here. Most of a tiny
bench's time is process start-up, so the benches selected in this module run in the
background, three at a time (one module fixture), and each test waits for its own; every
process is ended by pid.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncrl.bench import BENCHES
from asyncrl.forkserver import spawn_shared
from asyncrl.procs import Proc, python_env, stop

# test id -> (bench name, its arguments: tiny sizes)
SMOKE: dict[str, tuple[str, list[str]]] = {  # the longest first
    "pipeline": (
        "pipeline",
        "--steps=2 --warmup=1 --batch-size=2 --group-size=2 --max-len=16 --prompt-len=0 "
        "--no-pin".split(),
    ),
    "trace": ("trace", ["--steps=2", "--calib=200"]),
    # the long-tailed workload, sync and async arms at 2 x 2 samples a step (the arms'
    # summary: tests/test_bench_learning.py; the workloads learn: tests/tasks/test_workloads.py)
    "learning": (
        "learning",
        "--workload=longtail --workload-arg=max_len=16 --seeds=0 --steps=2 --batch-size=2 "
        "--group-size=2 --arms=sync,async_decoupled --no-pin".split(),
    ),
    # --losses: one default-job run of one option, 2 steps (the table: test_bench_learning.py)
    "learning-losses": ("learning", "--losses=rpp_baseline --seeds=0 --steps=2 --no-pin".split()),
    # the default job, 3 steps a side, TRL at 1 thread (the summary: tests/bench/test_peer.py)
    "peer": ("peer", "--seeds=0 --steps=3 --trl-max-steps=3 --trl-threads=1".split()),
    "weight-sync-delta": (
        "weight-sync",
        ["--delta", "--model=tiny", "--lrs", "1e-6", "--repeats=1"],
    ),
    "weight-sync-lora": (
        "weight-sync",
        ["--lora", "--model=tiny", "--dtype=float32", "--ranks", "4", "--repeats=1"],
    ),
    "generation": (
        "generation",
        ["--requests=4", "--prompt-len=16", "--short-len=4", "--long-factor=2", "--lora-rank=4"],
    ),
    "train": (
        "train",
        ["--budgets=256", "--steps=1", "--hidden=32", "--layers=1", "--vocab=256", "--batch=4"],
    ),
    "gateway": (
        "gateway",
        "--sessions=2 --concurrency=2 --serial-sessions=1 --turns=2 --max-tokens=3 "
        "--hold=4".split(),
    ),
    "transport": (
        "transport",
        ["--trajectories=200", "--group-sizes=8", "--repeats=1", "--transport=tcp"],
    ),
    "controller": ("controller", ["--episodes=2000", "--repeats=1", "--core=-1"]),
}
COVERED_ELSEWHERE = {"faults", "fuzz", "weight-sync", "soak"}  # soak: test_faults.py
TIMEOUT_S = 240


PARTS = {  # module of asyncrl/bench -> (the bench that runs it, the flag its run needs)
    "fuzz_experience": ("fuzz", ""),  # tests/bench/test_fuzz.py checks its "experience" half
    "fuzz_http": ("fuzz", ""),
    "fuzz_gateway": ("fuzz", ""),  # tests/bench/test_fuzz.py: --gateway-requests
    "gateway_paths": ("gateway", ""),  # both paths and the hold phase: every gateway run
    "generation_lora": ("generation", "--lora-rank"),  # rows lora, lora-mixed (_generation)
    "weight_sync_delta": ("weight-sync", "--delta"),
    "weight_sync_lora": ("weight-sync", "--lora"),
    # its --engine rows: test_weight_sync_into_the_vllm_standin below (a server to start first)
    "weight_sync_engines": ("weight-sync", ""),
    "weight_sync_setup": ("weight-sync", ""),  # weights, engine processes, floor: every run
    "weight_sync_arms": ("weight-sync", ""),  # the full-push arms and rows: every full run
    # --link-gbit: test_weight_sync_over_an_emulated_link below (root only; else its refusal)
    "netlink": ("weight-sync", ""),
    "peer_trl": ("peer", ""),  # the TRL side: every peer run
    "peer_settings": ("peer", ""),  # TRL's arguments and the settings table: every peer run
    "common": ("weight-sync", ""),  # model shapes and --json writing: most benches' runs
    "learning_losses": ("learning", "--losses"),  # the per-loss table
}


def test_every_shipped_benchmark_has_a_smoke_run() -> None:
    assert set(BENCHES) == {b for b, _ in SMOKE.values()} | COVERED_ELSEWHERE


def test_every_bench_module_is_run_by_a_test() -> None:
    """Each module of asyncrl/bench is a shipped benchmark or a part of one whose smoke (or
    covered-elsewhere) run drives it: a module no test runs would break silently."""
    folder = Path(__file__).resolve().parents[2] / "asyncrl" / "bench"
    mains = {module.rsplit(".", 1)[1] for module, _ in BENCHES.values()}
    modules = {f.stem for f in folder.glob("*.py")} - {"__init__"}
    assert modules == mains | set(PARTS), modules ^ (mains | set(PARTS))
    for part, (bench, flag) in PARTS.items():
        assert bench in BENCHES, part
        if flag:  # the smoke entry that runs this part passes its flag
            runs = [args for b, args in SMOKE.values() if b == bench]
            assert any(a.split("=")[0] == flag for args in runs for a in args), part


class _Runs:
    """Starts the selected benches' CLI processes in a thread, at most ``AT_ONCE`` at a time
    (more only contend for the two cores), the longest first."""

    AT_ONCE = 2

    def __init__(self, todo: list[tuple[str, list[str], Path]]):
        self.procs: dict[str, Proc] = {}
        self.started = {test_id: threading.Event() for test_id, _, _ in todo}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(todo,), daemon=True)
        self._thread.start()

    def _run(self, todo: list[tuple[str, list[str], Path]]) -> None:
        for test_id, cmd, folder in todo:
            while sum(p.poll() is None for p in self.procs.values()) >= self.AT_ONCE:
                if self._stop.wait(0.05):
                    return
            if self._stop.is_set():
                return
            tmp = folder / "tmp"  # the bench's temporary files: none may be left behind
            tmp.mkdir()
            env = python_env({"TMPDIR": str(tmp)})
            self.procs[test_id] = spawn_shared(cmd, folder / "log", env)  # forked: no imports
            self.started[test_id].set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        stop(list(self.procs.values()))


@pytest.fixture(scope="module")
def runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[tuple[_Runs, dict[str, Path]]]:
    """The selected benches, started in the background; test id -> folder holding its
    ``out.json`` and ``log``."""
    wanted = {
        item.callspec.params["bench"]
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec")
    }
    todo, folders = [], {}
    for test_id in [t for t in SMOKE if t in wanted]:  # SMOKE lists the longest first
        name, args = SMOKE[test_id]
        folder = folders[test_id] = tmp_path_factory.mktemp(test_id)
        if name == "generation":
            args = [*args, f"--model-path={tiny_model_dir}"]
        cmd = ["-m", "asyncrl.cli", "bench", name, *args, f"--json={folder / 'out.json'}"]
        todo.append((test_id, cmd, folder))
    pool = _Runs(todo)
    try:
        yield pool, folders
    finally:
        pool.close()


def _transport(res: dict[str, Any], out: str) -> None:
    assert "headline (group 8)" in out
    assert res["msgspec_zmq_eps"] > 0 and res["pickle_baseline_eps"] > 0 and res["speedup"] > 0
    assert res["group_size"] == 8 and res["runs"]
    assert "CURVE on vs off over tcp" in out  # CURVE's cost, measured in the same run
    c = res["curve"]
    assert c["frames_eps_on"] > 0 and c["frames_eps_off"] > 0 and c["shm_eps_off"] > 0
    assert {r["impl"] for r in res["runs"]} >= {"frames", "frames_plain", "shm_plain"}


def _controller(res: dict[str, Any], out: str) -> None:
    assert "speedup vs naive" in out
    assert res["episodes"] == 2000
    assert res["episodes_per_s"] > 0 and res["naive_episodes_per_s"] > 0


def _train(res: dict[str, Any], out: str) -> None:
    assert "engine/plain" in out
    assert [r["budget"] for r in res["rows"]] == [256]
    assert res["engine_tokens_per_s"] > 0 and res["plain_tokens_per_s"] > 0


def _generation(res: dict[str, Any], out: str) -> None:
    assert "speedup engine / hf generate" in out
    assert res["requests"] == 4 and res["output_tokens"] > 0
    assert res["engine_tokens_per_s"] > 0 and res["hf_generate_tokens_per_s"] > 0
    assert "engine lora-mixed" in out and res["lora_rank"] == 4
    assert res["lora_tokens_per_s"] > 0 and res["lora_mixed_vs_base"] > 0


def _gateway(res: dict[str, Any], out: str) -> None:
    assert "added by the gateway (openai client, stream, concurrency 2)" in out
    rows = {(r["path"], r["mode"], r["concurrency"]): r for r in res["rows"]}
    assert len(rows) == 12  # engine, gateway, gateway-http x whole, stream x concurrency 1, 2
    for (_path, mode, conc), r in rows.items():
        assert r["requests"] == (2 if conc == 1 else 4) and r["tokens"] == 3 * r["requests"]
        assert r["requests_per_s"] > 0 and r["latency_p50_ms"] > 0
        assert (r["ttft_p50_ms"] is not None) == (mode == "stream")
    assert "added by the gateway, paired (http client, whole" in out
    paired = {(a["client"], a["mode"]): a for a in res["paired"]}
    assert set(paired) == {(c, m) for c in ("http", "openai") for m in ("whole", "stream")}
    assert all(a["requests"] == 2 for a in paired.values())  # 1 serial session x 2 turns
    assert "pass-through proxy floor p50" in out  # the baseline of the paired phase
    assert all(a["floor_p50_ms"] == a["floor_p50_ms"] for a in paired.values())  # not NaN
    assert res["hold"]["errors"] == 0 and res["hold"]["open_at_peak"] == 4
    assert res["hold"]["trajectories"] == 4


def _weight_sync_delta(res: list[dict[str, Any]], out: str) -> None:
    assert "sender_bytes_per_param" in out.splitlines()[0]
    rows = {r["mode"]: r for r in res}
    assert set(rows) == {"full", "delta"} and all(r["verified"] is True for r in res)
    full, delta = rows["full"], rows["delta"]
    assert delta["delta_pushes"] == delta["pushes"] == 1 and full["delta_pushes"] == 0
    assert delta["wire_bytes"] < full["wire_bytes"] == full["bytes"]
    # one staging copy of the bf16 bytes; the delta sender: its bases, one scratch bucket (the
    # tiny model is one bucket) and a compare mask
    assert full["sender_bytes_per_param"] == 2.0
    assert 2.0 < delta["sender_bytes_per_param"] <= 2.0 + 2.0 + 2.0 / 8
    assert delta["tree_peak_rss_bytes"] >= delta["tree_rss_after_bytes"] > 0


def _weight_sync_lora(res: list[dict[str, Any]], out: str) -> None:
    assert "bytes_vs_full" in out.splitlines()[0]
    full, lora = res
    assert (full["mode"], lora["mode"], lora["rank"]) == ("full", "lora", 4)
    assert all(r["verified"] is True and r["total_s"] > 0 for r in res)
    # the tiny model (hidden 64, kv 32, intermediate 128, vocab 1024): in + out of q, k, v, o,
    # gate, up, down per layer, 2 layers, and the head; rank 4, float32
    per_layer = 128 + 96 + 96 + 128 + 192 + 192 + 192
    want = (2 * per_layer + 64 + 1024) * 4 * 4
    assert lora["tensors"] == 30 and lora["bytes"] == want < full["bytes"]
    assert lora["bytes_vs_full"] == full["bytes"] / want


def _trace(res: dict[str, Any], out: str) -> None:
    assert "per span" in out
    assert [r["traced"] for r in res["runs"]] == [False, True]
    assert res["events"] > 0 and res["span_cost_us"] > 0 and res["cost_frac"] > 0


def _learning(res: dict[str, Any], out: str) -> None:
    assert "async_decoupled  mean" in out and "1 / (1 - idle)" in out
    assert [r["arm"] for r in res["runs"]] == ["sync", "async_decoupled"]
    assert res["config"]["workload"] == "longtail"
    assert res["async_decoupled_wall_s"] > 0 and "0.5" in res["async_decoupled_time_to"]
    assert all(r["samples"] == 2 * 2 * 2 for r in res["runs"])  # steps x groups x group size
    assert 0.0 <= res["sync_trainer_idle"] <= 1.0 and res["overlap_ceiling"] >= 1.0
    assert "0.9" in res["async_decoupled_time_ratio"]


def _learning_losses(res: dict[str, Any], out: str) -> None:
    assert "rpp_baseline" in out and "NOT reached" in out  # 2 steps: no 10-step window
    assert [(r["loss"], r["steps"], r["steps_to"]) for r in res["runs"]] == [
        ("rpp_baseline", 2, None)
    ]
    assert res["losses"]["rpp_baseline"]["reached"] is False and res["target"] == 0.9


def _pipeline(res: dict[str, Any], out: str) -> None:
    assert "speedup" in out and "trainer idle" in out and "CPU bound: async" in out
    assert 0 < res["cpu_bound_s_per_step_async"] and 0 < res["cpu_bound_s_per_step_sync"]
    assert res["steps"] == 2 and res["samples_per_step"] == 4
    assert res["sync_s"] > 0 and res["async_s"] > 0 and res["staleness_violations"] == 0


def _peer(res: dict[str, Any], out: str) -> None:
    assert "settings (asyncrl run | TRL GRPOTrainer)" in out and "differences that remain" in out
    assert "asyncrl / trl-t1:" in out
    assert [(r["side"], r["threads"]) for r in res["runs"]] == [("asyncrl", "1+1"), ("trl", "1")]
    for r in res["runs"]:  # both sides trained the default job's batches: 3 steps of 32 x 8
        assert r["steps"] == 3 and r["samples"] == 3 * 32 * 8, r
        assert r["train_s"] > 0 and 0.0 <= r["final_reward"] <= 1.0
        assert set(r["reach"]) == {"0.5", "0.9"}  # fewer than 10 steps: neither reached
    trl = res["runs"][1]
    assert trl["gen_s"] > 0 and trl["config"]["num_generations"] == 8 and trl["torch_threads"] == 1
    assert trl["config"]["ref_model"] is False and trl["config"]["dtype"] == "float32"
    assert trl["versions"]["trl"] == "1.16.0"
    assert any(d.startswith("asynchrony:") for d in res["differences"])
    assert res["ratio_asyncrl_over"]["trl-t1"]["train_s"] > 0


CHECKS: dict[str, Callable[[Any, str], None]] = {
    "transport": _transport,
    "controller": _controller,
    "train": _train,
    "generation": _generation,
    "gateway": _gateway,
    "weight-sync-delta": _weight_sync_delta,
    "weight-sync-lora": _weight_sync_lora,
    "trace": _trace,
    "learning": _learning,
    "learning-losses": _learning_losses,
    "pipeline": _pipeline,
    "peer": _peer,
}


@pytest.mark.timeout(TIMEOUT_S * 2)
@pytest.mark.parametrize("bench", list(SMOKE))
def test_bench_runs_prints_its_table_and_writes_its_json(
    bench: str, runs: tuple[_Runs, dict[str, Path]]
) -> None:
    pool, folders = runs
    assert pool.started[bench].wait(TIMEOUT_S), f"{bench} was not started"
    proc = pool.procs[bench]
    try:
        code = proc.wait(TIMEOUT_S)
    finally:
        stop([proc])
    out = (folders[bench] / "log").read_text(errors="replace")
    assert code == 0, out[-4000:]
    CHECKS[bench](json.loads((folders[bench] / "out.json").read_text()), out)
    # a passing run removes its processes' log folders (a failing one keeps and names them)
    assert not list((folders[bench] / "tmp").glob("asyncrl-bench-*"))


def test_weight_sync_into_the_vllm_standin(tmp_path: Path) -> None:
    """``bench weight-sync --engine vllm`` at the tiny shapes into the vLLM 0.33 stand-in
    (tests/engines/rollout/vllm/standin.py, ``--no-truth``): the embedded and vLLM rows side
    by side with the same columns and bytes, each push verified (vLLM's: every tensor's
    ``/weight_checker`` sha256 = the sender's), the vLLM pushes through vLLM's session routes."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncrl.bench.weight_sync import MODELS
    from asyncrl.procs import finish
    from tests.engines.rollout.vllm.server import start_vllm

    model_dir = tmp_path / "tiny-shapes"
    Qwen2ForCausalLM(Qwen2Config(**MODELS["tiny"])).save_pretrained(model_dir)
    server = start_vllm(model_dir, tmp_path / "vllm", flags=("--no-truth",))
    try:
        out = tmp_path / "out.json"
        cmd = ["-m", "asyncrl.cli", "bench", "weight-sync", "--engine=vllm", f"--urls={server.url}"]
        cmd += ["--model=tiny", "--dtype=float32", "--repeats=1", "--modes=overlap,full-verify"]
        cmd += ["--bucket-mb=1", f"--json={out}"]
        code, log = finish(spawn_shared(cmd, tmp_path / "log", python_env()), TIMEOUT_S)
        log = (tmp_path / "log").read_text(errors="replace")
        assert code == 0, log[-4000:]
        rows = json.loads(out.read_text())
        assert [(r["engine"], r["mode"]) for r in rows] == [
            ("embedded", "overlap"), ("embedded", "full-verify"),
            ("vllm", "overlap"), ("vllm", "full-verify"),
        ]  # fmt: skip
        assert all(r["verified"] is True and r["total_s"] > 0 for r in rows), rows
        assert len({r["bytes"] for r in rows}) == 1 and len({frozenset(r) for r in rows}) == 1
        assert rows[0]["naive_s"] is not None and rows[2]["naive_s"] is None
        assert log.splitlines()[0].startswith("engine | backend | mode")
        paths = [c["path"] for c in server.wire()]
        assert paths.count("/finish_weight_update") == 2 * (2 + 1)  # 2 modes x (warm-ups + 1)
        assert paths.count("/weight_checker") == 2 * (3 + 1)  # each push (one engine), the check
    finally:
        server.stop()


def test_weight_sync_over_an_emulated_link(tmp_path: Path) -> None:
    """``bench weight-sync --link-gbit 1``: the engine and the floor's peer in a network
    namespace of their own behind a veth pair shaped to 1 Gbit/s, every push verified across
    it, the namespace gone afterwards. Without root, the bench refuses at once, saying why."""
    import subprocess

    from asyncrl.bench.netlink import refusal
    from asyncrl.procs import finish

    out = tmp_path / "out.json"
    cmd = ["-m", "asyncrl.cli", "bench", "weight-sync", "--model=tiny", "--link-gbit", "1"]
    cmd += ["--repeats=1", "--modes=overlap", "--no-naive", f"--json={out}"]
    bench = spawn_shared(cmd, tmp_path / "log", python_env())
    code, _ = finish(bench, TIMEOUT_S)
    log = (tmp_path / "log").read_text(errors="replace")
    why = refusal()
    if why:  # not root (or no iproute2): a clear refusal before anything is made
        assert code == 2 and why in log, log[-2000:]
        return
    assert code == 0, log[-4000:]
    (row,) = json.loads(out.read_text())
    assert row["link_gbit"] == 1 and row["verified"] is True and row["floor_s"] > 0
    assert row["send_host"].startswith("10.213.") and row["recv_host"].startswith("10.213.")
    assert "-- link: 1 Gbit/s" in log
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"asyncrl-link-{bench.pid}-" not in listed, listed  # removed on the way out
