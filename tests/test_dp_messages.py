"""Issue 34, item 9 (DP parts): what central DP says, once and naming what the user set."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from privacy_helpers import QUIET, start_run

from flwr_isoloco.strategies import CentralDP, DiLoCo, ReplyChecks

RC = {"strategy.dp-noise-multiplier": 1.0, "strategy.dp-clipping-norm": 0.5}


def test_uniform_weights_are_said_once_in_the_summary_not_per_construction(caplog):
    """Every ClientApp rebuilds the strategy from the run config: building it says nothing;
    the server's strategy summary says it once (it was 11 lines in a 2-round run)."""
    caplog.set_level(logging.DEBUG, logger="flwr")
    for _ in range(4):  # as the server and three ClientApps would
        DiLoCo.from_run_config(RC)
    assert not [r for r in caplog.records if "uniform" in r.getMessage()]
    start_run(DiLoCo(**QUIET, privacy=CentralDP(noise_multiplier=1.0, clipping_norm=0.5)), 2, 2)
    said = [r.getMessage() for r in caplog.records if "weighting='examples'" in r.getMessage()]
    assert len(said) == 1 and "weights uniform" in said[0]
    caplog.clear()
    start_run(
        DiLoCo(
            **QUIET, checks=ReplyChecks(weighting="uniform"), privacy=CentralDP(clipping_norm=0.5)
        ),
        2,
        1,
    )
    assert not [r for r in caplog.records if "weighting='examples'" in r.getMessage()]


def test_central_dp_with_a_robust_rule_names_the_keys_set_and_the_fix():
    from flwr_isoloco.runconfig import precheck_app_config

    with pytest.raises(ValueError) as exc:
        DiLoCo(robust="distance-filter", privacy=CentralDP(noise_multiplier=1.0, clipping_norm=0.5))
    msg = str(exc.value)
    assert "clipping_norm=0.5" in msg and "robust='distance-filter'" in msg
    assert "robust='none'" in msg and "LocalDP" in msg
    app = Path(__file__).resolve().parents[1] / "simulations" / "isoloco-lm"
    (msg,) = precheck_app_config(app, {**RC, "strategy.robust": "distance-filter"})
    assert "'strategy.dp-clipping-norm'" in msg and "'strategy.dp-mode'" not in msg
