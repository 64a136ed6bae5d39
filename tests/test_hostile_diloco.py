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

from flwr_isoloco.strategies import DiLoCo, IsoLoCo, MergeSettings, ReplyChecks, Rounds
from flwr_isoloco.strategies.core.ledger import SentLedger
from flwr_isoloco.strategies.core.replies import ReplyValidator

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
    _, res, _ = one_round(half, checks=ReplyChecks(dtype_policy="reject"))
    m = res.train_metrics_clientapp[1]
    assert (m["replies-used"], m["replies-rejected"]) == (N - 1, 1)


def test_huge_update_rejected_by_max_update_norm():
    huge = corrupt_arrays(lambda d: {k: v * 1e4 for k, v in d.items()})
    _, res, _ = one_round(huge)  # no bound: accepted, and it wrecks the model
    assert res.train_metrics_clientapp[1]["replies-used"] == N
    _, res, _ = one_round(huge, checks=ReplyChecks(max_update_norm=10.0))
    m = res.train_metrics_clientapp[1]
    assert (m["replies-used"], m["replies-rejected"]) == (N - 1, 1)
    expected = fedavg_of([0, 1, 3])
    for k, v in res.arrays.to_torch_state_dict().items():
        torch.testing.assert_close(v, expected[k], rtol=1e-6, atol=1e-6)


def test_huge_update_rejected_by_norm_ratio():
    huge = corrupt_arrays(lambda d: {k: v * 50 for k, v in d.items()})
    _, res, _ = one_round(huge, checks=ReplyChecks(max_norm_ratio=5.0))
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
        (
            {"merge_settings": {"orthogonalize": "update"}, "merge": "ties"},
            "orthogonalize='update'",
        ),
        ({"checks": {"weighting": "tokens"}}, "weighting"),
        ({"checks": {"max_update_norm": -3.0}}, "max_update_norm"),
        ({"checks": {"dtype_policy": "ignore"}}, "dtype_policy"),
        (
            {"merge": "mean", "merge_settings": {"options": {"prune_fraction": 0.2}}},
            "prune_fraction",
        ),
        (
            {"merge": "ties", "merge_settings": {"options": {"prune_fraction": 1.5}}},
            "prune_fraction",
        ),
    ],
)
def test_bad_constructor_argument_names_it(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace("'", "'")):
        if "checks" in kwargs:  # a settings object checks its fields when built
            kwargs = {**kwargs, "checks": ReplyChecks(**kwargs["checks"])}
        if "merge_settings" in kwargs:
            kwargs = {**kwargs, "merge_settings": MergeSettings(**kwargs["merge_settings"])}
        DiLoCo(**kwargs)


# --------------------------------------------------------------------------- one reply, one drop
def _same_round_without_bad(strategy_cls, **kw):
    """The model the good replies alone give: the bad node simply does not answer."""
    return one_round_with(strategy_cls, "timeout", **kw)[1].arrays.to_torch_state_dict()


def one_round_with(strategy_cls, fault, **kw):
    grid = FakeGrid({"train": train}, num_nodes=N)
    if fault is not None:
        grid.set_fault(BAD, fault)
    kw = {"min_train_nodes": 1, "min_available_nodes": 1, "fraction_evaluate": 0.0, **kw}
    strat = strategy_cls(**kw)
    res = strat.start(grid=grid, initial_arrays=ArrayRecord(init_model()), num_rounds=1)
    return strat, res, grid


def _alternating(value):
    def fn(d):
        w = np.full_like(d["w"], value)
        w.reshape(-1)[1::2] *= -1  # +-value: the sum stays finite, squares overflow fp32
        return {**d, "w": w}

    return corrupt_arrays(fn)


@pytest.mark.parametrize("merge_name", ["mean", "iso_c", "ties", "tsv_m"])
def test_near_fp32_max_values_drop_only_that_reply(merge_name, caplog):
    with caplog.at_level(logging.INFO):
        strat, res, grid = one_round_with(DiLoCo, _alternating(3e38), merge=merge_name)
    m = res.train_metrics_clientapp[1]
    assert (m["replies-used"], m["replies-rejected"]) == (N - 1, 1)
    bad = grid.node_ids[BAD]
    assert any(f"node {bad}:" in r.message and "exceeds 1e+18" in r.message for r in caplog.records)
    expected = _same_round_without_bad(DiLoCo, merge=merge_name)
    for k, v in res.arrays.to_torch_state_dict().items():
        torch.testing.assert_close(v, expected[k], rtol=1e-6, atol=1e-6)


def test_failing_merge_drops_the_reply_that_fails_alone(monkeypatch, caplog):
    """A merge that fails on one (finite, small) reply: that reply alone is dropped and named,
    and the log line and the metrics agree on the count (B12)."""
    import flwr_isoloco.merging.fold as diloco_mod  # the round merge lives in merging/

    real = diloco_mod.merge

    def picky(rule, deltas, weights=None, **opts):
        # the round merges spilled deltas one tensor at a time: look at "w" when it is there
        if any("w" in d and float(d["w"].abs().max()) > 50 for d in deltas):
            raise RuntimeError("SVD did not converge")
        return real(rule, deltas, weights, **opts)

    monkeypatch.setattr(diloco_mod, "merge", picky)
    big = corrupt_arrays(lambda d: {**d, "w": d["w"] * 1000})
    with caplog.at_level(logging.INFO):
        # dare: a spilled rule merged through merge() tensor by tensor (TIES reads row blocks)
        strat, res, grid = one_round_with(
            DiLoCo, big, merge="dare", checks=ReplyChecks(max_weight_ratio=0)
        )
    m = res.train_metrics_clientapp[1]
    assert (m["replies-used"], m["replies-rejected"]) == (N - 1, 1)
    bad = grid.node_ids[BAD]
    assert any(f"node {bad}:" in r.message and "merge fails" in r.message for r in caplog.records)
    summary = [r.message for r in caplog.records if r.message.startswith("aggregate_train (")]
    assert summary == [f"aggregate_train (round 1): {N - 1} replies used, 1 rejected, 0 missing"]


def test_merge_failure_log_and_metrics_agree(monkeypatch, caplog):
    import flwr_isoloco.merging.fold as diloco_mod  # the round merge lives in merging/

    def broken(*a, **k):
        raise RuntimeError("linalg error")

    monkeypatch.setattr(diloco_mod, "merge", broken)
    with caplog.at_level(logging.INFO):
        _, res, _ = one_round_with(DiLoCo, None, merge="ties")
    m = res.train_metrics_clientapp[1]
    assert (m["replies-used"], m["replies-rejected"]) == (0, N)
    summary = [r.message for r in caplog.records if r.message.startswith("aggregate_train (")]
    assert summary == [f"aggregate_train (round 1): 0 replies used, {N} rejected, 0 missing"]


# --------------------------------------------------------------------------- one site's weight
def fedavg_with_weights(weights):
    theta = init_model()
    tot = sum(weights.values())
    return {k: sum(w * trained(theta, p)[k] for p, w in weights.items()) / tot for k in theta}


def test_weight_bound_clips_a_huge_num_examples(caplog):
    huge = _set_metric("num-examples", 1e12)
    with caplog.at_level(logging.WARNING):
        strat, res, grid = one_round(huge)  # default max_weight_ratio = 5
    assert strat.max_weight_ratio == 5.0
    assert res.train_metrics_clientapp[1]["replies-used"] == N
    bad = grid.node_ids[BAD]
    assert any(f"node {bad}:" in r.message and "clipped" in r.message for r in caplog.records)
    # median of (1, 2, 1e12, 4) is 3; the huge site counts as 5 x 3 = 15
    expected = fedavg_with_weights({0: 1, 1: 2, 2: 15, 3: 4})
    for k, v in res.arrays.to_torch_state_dict().items():
        torch.testing.assert_close(v, expected[k], rtol=1e-6, atol=1e-6)
    # off: the site owns the model
    _, res, _ = one_round(huge, checks=ReplyChecks(max_weight_ratio=0))
    own = trained(init_model(), BAD)
    for k, v in res.arrays.to_torch_state_dict().items():
        torch.testing.assert_close(v, own[k], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("w", [3.5e38, 1e300, 1.7e308])
def test_weight_beyond_fp32_max_does_not_void_the_round(w):
    _, res, _ = one_round(_set_metric("num-examples", w), checks=ReplyChecks(max_weight_ratio=0))
    assert res.train_metrics_clientapp[1]["replies-used"] == N
    own = trained(init_model(), BAD)
    for k, v in res.arrays.to_torch_state_dict().items():
        torch.testing.assert_close(v, own[k], rtol=1e-5, atol=1e-6)


def test_honest_tenfold_skew_is_not_clipped():
    """8 sites, sizes spread geometrically over 10x: the default bound changes nothing."""
    from flwr_isoloco.merging.weights import bounded_weights

    sizes = [round(100 * 10 ** (i / 7)) for i in range(8)]  # 100 .. 1000
    assert bounded_weights(sizes, 5.0) == ([float(s) for s in sizes], [])
    assert bounded_weights([1, 1, 10], 5.0) == ([1.0, 1.0, 5.0], [2])
    assert bounded_weights([1e308, 1e308], 5.0)[1] == []  # r * median overflows: nothing clipped


def test_fedavg_equality_with_bound_off_and_skewed_weights():
    from flwr.serverapp.strategy import FedAvg

    skew = [1, 1, 1, 100]

    def skewed(msg, ctx):
        reply = train(msg, ctx)
        reply.content["metrics"]["num-examples"] = skew[int(ctx.node_config["partition-id"])]
        return reply

    def run(strat):
        grid = FakeGrid({"train": skewed}, num_nodes=N)
        return strat.start(grid=grid, initial_arrays=ArrayRecord(init_model()), num_rounds=1)

    kw = {"min_train_nodes": 1, "min_available_nodes": 1, "fraction_evaluate": 0.0}
    fed = run(FedAvg(**kw)).arrays.to_torch_state_dict()
    off = run(
        DiLoCo(outer_lr=1.0, outer_momentum=0.0, **kw, checks=ReplyChecks(max_weight_ratio=0))
    )
    on = run(DiLoCo(outer_lr=1.0, outer_momentum=0.0, **kw))
    for k, v in off.arrays.to_torch_state_dict().items():
        torch.testing.assert_close(v, fed[k], rtol=1e-6, atol=1e-7)
    assert not torch.allclose(on.arrays.to_torch_state_dict()["w"], fed["w"])


# --------------------------------------------------------------------------- nothing trained
def test_consecutive_empty_rounds_stop_the_run():
    from flwr_isoloco.strategies.core.guard import NoProgressError

    grid = FakeGrid({"train": train}, num_nodes=N)
    for p in range(N):
        grid.set_fault(p, "raise")
    strat = DiLoCo(min_train_nodes=1, min_available_nodes=1, fraction_evaluate=0.0)
    with pytest.raises(NoProgressError, match="3 consecutive rounds .* used no reply"):
        strat.start(grid=grid, initial_arrays=ArrayRecord(init_model()), num_rounds=5)
    assert strat.server_round == 3
    strat = DiLoCo(
        min_train_nodes=1,
        min_available_nodes=1,
        fraction_evaluate=0.0,
        rounds=Rounds(max_empty_rounds=0),
    )
    strat.start(grid=grid, initial_arrays=ArrayRecord(init_model()), num_rounds=5)
    assert strat.server_round == 5


def test_a_used_round_resets_the_empty_streak():
    grid = FakeGrid({"train": train}, num_nodes=N)
    for p in range(N):
        grid.set_fault(p, "raise", times=2)  # rounds 1-2 empty, then fine
    strat = DiLoCo(
        min_train_nodes=1,
        min_available_nodes=1,
        fraction_evaluate=0.0,
        rounds=Rounds(max_empty_rounds=3),
    )
    strat.start(grid=grid, initial_arrays=ArrayRecord(init_model()), num_rounds=4)
    assert strat.server_round == 4
