"""Compressed uploads through the loopback TLS deployment (SuperLink + 3 authenticated
SuperNodes, ``flwr run`` of the isoloco-lm app): every reply used, bytes-up about a quarter.

Select alone with ``pytest -m deployment tests/test_compression_deployment.py``.
"""

from __future__ import annotations

import json

import pytest
from test_deployment import ISOLOCO_APP, ISOLOCO_CONFIG, deployment  # noqa: F401 - fixture

pytestmark = pytest.mark.deployment


def test_isoloco_int8_uploads_over_tls(deployment, tmp_path):  # noqa: F811
    out = tmp_path / "isoloco-int8"
    cfg = {**ISOLOCO_CONFIG, "output-dir": str(out), "strategy.upload-codec": "int8"}
    run = deployment.run_app(ISOLOCO_APP, cfg, 600)
    assert run.status == "finished:completed", run.output + run.logs + deployment.diagnostics()
    results = json.loads((out / "results.json").read_text())
    rounds = results["rounds"]
    assert [r["replies-used"] for r in rounds] == [3] * ISOLOCO_CONFIG["num-server-rounds"]
    ratio = [r["bytes-up"] / r["bytes-down"] for r in rounds]  # both over the same 3 nodes
    assert all(0.24 < q < 0.3 for q in ratio), ratio
    assert rounds[-1]["val-loss"] < results["initial"]["val-loss"]
    print(
        f"\nint8 over TLS: bytes-up {rounds[0]['bytes-up']} vs down {rounds[0]['bytes-down']}"
        f" (ratio {ratio[0]:.4f}), final val loss {rounds[-1]['val-loss']:.4f},"
        f" wall {run.wall_s:.1f} s"
    )
