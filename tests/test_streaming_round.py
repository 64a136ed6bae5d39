"""Rounds that fold replies as they arrive (issue 18 items 1-2): the order-free accumulator, the
spill store, the quorum / grace window / late replies, and server memory flat in M.

Federations run on ``tests/fakegrid.FakeGrid`` (push/pull in-process; ``set_delay`` makes a
node answer late). Expected models are computed independently here (fp64 by hand, or
``flwr_isoloco.merging.merge`` on the same deltas).
"""

from __future__ import annotations

import gc
import logging
import os
import random
import stat
import tracemalloc

import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from flwr_isoloco.merging import merge
from flwr_isoloco.merging.fold import RoundFold, RoundMerge
from flwr_isoloco.merging.rules import MERGE_RULES
from flwr_isoloco.merging.spill import SpillStore
from flwr_isoloco.merging.streaming import OrderFreeMean
from flwr_isoloco.strategies import DiLoCo, IsoLoCo, ReplyChecks, Rounds
from flwr_isoloco.strategies.core.stream import check_quorum, quorum_arg, quorum_count

torch.set_num_threads(1)


# --------------------------------------------------------------------------- accumulator
def _deltas(m: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"emb": (512, 256), "w1": (256, 1024), "w2": (1024, 256), "b": (1024,)}
    out = []
    for i in range(m):
        scale = 10.0 ** (i % 4 - 2)  # magnitudes 1e-2 .. 10: rounding matters
        out.append({k: torch.randn(s, generator=g) * scale for k, s in shapes.items()})
    return out


@pytest.mark.parametrize(
    "weights", [[1, 2, 3, 4, 5, 6, 7, 8], [0.1, 1 / 3, 2.5, 7, 1e6, 3, 0.7, 9]]
)
def test_order_free_mean_is_bitwise_equal_across_arrival_orders(weights):
    deltas = _deltas(8)  # ~0.8 M entries each
    results = []
    for perm_seed in range(4):
        order = list(range(8))
        random.Random(perm_seed).shuffle(order)
        acc = OrderFreeMean()
        for i in order:
            acc.add(deltas[i], weights[i])
        results.append(acc.result("mean"))
    for r in results[1:]:
        for k in r:
            assert torch.equal(r[k], results[0][k]), k
    # against an independent fp64 computation, and against today's fp32 merge
    total = sum(weights)
    for k, got in results[0].items():
        exact = sum(w * d[k].double() for w, d in zip(weights, deltas, strict=True)) / total
        assert got.dtype == torch.float32
        ulp = torch.finfo(torch.float32).eps * exact.abs().clamp_min(1e-30)
        assert bool(((got.double() - exact).abs() <= ulp).all()), k
        # today's fp32 merge, to its round-off (entries span 1e-2..10: a few fp32 ulps of 10)
        torch.testing.assert_close(got, merge("mean", deltas, weights)[k], rtol=1e-5, atol=1e-5)


def test_order_free_iso_c_matches_merge():
    deltas, weights = _deltas(4), [1, 2, 3, 4]
    acc = OrderFreeMean()
    for d, w in zip(deltas, weights, strict=True):
        acc.add(d, w)
    got, today = acc.result("iso_c"), merge("iso_c", deltas, weights)
    exact = {  # iso_c of the correctly rounded mean, by merge() on that one delta
        k: (sum(w * d[k].double() for w, d in zip(weights, deltas, strict=True)) / 10).float()
        for k in deltas[0]
    }
    want = merge("iso_c", [exact], None)
    for k in want:
        assert torch.equal(got[k], want[k]), k
        torch.testing.assert_close(got[k], today[k], rtol=1e-3, atol=1e-4)


def test_order_free_result_device_path_is_the_cpu_one_here():
    """The transform runs on ``device``: "cpu" and the default "auto" (cpu on this machine) are
    the same code path and give bitwise equal CPU tensors; a bad device is refused."""
    acc = OrderFreeMean()
    for d, w in zip(_deltas(3), [1, 2, 3], strict=True):
        acc.add(d, w)
    auto, cpu = acc.result("iso_c"), acc.result("iso_c", device="cpu")
    for k in auto:
        assert auto[k].device.type == "cpu" and torch.equal(auto[k], cpu[k]), k
    with pytest.raises(ValueError, match="merge device"):
        acc.result("iso_c", device="tpu")


def test_order_free_mean_refuses_bad_delta_and_keeps_state():
    acc = OrderFreeMean()
    acc.add({"w": torch.ones(3)}, 1.0)
    with pytest.raises(ValueError, match="worker 1"):
        acc.add({"w": torch.tensor([1.0, float("nan"), 0.0])}, 1.0)
    acc.add({"w": torch.full((3,), 3.0)}, 1.0)
    assert torch.equal(acc.result()["w"], torch.full((3,), 2.0))


# --------------------------------------------------------------------------- spill store
def test_spill_store_is_private_and_removed(tmp_path):
    with SpillStore(dir=tmp_path) as store:
        e = store.put({"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2)})
        assert stat.S_IMODE(os.stat(store.path).st_mode) == 0o700
        assert torch.equal(store.get(e, "a"), torch.arange(6.0).reshape(2, 3))
        path = store.path
    assert not os.path.exists(path)
    with pytest.raises(RuntimeError), SpillStore(dir=tmp_path) as store:
        store.put({"a": torch.ones(2)})
        path = store.path
        raise RuntimeError("merge failed")
    assert not os.path.exists(path) and os.listdir(tmp_path) == []


class _Reply:
    def __init__(self, node_id, delta):
        self.node_id, self._d = node_id, delta

    def update(self, theta):
        return dict(self._d)

    def release(self):
        pass


@pytest.mark.parametrize("name", ["ties", "dare", "tsv_m", "iso_cts", "mean"])
def test_spilled_round_equals_merge_of_all_deltas(name, tmp_path):
    deltas, weights = _deltas(5, seed=1), [1.0, 2.0, 1.0, 3.0, 1.0]
    theta = {k: torch.zeros_like(v) for k, v in deltas[0].items()}
    rm = RoundMerge(MERGE_RULES[name], name, {}, seed=3)
    replies = [_Reply(i, d) for i, d in enumerate(deltas)]
    with RoundFold(rm, theta, server_round=2, spill=True, spill_dir=str(tmp_path)) as fold:
        for r in replies:
            fold.add(r)
        assert len(os.listdir(tmp_path)) == 1
        g, used = fold.finish(replies, lambda r: weights[r.node_id], reject=lambda r, w: None)
    assert os.listdir(tmp_path) == [] and used == replies
    want = merge(name, deltas, weights, **rm.round_options(2))
    for k in want:
        torch.testing.assert_close(g[k], want[k], rtol=1e-5, atol=1e-6)


def _spilled_ties(deltas, weights, tmp_path, opts=None, on_store=None):
    theta = {k: torch.zeros_like(v) for k, v in deltas[0].items()}
    rm = RoundMerge(MERGE_RULES["ties"], "ties", opts or {})
    replies = [_Reply(i, d) for i, d in enumerate(deltas)]
    with RoundFold(rm, theta, server_round=1, spill=True, spill_dir=str(tmp_path)) as fold:
        for r in replies:
            fold.add(r)
        if on_store is not None:
            on_store(fold._store)
        g, used = fold.finish(replies, lambda r: weights[r.node_id], reject=lambda r, w: None)
    assert used == replies
    return g


@pytest.mark.parametrize("budget", [1 << 22, 3000])
@pytest.mark.parametrize("scale", [1.0, 1e20, 1e-25])  # 1e20, 1e-25: merge() rescales by 2**k
def test_spilled_ties_reads_row_blocks_and_equals_merge_bitwise(
    budget, scale, tmp_path, monkeypatch
):
    from flwr_isoloco.merging import rules as rules_mod

    monkeypatch.setattr(rules_mod, "TIES_BLOCK_BUDGET", budget)  # 3000: blocks of 1-2 rows
    deltas = [{k: v * scale for k, v in d.items()} for d in _deltas(5, seed=4)]
    deltas[2]["w1"][:, :7] = deltas[0]["w1"][:, :7]  # equal magnitudes at the pruning threshold
    weights = [1.0, 2.0, 0.0, 3.0, 1.5]  # a zero weight takes no part, as in merge()
    g = _spilled_ties(deltas, weights, tmp_path, {"prune_fraction": 0.3})
    want = merge("ties", deltas, weights, prune_fraction=0.3)
    for k in want:
        assert torch.equal(g[k], want[k]), k


def test_spilled_ties_holds_one_tensor_whatever_the_number_of_workers(tmp_path, monkeypatch):
    """Bytes read off the spill files and alive at once: one whole tensor plus the block
    budget, the same at M = 4 and M = 16 (reading every worker's tensor at once: M tensors)."""
    import weakref

    from flwr_isoloco.merging import rules as rules_mod

    monkeypatch.setattr(rules_mod, "TIES_BLOCK_BUDGET", 1 << 16)

    def peak_held(m):
        live, peak = [0], [0]

        def track(store):
            def wrap(fn):
                def read(*args):
                    t = fn(*args)
                    live[0] += t.nbytes
                    peak[0] = max(peak[0], live[0])
                    weakref.finalize(t, lambda n=t.nbytes: live.__setitem__(0, live[0] - n))
                    return t

                return read

            store.get, store.rows = wrap(store.get), wrap(store.rows)

        deltas = _deltas(m, seed=5)
        _spilled_ties(deltas, [1.0] * m, tmp_path, on_store=track)
        return peak[0]

    largest = 4 * 256 * 1024  # w1
    p4, p16 = peak_held(4), peak_held(16)
    assert p16 <= largest + 4 * (1 << 16) + 4 * 1024 * 16, (p4, p16)  # + the 1-D bias, all M
    assert p16 < 2 * p4, (p4, p16)


# --------------------------------------------------------------------------- federation helpers
def _model(numel: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    side = int(numel**0.5)
    return {"w": torch.randn(side, side, generator=g), "b": torch.zeros(side)}


def _client(weights=(1, 2, 3, 4, 5, 6, 7, 8)):
    def train(msg: Message, ctx) -> Message:
        theta = msg.content["arrays"].to_torch_state_dict()
        pid = int(ctx.node_config["partition-id"])
        rnd = int(msg.content["config"]["server-round"])
        new = {k: v + 0.01 * (pid + 1) * (-1) ** rnd for k, v in theta.items()}
        metrics = MetricRecord({"num-examples": weights[pid % len(weights)]})
        return Message(RecordDict({"arrays": ArrayRecord(new), "m": metrics}), reply_to=msg)

    def evaluate(msg: Message, ctx) -> Message:
        return Message(
            RecordDict({"m": MetricRecord({"num-examples": 1, "eval-loss": 0.5})}), reply_to=msg
        )

    return {"train": train, "evaluate": evaluate}


def _quiet(**kw):
    base = dict(min_train_nodes=1, min_evaluate_nodes=1, min_available_nodes=1)
    return {**base, **kw}


# --------------------------------------------------------------------------- quorum
def test_quorum_arguments():
    assert check_quorum(None, 0) == (None, 0.0)
    assert check_quorum(7, 5) == (7, 5.0)
    assert check_quorum(7.0, 5) == (7, 5.0)
    assert quorum_count(0.875, 8) == 7 and quorum_count(None, 8) == 8 and quorum_count(9, 8) == 8
    assert quorum_count(1.0, 8) == 8 and quorum_count(0.5, 3) == 2
    for bad in (0, 0.0, -1, 1.5, True, "7"):
        with pytest.raises(ValueError, match="quorum"):
            check_quorum(bad, 0)
    # the int 1 would close a round on one reply where a run config's 1 waits for all: refused
    with pytest.raises(ValueError, match=r"quorum=1 is ambiguous.*count >= 2"):
        check_quorum(1, 0)
    assert [quorum_arg(v) for v in (1, 1.0, 0.5, 3.0, 3)] == [None, None, 0.5, 3, 3]
    assert type(quorum_arg(3.0)) is int


def test_gossip_reads_quorum_one_way():
    """GossipLoRA takes DiLoCo's Rounds: ``quorum=1`` is refused with the fix there, and the
    plain keyword with the new spelling."""
    from flwr_isoloco.strategies import GossipLoRA

    with pytest.raises(ValueError, match=r"quorum=1 is ambiguous"):
        GossipLoRA(rounds=Rounds(quorum=1))
    with pytest.raises(
        TypeError, match=r"GossipLoRA\(quorum=1\): .* use rounds=Rounds\(quorum=1\)"
    ):
        GossipLoRA(quorum=1)
    for bad in (-1, float("inf"), float("nan"), "5"):
        with pytest.raises(ValueError, match="grace_s"):
            check_quorum(None, bad)


def test_quorum_closes_round_and_discards_the_late_reply(caplog):
    n = 4
    grid = FakeGrid(_client(), num_nodes=n)
    grid.set_delay(3, pulls=1)  # node 3 answers round 1 only at the second pull
    strat = DiLoCo(**_quiet(outer_lr=1.0, outer_momentum=0.0, rounds=Rounds(quorum=3, grace_s=0.0)))
    theta0 = _model()
    with caplog.at_level(logging.INFO):
        res = strat.start(grid=grid, initial_arrays=ArrayRecord(theta0), num_rounds=2)
    m1, m2 = res.train_metrics_clientapp[1], res.train_metrics_clientapp[2]
    assert (m1["replies-arrived"], m1["replies-late"], m1["replies-used"]) == (3, 1, 3)
    assert (m2["replies-arrived"], m2["replies-late"], m2["replies-used"]) == (4, 0, 4)
    late = grid.node_ids[3]
    assert any(f"without the reply of node {late}" in r.message for r in caplog.records)
    assert any(
        f"late reply of node {late} for round 1 discarded" in r.message for r in caplog.records
    )
    assert strat._train_stream.discarded == [(late, 1)]
    # round 1 = FedAvg of nodes 0..2 (weights 1, 2, 3), round 2 = FedAvg of all four
    w = [1.0, 2.0, 3.0, 4.0]
    step1 = sum(w[p] * 0.01 * (p + 1) for p in range(3)) / sum(w[:3])  # theta_i - theta, round 1
    step2 = sum(w[p] * 0.01 * (p + 1) for p in range(4)) / sum(w)
    for k, v in res.arrays.to_torch_state_dict().items():
        want = (theta0[k].double() - step1 + step2).float()
        torch.testing.assert_close(v, want, rtol=1e-6, atol=1e-6)


def test_grace_window_waits_for_the_rest():
    grid = FakeGrid(_client(), num_nodes=4)
    grid.set_delay(2, pulls=3)
    strat = DiLoCo(**_quiet(rounds=Rounds(quorum=0.75, grace_s=30.0)))
    res = strat.start(grid=grid, initial_arrays=ArrayRecord(_model()), num_rounds=1)
    m = res.train_metrics_clientapp[1]
    assert (m["replies-arrived"], m["replies-late"], m["replies-used"]) == (4, 0, 4)
    assert m["wait-s"] >= 0
    ev = res.evaluate_metrics_clientapp[1]
    assert (ev["replies-arrived"], ev["replies-late"]) == (4, 0)


def test_evaluation_round_has_a_quorum_too():
    grid = FakeGrid(_client(), num_nodes=3)
    grid.set_delay(1, pulls=5, times=2)  # train and evaluate message of round 1
    strat = DiLoCo(**_quiet(rounds=Rounds(quorum=2, grace_s=0.0)))
    res = strat.start(grid=grid, initial_arrays=ArrayRecord(_model()), num_rounds=1)
    assert res.train_metrics_clientapp[1]["replies-late"] == 1
    ev = res.evaluate_metrics_clientapp[1]
    assert (ev["replies-arrived"], ev["replies-late"]) == (2, 1)


def test_default_waits_for_everyone_until_the_timeout():
    grid = FakeGrid(_client(), num_nodes=3)
    grid.set_delay(0, pulls=4)
    strat = DiLoCo(**_quiet())
    res = strat.start(grid=grid, initial_arrays=ArrayRecord(_model()), num_rounds=1)
    m = res.train_metrics_clientapp[1]
    assert (m["replies-arrived"], m["replies-late"], m["replies-used"]) == (3, 0, 3)


def test_weight_reference_is_the_previous_rounds_median(caplog):
    weights = (1, 2, 3, 1000)
    grid = FakeGrid(_client(weights), num_nodes=4)
    strat = DiLoCo(**_quiet(checks=ReplyChecks(max_weight_ratio=2.0)))
    with caplog.at_level(logging.WARNING):
        res = strat.start(grid=grid, initial_arrays=ArrayRecord(_model()), num_rounds=2)
    assert strat.weight_reference == statistics_median(weights)
    r1 = [r.message for r in caplog.records if "the round's median" in r.message]
    r2 = [r.message for r in caplog.records if "previous round's median" in r.message]
    assert len(r1) == 1 and len(r2) == 1 and str(grid.node_ids[3]) in r2[0]
    assert res.train_metrics_clientapp[1]["spill-bytes"] > 0  # round 1: no reference yet
    assert res.train_metrics_clientapp[2]["spill-bytes"] == 0  # round 2 folds as replies arrive


def statistics_median(xs):
    s = sorted(xs)
    return (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2 if len(s) % 2 == 0 else s[len(s) // 2]


# --------------------------------------------------------------------------- memory
def _tensor_bytes() -> int:
    """Bytes of every live CPU tensor storage (torch allocations are not in tracemalloc)."""
    seen, total = set(), 0
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and not o.is_meta:
            try:
                st = o.untyped_storage()
            except RuntimeError:
                continue
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def _peak(make, m: int, numel: int) -> tuple[int, int]:
    """(peak tracemalloc bytes, peak live tensor bytes) of a 2-round federation of ``m`` nodes."""
    from flwr_isoloco.strategies.diloco import train_round

    grid = FakeGrid(_client(), num_nodes=m)
    strat = make()
    theta = ArrayRecord(_model(numel))
    peaks = [0]
    real = train_round.TrainRound.finish

    def finish(self, wait=None):  # every reply taken, none merged yet: what the round holds
        peaks[0] = max(peaks[0], _tensor_bytes())
        return real(self, wait)

    train_round.TrainRound.finish = finish
    gc.collect()
    tracemalloc.start()
    try:
        strat.start(grid=grid, initial_arrays=theta, num_rounds=2)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        train_round.TrainRound.finish = real
    return peak, peaks[0]


@pytest.mark.parametrize(
    "make",
    [
        lambda: DiLoCo(**_quiet()),
        pytest.param(lambda: IsoLoCo(**_quiet()), marks=pytest.mark.slow),
        pytest.param(lambda: DiLoCo(**_quiet(merge="ties")), marks=pytest.mark.slow),
        pytest.param(
            lambda: DiLoCo(**_quiet(checks=ReplyChecks(max_norm_ratio=3.0))),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["diloco", "isoloco", "ties", "norm-ratio"],
)
def test_server_memory_does_not_grow_with_the_number_of_replies(make, monkeypatch):
    numel = 512 * 512  # 1 MiB of fp32 arrays, plus the bias
    model_bytes = 4 * (numel + 512)
    # a pull call brings at most PULL_BYTES of replies (1 GiB; here two of these 1 MiB replies)
    monkeypatch.setattr("flwr_isoloco.strategies.core.pull.PULL_BYTES", 2 * model_bytes)
    py4, t4 = _peak(make, 4, numel)
    py32, t32 = _peak(make, 32, numel)
    py_slope = (py32 - py4) / (28 * model_bytes)
    t_slope = (t32 - t4) / (28 * model_bytes)
    # measured: 0.04 here; Flower's send_and_receive round (every reply held): 0.97
    assert py_slope < 0.25, (py4, py32, py_slope)
    assert t_slope < 0.25, (t4, t32, t_slope)


def test_round_messages_share_one_copy_of_the_model():
    """The M instructions carry one ArrayRecord object; Flower's content-addressed objects of
    the M messages (what the deployment grid pushes) hold the model's bytes once."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    m = 8
    grid = FakeGrid(_client(), num_nodes=m)
    strat = DiLoCo(**_quiet())
    theta = ArrayRecord(_model(256 * 256))
    strat.prepare(grid, theta, 10)
    from flwr.app import ConfigRecord

    msgs = list(strat.configure_train(1, theta, ConfigRecord(), grid))
    assert len(msgs) == m
    assert len({id(msg.content["arrays"]) for msg in msgs}) == 1
    objects = {}
    for msg in msgs:
        objects.update(get_all_nested_objects(msg))
    array_bytes = sum(len(o.data) for o in objects.values() if type(o).__name__ == "Array")
    model = sum(len(a.data) for a in msgs[0].content["arrays"].values())
    assert array_bytes == model  # one copy, not m
