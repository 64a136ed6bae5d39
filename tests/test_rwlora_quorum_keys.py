"""rwlora_sentiment's strategy.quorum / strategy.grace-s: checked as the isoloco_lm app checks
them, passed to GossipLoRA as its Rounds, refused with a reason for RW-LoRA and the FedAvg baseline."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

APP = Path(__file__).resolve().parents[1] / "simulations" / "rwlora-sentiment"
sys.path.insert(0, str(APP))

from rwlora_sentiment.task import build_strategy, load_config  # noqa: E402

from flwr_isoloco.runconfig import RunConfigError  # noqa: E402
from flwr_isoloco.strategies.graph.rwlora import RWLoRA  # noqa: E402


@pytest.mark.parametrize(
    "over, quorum, grace",
    [
        ({"strategy.quorum": 0.5, "strategy.grace-s": 2.5}, 0.5, 2.5),
        ({"strategy.quorum": 3}, 3, 0.0),
        ({}, None, 0.0),  # the default 1.0: every reply
    ],
)
def test_quorum_keys_reach_gossip(over, quorum, grace):
    cfg = load_config({"strategy.name": "gossip", "strategy.graph": "ring", **over})
    s = build_strategy(cfg, 4)
    assert type(s.rounds.quorum) is type(quorum) and s.rounds.quorum == quorum
    assert s.rounds.grace_s == grace


@pytest.mark.parametrize(
    "name, key, value, why",
    [
        ("rwlora", "quorum", 0.5, RWLoRA.REFUSED_SETTINGS["Rounds.quorum"]),
        ("rwlora", "grace-s", 1.0, RWLoRA.REFUSED_SETTINGS["Rounds.grace_s"]),
        ("fedavg", "quorum", 2, "waits for every reply"),
    ],
)
def test_quorum_keys_elsewhere_are_a_named_error(name, key, value, why):
    with pytest.raises(RunConfigError) as err:
        load_config({"strategy.name": name, f"strategy.{key}": value})
    assert f"'strategy.{key}'" in str(err.value) and why in str(err.value)


@pytest.mark.parametrize("value", [0, -1.0, 1.5])
def test_bad_quorum_is_named(value):
    with pytest.raises(RunConfigError, match=r"strategy\.quorum"):
        load_config({"strategy.name": "gossip", "strategy.quorum": value})
