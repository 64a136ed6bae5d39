"""The load benchmark's record code (``benchmarks/faults/chaos_load.py``), no deployment."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "faults"))

import chaos_load as cl  # noqa: E402


def _record(**kw) -> dict:
    rec = {
        "mode": "load", "size": "smollm2-shapes", "supernodes": 4, "database": "on-disk",
        "per_round": 2, "rounds_planned": 2, "rounds_completed": 2, "status": "ok",
        "started_utc": "16:00:00", "load_avg_start": [3.0, 3.0, 3.0], "load_avg_end": [4.0, 4, 4],
        "sent_per_round": [2, 2], "round_wall_s": [61.2, 40.7], "message_mb_down": 538.1,
        "message_mb_up": 538.1, "db_bytes_end": 2_000_000, "db_bytes_peak": 1_100_000_000,
        "peak_rss_mb": {"superlink": 1500, "serverapp": 3000, "supernode": 1200, "clientapp": 2000},
        "peak_total_rss_mb": {"superlink": 1500, "superexec": 100, "serverapp": 3000,
                              "supernode": 2000, "clientapp": 4000},
        "max_processes": {"clientapp": 2}, "peak_all_rss_mb": 9000, "commit": "abc1234",
        "replies_used": [2, 1], "replies_lost": [0, 1],
    }  # fmt: skip
    return {**rec, **kw}


def test_fraction_samples_exactly_k():
    for n in range(1, 65):
        for k in range(1, n + 1):
            assert min(n, int(n * cl.fraction_for(n, k))) == k


def test_overrides_parse_the_size_presets():
    got = cl.overrides(cl.SIZES["smollm2-shapes"] + ["model.name-or-path='x'", "a=true", "b=0.5"])
    assert got["model.vocab-size"] == 24576 and got["model.name-or-path"] == "x"
    assert got["a"] is True and got["b"] == 0.5
    # SmolLM2-135M's parameter count: 30 layers, untied 24576 x 576 embedding and head
    layer = 2 * 576 * 576 + 2 * 192 * 576 + 3 * 576 * 1536 + 2 * 576
    assert 30 * layer + 576 + 2 * 24576 * 576 == 134_515_008


def test_results_fields_per_message_sizes():
    rounds = [
        {"replies-used": 2, "replies-rejected": 0, "replies-missing": 1, "bytes-down": 3e9,
         "bytes-up": 2e9, "round-wall-s": 10.04, "aggregation-time-s": 1.0, "val-loss": 3.0},
    ]  # fmt: skip
    f = cl.results_fields({"status": "completed", "rounds": rounds})
    assert f["sent_per_round"] == [3] and f["message_mb_down"] == 1000.0
    assert f["message_mb_up"] == 1000.0 and f["round_wall_s"] == [10.0]


def test_estimate_adds_idle_pairs_held_nodes_and_clientapps():
    idle = {"supernode": 130.0, "superexec": 120.0}
    recs = [_record(idle_rss_mb=idle), _record(supernodes=8, status="failed")]
    # 28 more idle SuperNode + SuperExec pairs; held(32, 2, 2) = held(4, 2, 2) = 2
    assert cl.estimate_gb(recs, "smollm2-shapes", 32, 2, 2) == (9000 + 28 * 250) / 1024
    # held(32, 4, 3) = 8: 6 more at 1200 - 130; 2 more ClientApp + SuperNode peaks
    want = 9000 + 28 * 250 + 6 * 1070 + 2 * 3200
    assert cl.estimate_gb(recs, "smollm2-shapes", 32, 4, 3) == want / 1024
    assert cl.estimate_gb(recs, "tiny-synthetic", 32, 4, 2) is None
    series = {"supernode": [[0.0, 130.0], [5.0, 900.0]], "superexec": [[0.0, 120.0]]}
    old = [_record(rss_mb_over_time=series)]  # no idle_rss_mb: the series' first samples
    assert cl.estimate_gb(old, "smollm2-shapes", 32, 2, 2) == (9000 + 28 * 250) / 1024


def test_recorded_and_table():
    recs = [_record(), _record(database="in-memory", status="failed")]
    cell = {k: recs[0][k] for k in cl.KEY}
    assert cl.recorded(recs, cell)
    assert not cl.recorded(recs, {**cell, "database": "in-memory"})  # failed: run again
    text = cl.table(recs)
    lines = text.splitlines()
    assert len(lines) == 4 and lines[1].count("|") == lines[0].count("|")
    assert "| 4 | on-disk | 2 (2/2) | 538 / 538 | 2 / 2 | 2/1 (1) | 61, 41 |" in lines[2]
    assert "| 2 (1100) |" in lines[2] and "| - |" in lines[3]  # DB MB: file, none in memory
