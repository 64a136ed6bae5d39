"""DiLoCo's constructor keeps its plain arguments by name (strategies/diloco/setup.py) and
unpacks its settings objects (strategies/diloco/settings.py): each value arrives where it
belongs."""

from __future__ import annotations

import inspect
import pydoc

import pytest

from flwr_isoloco.strategies import (
    AdaptiveClipping,
    CentralDP,
    DiLoCo,
    IsoLoCo,
    MergeSettings,
    Records,
    ReplyChecks,
)
from flwr_isoloco.strategies.diloco.setup import MOVED_TO_MERGE_SETTINGS, RECORD_FIELDS


def test_plain_arguments_and_grouped_fields_are_kept_as_given():
    fields = dict(
        weighted_by_key="tokens",
        arrayrecord_key="model",
        configrecord_key="cfg",
        train_metrics_aggr_fn=lambda r, k: None,
        evaluate_metrics_aggr_fn=lambda r, k: None,
    )
    assert set(fields) == set(RECORD_FIELDS)
    values = dict(min_available_nodes=3, seed=11, orthogonalize="update", **fields)
    checks = ReplyChecks(weighting="uniform", payload="delta")
    for cls in (DiLoCo, IsoLoCo):
        s = cls(
            merge="iso_c",
            min_available_nodes=3,
            seed=11,
            records=Records(**fields),
            merge_settings=MergeSettings(orthogonalize="update"),
            checks=checks,
        )
        assert {n: getattr(s, n) for n in values} == values
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


@pytest.mark.parametrize("cls", [DiLoCo, IsoLoCo])
def test_the_grouped_keywords_are_refused_naming_the_new_spelling(cls):
    assert not set(RECORD_FIELDS) & set(inspect.signature(cls).parameters)
    assert not set(MOVED_TO_MERGE_SETTINGS) & set(inspect.signature(cls).parameters)
    for old, field in MOVED_TO_MERGE_SETTINGS.items():
        with pytest.raises(
            TypeError, match=rf"use {cls.__name__}\(merge_settings=MergeSettings\({field}="
        ):
            cls(**{old: "x"})
    for old in RECORD_FIELDS:
        with pytest.raises(TypeError, match=rf"use {cls.__name__}\(records=Records\({old}='x'\)\)"):
            cls(**{old: "x"})


@pytest.mark.parametrize("cls", [DiLoCo, IsoLoCo])
def test_help_stays_about_the_size_of_fedavgs(cls):
    """help() shows what a user passes and calls: at most 20 constructor arguments (the rarely
    changed ones grouped in settings objects, each documented on its class) and 150 lines
    (Flower's FedAvg: 10 and 120), internals kept off the class."""
    assert len(inspect.signature(cls).parameters) <= 20
    assert len(pydoc.render_doc(cls, renderer=pydoc.plaintext).splitlines()) <= 150
