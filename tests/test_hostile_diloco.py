"""Hostile or broken input to DiLoCo/IsoLoCo (issue 5, item 5): bad replies and bad configs.

Each bad reply must be dropped with a reason naming the node, counted in the round's metrics,
and the model must be exactly what the good replies alone give (lr 1, mu 0: FedAvg of them).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from fakegrid import FakeGrid, corrupt_arrays
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from flwr_isoloco.strategies import DiLoCo, IsoLoCo
from flwr_isoloco.strategies.common import ReplyValidator, SentLedger

torch.set_num_threads(1)

N = 4
BAD = 2  # partition id of the hostile node
EX = [1, 2, 3, 4]  # num-examples per partition


def init_model():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}


def trained(theta, pid):
    g = torch.Generator().manual_seed(pid)
    return {k: theta[k] + 0.1 * torch.randn(theta[k].shape, generator=g) for k in sorted(theta)}


def train(msg, ctx):
    pid = int(ctx.node_config["partition-id"])
    new = trained(msg.content["arrays"].to_torch_state_dict(), pid)
    metrics = MetricRecord({"num-examples": EX[pid], "train-loss": 1.0})
    return Message(RecordDict({"arrays": ArrayRecord(new), "metrics": metrics}), reply_to=msg)


def fedavg_of(pids):
    theta = init_model()
    tot = sum(EX[p] for p in pids)
    return {k: sum(EX[p] * trained(theta, p)[k] for p in pids) / tot for k in theta}


def one_round(fault=None, **kw):
    grid = FakeGrid({"train": train}, num_nodes=N)
    if fault is not None:
        grid.set_fault(BAD, fault)
    strat = DiLoCo(
        outer_lr=1.0,
        outer_momentum=0.0,
        min_train_nodes=1,
        min_available_nodes=1,
        fraction_evaluate=0.0,
        **kw,
    )
    res = strat.start(grid=grid, initial_arrays=ArrayRecord(init_model()), num_rounds=1)
    return strat, res, grid


def _set_metric(key, value):
    def fault(reply):
        reply.content["metrics"][key] = value
        return reply

    return fault


def _drop_metric(key):
    def fault(reply):
        rec = reply.content["metrics"]
        reply.content["metrics"] = MetricRecord({k: v for k, v in rec.items() if k != key})
        return reply

    return fault


def _no_arrays(reply):
    reply.content = RecordDict({"metrics": reply.content["metrics"]})
    return reply


HOSTILE = {
    "nan": (corrupt_arrays(lambda d: {**d, "w": d["w"] * np.nan}), "non-finite"),
    "inf": (corrupt_arrays(lambda d: {**d, "b": d["b"] + np.inf}), "non-finite"),
    "overflow": (
        corrupt_arrays(lambda d: {**d, "w": np.full_like(d["w"], 3e38)}),
        "sum overflows",
    ),
    "wrong-shape": (corrupt_arrays(lambda d: {**d, "w": d["w"][:2]}), "shape"),
    "transposed": (corrupt_arrays(lambda d: {**d, "w": d["w"].T.copy()}), "shape"),
    "missing-key": (corrupt_arrays(lambda d: {"w": d["w"]}), "missing ['b']"),
    "extra-key": (
        corrupt_arrays(lambda d: {**d, "evil": np.ones(2, np.float32)}),
        "extra ['evil']",
    ),
    "int-dtype": (corrupt_arrays(lambda d: {**d, "b": d["b"].astype(np.int64)}), "dtype"),
    "bool-dtype": (corrupt_arrays(lambda d: {**d, "b": d["b"] > 0}), "dtype"),
    "no-arrays": (_no_arrays, "no ArrayRecord"),
    "raised": ("raise", "error reply (code 2)"),
    "dead-node": ("dead", "error reply (code 5)"),
    "missing-num-examples": (_drop_metric("num-examples"), "missing weight key"),
    "zero-num-examples": (_set_metric("num-examples", 0), "invalid weight"),
    "negative-num-examples": (_set_metric("num-examples", -5), "invalid weight"),
    "nan-num-examples": (_set_metric("num-examples", float("nan")), "invalid weight"),
    "list-num-examples": (_set_metric("num-examples", [1, 2]), "invalid weight"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_reply_is_dropped_and_round_goes_on(name, caplog):
    fault, reason = HOSTILE[name]
    with caplog.at_level(logging.WARNING):
        strat, res, grid = one_round(fault)
    m = res.train_metrics_clientapp[1]
    assert (m["replies-used"], m["replies-rejected"]) == (N - 1, 1)
    bad_node = grid.node_ids[BAD]
    assert any(str(bad_node) in r.message and reason in r.message for r in caplog.records), [
        r.message for r in caplog.records
    ]
    expected = fedavg_of([p for p in range(N) if p != BAD])
    got = res.arrays.to_torch_state_dict()
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-6, atol=1e-6)


def test_timeout_is_counted_as_missing():
    strat, res, _ = one_round("timeout")
    m = res.train_metrics_clientapp[1]
    assert (m["replies-used"], m["replies-rejected"], m["replies-missing"]) == (N - 1, 0, 1)


def test_dead_node_is_named_by_the_node_we_sent_to_not_the_superlink(caplog):
    with caplog.at_level(logging.WARNING):
        _, _, grid = one_round("dead")
    drops = [r.message for r in caplog.records if "dropped reply" in r.message]
    assert drops == [drops[0]] and f"node {grid.node_ids[BAD]}:" in drops[0]


def test_fp16_reply_is_cast_by_default_and_rejected_on_request():
    half = corrupt_arrays(lambda d: {k: v.astype(np.float16) for k, v in d.items()})
    _, res, _ = one_round(half)
    assert res.train_metrics_clientapp[1]["replies-used"] == N
    _, res, _ = one_round(half, dtype_policy="reject")
    m = res.train_metrics_clientapp[1]
    assert (m["replies-used"], m["replies-rejected"]) == (N - 1, 1)


def test_huge_update_rejected_by_max_update_norm():
    huge = corrupt_arrays(lambda d: {k: v * 1e4 for k, v in d.items()})
    _, res, _ = one_round(huge)  # no bound: accepted, and it wrecks the model
    assert res.train_metrics_clientapp[1]["replies-used"] == N
    _, res, _ = one_round(huge, max_update_norm=10.0)
    m = res.train_metrics_clientapp[1]
    assert (m["replies-used"], m["replies-rejected"]) == (N - 1, 1)
    expected = fedavg_of([0, 1, 3])
    for k, v in res.arrays.to_torch_state_dict().items():
        torch.testing.assert_close(v, expected[k], rtol=1e-6, atol=1e-6)


def test_huge_update_rejected_by_norm_ratio():
    huge = corrupt_arrays(lambda d: {k: v * 50 for k, v in d.items()})
    _, res, _ = one_round(huge, max_norm_ratio=5.0)
    m = res.train_metrics_clientapp[1]
    assert (m["replies-used"], m["replies-rejected"]) == (N - 1, 1)


def test_no_usable_reply_keeps_the_model():
    grid = FakeGrid({"train": train}, num_nodes=N)
    for p in range(N):
        grid.set_fault(p, corrupt_arrays(lambda d: {k: v * np.nan for k, v in d.items()}))
    strat = IsoLoCo(min_train_nodes=1, min_available_nodes=1, fraction_evaluate=0.0)
    before = init_model()
    res = strat.start(grid=grid, initial_arrays=ArrayRecord(before), num_rounds=2)
    assert len(res.arrays) == 0  # Flower: no round aggregated
    m = res.train_metrics_clientapp[2]
    assert (m["replies-used"], m["replies-rejected"]) == (0, N)
    for k in before:
        assert torch.equal(strat.theta[k], before[k])
    assert not strat.outer.momentum_buffer  # no outer step taken


def test_handler_exception_becomes_error_reply_not_a_crash():
    def broken(msg, ctx):
        if ctx.node_config["partition-id"] == BAD:
            raise RuntimeError("CUDA out of memory")
        return train(msg, ctx)

    grid = FakeGrid({"train": broken}, num_nodes=N)
    strat = DiLoCo(min_train_nodes=1, min_available_nodes=1, fraction_evaluate=0.0)
    res = strat.start(grid=grid, initial_arrays=ArrayRecord(init_model()), num_rounds=2)
    assert res.train_metrics_clientapp[2]["replies-rejected"] == 1


def test_validator_never_raises_on_garbage_messages():
    grid = FakeGrid({"train": train}, num_nodes=1)  # sets the task identity
    del grid
    ledger = SentLedger()
    msg = Message(RecordDict({"arrays": ArrayRecord(init_model())}), 7, "train")
    ledger.remember([msg])
    msg.metadata.__dict__["_message_id"] = "m1"
    weird = Message(RecordDict({"metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)
    checked, report = ReplyValidator().validate([weird], init_model(), ledger)
    assert checked == [] and report.rejected == 1 and report.reasons[0][0] == 7


# --------------------------------------------------------------------------- bad configuration
@pytest.mark.parametrize(
    "cfg, needle",
    [
        ({"strategy.merge": "average"}, "strategy.merge"),
        ({"strategy.outer-lr": -0.7}, "strategy.outer-lr"),
        ({"strategy.outer-momentum": -0.1}, "strategy.outer-momentum"),
        ({"strategy.outer-lr": "fast"}, "strategy.outer-lr"),
        ({"strategy.lerning-rate": 0.1}, "strategy.lerning-rate"),
        ({"strategy.fraction-train": 1.5}, "strategy.fraction-train"),
        ({"strategy.orthogonalize": "sideways"}, "strategy.orthogonalize"),
        ({"strategy.max-update-norm": -1.0}, "strategy.max-update-norm"),
        ({"strategy.prune-fraction": 0.3}, "prune_fraction"),
    ],
)
def test_bad_run_config_names_the_key(cfg, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        DiLoCo.from_run_config(cfg)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"merge": "average"}, "unknown merge rule 'average'"),
        ({"outer_lr": -1.0}, "lr"),
        ({"outer_lr": float("nan")}, "lr"),
        ({"fraction_train": 2.0}, "fraction_train"),
        ({"orthogonalize": "update", "merge": "ties"}, "orthogonalize='update'"),
        ({"weighting": "tokens"}, "weighting"),
        ({"max_update_norm": -3.0}, "max_update_norm"),
        ({"dtype_policy": "ignore"}, "dtype_policy"),
        ({"merge": "mean", "merge_options": {"prune_fraction": 0.2}}, "prune_fraction"),
        ({"merge": "ties", "merge_options": {"prune_fraction": 1.5}}, "prune_fraction"),
    ],
)
def test_bad_constructor_argument_names_it(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace("'", "'")):
        DiLoCo(**kwargs)
