"""SecAgg+ shim (strategies/diloco/secagg.py, secagg_mod.py): whole federations on the fake grid.

The plain run and the SecAgg+ run of the same config train the same tiny LLaMA workers; the
SecAgg+ model must equal the plain one to within the quantisation bound, the server must never
hold a single update, and every option that needs single replies is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, Message, RecordDict
from flwr.common import bytes_to_ndarray

from flwr_isoloco.clients import TrainSettings, make_diloco_train_handler, secagg_mod
from flwr_isoloco.models.llama import build_llama, llama_config
from flwr_isoloco.strategies import CentralDP, DiLoCo, IsoLoCo, LocalDP, ReplyChecks, Rounds
from flwr_isoloco.strategies.diloco.secagg import CLIPPED_METRIC, SecAggSettings, use_secagg

CFG = llama_config(vocab_size=32, hidden=16, layers=1, heads=2, max_seq_len=16)


def _model(_ctx=None):
    return build_llama(CFG, seed=0)


def _batches(ctx):
    g = torch.Generator().manual_seed(100 + int(ctx.node_config["partition-id"]))
    return [torch.randint(0, 32, (2, 9), generator=g) for _ in range(4)]


def _worker(**kw):
    train = TrainSettings(lr=1e-2, local_steps=2, num_server_rounds=2, warmup_steps=0)
    return make_diloco_train_handler(_model, _batches, train=train, **kw)


class RecordingGrid(FakeGrid):
    """FakeGrid that keeps every reply's arrays (ArrayRecords and bytes configs) the server got,
    and each node's true pseudo-gradient (computed client-side, for the test only)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.received: list[np.ndarray] = []

    def pull_messages(self, message_ids):
        out = list(super().pull_messages(message_ids))
        for m in out:
            if not m.has_content():
                continue
            for rec in m.content.array_records.values():
                self.received += [a.numpy() for a in rec.values()]
            for rec in m.content.config_records.values():
                for v in rec.values():
                    vals = v if isinstance(v, list) else [v]
                    for b in vals:
                        if isinstance(b, bytes) and b[:6] == b"\x93NUMPY":
                            self.received.append(bytes_to_ndarray(b))
        return out


def _federation(
    strategy, secagg: bool, rounds: int = 2, grid_cls=FakeGrid, faults=(), fail=None, **kw
):
    """Run ``strategy`` on 3 tiny-LLaMA nodes; returns the strategy, the Result, the grid, each
    round's true pseudo-gradients (recorded client-side, for the test only) and the momentum
    buffer after every round (read server-side: ``b_r = mu b_{r-1} + g_r``)."""
    worker = _worker(**kw)
    deltas: dict[int, list[dict[str, torch.Tensor]]] = {}

    def train(msg: Message, ctx):
        rnd = int(msg.content["config"]["server-round"])
        if fail == (ctx.node_config["partition-id"], rnd):
            raise RuntimeError("injected: the worker dies while training")
        theta = msg.content["arrays"].to_torch_state_dict()
        reply = worker(msg, ctx)
        new = reply.content["arrays"].to_torch_state_dict()
        deltas.setdefault(rnd, []).append({k: theta[k] - new[k] for k in theta})
        return reply

    handler = (lambda m, c: secagg_mod(m, c, train)) if secagg else train
    grid = grid_cls({"train": handler}, num_nodes=3)
    for node, fault, times in faults:
        grid.set_fault(grid.node_ids[node], fault, times)
    if secagg:
        use_secagg(strategy)
    buffers = {}

    def keep(rnd, arrays, tm, em):
        buffers[rnd] = {k: v.clone() for k, v in strategy.outer.momentum_buffer.items()}

    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(_model().state_dict()),
        num_rounds=rounds,
        on_round_end=keep,
    )
    return result, grid, deltas, buffers


def _strategy(cls=DiLoCo, **kw):
    kw = {
        "checks": ReplyChecks(weighting="uniform"),
        "min_train_nodes": 3,
        "min_available_nodes": 3,
        "fraction_evaluate": 0.0,
        **kw,
    }
    return cls(**kw)


def _g(buffers, rnd, mu):
    prev = buffers.get(rnd - 1, {})
    return {k: b - mu * prev.get(k, 0) for k, b in buffers[rnd].items()}


def _mean(ds):
    return {k: sum(d[k].double() for d in ds) / len(ds) for k in ds[0]}


STEP = SecAggSettings().step()  # 2 c / Q = 16 / 2^22 = 3.8e-6


def test_secagg_aggregate_is_the_mean_within_one_quantisation_step_every_round():
    """DiLoCo, 2 rounds: in each round the g the outer step used (read back from the momentum
    buffer) is the mean of that round's true pseudo-gradients to within SecAgg+'s step
    ``2c/Q`` per entry (uniform weights: each client's stochastic rounding errs by < one step,
    and the mean of M such errors too), plus fp32 rounding of the buffer arithmetic. The
    final model equals the plain run's: round 1's models differ by <= lr (1 + mu) step, round
    2's clients start from them (asserted within 1e-4; measured ~1e-5)."""
    rs, grid, deltas, buffers = _federation(_strategy(), secagg=True, grid_cls=RecordingGrid)
    rp, _, deltas_p, buffers_p = _federation(_strategy(), secagg=False)
    mu = 0.9
    for rnd in (1, 2):
        g, want = _g(buffers, rnd, mu), _mean(deltas[rnd])
        for k in g:
            tol = STEP + 4e-7 * float(want[k].abs().max()) + 1e-7
            assert (g[k].double() - want[k]).abs().max().item() < tol, (rnd, k)
    g1p = _g(buffers_p, 1, mu)
    assert all((g1p[k].double() - _mean(deltas_p[1])[k]).abs().max() < 1e-6 for k in g1p)
    a, b = rp.arrays.to_torch_state_dict(), rs.arrays.to_torch_state_dict()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4
    m = rs.train_metrics_clientapp[2]
    assert (m["replies-used"], m["replies-rejected"], m[CLIPPED_METRIC]) == (3, 0, 0)
    assert m["secagg-bound"] == pytest.approx(STEP)
    assert m["train-loss"] == pytest.approx(rp.train_metrics_clientapp[2]["train-loss"], rel=1e-3)
    # No single update reached the server: every array in a reply is a masked integer vector
    # (none a float delta), and none dequantises to any client's pseudo-gradient.
    assert grid.received and all(np.issubdtype(x.dtype, np.integer) for x in grid.received)
    flat = [d[k].numpy().ravel() for ds in deltas.values() for d in ds for k in d]
    for x in grid.received:
        deq = x.ravel().astype(np.float64) * STEP - 8.0
        for d in flat:
            if d.size == deq.size and d.size > 1:
                assert not np.allclose(deq, d, atol=1e-3)
                if d.size >= 256:  # masks are uniform: no correlation with the delta
                    assert abs(np.corrcoef(deq, d)[0, 1]) < 0.3


def test_isoloco_under_secagg_takes_iso_c_of_the_aggregate():
    """IsoLoCo's round 1 g is Iso-C of the mean: under SecAgg+ it is Iso-C of the aggregate,
    the same as the plain run's to within the step amplified by Iso-C (relative 1e-3)."""
    rs, _, _, bs = _federation(_strategy(IsoLoCo), secagg=True, rounds=1)
    rp, _, _, bp = _federation(_strategy(IsoLoCo), secagg=False, rounds=1)
    for k in bp[1]:
        diff = (bs[1][k] - bp[1][k]).norm() / bp[1][k].norm().clamp_min(1e-12)
        assert diff < 1e-3, k
    assert rs.train_metrics_clientapp[1]["replies-used"] == 3


def test_a_node_that_drops_out_is_unmasked_and_the_rest_is_merged():
    """Node 0 dies while training (SecAgg+'s masked-vector stage, after it shared its keys):
    2 of 3 shares suffice to remove its masks (threshold 0.67 x 3 = 2), the round merges the
    other two (their mean within one step) and counts one missing. (A node lost at the first
    stage, before sharing keys, halts Flower's workflow: "Not enough shares"; an empty round.)"""
    rs, _, deltas, buffers = _federation(
        _strategy(min_train_nodes=2), secagg=True, rounds=1, fail=(0, 1)
    )
    m = rs.train_metrics_clientapp[1]
    assert (m["replies-used"], m["replies-missing"]) == (2, 1)
    g, want = _g(buffers, 1, 0.9), _mean(deltas[1])
    assert len(deltas[1]) == 2
    assert all((g[k].double() - want[k]).abs().max() < STEP + 1e-6 for k in g)


def _weight_five(reply: Message) -> Message:
    rec = reply.content.metric_records.get("fitres.num_examples")
    if rec is not None:
        rec["num_examples"] = 5
    return reply


def test_a_misweighted_reply_drops_the_round_with_a_reason_not_the_run(caplog):
    """Uniform weighting: a reply claiming weight 5 has weighted the masked sum 5x; the server
    cannot undo it, so the round's aggregate is dropped (logged, naming the node), the model is
    kept and the run goes on."""
    faults = [(1, _weight_five, None)]
    rs, grid, _, _ = _federation(_strategy(), secagg=True, rounds=1, faults=faults)
    m = rs.train_metrics_clientapp[1]
    assert (m["replies-used"], m["replies-rejected"]) == (0, 3)
    assert "under uniform weighting" in caplog.text and str(grid.node_ids[1]) in caplog.text
    init = _model().state_dict()
    assert not rs.arrays or all(
        torch.equal(init[k], v) for k, v in rs.arrays.to_torch_state_dict().items()
    )


def test_options_that_need_single_replies_are_refused():
    for kw in (
        {"merge": "ties"},
        {"checks": ReplyChecks(weighting="examples")},  # max_weight_ratio needs every weight
        {"upload": "topk"},
        {"checks": ReplyChecks(weighting="uniform", max_norm_ratio=3.0)},
        {"robust": "median"},
        {"privacy": CentralDP(clipping_norm=1.0)},
        {"rounds": Rounds(quorum=2)},
    ):
        with pytest.raises(ValueError, match="secure aggregation"):
            use_secagg(_strategy(**kw))
    for bad in ({"clipping_range": 0}, {"quantization_range": 1}, {"max_weight": -1.0}):
        with pytest.raises(ValueError, match="secagg"):
            use_secagg(_strategy(), **bad)
    with pytest.raises(ValueError, match="num_shares"):
        use_secagg(_strategy(), num_shares=2)  # Flower's own check
    assert (
        use_secagg(_strategy(checks=ReplyChecks(weighting="examples", max_weight_ratio=0))).secagg
        is not None
    )


def test_the_bound_follows_the_weights():
    s = SecAggSettings(max_weight=100.0)
    assert s.bound([1, 1, 1], "uniform") == pytest.approx(STEP * 100)  # weights 1 / 100
    assert SecAggSettings().bound([1, 1], "uniform") == pytest.approx(STEP)
    assert s.bound([100, 50], "examples") == pytest.approx(STEP * 2 / 1.5)


def test_aggregate_checks_name_what_is_wrong():
    from flwr.common import ndarrays_to_parameters

    from flwr_isoloco.strategies.diloco.secagg import SecAggRound

    s = _strategy()
    s._adopt(ArrayRecord(_model().state_dict()))
    r = SecAggRound(s, None, None, SecAggSettings())
    r.floats = [k for k, t in s.theta.items() if t.is_floating_point()]
    good = [s.theta[k].numpy().astype(np.float64) for k in r.floats]
    assert isinstance(r._aggregate(ndarrays_to_parameters(good)), dict)
    assert "arrays" in r._aggregate(ndarrays_to_parameters(good[:-1]))
    assert "shape" in r._aggregate(ndarrays_to_parameters([good[0][:1]] + good[1:]))
    bad = [g.copy() for g in good]
    bad[0].flat[0] = np.nan
    assert "finite" in r._aggregate(ndarrays_to_parameters(bad))


def test_the_mod_passes_plain_messages_through_unchanged():
    from flwr.app import ConfigRecord, Context

    FakeGrid({}, num_nodes=1)  # Flower's task identity, so Messages can be built
    theta = _model().state_dict()
    msg = Message(
        RecordDict({"arrays": ArrayRecord(theta), "config": ConfigRecord({"server-round": 1})}),
        77,
        "train",
    )
    ctx = lambda: Context(1, 77, {"partition-id": 0, "num-partitions": 1}, RecordDict(), {})  # noqa: E731
    a = secagg_mod(msg, ctx(), _worker()).content["arrays"].to_torch_state_dict()
    b = _worker()(msg, ctx()).content["arrays"].to_torch_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_mod_names_flowers_record_keys():
    from flwr.common.secure_aggregation import secaggplus_constants as flower

    from flwr_isoloco.clients import secagg as ours

    assert (ours.RECORD_KEY_CONFIGS, ours.RECORD_KEY_STATE) == (
        flower.RECORD_KEY_CONFIGS,
        flower.RECORD_KEY_STATE,
    )


def test_local_dp_under_secagg_checks_each_echo_and_accounts():
    """Local DP composes with SecAgg+ (each worker noises its own delta; the server sees only
    the sum): the DP echo travels in each reply's clear metrics and is checked, and the
    accountant reports epsilon for the round."""
    kw = {"privacy": LocalDP(clipping_norm=1.0, noise_multiplier=0.5)}
    rs, _, _, _ = _federation(_strategy(**kw), secagg=True, rounds=1)
    m = rs.train_metrics_clientapp[1]
    assert (m["replies-used"], m["replies-rejected"]) == (3, 0)
    assert m["dp-epsilon"] > 0


def test_resume_under_secagg_continues_the_global_rounds():
    """A strategy restored from round 1's state and put under SecAgg+ again runs round 2 only
    (global numbering, momentum kept: its round-2 g is read back from the restored buffer)."""
    first = _strategy()
    _federation(first, secagg=True, rounds=1)
    again = _strategy()
    again.load_state_dict(first.state_dict())
    rs, _, deltas, buffers = _federation(again, secagg=True, rounds=2)
    assert list(rs.train_metrics_clientapp) == [2] and list(deltas) == [2]
    b1 = first.outer.momentum_buffer
    g2 = {k: buffers[2][k] - 0.9 * b1[k] for k in b1}
    want = _mean(deltas[2])
    assert all((g2[k].double() - want[k]).abs().max() < STEP + 1e-6 for k in g2)


def _bad_share_owner_once():
    done = []

    def fault(reply: Message) -> Message:
        rec = reply.content.config_records.get("secaggplus_configs")
        if not done and rec is not None and "nids" in rec:  # round 1's unmask-stage reply
            rec["nids"] = [12345] * len(rec["nids"])
            done.append(1)
        return reply

    return fault


def test_a_hostile_unmask_reply_is_a_logged_empty_round_not_a_crash(caplog):
    """Flower's workflow raises (KeyError) on a share for a node that was never sampled; the
    shim logs it, keeps the model, counts the round empty, and the next round trains."""
    rs, grid, _, _ = _federation(
        _strategy(), secagg=True, rounds=2, faults=[(2, _bad_share_owner_once(), None)]
    )
    assert "SecAgg+ failed in round 1 (KeyError" in caplog.text
    assert rs.train_metrics_clientapp[1]["replies-used"] == 0
    assert rs.train_metrics_clientapp[2]["replies-used"] == 3
