"""Central DP with adaptive clipping (issue 20): the clipping norm moves to the quantile, epsilon
and noise per round, bitwise resume, refusals."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from privacy_helpers import QUIET, flower_epsilon, start_run, through_checkpoint

from flwr_isoloco.checkpoint.spec import CheckpointError
from flwr_isoloco.merging.dp import noise_like
from flwr_isoloco.strategies import AdaptiveClipping, CentralDP, DiLoCo, IsoLoCo, LocalDP


def _z_update(z: float, count_std: float) -> float:
    """Andrew et al.'s split, written here: z^-2 = z_delta^-2 + (2 sigma_b)^-2."""
    return (z**-2 - (2 * count_std) ** -2) ** -0.5


def _adaptive(z: float, c0: float, q: float, count_std: float, lr=0.2, key=None, **kw):
    """Arguments of central DP with adaptive clipping: multiplier ``z``, initial ``C = c0``,
    target quantile ``q``, count noise ``count_std``, step ``lr``, noise key ``key`` (on the
    :data:`QUIET` federation)."""
    adaptive = AdaptiveClipping(quantile=q, count_std=count_std, lr=lr)
    dp = CentralDP(noise_multiplier=z, clipping_norm=c0, seed=key, adaptive=adaptive)
    return dict(**QUIET, **kw, privacy=dp)


def test_adaptive_clipping_norm_moves_to_the_quantile():
    """200 fixed log-normal norms, target quantile 0.3, C_0 far below: every step is the
    formula computed here, C rises while it is below the quantile, and over the last 100 of
    300 rounds the unclipped fraction of the true norms averages 0.3 within 0.05."""
    from flwr_isoloco.strategies.diloco.privacy import COUNT_NOISE_INDEX, StrategyDP

    k, q, lr, std, c = 200, 0.3, 0.2, 10.0, 0.05
    norms = torch.exp(
        torch.randn(k, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    )
    adaptive = AdaptiveClipping(quantile=q, count_std=std, lr=lr)
    dp = StrategyDP(CentralDP(noise_multiplier=1.0, clipping_norm=c, seed=7, adaptive=adaptive))
    assert dp.z_update == pytest.approx(_z_update(1.0, std), rel=1e-12)
    seen = []
    for t in range(1, 301):
        gs = dp.mechanism(t, k, ["w"])
        assert gs.z == dp.z_update and gs.c == c
        for n in norms:
            gs.clip({"w": torch.tensor([float(n)], dtype=torch.float64)})
        noise = float(noise_like(torch.zeros(()), std, 7, t, COUNT_NOISE_INDEX))
        unclipped = int((norms <= c).sum())
        want = c * math.exp(-lr * ((unclipped + noise) / k - q))
        dp.account(released=True, sent=True)
        assert dp.c == pytest.approx(want, rel=1e-14)
        if t <= 20:
            assert dp.c > c  # far below the quantile: C grows
        c = dp.c
        seen.append(float((norms <= c).double().mean()))
    assert abs(sum(seen[-100:]) / 100 - q) < 0.05
    assert dp.accountant.num_releases == 300


def test_adaptive_clipping_epsilon_and_noise_per_round():
    """A federation with adaptive C: dp-epsilon is Flower's accountant fed one event of the
    accounted z per round; the update noise is z_delta C_t / k; C_{t+1} follows the round's
    clipped count (computed here from the nodes' updates) and count noise (from the key); the
    round publishes only the noised unclipped fraction, never the exact count."""
    from flwr_isoloco.strategies.diloco.privacy import COUNT_NOISE_INDEX

    z, std, q, lr, c0, key, rounds, k = 1.1, 1.0, 0.5, 0.3, 0.05, 11, 4, 3
    s = DiLoCo(**_adaptive(z, c0, q, std, lr=lr, key=key))
    res = start_run(s, k, rounds)
    c = c0
    for r in range(1, rounds + 1):
        m = res.train_metrics_clientapp[r]
        assert m["dp-epsilon"] == pytest.approx(flower_epsilon(z, r, 1e-5, 1), rel=1e-12)
        assert m["dp-clipping-norm"] == c
        assert m["dp-noise-std"] == pytest.approx(_z_update(z, std) * c / k, rel=1e-12)
        # step_client: node pid's delta is 0.01 (pid + 1) on each of the 72 entries
        clipped = sum(0.01 * (pid + 1) * math.sqrt(72) > c for pid in range(k))
        noise = float(noise_like(torch.zeros(()), std, key, r, COUNT_NOISE_INDEX))
        released = (k - clipped + noise) / k
        assert "dp-clipped-fraction" not in m  # the exact count is what the noise protects
        assert m["dp-unclipped-fraction"] == pytest.approx(released, rel=1e-12)
        c = c * math.exp(-lr * (released - q))
    assert s.dp.c == pytest.approx(c, rel=1e-14)
    assert len({res.train_metrics_clientapp[r]["dp-clipping-norm"] for r in (1, 2, 3, 4)}) == 4


def test_adaptive_clipping_resume_keeps_the_clipping_norm_bitwise(tmp_path):
    kw = _adaptive(0.9, 0.03, 0.5, 1.0, seed=3, key=5)  # fixed key: reproducible noise
    first = DiLoCo(**kw)
    first.dp.attach_journal(tmp_path / "dp-journal.json")
    start_run(first, 3, 2)
    assert first.dp.c != 0.03
    tensors, meta = through_checkpoint(first, tmp_path)
    second = DiLoCo(**kw)
    second.dp.attach_journal(tmp_path / "dp-journal.json")
    second.load_state_dict({"tensors": tensors, "meta": meta})
    assert second.dp.c == first.dp.c  # bit for bit through the checkpoint's JSON
    rest = start_run(second, 3, 4)
    straight = DiLoCo(**{**kw, "privacy": replace(kw["privacy"], seed=first.dp.noise_key)})
    full = start_run(straight, 3, 4)
    for r in (3, 4):
        got, want = rest.train_metrics_clientapp[r], full.train_metrics_clientapp[r]
        assert got["dp-clipping-norm"] == want["dp-clipping-norm"]
    assert second.dp.c == straight.dp.c
    a, b = rest.arrays.to_torch_state_dict(), full.arrays.to_torch_state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0)
    dp = meta["dp"]
    for bad in (None, -1.0, float("nan"), "0.1"):
        forged = {**meta, "dp": {**dp, "clipping_norm": bad}}
        target = DiLoCo(**kw)
        target.dp.attach_journal(tmp_path / "dp-journal.json")
        with pytest.raises(CheckpointError, match="clipping_norm"):
            target.load_state_dict({"tensors": tensors, "meta": forged})
    fixed = {**kw, "privacy": replace(kw["privacy"], adaptive=None)}
    target = DiLoCo(**fixed)
    target.dp.attach_journal(tmp_path / "dp-journal.json")
    with pytest.raises(CheckpointError, match="adaptive clipping norm"):
        target.load_state_dict({"tensors": tensors, "meta": meta})


def test_bad_adaptive_clipping_arguments_are_refused():
    def dp(z=1.0, **adaptive):
        return CentralDP(
            noise_multiplier=z, clipping_norm=1.0, adaptive=AdaptiveClipping(**adaptive)
        )

    with pytest.raises(ValueError, match="central DP with noise"):
        DiLoCo(privacy=dp(z=0.0, quantile=0.5, count_std=1.0))
    with pytest.raises(TypeError, match="adaptive"):  # local DP has no adaptive clipping
        LocalDP(noise_multiplier=1.0, clipping_norm=1.0, adaptive=None)
    for q in (0.0, 1.0, -0.1, True, "0.5"):
        with pytest.raises(ValueError, match="quantile"):
            DiLoCo(privacy=dp(quantile=q, count_std=1.0))
    with pytest.raises(ValueError, match="lr"):
        DiLoCo(privacy=dp(quantile=0.5, count_std=1.0, lr=0.0))
    with pytest.raises(TypeError, match="count_std"):
        DiLoCo(privacy=dp(quantile=0.5))
    with pytest.raises(ValueError, match="too small"):
        DiLoCo(privacy=dp(quantile=0.5, count_std=0.5))  # z = 2 sigma_b: the count spends all
    assert (
        "adaptive C: quantile 0.5" in IsoLoCo(privacy=dp(quantile=0.5, count_std=1.0)).dp.describe()
    )
