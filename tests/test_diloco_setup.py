"""DiLoCo's constructor passes its arguments on by name (strategies/diloco/setup.py): every
name in the lists is a parameter of the signature, and each one arrives where it belongs."""

from __future__ import annotations

import inspect

from flwr_isoloco.strategies import DiLoCo, IsoLoCo
from flwr_isoloco.strategies.diloco.privacy import StrategyDP
from flwr_isoloco.strategies.diloco.setup import DP_ARGUMENTS, PLAIN_ARGUMENTS


def test_plain_arguments_are_kept_as_given():
    values = dict(
        min_available_nodes=3,
        weighted_by_key="tokens",
        arrayrecord_key="model",
        configrecord_key="cfg",
        train_metrics_aggr_fn=lambda r, k: None,
        evaluate_metrics_aggr_fn=lambda r, k: None,
        orthogonalize="update",
        weighting="uniform",
        client_sends="delta",
        seed=11,
    )
    assert set(values) == set(PLAIN_ARGUMENTS)
    for cls in (DiLoCo, IsoLoCo):
        s = cls(merge="iso_c", **values)
        assert {n: getattr(s, n) for n in PLAIN_ARGUMENTS} == values
        assert s.train_validator.arrayrecord_key == "model"
        assert s.eval_validator.weighted_by_key == "tokens"


def test_dp_arguments_are_strategy_dp_parameters_in_its_order():
    params = list(inspect.signature(StrategyDP).parameters)
    want = [{"noise_seed": "dp_seed"}.get(p, "dp_" + p) for p in params]
    assert list(DP_ARGUMENTS) == want
    assert set(DP_ARGUMENTS) <= set(inspect.signature(DiLoCo).parameters)
    s = DiLoCo(
        dp_noise_multiplier=1.5,
        dp_clipping_norm=0.2,
        dp_delta=1e-6,
        dp_max_epsilon=50.0,
        dp_seed=9,
        dp_adaptive_quantile=0.4,
        dp_clip_lr=0.1,
        dp_clip_count_std=2.0,
        weighting="uniform",
    )
    assert (s.dp.z, s.dp.c, s.dp.delta, s.dp.max_epsilon) == (1.5, 0.2, 1e-6, 50.0)
    assert (s.dp.noise_key, s.dp.mode, s.dp.quantile) == (9, "central", 0.4)
    assert (s.dp.clip_lr, s.dp.count_std) == (0.1, 2.0)
