"""A SuperNode SIGKILLed mid-upload does not hold the round (loopback deployment).

Flower 1.42's ``pull_messages`` retries the objects of a reply whose upload never completed
until the SuperLink drops the push session (180 s); the round drivers pull in a daemon thread
they never wait for past the round's deadline (``flwr_isoloco/strategies/core/pull.py``). The
scenario is ``benchmarks/faults/blocked_pull.py``'s ``grace`` (``run_once``): synchronous
DiLoCo, ``Rounds(quorum=2, grace_s=20)``, 60 s round timeout, 3 TLS SuperNodes; the two fast
nodes reply, then partition 2 replies with 256 MB and its SuperNode is SIGKILLed 0.3 s after it
logs ``Sending: train message``. Measured by the benchmark: the round took 189-193 s before
the pull change and 26-28 s after it (quorum + grace). Select with ``pytest -m deployment``
(measured: 49 s on 2 shared cores at load ~3.6).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "faults"))

from blocked_pull import run_once  # noqa: E402

pytestmark = pytest.mark.deployment


def test_a_supernode_killed_mid_upload_does_not_hold_the_round(tmp_path):
    """The round closes on its quorum and grace window, well before Flower's ~3-minute pull
    block; the killed node is named late, its upload was cut (never logged as sent); the two
    other replies are merged."""
    rec = run_once(tmp_path, "grace", kill_delay=0.3, ballast_mb=256)
    assert rec["status"] == "finished:completed", rec
    assert not rec["upload-finished-before-kill"], rec
    assert rec["round-wall-s"] < 60.0, rec
    assert rec["doomed-named-late"], rec
    assert rec["replies-arrived"] == 2 and rec["replies-used"] == 2, rec
    assert rec["final-params"] == pytest.approx([0.1875, 0.1875])  # mean of 0.125 and 0.25
    print(f"\nblocked pull: round {rec['round-wall-s']} s, run {rec['run-wall-s']} s")
