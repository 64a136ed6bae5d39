"""Central DP in DiLoCo / IsoLoCo (issue 20): noise scale, accounting against Flower's own
accountant, noise before the outer step, budget stop, resume, refusals and run-config keys."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord
from privacy_helpers import (
    QUIET,
    flower_epsilon,
    small_model,
    start_run,
    step_client,
    through_checkpoint,
)

from flwr_isoloco.checkpoint.spec import CheckpointError
from flwr_isoloco.merging.dp import clip_to_norm, noise_like
from flwr_isoloco.strategies import CentralDP, DiLoCo, IsoLoCo, LocalDP, ReplyChecks, Rounds
from flwr_isoloco.strategies.diloco.privacy import PrivacyBudgetExhausted, noise_for_epsilon
from flwr_isoloco.strategies.diloco.setup import effective_weighting


def test_zero_updates_release_noise_of_std_z_c_over_m():
    """M = 8 identical zero updates: theta moves by -g, g's entries ~ N(0, (z C / M)^2)."""
    m, z, c = 8, 1.3, 0.7
    theta0 = {"w": torch.zeros(160, 160)}
    s = DiLoCo(
        **QUIET,
        outer_lr=1.0,
        outer_momentum=0.0,
        privacy=CentralDP(noise_multiplier=z, clipping_norm=c),
    )
    res = s.start(
        grid=FakeGrid(step_client(lambda p, r: 0.0), num_nodes=m),
        initial_arrays=ArrayRecord(theta0),
        num_rounds=1,
    )
    g = -res.arrays.to_torch_state_dict()["w"].double()
    want = z * c / m
    assert abs(g.std().item() / want - 1) < 0.03
    assert abs(g.mean().item()) < 0.03 * want
    assert res.train_metrics_clientapp[1]["dp-noise-std"] == pytest.approx(want)


@pytest.mark.parametrize("cls", [DiLoCo, IsoLoCo])
def test_epsilon_per_round_equals_flowers_accountant(cls):
    z, delta, rounds = 1.1, 1e-5, 4
    s = cls(**QUIET, privacy=CentralDP(noise_multiplier=z, clipping_norm=0.05, delta=delta))
    res = start_run(s, 3, rounds)
    for r in range(1, rounds + 1):
        got = res.train_metrics_clientapp[r]["dp-epsilon"]
        # no amplification: the population size given to the accountant changes nothing
        assert got == pytest.approx(flower_epsilon(z, r, delta, 1), rel=1e-12)
        assert got == pytest.approx(flower_epsilon(z, r, delta, 3), rel=1e-9)
    assert (
        res.train_metrics_clientapp[rounds]["dp-epsilon"]
        > res.train_metrics_clientapp[1]["dp-epsilon"]
    )


def test_momentum_buffer_holds_the_noised_mean_of_clipped_updates():
    """b_1 = g = (sum_i clip(delta_i) + N(0, (zC)^2)) / k: the outer optimiser (and the model)
    see only the noised mean. Noise added after the outer step would leave b_1 = the clean
    mean; noise not seeded from (seed, round) would differ from noise_like's."""
    z, c, m, seed, lr, mu = 0.8, 0.02, 4, 7, 0.5, 0.9
    theta0 = small_model()
    s = DiLoCo(
        **QUIET,
        outer_lr=lr,
        outer_momentum=mu,
        privacy=CentralDP(noise_multiplier=z, clipping_norm=c, seed=seed),
    )
    res = s.start(
        grid=FakeGrid(step_client(), num_nodes=m), initial_arrays=ArrayRecord(theta0), num_rounds=1
    )
    keys = list(theta0)
    clean, noised = {}, {}
    for i, k in enumerate(keys):
        total = torch.zeros(theta0[k].shape, dtype=torch.float64)
        for pid in range(m):  # delta_i = theta - theta_i = -step, the same on every entry
            d = {kk: torch.full(theta0[kk].shape, 0.01 * (pid + 1)) for kk in keys}
            n = math.sqrt(sum(float(t.double().pow(2).sum()) for t in d.values()))
            total += d[k].double() * min(1.0, c / n)
        clean[k] = total / m
        noised[k] = (total + noise_like(theta0[k], z * c, seed, 1, i)) / m
    buf = s.outer.state_dict()["momentum_buffer"]
    new = res.arrays.to_torch_state_dict()
    for k in keys:
        torch.testing.assert_close(buf[k].double(), noised[k], rtol=1e-5, atol=1e-7)
        assert not torch.allclose(buf[k].double(), clean[k], atol=1e-4)
        # Nesterov: theta_1 = theta_0 - lr (g + mu b_1), b_1 = g
        want = theta0[k].double() - lr * (1 + mu) * noised[k]
        torch.testing.assert_close(new[k].double(), want, rtol=1e-5, atol=1e-6)


def test_clip_bounds_the_whole_update_norm():
    d = {"a": torch.full((3,), 3.0), "b": torch.full((4,), 4.0)}
    out, norm = clip_to_norm(d, 1.0)
    assert norm == pytest.approx(math.sqrt(27 + 64))
    assert math.sqrt(sum(float(t.pow(2).sum()) for t in out.values())) == pytest.approx(1.0)
    same, _ = clip_to_norm(d, 100.0)
    assert all(torch.equal(same[k], d[k]) for k in d)


def test_budget_stops_before_the_round_that_would_exceed_it():
    z = 1.0  # epsilon at 1e-5: 4.73 after one round, 7.08 after two
    grid = FakeGrid(step_client(), num_nodes=2)
    s = DiLoCo(**QUIET, privacy=CentralDP(noise_multiplier=z, clipping_norm=0.05, max_epsilon=6.0))
    with pytest.raises(PrivacyBudgetExhausted, match="round 2 would exceed max_epsilon=6"):
        s.start(grid=grid, initial_arrays=ArrayRecord(small_model()), num_rounds=3)
    assert s.server_round == 1
    assert sum(1 for r in grid.log if r.message_type == "train") == 2  # round 1 only


def _resume_rounds_3_4(tmp_path, privacy):
    """Rounds 1-2, a checkpoint, rounds 3-4 resumed from it; and rounds 1-4 straight with the
    first run's key as a fixed seed. ``(first, second, resumed result, straight result)``."""
    kw = dict(**QUIET, seed=3, privacy=privacy)
    first = DiLoCo(**kw)
    first.dp.attach_journal(tmp_path / "dp-journal.json")
    start_run(first, 3, 2)
    tensors, meta = through_checkpoint(first, tmp_path)
    second = DiLoCo(**kw)
    second.dp.attach_journal(tmp_path / "dp-journal.json")
    second.load_state_dict({"tensors": tensors, "meta": meta})
    assert second.dp.noise_key == first.dp.noise_key
    assert second.dp.epsilon() == pytest.approx(first.dp.epsilon())
    rest = start_run(second, 3, 4)
    straight = DiLoCo(**{**kw, "privacy": replace(privacy, seed=first.dp.noise_key)})
    full = start_run(straight, 3, 4)
    for r in (3, 4):
        assert rest.train_metrics_clientapp[r]["dp-epsilon"] == pytest.approx(
            full.train_metrics_clientapp[r]["dp-epsilon"], rel=1e-12
        )
    assert rest.train_metrics_clientapp[3]["dp-epsilon"] > first.dp.epsilon()
    assert second.dp.accountant.num_releases == 4
    return first, second, rest, full


def test_resume_continues_epsilon_with_fresh_secret_noise(tmp_path):
    """A secret noise key (seed=None) travels in the checkpoint and epsilon continues from
    round 2; each release also draws a fresh secret nonce, so the resumed rounds' noise is not
    the noise a straight run with that key would draw (a resume can never replay noise)."""
    privacy = CentralDP(noise_multiplier=0.9, clipping_norm=0.03)
    first, _, rest, full = _resume_rounds_3_4(tmp_path, privacy)
    assert first.dp.noise_key != DiLoCo(**QUIET, privacy=privacy).dp.noise_key  # from the OS
    a, b = rest.arrays.to_torch_state_dict(), full.arrays.to_torch_state_dict()
    # the same clipped sums; noise of std z C / k = 0.009 per entry in each of 2 rounds
    assert float((a["w"] - b["w"]).double().pow(2).mean().sqrt()) > 0.003


def test_resume_with_a_fixed_seed_is_bitwise(tmp_path):
    """A fixed DP seed (tests, benchmarks; not private) keys the noise by (seed, round, tensor,
    attempt) alone: the resumed rounds 3-4 are bitwise a straight run's."""
    privacy = CentralDP(noise_multiplier=0.9, clipping_norm=0.03, seed=11)
    _, _, rest, full = _resume_rounds_3_4(tmp_path, privacy)
    a, b = rest.arrays.to_torch_state_dict(), full.arrays.to_torch_state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


def test_checkpoint_dp_state_is_checked(tmp_path):
    kw = dict(**QUIET, privacy=CentralDP(noise_multiplier=0.9, clipping_norm=0.03))
    s = DiLoCo(**kw)
    journal = tmp_path / "dp-journal.json"
    s.dp.attach_journal(journal)
    start_run(s, 2, 1)
    sd = s.state_dict()
    with pytest.raises(CheckpointError, match="needs its DP journal"):
        DiLoCo(**kw).load_state_dict(sd)  # no journal attached
    other = DiLoCo(**kw)
    other.dp.attach_journal(tmp_path / "elsewhere.json")
    with pytest.raises(CheckpointError, match="needs its DP journal .none at"):
        other.load_state_dict(sd)
    other = DiLoCo(**kw)
    start_run(other, 2, 1)  # another run's journal in the file
    other.dp.attach_journal(tmp_path / "theirs.json").record(other.dp.run_id, 1, 0)
    other = DiLoCo(**kw)
    other.dp.attach_journal(tmp_path / "theirs.json")
    with pytest.raises(CheckpointError, match="another run's"):
        other.load_state_dict(sd)
    no_run = {**sd["meta"], "dp": {k: v for k, v in sd["meta"]["dp"].items() if k != "run"}}
    with pytest.raises(CheckpointError, match="predates the DP journal"):
        DiLoCo(**kw).load_state_dict({"tensors": sd["tensors"], "meta": no_run})
    no_dp = {"tensors": sd["tensors"], "meta": {k: v for k, v in sd["meta"].items() if k != "dp"}}
    with pytest.raises(CheckpointError, match="not accounted"):
        DiLoCo(**kw).load_state_dict(no_dp)
    with pytest.raises(CheckpointError, match="no DP noise"):
        DiLoCo(**QUIET).load_state_dict(sd)
    dp = sd["meta"]["dp"]
    forged = {**sd["meta"], "dp": {**dp, "accountant": {**dp["accountant"], "compositions": "x"}}}
    with pytest.raises(CheckpointError, match="DP accountant"):
        DiLoCo(**kw).load_state_dict({"tensors": sd["tensors"], "meta": forged})
    comp = dp["accountant"]["compositions"][0]
    five = {**dp["accountant"], "compositions": [{**comp, "count": 5}]}
    many = {**sd["meta"], "dp": {**dp, "accountant": five}}
    no_key = {**sd["meta"], "dp": {"accountant": dp["accountant"]}}
    with pytest.raises(CheckpointError, match="noise_key"):
        DiLoCo(**kw).load_state_dict({"tensors": sd["tensors"], "meta": no_key})
    target = DiLoCo(**kw)
    target.dp.attach_journal(journal)
    with pytest.raises(CheckpointError, match="more than the 1 rounds"):
        target.load_state_dict({"tensors": sd["tensors"], "meta": many})
    assert target.theta is None and target.dp.accountant.num_releases == 0  # nothing set


@pytest.mark.parametrize("rule", ["ties", "dare", "tsv_m", "iso_cts"])
def test_rules_that_need_every_delta_are_refused(rule):
    with pytest.raises(ValueError, match="client-side .local. DP"):
        DiLoCo(merge=rule, privacy=CentralDP(noise_multiplier=1.0, clipping_norm=1.0))


def test_bad_dp_arguments_are_refused():
    with pytest.raises(ValueError, match="max_norm_ratio"):
        DiLoCo(checks=ReplyChecks(max_norm_ratio=3.0), privacy=CentralDP(clipping_norm=1.0))
    with pytest.raises(TypeError, match="clipping_norm"):
        DiLoCo(privacy=CentralDP(noise_multiplier=1.0))
    with pytest.raises(ValueError, match="max_epsilon needs"):
        DiLoCo(privacy=CentralDP(clipping_norm=1.0, max_epsilon=3.0))
    for bad in (-1.0, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="clipping_norm"):
            DiLoCo(privacy=CentralDP(clipping_norm=bad))
    with pytest.raises(ValueError, match="delta"):
        DiLoCo(privacy=CentralDP(noise_multiplier=1.0, clipping_norm=1.0, delta=1.0))
    assert (
        effective_weighting(DiLoCo(privacy=CentralDP(clipping_norm=1.0))) == "uniform"
    )  # DP's weights are w_i = 1


def test_the_dp_check_reads_the_configuration_and_never_rewrites_it():
    """Central DP merges with w_i = 1 whatever ``checks`` say: the strategy's weighting in
    force is uniform, its ``checks`` stay the object the user passed, unchanged."""
    checks = ReplyChecks(weighting="examples")
    s = DiLoCo(checks=checks, privacy=CentralDP(clipping_norm=1.0))
    assert s.checks is checks and s.checks.weighting == "examples"
    assert effective_weighting(s) == "uniform" and s.max_weight_ratio == 0.0
    assert "weighting='examples' ignored" in s.dp.describe()
    with pytest.raises(ValueError, match="central DP refuses ReplyChecks.max_weight_ratio=3"):
        DiLoCo(checks=ReplyChecks(max_weight_ratio=3), privacy=CentralDP(clipping_norm=1.0))


def test_run_config_keys_build_the_mechanism():
    rc = {
        "strategy.dp-noise-multiplier": 1.5,
        "strategy.dp-clipping-norm": 0.25,
        "strategy.dp-delta": 1e-6,
        "strategy.dp-max-epsilon": 9.0,
    }
    for cls in (DiLoCo, IsoLoCo):
        s = cls.from_run_config(rc)
        assert (s.dp.z, s.dp.c, s.dp.delta, s.dp.max_epsilon) == (1.5, 0.25, 1e-6, 9.0)
    off = DiLoCo.from_run_config({})
    assert not off.dp.enabled and off.dp.accountant is None and off.dp.quantile is None
    with pytest.raises(ValueError, match="strategy.dp-delta"):
        DiLoCo.from_run_config({"strategy.dp-delta": 2.0})
    adaptive = {
        **rc,
        "strategy.dp-adaptive-quantile": 0.4,
        "strategy.dp-clip-lr": 0.1,
        "strategy.dp-clip-count-std": 2.0,
    }
    s = IsoLoCo.from_run_config(adaptive)
    assert (s.dp.quantile, s.dp.clip_lr, s.dp.count_std) == (0.4, 0.1, 2.0)
    with pytest.raises(ValueError, match="strategy.dp-adaptive-quantile"):
        DiLoCo.from_run_config({**adaptive, "strategy.dp-adaptive-quantile": 1.0})


def test_noise_for_epsilon_calibrates_on_flowers_accountant():
    z = noise_for_epsilon(2.0, 5, 1e-5)
    assert flower_epsilon(z, 5, 1e-5, 1) <= 2.0 < flower_epsilon(z * 0.99, 5, 1e-5, 1)


def test_secagg_compatibility_names_every_option_that_needs_single_replies():
    from flwr_isoloco.strategies.diloco.privacy import require_secagg, secagg_problems

    ok = dict(checks=ReplyChecks(weighting="uniform"))
    assert secagg_problems(DiLoCo(**ok)) == []
    assert secagg_problems(IsoLoCo(**ok)) == []
    assert (
        secagg_problems(DiLoCo(checks=ReplyChecks(max_weight_ratio=0))) == []
    )  # examples weights, no bound
    cases = {
        "merge='ties'": dict(merge="ties"),
        "max_norm_ratio": dict(checks=ReplyChecks(weighting="uniform", max_norm_ratio=3.0)),
        "max_weight_ratio": dict(checks=ReplyChecks(weighting="examples")),
        "upload='topk'": dict(upload="topk"),
        "quorum": dict(rounds=Rounds(quorum=2)),
        "central DP": dict(privacy=CentralDP(clipping_norm=1.0)),
    }
    for what, kw in cases.items():
        with pytest.raises(ValueError, match=f"secure aggregation: .*{re.escape(what)}"):
            require_secagg(DiLoCo(**{**ok, **kw}))


@pytest.mark.parametrize("robust", ["median", "norm-clip", "krum"])
def test_central_dp_refuses_a_robust_rule_whose_round_skips_the_noise(robust):
    from flwr_isoloco.strategies import DiLoCo

    with pytest.raises(
        ValueError, match="central DP .clipping_norm=1. refuses robust=.*robust=.none."
    ):
        DiLoCo(
            robust=robust,
            privacy=CentralDP(noise_multiplier=1.0, clipping_norm=1.0),
        )
    DiLoCo(robust=robust, privacy=LocalDP(noise_multiplier=1.0, clipping_norm=1.0))
