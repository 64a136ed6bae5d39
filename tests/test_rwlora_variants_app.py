"""The rwlora_sentiment app's variant keys, validation split and per-class scores."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from test_rwlora_app import TINY, _run

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "simulations" / "rwlora-sentiment"))

from rwlora_sentiment.task import (  # noqa: E402
    build_strategy,
    client_config,
    load_config,
    validation_split,
)

from flwr_isoloco.clients.lora_client import load_node_data  # noqa: E402
from flwr_isoloco.data import sentiment  # noqa: E402
from flwr_isoloco.runconfig import RunConfigError  # noqa: E402


@pytest.mark.parametrize(
    "override, key",
    [
        ({"strategy.name": "gossip", "strategy.average-decay": 0.9}, "average-decay"),
        ({"strategy.name": "fedavg", "strategy.lr-decay-hops": 8.0}, "lr-decay-hops"),
        ({"strategy.name": "gossip", "strategy.hop-momentum": 0.5}, "hop-momentum"),
        ({"strategy.hop-momentum": 1.0}, "strategy.hop-momentum"),
        ({"strategy.average-decay": -0.1}, "strategy.average-decay"),
        ({"strategy.lr-decay-hops": -1.0}, "strategy.lr-decay-hops"),
        ({"data.eval-split": "train"}, "data.eval-split"),
        ({"data.eval-split": "val", "data.val-fraction": 0.0}, "data.eval-split"),
    ],
)
def test_bad_variant_keys_are_named(override, key):
    with pytest.raises(RunConfigError, match=key.replace(".", r"\.")):
        load_config(override)


def test_variant_keys_reach_the_strategy():
    cfg = load_config(
        {"strategy.lr-decay-hops": 8.0, "strategy.hop-momentum": 0.5, "train.lr": 1e-3}
    )
    s = build_strategy(cfg, 4)
    assert (s.lr, s.lr_decay_hops, s.hop_momentum, s.average_decay) == (1e-3, 8.0, 0.5, 0.0)
    plain = build_strategy(load_config({}), 4)
    assert (plain.lr_decay_hops, plain.hop_momentum, plain.average_decay) == (0, 0, 0)


def test_validation_split_is_the_clients_held_out_rows():
    rc = {**TINY, "data.max-examples": 40, "data.eval-examples": 0, "seed": 3}
    cfg = load_config(rc)
    texts, labels = validation_split(cfg, 3)
    val, train = [], []
    for pid in range(3):
        nd = load_node_data(client_config(cfg), pid, 3)
        val += list(zip(nd.val_texts, nd.val_labels, strict=True))
        train += nd.train_texts
    assert sorted(zip(texts, labels, strict=True)) == sorted(val) and len(texts) == 3 * 4
    test = set(sentiment.load_test(cfg.data.source, cfg.data["test-size"], 3)["text"])
    assert not set(texts) & test and not set(texts) & set(train)
    assert validation_split(cfg, 3) == (texts, labels)  # seeded order
    capped = validation_split(load_config({**rc, "data.eval-examples": 5}), 3)
    assert capped == (texts[:5], labels[:5])


def test_per_class_scores_on_the_validation_split_with_every_variant(tmp_path):
    over = {
        "num-server-rounds": 4,
        "eval-per-class": True,
        "data.eval-split": "val",
        "data.eval-examples": 0,
        "strategy.lr-decay-hops": 2.0,
        "strategy.hop-momentum": 0.5,
        "strategy.average-decay": 0.9,
    }
    _, res = _run(tmp_path, "v", **over)
    assert res["status"] == "completed" and res["eval-split"] == "val"
    cfg = load_config({**TINY, **over})
    _, labels = validation_split(cfg, 3)
    share = {c: labels.count(c) / len(labels) for c in (0, 1)}
    rows = [res["initial"], *(r for r in res["rounds"] if "test-accuracy" in r)]
    assert len(rows) == 3 and res["test-examples"] == len(labels)
    for r in rows:
        per = {c: r[f"test-accuracy-class-{c}"] for c in (0, 1)}
        assert r["test-accuracy"] == pytest.approx(sum(share[c] * per[c] for c in per))
        for c in per:  # a recall: a multiple of 1 / (rows of that class)
            n_c = labels.count(c)
            assert per[c] * n_c == pytest.approx(round(per[c] * n_c))
