"""The divergence guard on the shared lifecycle: a round whose server-side evaluation loss is
non-finite or above ``factor x`` the previous one's is logged, and kept ("warn"), undone
("skip": model and momentum bitwise as before the round) or ends the run ("stop")."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, MetricRecord
from test_lifecycle import init_model, plain_app

from flwr_isoloco.checkpoint import load_checkpoint, save_checkpoint
from flwr_isoloco.strategies import DiLoCo, Divergence, GossipLoRA, IsoLoCo, RWLoRA
from flwr_isoloco.strategies.core.divergence import DivergenceError, DivergenceGuard
from flwr_isoloco.strategies.core.guard import NoProgressError
from flwr_isoloco.strategies.core.lifecycle import divergence_guard, set_divergence_guard

torch.set_num_threads(1)
N = 3


def diloco(**kw) -> DiLoCo:
    return DiLoCo(
        min_train_nodes=1, min_available_nodes=1, fraction_evaluate=0.0, outer_momentum=0.9, **kw
    )


class Scripted:
    """``evaluate_fn`` returning the next loss of ``losses`` per call; records every call."""

    def __init__(self, losses, key="loss"):
        self.losses, self.key, self.calls = list(losses), key, []

    def __call__(self, rnd, arrays):
        sd = arrays.to_torch_state_dict()
        self.calls.append((rnd, {k: v.clone() for k, v in sd.items()}))
        return MetricRecord({self.key: self.losses[len(self.calls) - 1], "other": 1.0})


def run(strategy, rounds, evaluate_fn, hook=None, grid=None):
    return strategy.start(
        grid=grid or FakeGrid(plain_app(), num_nodes=N),
        initial_arrays=ArrayRecord(init_model()),
        num_rounds=rounds,
        timeout=5,
        evaluate_fn=evaluate_fn,
        on_round_end=hook,
    )


def _state(s: DiLoCo):
    """theta and the momentum buffers, cloned."""
    return (
        {k: v.clone() for k, v in s.theta.items()},
        {k: v.clone() for k, v in s.outer.momentum_buffer.items()},
    )


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _diverged(result) -> list[int]:
    return [
        int(result.evaluate_metrics_serverapp[r]["diverged"])
        for r in sorted(result.evaluate_metrics_serverapp)
        if r > 0
    ]


def test_warn_logs_round_losses_and_factor_and_keeps_the_update(caplog):
    plain = run(diloco(divergence=Divergence(factor=0)), 3, Scripted([1.0, 0.9, 2.0, 1.9]))
    with caplog.at_level(logging.INFO, logger="flwr"):
        res = run(diloco(), 3, Scripted([1.0, 0.9, 2.0, 1.9]))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    flagged = [w for w in warnings if "divergence guard" in w]
    assert len(flagged) == 2, warnings
    assert "round 2: loss 0.9 -> 2 " in flagged[0] and "factor 1.5" in flagged[0]
    assert "update kept" in flagged[0]
    # round 3 (1.9) is no jump from round 2's kept 2.0, but still above 1.5 x the best 0.9
    assert "round 3: loss 2 -> 1.9 (above 1.5 x the best loss so far 0.9" in flagged[1]
    assert _diverged(res) == [0, 1, 1]
    assert _diverged(plain) == [0, 0, 0]  # factor 0: only non-finite losses count
    a, b = plain.arrays.to_torch_state_dict(), res.arrays.to_torch_state_dict()
    assert _equal(a, b)  # "warn" changes nothing but the log and the metric


def test_skip_restores_model_and_momentum_bitwise_and_goes_on():
    s = diloco(divergence=Divergence(on_divergence="skip"))
    states, hooked = {}, {}

    def hook(rnd, arrays, tm, em):
        states[rnd] = _state(s)
        hooked[rnd] = (arrays.to_torch_state_dict(), dict(em), s.completed_rounds)

    ev = Scripted([1.0, 0.9, math.nan, 0.9, 0.8])  # round 2 non-finite; 0.9 = its re-evaluation
    res = run(s, 3, ev, hook)
    theta1, mom1 = states[1]
    theta2, mom2 = states[2]
    assert _equal(theta1, theta2) and _equal(mom1, mom2) and mom1  # bitwise, momentum non-empty
    assert [r for r, _ in ev.calls] == [0, 1, 2, 2, 3]
    assert _equal(ev.calls[3][1], hooked[1][0])  # the restored model was evaluated again
    assert not _equal(ev.calls[2][1], hooked[1][0])  # the diverged one was another
    assert _equal(hooked[2][0], hooked[1][0])  # the hook (checkpoint) sees the restored model
    assert hooked[2][1]["diverged"] == 1 and hooked[2][1]["loss"] == 0.9
    assert hooked[2][2] == 2  # the round still counts
    assert _diverged(res) == [0, 1, 0]
    # independent check: round 3 after the skip is round 2 of a run that never had round 2
    # (all nodes sampled, merge in content-digest order: the same computation)
    clean = run(diloco(), 2, Scripted([1.0, 0.9, 0.8]))
    assert _equal(res.arrays.to_torch_state_dict(), clean.arrays.to_torch_state_dict())
    assert s.outer.steps == 2


def test_skip_reference_stays_the_kept_round_s_loss():
    g = DivergenceGuard("skip", 1.5)
    g.observe({"loss": 1.0})
    assert g.check(1, {"loss": 2.0}) is True  # skipped: reference stays 1.0
    assert g.check(2, {"loss": 1.4}) is False and g.reference == 1.4
    assert g.check(3, {"loss": 2.2}) is True  # 2.2 > 1.5 x 1.4


def test_stop_raises_after_the_round_end_hook():
    ended = []
    s = diloco(divergence=Divergence(on_divergence="stop"))
    with pytest.raises(DivergenceError, match="round 2: the evaluation loss diverged") as info:
        run(s, 4, Scripted([1.0, 0.9, math.inf]), lambda r, *_: ended.append(r))
    assert isinstance(info.value, NoProgressError)  # apps end such a run as failed
    assert ended == [1, 2] and s.completed_rounds == 2


def test_resume_restores_the_reference_loss(tmp_path):
    first = diloco(divergence=Divergence(on_divergence="skip"))
    run(first, 2, Scripted([1.0, 0.5, 0.6]))
    sd = first.state_dict()
    assert sd["meta"]["divergence"] == {"reference": 0.6, "best": 0.5}
    save_checkpoint(tmp_path / "c.safetensors", sd["tensors"], sd["meta"])
    tensors, meta = load_checkpoint(tmp_path / "c.safetensors")
    second = diloco(divergence=Divergence(on_divergence="skip"))
    second.load_state_dict({"tensors": tensors, "meta": meta})
    before = _state(second)
    ev = Scripted([0.95, 0.6, 0.55])  # round 3: 0.95 > 1.5 x 0.6 (the checkpoint's reference)
    res = run(second, 4, ev)
    assert [r for r, _ in ev.calls] == [3, 3, 4]
    assert _diverged(res) == [1, 0]
    # an uninterrupted run with the same losses ends where the resumed one does
    full = run(
        diloco(divergence=Divergence(on_divergence="skip")),
        4,
        Scripted([1.0, 0.5, 0.6, 0.95, 0.6, 0.55]),
    )
    assert _equal(full.arrays.to_torch_state_dict(), res.arrays.to_torch_state_dict())
    assert before[0] and second.completed_rounds == 4


def test_old_checkpoint_without_guard_state_still_loads():
    first = diloco()
    run(first, 1, Scripted([1.0, 0.9]))
    sd = first.state_dict()
    del sd["meta"]["divergence"]
    second = diloco()
    second.load_state_dict(sd)
    assert divergence_guard(second).reference is None and second.completed_rounds == 1


def test_loss_key_is_found_by_name_or_given(caplog):
    with caplog.at_level(logging.INFO, logger="flwr"):
        res = run(diloco(), 2, Scripted([1.0, 0.9, math.nan], key="accuracy"))
    assert "guard inactive" in caplog.text and caplog.text.count("guard inactive") == 1
    assert "diverged" not in res.evaluate_metrics_serverapp[2]
    res = run(diloco(), 2, Scripted([1.0, 0.9, math.nan], key="val-loss"))
    assert _diverged(res) == [0, 1]
    res = run(
        diloco(divergence=Divergence(key="accuracy")),
        2,
        Scripted([1.0, 0.9, math.nan], key="accuracy"),
    )
    assert _diverged(res) == [0, 1]


def test_negative_losses_use_the_factor_on_the_magnitude():
    g = DivergenceGuard("warn", 1.5)
    g.observe({"loss": -2.0})
    assert g.check(1, {"loss": -1.1}) is False  # threshold -2 + 0.5 x 2 = -1
    assert g.check(2, {"loss": 0.0}) is True


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"on_divergence": "ignore"}, "on_divergence must be one of"),
        ({"factor": 0.5}, "divergence_factor must be >= 1, or 0"),
        ({"factor": math.inf}, "divergence_factor must be >= 1, or 0"),
        ({"key": ""}, "divergence_key must be"),
    ],
)
def test_bad_arguments_are_refused(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        diloco(divergence=Divergence(**kwargs))


def test_run_config_keys_reach_the_guard():
    s = IsoLoCo.from_run_config(
        {"strategy.on-divergence": "stop", "strategy.divergence-factor": 2.0}
    )
    assert (divergence_guard(s).mode, divergence_guard(s).factor) == ("stop", 2.0)
    assert divergence_guard(DiLoCo.from_run_config({})).mode == "warn"
    with pytest.raises(ValueError, match="strategy.on-divergence"):
        DiLoCo.from_run_config({"strategy.on-divergence": "skipp"})
    with pytest.raises(ValueError, match="strategy.divergence-factor"):
        DiLoCo.from_run_config({"strategy.divergence-factor": 0.9})


@pytest.mark.parametrize("cls", [RWLoRA, GossipLoRA])
def test_graph_strategies_warn_and_refuse_skip(cls, caplog):
    with pytest.raises(ValueError, match="on_divergence='skip' needs"):
        set_divergence_guard(cls(), "skip")
    with caplog.at_level(logging.WARNING, logger="flwr"):
        res = run(cls(), 2, Scripted([1.0, math.nan, 0.9]))
    assert "divergence guard: round 1: loss 1 -> nan (not finite" in caplog.text
    assert _diverged(res) == [1, 0]
    s = cls()
    set_divergence_guard(s, "stop")
    with pytest.raises(DivergenceError):
        run(s, 2, Scripted([1.0, math.nan]))


# --------------------------------------------------------------------- slow collapse (issue 34)
ISSUE_34 = [0.39, 0.42, 0.5, 0.6, 0.72, 0.86, 1.07]
"""A test loss climbing 0.39 -> 1.07 (issue 34, item 7) in steps of at most x1.25."""


def test_a_slow_collapse_is_flagged_against_the_best_loss():
    assert max(b / a for a, b in zip(ISSUE_34[:-1], ISSUE_34[1:], strict=True)) < 1.5  # no jump
    g = DivergenceGuard("warn")
    g.observe({"loss": ISSUE_34[0]})
    flags = [g.check(r, {"loss": v}) for r, v in enumerate(ISSUE_34[1:], start=1)]
    assert flags == [False, False, True, True, True, True]  # from 0.6 > 1.5 x 0.39 on
    assert g.best == 0.39 and g.reference == 1.07


def test_a_slow_collapse_stops_a_run_and_skip_keeps_the_best_model():
    with pytest.raises(DivergenceError, match="round 3"):
        run(diloco(divergence=Divergence(on_divergence="stop")), 6, Scripted(ISSUE_34))
    s = diloco(divergence=Divergence(on_divergence="skip"))
    # every round after round 2 keeps collapsing: each is undone and re-evaluated at 0.5
    res = run(s, 4, Scripted([0.39, 0.42, 0.5, 0.6, 0.5, 0.62, 0.5]))
    assert _diverged(res) == [0, 0, 1, 1]
    assert divergence_guard(s).best == 0.39 and s.outer.steps == 2


def test_collapse_factor_is_checked_documented_and_can_be_off():
    g = DivergenceGuard("warn", collapse_factor=0)
    g.observe({"loss": ISSUE_34[0]})
    assert not any(g.check(r, {"loss": v}) for r, v in enumerate(ISSUE_34[1:], start=1))
    assert not DivergenceGuard("warn", factor=0).diverged(100.0)  # factor 0: non-finite only
    for bad in (0.5, -1, math.inf, True, "2"):
        with pytest.raises(ValueError, match="collapse_factor"):
            DivergenceGuard("warn", collapse_factor=bad)
    s = diloco()
    set_divergence_guard(s, "warn", 1.5, None, collapse_factor=3.0)
    assert divergence_guard(s).collapse_factor == 3.0


def _record_curves(name: str, path: list) -> list[list[float]]:
    import json
    from pathlib import Path

    data = json.loads((Path(__file__).parents[1] / "benchmarks" / "results" / name).read_text())
    for step in path:
        data = data[step]
    return data


def test_healthy_record_curves_are_not_flagged_and_a_diverging_one_is():
    """The default factors against our records: the 54 LM runs of compression_loss.json and
    the sentiment runs of rwlora_summary.json are healthy (largest loss / best so far: 1.07,
    1.15) and raise no flag; weight_bound.json's attack-off DiLoCo diverges slowly (7.50 ->
    14.68, at most x1.14 a round) and is flagged."""
    curves = [run["val-loss"] for run in _record_curves("compression_loss.json", ["runs"])]
    summary = _record_curves("rwlora_summary.json", ["runs"])
    curves += [
        [r["test-loss"] for r in run["rounds"] if "test-loss" in r] for run in summary.values()
    ]
    assert len(curves) >= 55
    for curve in curves:
        g = DivergenceGuard("warn")
        g.observe({"loss": curve[0]})
        assert not any(g.check(r, {"loss": v}) for r, v in enumerate(curve[1:], start=1)), curve
    bad = [
        c
        for c in _record_curves("weight_bound.json", [])
        if c.get("case") == "attack-off" and c.get("strategy") == "diloco"
    ][0]["val_loss"]
    g = DivergenceGuard("warn")
    g.observe({"loss": bad[0]})
    assert any(g.check(r, {"loss": v}) for r, v in enumerate(bad[1:], start=1))
