"""Robust aggregation under the outer step (issue 20 item 3): flwr_isoloco/merging/robust.py.

Each rule is checked against an independent numpy computation on whole (flattened) updates,
Krum's choice also against Flower's own ``select_multikrum``; then through the spilled round
(RoundFold + SpillStore, tensor by tensor) and through a DiLoCo / IsoLoCo federation on
``tests/fakegrid.FakeGrid`` with one hostile node.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy.multikrum import select_multikrum

from flwr_isoloco.merging.fold import RoundFold, RoundMerge
from flwr_isoloco.merging.robust import (
    RobustMerge,
    clip_factors,
    coordinate_median,
    distance_keep,
    krum_select,
    pairwise_sq_distances,
    resolve_robust,
    trimmed_mean,
)
from flwr_isoloco.merging.rules import MERGE_RULES
from flwr_isoloco.strategies import DiLoCo, IsoLoCo

torch.set_num_threads(1)
SHAPES = {"w": (12, 8), "v": (5, 7), "b": (9,)}


def _deltas(m: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{k: torch.randn(s, generator=g) * (1 + i) for k, s in SHAPES.items()} for i in range(m)]


def _flat(d) -> np.ndarray:
    return np.concatenate([d[k].double().numpy().ravel() for k in SHAPES])


# --------------------------------------------------------------------------- pure maths
@pytest.mark.parametrize("m", [5, 6])
def test_median_and_trimmed_mean_against_numpy(m):
    xs = [d["w"] for d in _deltas(m, seed=m)]
    arr = np.stack([x.double().numpy() for x in xs])
    np.testing.assert_allclose(coordinate_median(xs).numpy(), np.median(arr, axis=0), rtol=1e-6)
    for trim in (0.0, 0.2, 0.34):
        k = int(trim * m)
        want = np.sort(arr, axis=0)[k : m - k].mean(axis=0)  # sort, cut k each side, mean
        np.testing.assert_allclose(trimmed_mean(xs, trim).numpy(), want, rtol=1e-5, atol=1e-6)


def test_krum_distances_by_tensor_and_choice_match_flower():
    ds = _deltas(7, seed=3)
    ds[2] = {k: -10 * v for k, v in ds[2].items()}  # an outlier Krum must not pick
    dist = sum(pairwise_sq_distances([d[k] for d in ds]) for k in SHAPES)
    flat = np.stack([_flat(d) for d in ds])
    want = ((flat[:, None, :] - flat[None, :, :]) ** 2).sum(axis=2)
    np.testing.assert_allclose(dist.numpy(), want, rtol=1e-9, atol=1e-6)
    contents = [
        RecordDict({"arrays": ArrayRecord([_flat(d)]), "id": MetricRecord({"i": i})})
        for i, d in enumerate(ds)
    ]
    for f, sel in ((1, 1), (2, 1), (1, 4), (2, 5)):
        ours = krum_select(dist, f, sel)
        theirs = [int(c["id"]["i"]) for c in select_multikrum(contents, f, sel)]
        assert ours == theirs and 2 not in ours


def test_clip_factors_against_numpy():
    norms = [1.0, 4.0, 2.0, 8.0, 3.0]
    want = np.minimum(1.0, np.median(norms) / np.asarray(norms))
    np.testing.assert_allclose(clip_factors(norms), want)
    assert clip_factors([0.0, 0.0, 1.0]) == [1.0, 1.0, 0.0]


def test_resolve_robust_refuses_bad_input():
    assert resolve_robust(None, None, MERGE_RULES["mean"]) == ("none", {})
    assert resolve_robust("trimmed-mean", {"trim": 0.1}, MERGE_RULES["iso_c"])[1] == {"trim": 0.1}
    for name, opts, match in (
        ("mode", None, "robust must be one of"),
        ("median", {"trim": 0.1}, "unknown option 'trim'"),
        ("trimmed-mean", {"trim": 0.5}, r"trim must be in \[0, 0.5\)"),
        ("krum", {"f": -1}, "f must be an int >= 0"),
        ("multikrum", {"select": 0}, "select must be an int >= 1"),
        ("distance-filter", {"factor": 0.9}, "factor must be a finite number >= 1"),
        ("distance-filter", {"factor": float("inf")}, "factor must be a finite number >= 1"),
        ("distance-filter", {"factor": True}, "factor must be a finite number >= 1"),
    ):
        with pytest.raises(ValueError, match=match):
            resolve_robust(name, opts, MERGE_RULES["mean"])
    with pytest.raises(ValueError, match="function of the mean"):
        resolve_robust("median", None, MERGE_RULES["ties"])
    resolve_robust("krum", None, MERGE_RULES["ties"])  # selection feeds any rule


# --------------------------------------------------------------------------- spilled round
class _Reply:
    def __init__(self, node_id, delta):
        self.node_id, self._d = node_id, delta

    def update(self, theta):
        return dict(self._d)

    def release(self):
        pass


def _fold(name, rule, deltas, weights, options=None, tmp_path=None):
    theta = {k: torch.zeros(s) for k, s in SHAPES.items()}
    robust = RobustMerge(*resolve_robust(name, options, MERGE_RULES[rule]))
    rm = RoundMerge(MERGE_RULES[rule], rule, {}, robust=robust)
    replies = [_Reply(i, d) for i, d in enumerate(deltas)]
    with RoundFold(rm, theta, 1, spill_dir=str(tmp_path)) as fold:
        assert fold.spills  # a streaming rule still spills: the robust rule needs every delta
        for r in replies:
            fold.add(r)
        g, used = fold.finish(replies, lambda r: weights[r.node_id], reject=lambda r, w: None)
    return g, robust


def _np_iso_c(a: np.ndarray) -> np.ndarray:
    u, s, vt = np.linalg.svd(a, full_matrices=False)
    return s.mean() * u @ vt


def test_round_fold_median_then_iso_c(tmp_path):
    ds, ws = _deltas(5, seed=4), [1.0, 1.0, 5.0, 1.0, 1.0]  # weights play no part in the median
    g, _ = _fold("median", "iso_c", ds, ws, tmp_path=tmp_path)
    for k in SHAPES:
        med = np.median(np.stack([d[k].double().numpy() for d in ds]), axis=0)
        want = _np_iso_c(med) if med.ndim == 2 else med
        np.testing.assert_allclose(g[k].numpy(), want, rtol=1e-4, atol=1e-5)


def test_round_merge_in_memory_path_equals_the_spilled_one(tmp_path):
    ds, ws = _deltas(5, seed=6), [1.0, 2.0, 1.0, 1.0, 3.0]
    spilled, _ = _fold("trimmed-mean", "mean", ds, ws, {"trim": 0.2}, tmp_path)
    robust = RobustMerge(*resolve_robust("trimmed-mean", {"trim": 0.2}, MERGE_RULES["mean"]))
    rm = RoundMerge(MERGE_RULES["mean"], "mean", {}, robust=robust)
    theta = {k: torch.zeros(s) for k, s in SHAPES.items()}
    replies, used = [_Reply(i, d) for i, d in enumerate(ds)], []
    g = rm.merge(theta, replies, used, lambda r: ws[r.node_id], 1)
    assert used == replies
    for k in SHAPES:
        torch.testing.assert_close(g[k], spilled[k], rtol=0, atol=0)


def test_round_fold_multikrum_and_norm_clip_weighted_mean(tmp_path):
    ds, ws = _deltas(6, seed=5), [1.0, 2.0, 3.0, 1.0, 2.0, 1.0]
    ds[4] = {k: v + 50.0 for k, v in ds[4].items()}
    g, robust = _fold("multikrum", "mean", ds, ws, {"f": 1}, tmp_path)
    flat = np.stack([_flat(d) for d in ds])
    dist = ((flat[:, None] - flat[None]) ** 2).sum(axis=2)
    score = [np.sort(np.delete(dist[i], i))[:3].sum() for i in range(6)]  # n - f - 2 = 3
    kept = sorted(np.argsort(score)[:5].tolist())  # select = n - f
    assert robust.last_kept == kept and 4 not in kept
    for k in SHAPES:
        want = sum(ws[i] * ds[i][k].double().numpy() for i in kept) / sum(ws[i] for i in kept)
        np.testing.assert_allclose(g[k].numpy(), want, rtol=1e-5, atol=1e-5)
    g, robust = _fold("norm-clip", "mean", ds, ws, tmp_path=tmp_path)
    norms = np.linalg.norm(flat, axis=1)
    c = np.minimum(1, np.median(norms) / norms)
    np.testing.assert_allclose(robust.last_factors, c, rtol=1e-9)
    for k in SHAPES:
        want = sum(
            w * ci * d[k].double().numpy() for w, ci, d in zip(ws, c, ds, strict=True)
        ) / sum(ws)
        np.testing.assert_allclose(g[k].numpy(), want, rtol=1e-5, atol=1e-5)


def test_round_fold_distance_filter_against_numpy(tmp_path):
    ds, ws = _deltas(7, seed=8), [1.0, 2.0, 1.0, 3.0, 1.0, 1.0, 2.0]
    ds[5] = {k: -10 * v for k, v in ds[5].items()}  # far from the median: left out
    flat = np.stack([_flat(d) for d in ds])
    r = np.linalg.norm(flat - np.median(flat, axis=0), axis=1)  # whole-update distances
    for factor in (1.0, 2.0, 1e6):
        kept = [i for i in range(7) if r[i] <= factor * np.median(r)]
        g, robust = _fold("distance-filter", "mean", ds, ws, {"factor": factor}, tmp_path)
        assert robust.last_kept == kept
        assert (5 in kept) == (factor == 1e6) and len(kept) >= 4  # factor >= 1: half at least
        for k in SHAPES:
            want = sum(ws[i] * ds[i][k].double().numpy() for i in kept) / sum(ws[i] for i in kept)
            np.testing.assert_allclose(g[k].numpy(), want, rtol=1e-5, atol=1e-5)
    assert distance_keep([1.0, 1.0, 1.0, 9.0], 2.0) == [0, 1, 2]
    assert distance_keep([0.0, 0.0, 0.0, 1e-9], 2.0) == [0, 1, 2]


def test_distance_filter_keeps_alike_updates_and_equals_the_plain_merge(tmp_path):
    g0 = torch.Generator().manual_seed(9)
    base = {k: torch.randn(s, generator=g0) for k, s in SHAPES.items()}
    ds = [
        {k: v + 0.1 * torch.randn(v.shape, generator=g0) for k, v in base.items()} for _ in range(8)
    ]
    ws = [1.0] * 8
    g, robust = _fold("distance-filter", "iso_c", ds, ws, tmp_path=tmp_path)
    assert robust.last_kept == list(range(8))
    rm = RoundMerge(MERGE_RULES["iso_c"], "iso_c", {})
    theta = {k: torch.zeros(s) for k, s in SHAPES.items()}
    plain = rm.merge(theta, [_Reply(i, d) for i, d in enumerate(ds)], [], lambda r: 1.0, 1)
    for k in SHAPES:
        torch.testing.assert_close(g[k], plain[k], rtol=1e-4, atol=1e-5)  # fp32 vs fp64 mean


@pytest.mark.parametrize(
    "name, rule, options",
    [
        ("median", "iso_c", None),
        ("trimmed-mean", "mean", {"trim": 0.2}),
        ("distance-filter", "iso_c", None),
        ("multikrum", "iso_c", {"f": 1}),
        ("norm-clip", "mean", None),
    ],
)
def test_row_blocks_and_one_at_a_time_give_the_whole_tensor_result(
    name, rule, options, tmp_path, monkeypatch
):
    """The spilled round reads blocks of 2 rows (w: 12 x 8, v: 5 x 7; b whole) and adds the kept
    updates one at a time; the in-memory path stacks whole tensors: the same bits."""
    ds, ws = _deltas(6, seed=11), [1.0, 2.0, 1.0, 3.0, 1.0, 1.0]
    ds[3] = {k: -10 * v for k, v in ds[3].items()}
    monkeypatch.setattr(RobustMerge, "block_bytes", 4 * 6 * 8 * 2)
    seen = []
    blocks = RobustMerge.blocks

    def spy(self, key, n, get, rows, shapes):
        for xs in blocks(self, key, n, get, rows, shapes):
            seen.append((key, xs[0].shape[0] if xs[0].dim() else 0))
            yield xs

    monkeypatch.setattr(RobustMerge, "blocks", spy)
    g, robust = _fold(name, rule, ds, ws, options, tmp_path)
    if name != "norm-clip":
        assert ("w", 2) in seen and ("b", 9) in seen and ("w", 12) not in seen, seen
    whole = RobustMerge(*resolve_robust(name, options, MERGE_RULES[rule]))
    rm = RoundMerge(MERGE_RULES[rule], rule, {}, robust=whole)
    theta = {k: torch.zeros(s) for k, s in SHAPES.items()}
    want = rm.merge(theta, [_Reply(i, d) for i, d in enumerate(ds)], [], lambda r: ws[r.node_id], 1)
    assert robust.last_kept == whole.last_kept
    if name in ("distance-filter", "multikrum"):
        assert 3 not in robust.last_kept
    for k in SHAPES:
        torch.testing.assert_close(g[k], want[k], rtol=0, atol=0)


# --------------------------------------------------------------------------- federation
def _client(bad: int, scale: float):
    def train(msg: Message, ctx) -> Message:
        theta = msg.content["arrays"].to_torch_state_dict()
        pid = int(ctx.node_config["partition-id"])
        step = -10.0 * scale if pid == bad else 0.01 * (pid + 1)
        new = {k: v - step for k, v in theta.items()}  # delta_i = theta - theta_i = step
        nex = 1e6 if pid == bad else 1
        return Message(
            RecordDict({"arrays": ArrayRecord(new), "m": MetricRecord({"num-examples": nex})}),
            reply_to=msg,
        )

    def evaluate(msg: Message, ctx) -> Message:
        return Message(RecordDict({"m": MetricRecord({"num-examples": 1})}), reply_to=msg)

    return {"train": train, "evaluate": evaluate}


@pytest.mark.parametrize(
    "robust", ["median", "trimmed-mean", "krum", "multikrum", "norm-clip", "distance-filter"]
)
def test_diloco_one_attacker_is_contained(robust, caplog):
    n, bad = 5, 4
    grid = FakeGrid(_client(bad, 1.0), num_nodes=n)
    kw = dict(min_train_nodes=1, min_evaluate_nodes=1, min_available_nodes=1)
    strat = DiLoCo(**kw, outer_lr=1.0, outer_momentum=0.0, robust=robust)
    theta0 = {"w": torch.zeros(4, 4)}
    res = strat.start(grid=grid, initial_arrays=ArrayRecord(theta0), num_rounds=1)
    got = float(res.arrays.to_torch_state_dict()["w"].mean())
    assert res.train_metrics_clientapp[1]["replies-used"] == n and got != 0.0
    honest = [0.01 * (p + 1) for p in range(bad)]
    # the attacker's delta is -10 with weight 1e6 (bounded to 5 x median): every rule keeps the
    # step within the largest honest one (norm-clip: clipped, weight 5, -> +0.0056), while the
    # plain mean moves theta by about +5.5
    assert abs(got) <= max(honest) + 1e-6, (robust, got)
    if robust == "distance-filter":  # the left-out node is named, and the metric counts
        assert res.train_metrics_clientapp[1]["robust-kept"] == n - 1
        named = [r.getMessage() for r in caplog.records if "left out node" in r.getMessage()]
        assert len(named) == 1 and "robust=distance-filter" in named[0], named
    plain = DiLoCo(**kw, outer_lr=1.0, outer_momentum=0.0)
    res = plain.start(
        grid=FakeGrid(_client(bad, 1.0), num_nodes=n),
        initial_arrays=ArrayRecord(theta0),
        num_rounds=1,
    )
    assert float(res.arrays.to_torch_state_dict()["w"].mean()) > 1.0


def test_isoloco_run_config_keys():
    s = IsoLoCo.from_run_config({"strategy.robust": "krum", "strategy.robust-f": 1})
    assert (s.robust, s.robust_options) == ("krum", {"f": 1})
    s = DiLoCo.from_run_config({"strategy.robust": "trimmed-mean", "strategy.robust-f": 2})
    assert (s.robust, s.robust_options) == ("trimmed-mean", {"trim": 0.25})
    assert DiLoCo.from_run_config({}).merger.robust is None
    with pytest.raises(ValueError, match="strategy.robust"):
        DiLoCo.from_run_config({"strategy.robust": "mean"})
    with pytest.raises(ValueError, match="strategy.robust-trim"):
        DiLoCo.from_run_config({"strategy.robust-trim": 0.6})
    with pytest.raises(ValueError, match="strategy.robust-select"):
        DiLoCo.from_run_config({"strategy.robust": "multikrum", "strategy.robust-select": 0})
    s = DiLoCo.from_run_config({"strategy.robust": "distance-filter", "strategy.robust-factor": 3})
    assert (s.robust, s.robust_options) == ("distance-filter", {"factor": 3})
    assert DiLoCo.from_run_config({"strategy.robust": "distance-filter"}).robust_options == {
        "factor": 2.0
    }
    with pytest.raises(ValueError, match="strategy.robust-factor"):
        DiLoCo.from_run_config(
            {"strategy.robust": "distance-filter", "strategy.robust-factor": 0.5}
        )
