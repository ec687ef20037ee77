"""`asyncrl bench faults`, kept short: the trainer SIGKILLed, both engines SIGKILLed in turn
and the run process SIGKILLed, each survived with nothing lost (real CLI runs of the tiny
default job)."""

from __future__ import annotations

import json
from pathlib import Path

from asyncrl.bench.faults import main


def test_bench_faults_nothing_lost(tmp_path: Path) -> None:
    out = tmp_path / "faults.json"
    main(
        [
            "--steps=12",
            "--every=4",
            "--kill-at=5",
            "--scenarios=trainer,engines,run",
            # engine 1 dies while engine 0 is still restarting: the run cannot reach its last
            # step before an engine is back (with kills at 5 and 8 of 12 steps the run could
            # end before the second engine was re-admitted, whose admission is then unrecorded)
            "--engine-kills=3,4",
            f"--json={out}",
            f"--root={tmp_path}",
            "--timeout=240",
            "--controller.batch_size=4",
            "--controller.max_staleness=2",
        ]
    )
    results = {r["scenario"]: r for r in json.loads(out.read_text())["results"]}
    for r in results.values():
        assert r["steps"] == 12 and r["samples_lost"] == 0 and r["staleness_violations"] == 0
        assert r["groups_failed"] == 0, r
        assert r["checkpoints"] >= 1 and r["stall_per_checkpoint_s"] >= 0
    assert results["trainer"]["steps_redone"] >= 1 and results["trainer"]["recovery_s"] > 0
    # engine deaths: each engine restarted and re-synced by the running trainer, no step redone
    engines = results["engines"]
    assert engines["engine_restarts"] >= 1 and engines["trainer_restarts"] == 0, engines
    assert engines["steps_redone"] == 0 and engines["recovery_s"] > 0
    assert results["run"]["left_after_kill"] == 0 and results["run"]["recovery_s"] > 0


def test_bench_soak_strikes_each_kind_and_loses_nothing(tmp_path: Path) -> None:
    """``asyncrl bench soak`` kept short: engines and the trainer SIGKILLed and an engine
    hung at random 1-2 s intervals, in shuffled rounds; the run still trains every step
    exactly once, loses no sample and leaves nothing behind (the bench itself exits non-zero
    otherwise)."""
    from asyncrl.bench.soak import main as soak

    out = tmp_path / "soak.json"
    soak(
        [
            "--steps=40",
            "--every=5",
            "--kill-every=1,2",
            "--hang-s=1.5",
            "--timeout=300",
            f"--json={out}",
            f"--root={tmp_path}",
            "--controller.batch_size=4",
            "--controller.max_staleness=2",
        ]
    )
    r = json.loads(out.read_text())["result"]
    assert r["steps"] == 40 and r["steps_exactly_once"] and r["samples_lost"] == 0, r
    assert r["left"] == [] and r["rss_start_mb"] > 0 and r["budget_per_window"] == 601
    assert sum(r["faults"].values()) >= 1, r  # at least one strike landed before the end
    assert set(r["faults"]) == {"engine", "trainer", "hang"}
