"""``asyncrl bench fuzz``, small (the full size is the benchmark's own default): a real
engine and a real experience channel take hostile input; every request answered (no 5xx),
every malformed message rejected and counted, every frame over the size limit a cut that
is restored (not a reject), the valid messages after it all bit-exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.forkserver import spawn_shared
from asyncrl.procs import finish, python_env

REQUESTS, MESSAGES, PRODUCER_MESSAGES, CUTS, HEAVY = 100, 200, 60, 2, 1
GATEWAY_REQUESTS = 80


@pytest.mark.timeout(120)
def test_bench_fuzz_small(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "fuzz.json"
    args = ["--requests", REQUESTS, "--concurrency", 16, "--messages", MESSAGES,
            "--producer-messages", PRODUCER_MESSAGES, "--cuts", CUTS, "--heavy", HEAVY,
            "--limit-mb", 1, "--model-path", tiny_model_dir, "--json", out,
            "--gateway-requests", GATEWAY_REQUESTS]  # fmt: skip
    log = tmp_path / "log"
    cmd = ["-m", "asyncrl.cli", "bench", "fuzz", *map(str, args)]
    code, _ = finish(spawn_shared(cmd, log, python_env()), 100)  # forked: no imports
    text = log.read_text(errors="replace")
    assert code == 0, text[-4000:]
    assert "asyncrl serve" in text and "experience -> consumer" in text
    res = json.loads(out.read_text())
    assert res["failures"] == []
    h, e = res["http"], res["experience"]
    assert h["sent"] == REQUESTS and h["5xx"] == 0 and h["unanswered"] == 0
    assert h["greedy_unchanged"] and h["alive"]
    c, p = e["consumer"], e["producer"]
    # every message but the cuts is a reject, counted once; each cut is one reconnect
    assert c["sent"] == MESSAGES and c["cuts_sent"] == CUTS
    assert c["rejected"] == c["expected_rejects"] == MESSAGES - CUTS
    assert sum(c["rejected_by"].values()) == c["rejected"]
    assert c["reconnects"] == CUTS
    # under a 1 MiB limit the 7.7 MB header is one frame over it: not sent as a reject
    kinds = c["sent_by_kind"]
    assert kinds["total_over_limit"] == kinds["header_over_cap"] == HEAVY
    assert "million_trajectories" not in kinds
    assert p["sent"] == PRODUCER_MESSAGES and p["cuts_sent"] == p["cuts_seen"] == CUTS
    assert p["rejected"] == p["expected_rejects"] == PRODUCER_MESSAGES - CUTS
    assert p["disconnects"] >= CUTS
    assert e["valid_after"] == {"bit_exact": True, "report_received": True}
    g = res["gateway"]  # hostile OpenAI requests: 4xx in OpenAI's JSON, retries one turn
    assert "http -> gateway" in text and g["sent"] >= GATEWAY_REQUESTS
    assert g["5xx"] == g["unanswered"] == g["not_openai_error"] == 0 and g["alive"]
    assert g["by_status"].get("400", 0) > 0 and g["retried_sessions"] > 0
    assert g["recorded_twice"] == g["retried_without_turn"] == 0
