"""Quorum and grace window in a real Ray simulation (benchmarks/faults/straggler.py --quick).

3 nodes, one answering 10x slower; quorum 2, grace 1 s, 3 rounds. Slow (two Ray starts).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "faults"))


def test_straggler_is_late_discarded_and_the_model_is_the_fast_merge():
    import straggler

    s = straggler.main(["--quick"])
    q = s["quorum_n_minus_1"]
    assert q["replies_used"] == [2, 2, 2]
    assert all(n == 1 for n in q["replies_late"])
    assert any("closed without the reply of node" in line for line in q["log"])
    # the slow node's round-1 reply came during a later round and was not merged
    assert any(rnd == 1 for _, rnd in q["discarded"])
    assert s["round1_model_equals_in_process_merge_of_fast_replies"] is True
