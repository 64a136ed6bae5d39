"""benchmarks/compression/digits_frontier.py --quick: the digits app with sparseloco both ways
(download_mod in the app, the script's upload mod) against fp32, in-process."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("sklearn")

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "compression" / "digits_frontier.py"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("digits_frontier", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path_factory.mktemp("frontier") / "quick.json"
    return mod.main(["--quick", "--out", str(out)]), out


def test_sparseloco_both_ways_cuts_rounds_2_on_and_every_reply_is_used(quick):
    rec, out = quick
    from digits.task import Net

    n = sum(p.numel() for p in Net().state_dict().values())
    fp32 = rec["test"]["DiLoCo"]["fp32"]
    sparse = rec["test"]["DiLoCo"]["sparseloco, mu=0"]
    # fp32 downloads carry the model's 4 n bytes of arrays to each node every round
    assert fp32["down-arrays-per-node-round-2+"] == 4 * n
    for seed, r in sparse["seeds"].items():
        assert r["down-arrays-round-1"] == 4 * n  # round 1: the full fp32 model
        assert r["replies-used"] == [4, 4], seed  # no node refused its update or was dropped
        assert not r["errors"], r["errors"]
    # rounds 2+: array payload both ways >= 20x below fp32; Flower's count (npy headers,
    # config records) still >= 8x
    assert sparse["x-fewer-payload"]["total"] >= 20, sparse["x-fewer-payload"]
    assert sparse["x-fewer-count"]["total"] >= 8, sparse["x-fewer-count"]
    for row in (fp32, sparse):
        assert sorted(row["seeds"]) == ["0", "1"]
        accs = [r["final-accuracy"] for r in row["seeds"].values()]
        assert all(0.0 <= a <= 1.0 for a in accs) and len(set(accs)) == 2  # seeds differ
        assert row["accuracy-mean"] == pytest.approx(sum(accs) / 2)
    assert out.is_file()
