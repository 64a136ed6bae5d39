"""DiLoCo's constructor keeps its plain arguments by name (strategies/diloco/setup.py) and
unpacks its settings objects (strategies/diloco/settings.py): each value arrives where it
belongs."""

from __future__ import annotations

import inspect

from flwr_isoloco.strategies import AdaptiveClipping, CentralDP, DiLoCo, IsoLoCo, ReplyChecks
from flwr_isoloco.strategies.diloco.setup import PLAIN_ARGUMENTS


def test_plain_arguments_are_kept_as_given():
    values = dict(
        min_available_nodes=3,
        weighted_by_key="tokens",
        arrayrecord_key="model",
        configrecord_key="cfg",
        train_metrics_aggr_fn=lambda r, k: None,
        evaluate_metrics_aggr_fn=lambda r, k: None,
        orthogonalize="update",
        seed=11,
    )
    assert set(values) == set(PLAIN_ARGUMENTS)
    assert set(PLAIN_ARGUMENTS) <= set(inspect.signature(DiLoCo).parameters)
    checks = ReplyChecks(weighting="uniform", payload="delta")
    for cls in (DiLoCo, IsoLoCo):
        s = cls(merge="iso_c", **values, checks=checks)
        assert {n: getattr(s, n) for n in PLAIN_ARGUMENTS} == values
        assert (s.checks, s.weighting, s.payload) == (checks, "uniform", "delta")
        assert s.train_validator.arrayrecord_key == "model"
        assert s.eval_validator.weighted_by_key == "tokens"


def test_every_dp_setting_arrives_in_the_strategys_dp():
    s = DiLoCo(
        checks=ReplyChecks(weighting="uniform"),
        privacy=CentralDP(
            noise_multiplier=1.5,
            clipping_norm=0.2,
            delta=1e-6,
            max_epsilon=50.0,
            seed=9,
            adaptive=AdaptiveClipping(quantile=0.4, count_std=2.0, lr=0.1),
        ),
    )
    assert (s.dp.z, s.dp.c, s.dp.delta, s.dp.max_epsilon) == (1.5, 0.2, 1e-6, 50.0)
    assert (s.dp.noise_key, s.dp.mode, s.dp.quantile) == (9, "central", 0.4)
    assert (s.dp.clip_lr, s.dp.count_std) == (0.1, 2.0)
