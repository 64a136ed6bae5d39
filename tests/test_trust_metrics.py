"""Train-round client metrics (issue 34, item 5): SecAgg+ rounds call the app's
``train_metrics_aggr_fn`` as plain rounds do (one epilogue), and the default mean is weighted by
the bounded merge weight, not the self-reported ``num-examples``."""

from __future__ import annotations

import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from test_lifecycle import init_model
from test_secagg import _federation, _strategy

from flwr_isoloco.strategies import DiLoCo, Records, ReplyChecks

torch.set_num_threads(1)


def _claims_app(claims: list[int]) -> ClientApp:
    """Node ``i`` claims ``claims[i]`` examples and reports ``train-loss = i``."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context) -> Message:
        pid = int(context.node_config["partition-id"])
        theta = msg.content["arrays"].to_torch_state_dict()
        new = {k: 0.9 * v for k, v in theta.items()}
        metrics = MetricRecord({"num-examples": claims[pid], "train-loss": float(pid)})
        return Message(RecordDict({"arrays": ArrayRecord(new), "metrics": metrics}), reply_to=msg)

    return app


def _round_one(strategy, claims):
    res = strategy.start(
        grid=FakeGrid(_claims_app(claims), num_nodes=len(claims)),
        initial_arrays=ArrayRecord(init_model()),
        num_rounds=1,
        timeout=5,
    )
    return res.train_metrics_clientapp[1]


def test_train_loss_is_weighted_by_the_bounded_merge_weight():
    """Weights 10, 10, 10^6 bounded at 5 x the median: 10, 10, 50; train-loss = (0 + 10 +
    100) / 70, where the raw claims would give ~2 (the big claimer alone)."""
    s = DiLoCo(min_train_nodes=3, min_available_nodes=3, fraction_evaluate=0.0)
    m = _round_one(s, [10, 10, 10**6])
    assert m["train-loss"] == pytest.approx(110 / 70)


def test_train_loss_is_unweighted_under_uniform_weighting():
    s = DiLoCo(
        min_train_nodes=3,
        min_available_nodes=3,
        fraction_evaluate=0.0,
        checks=ReplyChecks(weighting="uniform"),
    )
    assert _round_one(s, [10, 10, 10**6])["train-loss"] == pytest.approx(1.0)


def test_the_app_s_aggr_fn_still_sees_what_the_clients_sent():
    seen = []

    def aggr(records, key):
        seen.append([dict(next(iter(r.metric_records.values()))) for r in records])
        return MetricRecord({"n": len(records)})

    s = DiLoCo(
        min_train_nodes=3,
        min_available_nodes=3,
        fraction_evaluate=0.0,
        records=Records(train_metrics_aggr_fn=aggr),
    )
    assert _round_one(s, [10, 10, 10**6])["n"] == 3
    assert sorted(m["num-examples"] for m in seen[0]) == [10, 10, 10**6]


def test_train_client_metrics_checks_the_weights():
    from flwr_isoloco.strategies.core.metrics import train_client_metrics

    class R:
        weight, metrics, content = 1.0, {"a": 1.0}, RecordDict()

    with pytest.raises(ValueError, match="2 weights for 1 replies"):
        train_client_metrics([R()], [1.0, 2.0], "num-examples", None)


def test_secagg_round_calls_the_app_s_train_metrics_aggr_fn():
    """The SecAgg+ round's epilogue is the plain round's: the app's function is called with
    one RecordDict per used reply, holding its metrics and its weight."""
    calls = []

    def aggr(records, key):
        calls.append((key, [dict(next(iter(r.metric_records.values()))) for r in records]))
        return MetricRecord({"my-metric": 42.0})

    result, *_ = _federation(
        _strategy(records=Records(train_metrics_aggr_fn=aggr)), secagg=True, rounds=1
    )
    m = result.train_metrics_clientapp[1]
    assert m["my-metric"] == 42.0 and m["replies-used"] == 3
    assert len(calls) == 1
    key, metrics = calls[0]
    assert key == "num-examples" and len(metrics) == 3
    assert all(x["num-examples"] == 1.0 and "train-loss" in x for x in metrics)


def test_secagg_round_out_of_memory_fails_loudly_not_blamed_on_the_replies(monkeypatch):
    """An out-of-memory merge under SecAgg+ is the server's fault: it raises (as the plain
    round does, issue 34 item 4) instead of rejecting every reply of the round."""
    s = _strategy()

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(s.merger, "merge", oom)
    with pytest.raises(torch.OutOfMemoryError):
        _federation(s, secagg=True, rounds=1)
