"""SecAgg+ over a real loopback deployment: TLS SuperLink, 3 authenticated SuperNodes.

The instrumented app ``tests/secagg-app`` runs DiLoCo (tiny LLaMA, uniform weights, 1 round)
plain and under SecAgg+ as two concurrent runs on the same deployment. Asserted:

- both runs complete;
- the round's g under SecAgg+ is the mean of the true pseudo-gradients (written by the
  clients) to within SecAgg+'s quantisation step ``2c/Q`` = 16 / 2^22 = 3.8e-6 per entry
  (uniform weights: each client's stochastic rounding errs by less than one step), plus fp32
  rounding, and equals the plain run's g to within the same bound (same start model);
- the final model equals the plain run's to within ``lr (1 + mu)`` times that bound (one
  Nesterov outer step from the same start: 6.5e-6 per entry), and so do the val losses;
- no single update reached the ServerApp: under SecAgg+ every array in every reply the
  ServerApp received is a masked integer vector, none equal (nor, dequantised, close or
  correlated) to any client's pseudo-gradient; in the plain run the same recorder does see
  the clients' weights (the instrument works).

Several rounds under SecAgg+ (fresh keys and masks each round, global round numbers) are
asserted in-process in ``tests/test_secagg.py``. Select with ``pytest -m deployment``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from deploy_harness import loopback_deployment

pytestmark = pytest.mark.deployment

APP = Path(__file__).resolve().parent / "secagg-app"
STEP = 16 / 2**22
LR, MU = 0.7, 0.9


def _deltas(out: Path, tag: str, rnd: int) -> list[dict[str, np.ndarray]]:
    files = sorted(out.glob(f"{tag}-delta-p*-r{rnd}.npz"))
    return [dict(np.load(f)) for f in files]


def _received(out: Path, tag: str) -> list[np.ndarray]:
    with np.load(out / f"{tag}-received.npz") as z:
        return [z[k] for k in z.files]


def test_secagg_over_tls_equals_plain_and_hides_every_update(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with loopback_deployment(tmp_path / "dep", num_supernodes=3) as dep:
        started = {
            tag: dep.start_app(APP, {"secagg": secagg, "tag": tag, "output-dir": str(out)}, 400)
            for tag, secagg in (("plain", False), ("secagg", True))
        }
        runs = {tag: run.wait() for tag, run in started.items()}
        for tag, run in runs.items():
            assert run.status == "finished:completed", (
                tag + run.output + run.logs + dep.diagnostics()
            )
    res = {t: json.loads((out / f"{t}-results.json").read_text()) for t in runs}
    g = {t: dict(np.load(out / f"{t}-g.npz")) for t in runs}
    ds = _deltas(out, "secagg", 1)
    assert len(ds) == 3
    assert {f"r1/{k}" for k in ds[0]} == set(g["secagg"]) == set(g["plain"])
    g_bound = 0.0
    for k in ds[0]:
        if not np.issubdtype(ds[0][k].dtype, np.floating):
            continue
        mean = sum(d[k].astype(np.float64) for d in ds) / 3
        bound = STEP + 4e-7 * np.abs(mean).max() + 1e-7
        g_bound = max(g_bound, bound)
        err = np.abs(g["secagg"][f"r1/{k}"] - mean).max()
        assert err < bound, (k, err)
        err_plain = np.abs(g["secagg"][f"r1/{k}"] - g["plain"][f"r1/{k}"]).max()
        assert err_plain < bound, (k, err_plain)
    final = {t: dict(np.load(out / f"{t}-final.npz")) for t in runs}
    diff = max(np.abs(final["plain"][k] - final["secagg"][k]).max() for k in final["plain"])
    # One outer step theta - lr (g + mu g) from the same theta; 1e-6: fp32 rounding of theta.
    assert diff < LR * (1 + MU) * g_bound + 1e-6, diff
    losses = {t: res[t]["rounds"][-1]["val-loss"] for t in runs}
    assert abs(losses["plain"] - losses["secagg"]) < 1e-4
    assert losses["secagg"] < res["secagg"]["initial-val-loss"]
    # The instrument sees the clients' uploads in the plain run ...
    plain_rx = _received(out, "plain")
    assert any(np.issubdtype(a.dtype, np.floating) for a in plain_rx)
    # ... and under SecAgg+ only masked integer vectors, none close to a pseudo-gradient.
    rx = _received(out, "secagg")
    assert rx and all(np.issubdtype(a.dtype, np.integer) for a in rx)
    flat = [d[k].ravel() for d in ds for k in d]
    for a in rx:
        deq = a.ravel().astype(np.float64) * STEP - 8.0
        for d in flat:
            if d.size == a.size and d.size > 1:
                assert not np.allclose(deq, d, atol=1e-3) and not np.array_equal(a.ravel(), d)
                if d.size >= 256:
                    assert abs(np.corrcoef(deq, d)[0, 1]) < 0.3
    m = {t: res[t]["rounds"][-1] for t in runs}
    print(
        f"\nSECAGG-DEPLOYMENT plain val {losses['plain']:.6f} secagg {losses['secagg']:.6f} "
        f"|final diff| {diff:.3g} wall plain {runs['plain'].wall_s:.1f} s secagg "
        f"{runs['secagg'].wall_s:.1f} s (strategy {res['plain']['wall-s']:.1f} / "
        f"{res['secagg']['wall-s']:.1f} s) bytes-up/round plain {m['plain']['bytes-up']} "
        f"secagg {m['secagg']['bytes-up']} bytes-down/round plain {m['plain']['bytes-down']} "
        f"secagg {m['secagg']['bytes-down']} received arrays {len(rx)}"
    )
