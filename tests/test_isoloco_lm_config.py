"""The LM app's run-config vocabulary is the strategies' (docs/strategies.md): every documented
key is accepted where it means something, validated once, with the strategy's defaults."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "simulations" / "isoloco-lm"))

from isoloco_lm import task  # noqa: E402

from flwr_isoloco.runconfig import RunConfigError  # noqa: E402
from flwr_isoloco.strategies.diloco.config import (  # noqa: E402
    DILOCO_RUN_CONFIG,
    ISOLOCO_RUN_CONFIG,
    RENAMED_KEYS,
)


def _documented_keys() -> set[str]:
    text = (ROOT / "docs" / "strategies.md").read_text()
    section = text.split("## Run-config keys")[1].split("\n## ")[0]
    found = set(re.findall(r"`strategy\.([a-z-]+)`", section))
    app_keys = {"name", "timeout", "round-timeout"}  # documented as the app's, ignored there
    assert found - app_keys <= set(DILOCO_RUN_CONFIG) | {"fast", "preset"}  # + IsoLoCo's own
    return found - app_keys


def test_every_documented_key_is_accepted_or_refused_with_a_reason():
    keys = _documented_keys()
    assert {"prune-fraction", "drop-rate", "weighting", "min-available-nodes"} <= keys
    for key in sorted(keys):
        if key in task.NOT_IN_APP:
            with pytest.raises(RunConfigError, match=f"'strategy.{key}' has no meaning here"):
                value = DILOCO_RUN_CONFIG.get(key, ISOLOCO_RUN_CONFIG.get(key))
                task.load_config({f"strategy.{key}": value})
        else:
            assert key in task.STRATEGY_SECTION, key


def test_a_renamed_key_is_refused_naming_the_new_one():
    for old, new in RENAMED_KEYS.items():
        value = DILOCO_RUN_CONFIG[new]
        with pytest.raises(RunConfigError, match=f"'strategy.{old}' is now 'strategy.{new}'"):
            task.load_config({f"strategy.{old}": value})


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


def test_compression_md_s_commands_build_what_they_say():
    """docs/compression.md's first two ``flwr run`` commands, parsed as Flower parses them:
    int4 both ways, then SparseLoCo's setup."""
    from flwr.common.config import parse_config_args

    text = (ROOT / "docs" / "compression.md").read_text()
    commands = re.findall(r'flwr run simulations/isoloco-lm --run-config "([^"]+)"', text)
    int4, sparse = (
        task.build_strategy(task.load_config(parse_config_args([c]))) for c in commands[:2]
    )
    assert (int4.upload.name, int4.download.name) == ("int4", "int4")
    assert (sparse.merge_name, sparse.outer.lr, sparse.outer.momentum, sparse.outer.nesterov) == (
        "sparseloco",
        0.18,
        0.0,
        False,
    )
    assert (sparse.upload.name, sparse.upload.options["k"], sparse.download.name) == (
        "sparseloco",
        64,
        "exact",
    )


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


def test_tuned_outer_values_are_the_sweep_s_optimum():
    """The app's per-rule table (isoloco_lm/tuned.py) equals what the LM sweep picks as tuned
    (benchmarks/lm/lm_sweep.py tuned_hp at M = 8 on benchmarks/results/lm_tuning.json)."""
    import json

    sys.path.insert(0, str(ROOT / "benchmarks" / "lm"))
    import lm_sweep
    import lm_sweep_lib
    from isoloco_lm import tuned

    grid = json.loads((ROOT / tuned.SOURCE).read_text())
    assert set(tuned.TUNED) == {"mean", "iso_c", "iso_cts", "tsv_m", "ties", "dare"}
    for rule, row in tuned.TUNED.items():
        rule_of, with_momentum, _ = lm_sweep_lib.METHODS[row.method]
        assert rule_of == rule and with_momentum == (row.outer_momentum > 0), rule
        hp = lm_sweep.tuned_hp(row.method, lm_sweep.TUNE_WORKERS, grid, quick=False)
        assert hp["hp_source"] == f"tuned-M{lm_sweep.TUNE_WORKERS}", rule
        assert (row.outer_lr, row.outer_momentum) == (hp["outer_lr"], hp["outer_momentum"]), rule


@pytest.mark.parametrize(
    "rc, lr, mu, text",
    [
        ({}, 1.8, 0.8, "outer lr 1.8, momentum 0.8 (Iso-C's tuned values, "),
        (
            {"strategy.merge": "ties"},
            0.7,
            0.0,
            "outer lr 0.7, momentum 0.0 (TIES' tuned values, benchmarks/results/lm_tuning.json); "
            "set strategy.outer-lr / strategy.outer-momentum to override",
        ),
        ({"strategy.name": "diloco"}, 0.25, 0.8, "(the mean merge's tuned values, "),
        ({"strategy.fast": True}, 1.8, 0.8, "(IsoLoCo's defaults; iso_c_ns was not in the tuning"),
        (
            {"strategy.merge": "dare", "strategy.outer-momentum": 0.5},
            0.7,
            0.5,
            "outer lr 0.7 (DARE's tuned value, benchmarks/results/lm_tuning.json), momentum 0.5 "
            "(run config); set strategy.outer-lr to override",
        ),
        (
            {"strategy.outer-lr": 1.0, "strategy.outer-momentum": 0.0},
            1.0,
            0.0,
            "outer lr 1.0, momentum 0.0 (run config)",
        ),
        ({"strategy.name": "fedavg"}, 1.0, 0.0, "outer lr 1.0, momentum 0.0 (FedAvg)"),
    ],
)
def test_outer_values_in_force_say_where_they_came_from(rc, lr, mu, text):
    cfg = task.load_config(rc)
    outer = task.strategy_outer(cfg)
    assert text in outer.message
    s = task.build_strategy(cfg)
    assert (s.outer.lr, s.outer.momentum) == (outer.outer_lr, outer.outer_momentum) == (lr, mu)
