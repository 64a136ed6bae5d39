"""Central DP in DiLoCo / IsoLoCo (issue 20): noise scale, accounting against Flower's own
accountant, noise before the outer step, budget stop, resume, refusals and run-config keys."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import (
    GaussianPrivacyEvent,
    NeighboringRelation,
    PrivacyConfig,
    RdpAccountant,
    SamplingMethod,
)

from flwr_isoloco.checkpoint import load_checkpoint, save_checkpoint
from flwr_isoloco.checkpoint_spec import CheckpointError
from flwr_isoloco.merging.dp import clip_to_norm, noise_like
from flwr_isoloco.strategies import DiLoCo, IsoLoCo
from flwr_isoloco.strategies.privacy import PrivacyBudgetExhausted, noise_for_epsilon

QUIET = dict(min_train_nodes=1, min_available_nodes=1, fraction_evaluate=0.0)


def _client(step=lambda pid, rnd: 0.01 * (pid + 1) * (-1) ** rnd):
    """Node ``pid`` replies ``theta + step(pid, round)`` (weights = its pid + 1 examples)."""

    def train(msg: Message, ctx) -> Message:
        theta = msg.content["arrays"].to_torch_state_dict()
        pid = int(ctx.node_config["partition-id"])
        rnd = int(msg.content["config"]["server-round"])
        new = {k: v + step(pid, rnd) for k, v in theta.items()}
        metrics = MetricRecord({"num-examples": pid + 1})
        return Message(RecordDict({"arrays": ArrayRecord(new), "m": metrics}), reply_to=msg)

    return {"train": train}


def _model(side: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(side, side, generator=g), "b": torch.zeros(side)}


def _start(strategy, num_nodes: int, num_rounds: int):
    """``strategy`` run for ``num_rounds`` on ``num_nodes`` :func:`_client` nodes from :func:`_model`."""
    return strategy.start(
        grid=FakeGrid(_client(), num_nodes=num_nodes),
        initial_arrays=ArrayRecord(_model()),
        num_rounds=num_rounds,
    )


def _through_checkpoint(strategy, tmp_path):
    """``strategy.state_dict()`` written to a checkpoint file and read back: ``(tensors, meta)``."""
    sd = strategy.state_dict()
    return load_checkpoint(save_checkpoint(tmp_path / "ck.safetensors", sd["tensors"], sd["meta"]))


def _flower_epsilon(z: float, rounds: int, delta: float, population: int) -> float:
    """An accountant built here from Flower's public API, fed ``rounds`` Gaussian events."""
    config = PrivacyConfig(
        target_delta=delta,
        population_size=population,
        neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
        sampling_method=SamplingMethod.NO_AMPLIFICATION,
    )
    acc = RdpAccountant(config)
    for _ in range(rounds):
        acc.compose(GaussianPrivacyEvent(z, population, population))
    return acc.get_epsilon(delta)


def test_zero_updates_release_noise_of_std_z_c_over_m():
    """M = 8 identical zero updates: theta moves by -g, g's entries ~ N(0, (z C / M)^2)."""
    m, z, c = 8, 1.3, 0.7
    theta0 = {"w": torch.zeros(160, 160)}
    s = DiLoCo(**QUIET, outer_lr=1.0, outer_momentum=0.0, dp_noise_multiplier=z, dp_clipping_norm=c)
    res = s.start(
        grid=FakeGrid(_client(lambda p, r: 0.0), num_nodes=m),
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
    s = cls(**QUIET, dp_noise_multiplier=z, dp_clipping_norm=0.05, dp_delta=delta)
    res = _start(s, 3, rounds)
    for r in range(1, rounds + 1):
        got = res.train_metrics_clientapp[r]["dp-epsilon"]
        # no amplification: the population size given to the accountant changes nothing
        assert got == pytest.approx(_flower_epsilon(z, r, delta, 1), rel=1e-12)
        assert got == pytest.approx(_flower_epsilon(z, r, delta, 3), rel=1e-9)
    assert (
        res.train_metrics_clientapp[rounds]["dp-epsilon"]
        > res.train_metrics_clientapp[1]["dp-epsilon"]
    )


def test_momentum_buffer_holds_the_noised_mean_of_clipped_updates():
    """b_1 = g = (sum_i clip(delta_i) + N(0, (zC)^2)) / k: the outer optimiser (and the model)
    see only the noised mean. Noise added after the outer step would leave b_1 = the clean
    mean; noise not seeded from (seed, round) would differ from noise_like's."""
    z, c, m, seed, lr, mu = 0.8, 0.02, 4, 7, 0.5, 0.9
    theta0 = _model()
    s = DiLoCo(
        **QUIET,
        outer_lr=lr,
        outer_momentum=mu,
        dp_seed=seed,
        dp_noise_multiplier=z,
        dp_clipping_norm=c,
    )
    res = s.start(
        grid=FakeGrid(_client(), num_nodes=m), initial_arrays=ArrayRecord(theta0), num_rounds=1
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
    grid = FakeGrid(_client(), num_nodes=2)
    s = DiLoCo(**QUIET, dp_noise_multiplier=z, dp_clipping_norm=0.05, dp_max_epsilon=6.0)
    with pytest.raises(PrivacyBudgetExhausted, match="round 2 would exceed dp_max_epsilon=6"):
        s.start(grid=grid, initial_arrays=ArrayRecord(_model()), num_rounds=3)
    assert s.server_round == 1
    assert sum(1 for r in grid.log if r.message_type == "train") == 2  # round 1 only


def test_resume_continues_epsilon_and_the_noise(tmp_path):
    """A secret noise key (dp_seed=None) travels in the checkpoint: the resumed run's rounds 3-4
    are bitwise those of a straight run with that key, and epsilon continues from round 2."""
    kw = dict(**QUIET, dp_noise_multiplier=0.9, dp_clipping_norm=0.03, seed=3)
    first = DiLoCo(**kw)
    assert first.dp.noise_key != DiLoCo(**kw).dp.noise_key  # drawn from the OS, per strategy
    _start(first, 3, 2)
    tensors, meta = _through_checkpoint(first, tmp_path)
    second = DiLoCo(**kw)
    second.load_state_dict({"tensors": tensors, "meta": meta})
    assert second.dp.noise_key == first.dp.noise_key
    assert second.dp.epsilon() == pytest.approx(first.dp.epsilon())
    rest = _start(second, 3, 4)
    straight = DiLoCo(**kw, dp_seed=first.dp.noise_key)
    full = _start(straight, 3, 4)
    for r in (3, 4):
        assert rest.train_metrics_clientapp[r]["dp-epsilon"] == pytest.approx(
            full.train_metrics_clientapp[r]["dp-epsilon"], rel=1e-12
        )
    assert rest.train_metrics_clientapp[3]["dp-epsilon"] > first.dp.epsilon()
    assert second.dp.accountant.num_releases == 4
    a, b = rest.arrays.to_torch_state_dict(), full.arrays.to_torch_state_dict()
    for k in a:  # same noise in rounds 3-4: drawn from (key, round)
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


def test_checkpoint_dp_state_is_checked():
    kw = dict(**QUIET, dp_noise_multiplier=0.9, dp_clipping_norm=0.03)
    s = DiLoCo(**kw)
    _start(s, 2, 1)
    sd = s.state_dict()
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
    with pytest.raises(CheckpointError, match="more than the 1 rounds"):
        target.load_state_dict({"tensors": sd["tensors"], "meta": many})
    assert target.theta is None and target.dp.accountant.num_releases == 0  # nothing set


@pytest.mark.parametrize("rule", ["ties", "dare", "tsv_m", "iso_cts"])
def test_rules_that_need_every_delta_are_refused(rule):
    with pytest.raises(ValueError, match="client-side .local. DP"):
        DiLoCo(merge=rule, dp_noise_multiplier=1.0, dp_clipping_norm=1.0)


def test_bad_dp_arguments_are_refused():
    with pytest.raises(ValueError, match="max_norm_ratio"):
        DiLoCo(max_norm_ratio=3.0, dp_clipping_norm=1.0)
    with pytest.raises(ValueError, match="needs dp_clipping_norm"):
        DiLoCo(dp_noise_multiplier=1.0)
    with pytest.raises(ValueError, match="dp_max_epsilon needs"):
        DiLoCo(dp_clipping_norm=1.0, dp_max_epsilon=3.0)
    for bad in (-1.0, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="dp_clipping_norm"):
            DiLoCo(dp_clipping_norm=bad)
    with pytest.raises(ValueError, match="dp_delta"):
        DiLoCo(dp_clipping_norm=1.0, dp_noise_multiplier=1.0, dp_delta=1.0)
    assert DiLoCo(dp_clipping_norm=1.0).weighting == "uniform"  # DP's weights are w_i = 1


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
    assert _flower_epsilon(z, 5, 1e-5, 1) <= 2.0 < _flower_epsilon(z * 0.99, 5, 1e-5, 1)


def test_secagg_compatibility_names_every_option_that_needs_single_replies():
    from flwr_isoloco.strategies.privacy import require_secagg, secagg_problems

    ok = dict(weighting="uniform")
    assert secagg_problems(DiLoCo(**ok)) == []
    assert secagg_problems(IsoLoCo(**ok)) == []
    assert secagg_problems(DiLoCo(max_weight_ratio=0)) == []  # examples weights, no bound
    cases = {
        "merge='ties'": dict(merge="ties"),
        "max_norm_ratio": dict(max_norm_ratio=3.0),
        "max_weight_ratio": dict(weighting="examples"),
        "upload_codec='topk'": dict(upload_codec="topk"),
        "quorum": dict(quorum=2),
        "central DP": dict(dp_clipping_norm=1.0),
    }
    for what, kw in cases.items():
        with pytest.raises(ValueError, match=f"secure aggregation: .*{re.escape(what)}"):
            require_secagg(DiLoCo(**{**ok, **kw}))


# --------------------------------------------------------------------------- local (client) DP
def _tiny_worker(**kw):
    from flwr_isoloco.clients import make_diloco_train_handler
    from flwr_isoloco.models.llama import build_llama, llama_config

    cfg = llama_config(vocab_size=32, hidden=16, layers=1, heads=2, max_seq_len=16)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 32, (2, 9), generator=g) for _ in range(4)]
    kw = {"lr": 1e-2, "local_steps": 2, "num_server_rounds": 2, **kw}
    model_fn = lambda _ctx=None: build_llama(cfg, seed=0)  # noqa: E731
    return make_diloco_train_handler(model_fn, lambda _c: batches, **kw), model_fn


def test_privatize_clips_then_adds_noise_of_std_z_c():
    from flwr_isoloco.merging.dp import privatize

    gen = torch.Generator().manual_seed(0)
    out = privatize({"w": torch.zeros(200, 200)}, 0.5, 2.0, gen)
    assert abs(out["w"].double().std().item() / 1.0 - 1) < 0.03  # z C = 1
    big = privatize({"a": torch.full((10,), 100.0)}, 1.0, 0.0)  # no noise: clipping only
    assert big["a"].norm().item() == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("codec", [None, "int8"])
def test_worker_applies_local_dp_before_compression(codec):
    """lr = 0: the trained delta is exactly zero, so the reply is the noise: std z C, and the
    compressed upload carries it (noise first, then compression with error feedback)."""
    from flwr.app import ConfigRecord, Context

    from flwr_isoloco.compression import decompress

    FakeGrid({}, num_nodes=1)  # Flower's task identity, so Messages can be built
    train, model_fn = _tiny_worker(lr=0.0, warmup_steps=0, payload="delta")
    theta = model_fn().state_dict()
    config = {"server-round": 1, "dp-clipping-norm": 0.05, "dp-noise-multiplier": 3.0}
    if codec:
        config.update({"upload-codec": codec, "error-feedback": True})
    msg = Message(
        RecordDict({"arrays": ArrayRecord(theta), "config": ConfigRecord(config)}), 77, "train"
    )
    ctx = Context(1, 77, {"partition-id": 0, "num-partitions": 1}, RecordDict(), {})
    reply = train(msg, ctx)
    echo = reply.content["config"]
    assert (echo["dp-clipping-norm"], echo["dp-noise-multiplier"]) == (0.05, 3.0)
    arrays = reply.content["arrays"]
    d = decompress(arrays) if codec else arrays.to_torch_state_dict()
    flat = torch.cat([v.double().flatten() for v in d.values() if v.is_floating_point()])
    assert abs(flat.std().item() / 0.15 - 1) < 0.05


def test_local_dp_allows_every_rule_and_drops_replies_without_the_echo():
    z, c = 2.0, 0.05
    train, model_fn = _tiny_worker()
    s = DiLoCo(**QUIET, merge="ties", dp_mode="local", dp_noise_multiplier=z, dp_clipping_norm=c)
    res = s.start(
        grid=FakeGrid({"train": train}, num_nodes=2),
        initial_arrays=ArrayRecord(model_fn().state_dict()),
        num_rounds=2,
        train_config=ConfigRecord({"num-server-rounds": 2}),
    )
    for r in (1, 2):
        m = res.train_metrics_clientapp[r]
        assert m["replies-used"] == 2 and m["dp-noise-std"] == pytest.approx(z * c)
        # each site's own release: multiplier z / 2 (replace-one sensitivity 2 C)
        assert m["dp-epsilon"] == pytest.approx(_flower_epsilon(z / 2, r, 1e-5, 1), rel=1e-12)
    plain = DiLoCo(**QUIET, dp_mode="local", dp_noise_multiplier=z, dp_clipping_norm=c)
    res = _start(plain, 2, 1)
    assert res.train_metrics_clientapp[1]["replies-rejected"] == 2  # no echo: not private


def test_lm_app_precheck_names_the_dp_key():
    from flwr_isoloco.runconfig import precheck_app_config

    app = Path(__file__).resolve().parents[1] / "simulations" / "isoloco_lm"
    (msg,) = precheck_app_config(app, {"strategy.dp-noise-multiplier": 1.0})
    assert "'strategy.dp-noise-multiplier'" in msg and "needs dp_clipping_norm" in msg
    ties = {"strategy.dp-noise-multiplier": 1.0, "strategy.dp-clipping-norm": 0.5}
    ties["strategy.merge"] = "ties"
    (msg,) = precheck_app_config(app, ties)
    assert "'strategy.dp-clipping-norm'" in msg and "dp_mode='local'" in msg
    assert precheck_app_config(app, {**ties, "strategy.dp-mode": "local"}) == []
    (msg,) = precheck_app_config(app, {"strategy.dp-delta": 2.0})
    assert "'strategy.dp-delta'" in msg


@pytest.mark.parametrize("robust", ["median", "norm-clip", "krum"])
def test_central_dp_refuses_a_robust_rule_whose_round_skips_the_noise(robust):
    from flwr_isoloco.strategies import DiLoCo

    with pytest.raises(ValueError, match="central DP refuses robust"):
        DiLoCo(dp_clipping_norm=1.0, dp_noise_multiplier=1.0, robust=robust)
    DiLoCo(dp_clipping_norm=1.0, dp_noise_multiplier=1.0, dp_mode="local", robust=robust)


# ---------------------------------------------------------------------- adaptive clipping
def _z_update(z: float, count_std: float) -> float:
    """Andrew et al.'s split, written here: z^-2 = z_delta^-2 + (2 sigma_b)^-2."""
    return (z**-2 - (2 * count_std) ** -2) ** -0.5


def _adaptive(z: float, c0: float, q: float, count_std: float, **kw):
    """Arguments of central DP with adaptive clipping: multiplier ``z``, initial ``C = c0``,
    target quantile ``q``, count noise ``count_std`` (on the :data:`QUIET` federation)."""
    return dict(
        **QUIET,
        dp_noise_multiplier=z,
        dp_clipping_norm=c0,
        dp_adaptive_quantile=q,
        dp_clip_count_std=count_std,
        **kw,
    )


def test_adaptive_clipping_norm_moves_to_the_quantile():
    """200 fixed log-normal norms, target quantile 0.3, C_0 far below: every step is the
    formula computed here, C rises while it is below the quantile, and over the last 100 of
    300 rounds the unclipped fraction of the true norms averages 0.3 within 0.05."""
    from flwr_isoloco.strategies.privacy import COUNT_NOISE_INDEX, StrategyDP

    k, q, lr, std, c = 200, 0.3, 0.2, 10.0, 0.05
    norms = torch.exp(
        torch.randn(k, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    )
    dp = StrategyDP(
        1.0, c, 1e-5, None, noise_seed=7, adaptive_quantile=q, clip_lr=lr, clip_count_std=std
    )
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
    clipped count (from the metrics) and count noise (from the key)."""
    from flwr_isoloco.strategies.privacy import COUNT_NOISE_INDEX

    z, std, q, lr, c0, key, rounds, k = 1.1, 1.0, 0.5, 0.3, 0.05, 11, 4, 3
    s = DiLoCo(**_adaptive(z, c0, q, std, dp_seed=key, dp_clip_lr=lr))
    res = _start(s, k, rounds)
    c = c0
    for r in range(1, rounds + 1):
        m = res.train_metrics_clientapp[r]
        assert m["dp-epsilon"] == pytest.approx(_flower_epsilon(z, r, 1e-5, 1), rel=1e-12)
        assert m["dp-clipping-norm"] == c
        assert m["dp-noise-std"] == pytest.approx(_z_update(z, std) * c / k, rel=1e-12)
        clipped = round(m["dp-clipped-fraction"] * k)
        noise = float(noise_like(torch.zeros(()), std, key, r, COUNT_NOISE_INDEX))
        c = c * math.exp(-lr * ((k - clipped + noise) / k - q))
    assert s.dp.c == pytest.approx(c, rel=1e-14)
    assert len({res.train_metrics_clientapp[r]["dp-clipping-norm"] for r in (1, 2, 3, 4)}) == 4


def test_adaptive_clipping_resume_keeps_the_clipping_norm_bitwise(tmp_path):
    kw = _adaptive(0.9, 0.03, 0.5, 1.0, seed=3)
    first = DiLoCo(**kw)
    _start(first, 3, 2)
    assert first.dp.c != 0.03
    tensors, meta = _through_checkpoint(first, tmp_path)
    second = DiLoCo(**kw)
    second.load_state_dict({"tensors": tensors, "meta": meta})
    assert second.dp.c == first.dp.c  # bit for bit through the checkpoint's JSON
    rest = _start(second, 3, 4)
    straight = DiLoCo(**kw, dp_seed=first.dp.noise_key)
    full = _start(straight, 3, 4)
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
        with pytest.raises(CheckpointError, match="clipping_norm"):
            DiLoCo(**kw).load_state_dict({"tensors": tensors, "meta": forged})
    fixed = {k: v for k, v in kw.items() if k not in ("dp_adaptive_quantile", "dp_clip_count_std")}
    with pytest.raises(CheckpointError, match="adaptive clipping norm"):
        DiLoCo(**fixed).load_state_dict({"tensors": tensors, "meta": meta})


def test_bad_adaptive_clipping_arguments_are_refused():
    ok = dict(dp_clipping_norm=1.0, dp_noise_multiplier=1.0, dp_clip_count_std=1.0)
    with pytest.raises(ValueError, match="central DP with noise"):
        DiLoCo(dp_clipping_norm=1.0, dp_adaptive_quantile=0.5, dp_clip_count_std=1.0)
    with pytest.raises(ValueError, match="central DP with noise"):
        DiLoCo(merge="ties", **ok, dp_mode="local", dp_adaptive_quantile=0.5)
    for q in (0.0, 1.0, -0.1, True, "0.5"):
        with pytest.raises(ValueError, match="dp_adaptive_quantile"):
            DiLoCo(**ok, dp_adaptive_quantile=q)
    with pytest.raises(ValueError, match="dp_clip_lr"):
        DiLoCo(**ok, dp_adaptive_quantile=0.5, dp_clip_lr=0.0)
    with pytest.raises(ValueError, match="needs dp_clip_count_std"):
        DiLoCo(dp_clipping_norm=1.0, dp_noise_multiplier=1.0, dp_adaptive_quantile=0.5)
    with pytest.raises(ValueError, match="too small"):
        DiLoCo(
            dp_clipping_norm=1.0,
            dp_noise_multiplier=1.0,
            dp_adaptive_quantile=0.5,
            dp_clip_count_std=0.5,
        )  # z = 2 sigma_b: the count would spend everything
    assert "adaptive C: quantile 0.5" in IsoLoCo(**ok, dp_adaptive_quantile=0.5).dp.describe()
