"""The drop-in's merge under label skew (issue 34, item 7): no singular direction raised more
than ``max_gain``.

The uncapped ``iso_c_matched`` raised the weak directions of the mean 100-2000 x, and a truly
rank-1 classifier pseudo-gradient (two classes: its rows are opposite) that is numerically rank 2
got half its step in the round-off direction (benchmarks/dropin/label_skew.py --diagnose). Checked here
against an independent numpy computation (SVD + bisection for the level), on that classifier
case, on the option's checks, and end to end on the breast-cancer app with Dirichlet(0.1)
shards, where the uncapped merge collapsed (seed 1: 0.657, FedAvg 0.874).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from flwr_isoloco.merging import MERGE_RULES, StreamingMerger, merge
from flwr_isoloco.merging.iso_range import MAX_GAIN, iso_c_matched


def _numpy_capped(x: np.ndarray, kappa: float) -> np.ndarray:
    """``U diag(min(t, kappa s)) V^T`` with ``sum min(t, kappa s)^2 = sum s^2``, ``t`` by
    bisection (an independent computation of the level)."""
    u, s, vh = np.linalg.svd(x, full_matrices=False)
    target, lo, hi = (s**2).sum(), 0.0, float(s[0])
    for _ in range(200):
        t = (lo + hi) / 2
        lo, hi = (t, hi) if (np.minimum(t, kappa * s) ** 2).sum() < target else (lo, t)
    return (u * np.minimum(hi, kappa * s)) @ vh


def _uneven(m: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(0, -4, n, dtype=torch.float64)
    return torch.randn(m, n, generator=g, dtype=torch.float64) * scale


@pytest.mark.parametrize("shape", [(10, 64), (64, 10), (30, 30), (2, 32)])
@pytest.mark.parametrize("kappa", [1.0, 2.0, 5.0])
def test_capped_merge_matches_an_independent_numpy_computation(shape, kappa):
    x = _uneven(*shape, seed=sum(shape))
    out = iso_c_matched(x, max_gain=kappa)
    ref = _numpy_capped(x.numpy(), kappa)
    np.testing.assert_allclose(out.numpy(), ref, rtol=0, atol=1e-10 * np.abs(ref).max())
    assert float(out.norm()) == pytest.approx(float(x.norm()), rel=1e-12)  # the mean's norm
    gain = torch.linalg.svdvals(out) / torch.linalg.svdvals(x)
    assert float(gain.max()) <= kappa * (1 + 1e-9)
    if kappa == 1.0:
        assert torch.allclose(out, x, rtol=0, atol=1e-12)  # max_gain=1 is the mean


def test_a_rank_one_classifier_step_is_not_split_into_round_off():
    """Two classes: the rows of the classifier's pseudo-gradient are opposite, so it has rank 1;
    with round-off (here 1e-4 relative, above the rank tolerance) the uncapped merge gave the
    second direction half the step. Capped: at most ``MAX_GAIN`` x its size."""
    g = torch.Generator().manual_seed(0)
    row = torch.randn(32, generator=g)
    x = torch.stack([row, -row + 1e-4 * torch.randn(32, generator=g)])
    s = torch.linalg.svdvals(x.double())
    out = torch.linalg.svdvals(iso_c_matched(x).double())
    assert float(out[1]) <= MAX_GAIN * float(s[1]) * (1 + 1e-6)
    assert float(out[0]) == pytest.approx(float(x.double().norm()), rel=1e-6)
    old = torch.linalg.svdvals(iso_c_matched(x, max_gain=None).double())
    assert float(old[1]) > 1e3 * float(s[1])  # what the uncapped form did


def test_max_gain_is_the_registered_option_and_is_checked():
    rule = MERGE_RULES["iso_c_matched"]
    assert rule.streaming and rule.options == {"max_gain": MAX_GAIN} and MAX_GAIN == 2.0
    g = torch.Generator().manual_seed(1)
    deltas = [{"w": torch.randn(6, 20, generator=g), "b": torch.randn(6, generator=g)}]
    deltas.append({k: -0.5 * v + 0.1 for k, v in deltas[0].items()})
    mean_w = (deltas[0]["w"] + deltas[1]["w"]) / 2
    out = merge("iso_c_matched", deltas)
    assert torch.allclose(out["w"], iso_c_matched(mean_w), atol=1e-6)
    assert torch.allclose(out["b"], (deltas[0]["b"] + deltas[1]["b"]) / 2, atol=1e-6)
    old = merge("iso_c_matched", deltas, max_gain=None)
    assert torch.allclose(old["w"], iso_c_matched(mean_w, max_gain=None), atol=1e-6)
    sm = StreamingMerger("iso_c_matched", max_gain=3.0)
    for d in deltas:
        sm.add(d, 1.0)
    assert torch.allclose(sm.result()["w"], iso_c_matched(mean_w, max_gain=3.0), atol=1e-6)
    for bad in (0.5, float("nan"), float("inf"), "2", True):
        with pytest.raises(ValueError, match="max_gain"):
            StreamingMerger("iso_c_matched", max_gain=bad)
    zero = iso_c_matched(torch.zeros(3, 4))
    assert torch.equal(zero, torch.zeros(3, 4))


def test_dropin_survives_dirichlet_shards_of_the_breast_cancer_app():
    """IsoLoCo() >= FedAvg - 0.01 on benchmarks/dropin/label_skew.py's breast-cancer MLP (Adam, 5
    nodes, Dirichlet(0.1) shards, seed 1, 15 rounds), where the uncapped merge ended at 0.657
    against FedAvg's 0.874. About 2 s."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "dropin"))
    import label_skew

    from flwr_isoloco.strategies import IsoLoCo

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the benchmark runs
    try:
        fed = label_skew.run_cancer(label_skew.STRATEGIES["FedAvg"], "dir0.1", 1, 15)["final"]
        iso = label_skew.run_cancer(lambda: IsoLoCo(), "dir0.1", 1, 15)["final"]
    finally:
        torch.set_num_threads(threads)
    assert iso >= fed - 0.01, (iso, fed)


def test_the_docs_block_is_what_the_record_gives():
    """docs/strategies.md's label-skew tables are written by ``label_skew.py --docs`` from
    benchmarks/results/label_skew.json: they must not drift from it."""
    import json

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "dropin"))
    import label_skew

    saved = json.loads(label_skew.OUT.read_text())
    text = label_skew.DOCS.read_text()
    start = text.index(label_skew.BEGIN)
    stop = text.index(label_skew.END) + len(label_skew.END)
    assert text[start:stop] == label_skew.docs_block(saved)
    assert "IsoLoCo() before" in text[start:stop]  # the old default is shown beside the new
