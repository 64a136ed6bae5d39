"""The LM app's run-config vocabulary is the strategies' (docs/strategies.md): every documented
key is accepted where it means something, validated once, with the strategy's defaults."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "simulations" / "isoloco_lm"))

from isoloco_lm import task  # noqa: E402

from flwr_isoloco.runconfig import RunConfigError  # noqa: E402
from flwr_isoloco.strategies.diloco_config import DILOCO_RUN_CONFIG  # noqa: E402


def _documented_keys() -> set[str]:
    text = (ROOT / "docs" / "strategies.md").read_text()
    section = text.split("## Run-config keys")[1].split("\n## ")[0]
    found = set(re.findall(r"`strategy\.([a-z-]+)`", section))
    app_keys = {"name", "timeout", "round-timeout"}  # documented as the app's, ignored there
    assert found - app_keys <= set(DILOCO_RUN_CONFIG) | {"fast"}
    return found - app_keys


def test_every_documented_key_is_accepted_or_refused_with_a_reason():
    keys = _documented_keys()
    assert {"prune-fraction", "drop-rate", "weighting", "min-available-nodes"} <= keys
    for key in sorted(keys):
        if key in task.NOT_IN_APP:
            with pytest.raises(RunConfigError, match=f"'strategy.{key}' has no meaning here"):
                task.load_config({f"strategy.{key}": DILOCO_RUN_CONFIG[key]})
        else:
            assert key in task.STRATEGY_SECTION, key


def test_strategy_defaults_are_the_strategy_s_own():
    for key, value in task.STRATEGY_SECTION.items():
        if key not in task.APP_STRATEGY_KEYS:
            assert value == DILOCO_RUN_CONFIG[key], key


@pytest.mark.parametrize(
    "rc, check",
    [
        (
            {"strategy.merge": "ties", "strategy.prune-fraction": 0.3},
            lambda s: s.merge_options == {"prune_fraction": 0.3},
        ),
        (
            {"strategy.merge": "dare", "strategy.drop-rate": 0.5},
            lambda s: s.merge_options == {"drop_rate": 0.5},
        ),
        ({"strategy.weighting": "uniform"}, lambda s: s.weighting == "uniform"),
        (
            {"strategy.min-available-nodes": 3},
            lambda s: (s.min_available_nodes, s.min_train_nodes) == (3, 2),
        ),
        ({"strategy.min-nodes": 3}, lambda s: (s.min_available_nodes, s.min_train_nodes) == (3, 3)),
        ({}, lambda s: (s.merge_name, s.outer.lr, s.outer.momentum) == ("iso_c", 1.8, 0.8)),
        (
            {"strategy.name": "fedavg"},
            lambda s: (s.merge_name, s.outer.lr, s.outer.momentum) == ("mean", 1.0, 0.0),
        ),
    ],
)
def test_documented_keys_reach_the_strategy(rc, check):
    strategy = task.build_strategy(task.load_config(rc))
    assert check(strategy)


@pytest.mark.parametrize(
    "rc, pattern",
    [
        (
            {"strategy.merge": "dare", "strategy.drop-rate": 1.5},
            r"'strategy\.drop-rate' \(strategy\.merge 'dare'\): option drop_rate=1\.5",
        ),
        ({"strategy.prune-fraction": 0.3}, r"'strategy\.prune-fraction'"),  # iso_c takes none
        ({"strategy.weighting": "size"}, r"'strategy\.weighting' has bad value 'size'"),
        ({"strategy.min-available-nodes": -3}, r"'strategy\.min-available-nodes'"),
        ({"strategy.fraction-evaluate": 0.5}, r"server-side only"),
    ],
)
def test_bad_strategy_values_are_refused_at_the_boundary(rc, pattern):
    with pytest.raises(RunConfigError, match=pattern):
        task.load_config(rc)
