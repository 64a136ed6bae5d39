"""benchmarks/privacy/weight_bound_bench.py --quick: real Ray runs, one malicious site, bound off vs on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def test_quick_attack_bound_off_vs_on(tmp_path):
    out = tmp_path / "wb.json"
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "privacy" / "weight_bound_bench.py"),
        "--quick",
        "--strategies",
        "isoloco",
        "--cases",
        "attack-off",
        "attack-on",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, timeout=600, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = {r["case"]: r for r in json.loads(out.read_text())}
    off, on = recs["attack-off"], recs["attack-on"]
    assert off["status"] == on["status"] == "completed"
    assert off["replies_used"] == on["replies_used"] == [8, 8, 8]  # the attacker is not dropped
    # unbounded, the reversed update with weight 1e12 owns the merge: the loss rises
    assert off["val_loss"][-1] > off["initial_val_loss"]
    # bounded, the honest majority still trains the model
    assert on["val_loss"][-1] < on["initial_val_loss"] < off["val_loss"][-1]
