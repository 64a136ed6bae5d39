"""RWLoRA and GossipLoRA take DiLoCo's settings objects, one spelling per concept:
``checks=ReplyChecks(...)`` and ``rounds=Rounds(...)``. The plain keywords those replaced are
refused naming the new spelling; a field a graph does not use is refused unless at its default,
saying why; a setting lives in one place (no attribute copies)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from flwr_isoloco.strategies import GossipLoRA, ReplyChecks, Rounds, RWLoRA
from flwr_isoloco.strategies.graph.settings import MOVED, RENAMED

APP = Path(__file__).resolve().parents[1] / "simulations" / "rwlora-sentiment"
STRATEGIES = [RWLoRA, GossipLoRA]
VALUES = {
    "max_update_norm": 5.0,
    "max_norm_ratio": 4.0,
    "dtype_policy": "reject",
    "client_sends": "delta",
    "payload": "delta",
    "quorum": 3,
    "grace_s": 1.5,
    "max_empty_rounds": 0,
}


@pytest.mark.parametrize("cls", STRATEGIES)
@pytest.mark.parametrize("name", sorted(MOVED))
def test_a_plain_keyword_names_its_settings_object(cls, name):
    arg, klass = MOVED[name]
    v = VALUES[name]
    with pytest.raises(TypeError) as err:
        cls(**{name: v})
    want = f"{cls.__name__}({name}={v!r}): {name} is a {klass.__name__} setting: use "
    field = RENAMED.get(name, name)
    assert str(err.value).startswith(want + f"{arg}={klass.__name__}({field}={v!r})")


@pytest.mark.parametrize("cls", STRATEGIES)
@pytest.mark.parametrize(
    "settings, field",
    [
        ({"checks": ReplyChecks(weighting="uniform")}, "ReplyChecks.weighting='uniform'"),
        ({"checks": ReplyChecks(max_weight_ratio=2.0)}, "ReplyChecks.max_weight_ratio=2.0"),
        ({"rounds": Rounds(asynchronous=True)}, "Rounds.asynchronous=True"),
    ],
)
def test_a_field_a_graph_does_not_use_is_refused_with_why(cls, settings, field):
    with pytest.raises(ValueError) as err:
        cls(**settings)
    text = str(err.value)
    assert text.startswith(f"{cls.__name__}: {field} does not apply here: ")
    assert (
        "weights no reply" in text or "synchronous" in text
    ) and "leave it at its default" in text


@pytest.mark.parametrize("cls", STRATEGIES)
def test_settings_must_be_the_settings_classes(cls):
    with pytest.raises(ValueError, match=r"checks must be a ReplyChecks, got \{"):
        cls(checks={"max_norm_ratio": 2.0})
    with pytest.raises(ValueError, match="rounds must be a Rounds, got 3"):
        cls(rounds=3)


@pytest.mark.parametrize("cls", STRATEGIES)
def test_one_source_of_truth(cls):
    checks = ReplyChecks(
        max_update_norm=7.0, max_norm_ratio=3.0, dtype_policy="reject", payload="delta"
    )
    rounds = Rounds(max_empty_rounds=5)
    s = cls(checks=checks, rounds=rounds)
    assert s.checks is checks and s.rounds is rounds
    for name in MOVED:  # read from s.checks / s.rounds, never a copy on the strategy
        assert not hasattr(s, name), name
    v = s.validator  # what enforces them is built from them
    assert (v.max_update_norm, v.dtype_policy, v.default_payload) == (7.0, "reject", "delta")
    assert s.guard.limit == 5


def test_gossip_closes_rounds_on_its_rounds():
    s = GossipLoRA(rounds=Rounds(quorum=1.0))
    assert s.rounds.closing_quorum is None  # 1.0: every reply, as None
    s = GossipLoRA(rounds=Rounds(quorum=0.5, grace_s=2.0))
    assert (s.rounds.closing_quorum, s.rounds.grace_s) == (0.5, 2.0)


# ----------------------------------------------------------------------------- the app's keys
@pytest.fixture
def app():
    sys.path.insert(0, str(APP))
    from rwlora_sentiment import task

    yield task
    sys.path.remove(str(APP))


@pytest.mark.parametrize("name", ["rwlora", "gossip"])
def test_the_app_keys_reach_checks_and_rounds(app, name):
    over = {
        "strategy.name": name,
        "strategy.graph": "ring",
        "strategy.max-update-norm": 50.0,
        "strategy.max-norm-ratio": 8.0,
        "strategy.max-empty-rounds": 0,
    }
    if name == "rwlora":
        over["strategy.lazy"] = True
    s = app.build_strategy(app.load_config(over), 4)
    assert (s.checks.max_update_norm, s.checks.max_norm_ratio) == (50.0, 8.0)
    assert s.rounds.max_empty_rounds == 0 and s.guard.limit == 0
    off = app.build_strategy(app.load_config({"strategy.name": name, "strategy.lazy": True}), 4)
    assert off.checks == ReplyChecks() and off.rounds == Rounds()  # 0 = off: the defaults


def test_the_app_refuses_a_grace_window_without_a_quorum(app):
    from flwr_isoloco.runconfig import RunConfigError

    with pytest.raises(RunConfigError, match=r"'strategy.grace-s' = 2 .* 'strategy.quorum' = 1"):
        app.load_config({"strategy.name": "gossip", "strategy.grace-s": 2.0})
