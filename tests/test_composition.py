"""The composition matrix (``flwr_isoloco/strategies/diloco/composition.py``), cell by cell.

Every cell of ``MATRIX`` is a test here. A refused cell builds the strategy with that pair and
expects the ``ValueError`` carrying the cell's sentence. A cell that holds runs a tiny
federation on the fake grid with that collector and checks the guarantee against an
independent computation: hand formulas in fp64, Flower's own accountant (``flower_epsilon``),
``noise_like`` recomputed, ``torch.median``, bytes counted from the shapes, a bitwise
uninterrupted run. The matrix in docs/strategies.md is ``render()``'s.

The collectors' federations:

- synchronous: 3 nodes; node ``p`` moves the model half-way to its target
  (``test_async_rounds.local``: ``delta_p = 0.5 (theta - target_p)``) and reports
  ``n_p = p + 1`` examples (merge weights 1, 2, 3);
- quorum: 4 nodes, ``Rounds(quorum=3, grace_s=0)``, node 3 late for every message: the
  expected values are those of nodes 0-2 while 4 were sampled;
- SecAgg+: 3 nodes behind ``secagg_mod``, uniform weights: exact to within SecAgg+'s
  quantisation step ``2c / Q`` per entry;
- asynchronous: ``test_async_rounds.ScriptedGrid``, replies in a scripted order of nodes.

Outer step ``lr = 1``, no momentum, unless a check needs momentum.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import test_async_rounds as async_tests
import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from privacy_helpers import flower_epsilon
from test_async_hold import check_evaluation_async
from test_async_rounds import N_EX, ORDER, ScriptedGrid, delta, init_model, local, target
from test_async_rounds import strategy as async_strategy
from test_async_rounds import train as async_train

from flwr_isoloco.checkpoint import load_checkpoint, save_checkpoint
from flwr_isoloco.clients import download_mod, secagg_mod, upload_mod
from flwr_isoloco.compression import compress, decompress, payload_nbytes
from flwr_isoloco.compression.broadcast import apply_update
from flwr_isoloco.merging.dp import CLIP_KEY, NOISE_KEY, noise_like, privatize
from flwr_isoloco.strategies import (
    CentralDP,
    Codec,
    DiLoCo,
    Divergence,
    LocalDP,
    Median,
    ReplyChecks,
    Rounds,
)
from flwr_isoloco.strategies.diloco import composition
from flwr_isoloco.strategies.diloco.composition import MATRIX, ROW_PAIRS, Holds, Refused
from flwr_isoloco.strategies.diloco.secagg import SecAggSettings, use_secagg

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
STEP = SecAggSettings().step()  # 2 c / Q: SecAgg+'s quantisation step per entry
SEED = 7
INT8 = Codec("int8", error_feedback=False)  # each reply exactly Q(delta): a closed formula
Tensors = dict[str, torch.Tensor]


# ----------------------------------------------------------------------------- the nodes
def _pid(ctx) -> int:
    return int(ctx.node_config["partition-id"])


class Nodes:
    """The test's nodes: node ``p`` replies ``local(theta, p)`` with ``p + 1`` examples, or
    under local DP ``theta - privatize(theta - local(theta, p))`` (its generator seeded by
    ``(p, round)``) with the echo. ``trained`` / ``evaluated`` / ``noised``: ``(p, round)`` ->
    the model it trained on / evaluated / the delta it released."""

    def __init__(self) -> None:
        self.trained: dict[tuple[int, int], Tensors] = {}
        self.evaluated: dict[tuple[int, int], Tensors] = {}
        self.noised: dict[tuple[int, int], Tensors] = {}

    def train(self, msg: Message, ctx) -> Message:
        th = msg.content["arrays"].to_torch_state_dict()
        p, r = _pid(ctx), int(msg.content["config"]["server-round"])
        self.trained[p, r] = th
        new = local(th, p)
        content = {"arrays": ArrayRecord(new), "metrics": MetricRecord({"num-examples": p + 1})}
        cfg = msg.content["config"]
        if CLIP_KEY in cfg:  # local DP: clip and noise the delta here, and say so
            gen = torch.Generator().manual_seed(1000 * r + p)
            d = privatize({k: th[k] - new[k] for k in th}, cfg[CLIP_KEY], cfg[NOISE_KEY], gen)
            self.noised[p, r] = d
            content["arrays"] = ArrayRecord({k: th[k] - d[k] for k in th})
            content["config"] = ConfigRecord({k: cfg[k] for k in (CLIP_KEY, NOISE_KEY)})
        return Message(RecordDict(content), reply_to=msg)

    def evaluate(self, msg: Message, ctx) -> Message:
        th = msg.content["arrays"].to_torch_state_dict()
        p, r = _pid(ctx), int(msg.content["config"]["server-round"])
        self.evaluated[p, r] = th
        loss = float(sum((th[k].double() - target(p)[k].double()).pow(2).sum() for k in th))
        metrics = MetricRecord({"num-examples": p + 1, "loss": loss})
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

    def handlers(self) -> dict[str, Callable]:
        return {"train": self.train, "evaluate": self.evaluate}

    def app(self, *mods) -> ClientApp:
        """The handlers behind ``mods`` (download_mod, upload_mod) as a ClientApp."""
        app = ClientApp(mods=list(mods))
        app.train()(self.train)
        app.evaluate()(self.evaluate)
        return app


# ----------------------------------------------------------------------------- collectors
USED = [0, 1, 2]  # the nodes whose replies a round merges (quorum: node 3 is late)


def _n(row: str) -> int:
    return 4 if row == "quorum" else 3


def _weights(row: str, uniform: bool = False) -> list[float]:
    return [1.0] * 3 if uniform or row == "secagg" else [1.0, 2.0, 3.0]


def _tol(row: str, scale: float = 1.0) -> float:
    return 2e-6 + (scale * STEP if row == "secagg" else 0.0)


def _strategy(row: str, **kw) -> DiLoCo:
    base = dict(
        outer_lr=1.0,
        outer_momentum=0.0,
        min_train_nodes=1,
        min_evaluate_nodes=1,
        min_available_nodes=_n(row),
        fraction_evaluate=0.0,
    )
    if row == "quorum":
        base["rounds"] = Rounds(quorum=3, grace_s=0.0)
    if row == "secagg":
        base["checks"] = ReplyChecks(weighting="uniform")
    s = DiLoCo(**{**base, **kw})
    return use_secagg(s) if row == "secagg" else s


def _grid(row: str, app) -> FakeGrid:
    """``app`` on the row's nodes: behind ``secagg_mod`` for SecAgg+; for the quorum, node 3
    answers every message one pull late (after the round closed)."""
    if row == "secagg":
        handlers = app
        app = {**handlers, "train": lambda m, c: secagg_mod(m, c, handlers["train"])}
    grid = FakeGrid(app, num_nodes=_n(row))
    if row == "quorum":
        grid.set_delay(3, pulls=1, times=10**6)
    return grid


def _run(row, s, app, rounds, model=init_model, after=None, grid=None, **kw):
    """``(result, grid, models)``: ``models[r]`` the model after round ``r`` (0: initial);
    ``after(r, grid)`` runs at each round's end."""
    grid = grid or _grid(row, app)
    models = {0: model()}

    def hook(rnd, arrays, tm, em):
        models[rnd] = {k: v.clone() for k, v in arrays.to_torch_state_dict().items()}
        if after is not None:
            after(rnd, grid)

    res = s.start(
        grid=grid, initial_arrays=ArrayRecord(model()), num_rounds=rounds, on_round_end=hook, **kw
    )
    return res, grid, models


def _f64(t: Tensors) -> Tensors:
    return {k: v.double() for k, v in t.items()}


def _wmean(ds: list[Tensors], ws: list[float]) -> Tensors:
    return {k: sum(w * d[k].double() for d, w in zip(ds, ws, strict=True)) / sum(ws) for k in ds[0]}


def _minus(a: Tensors, b: Tensors, lr: float = 1.0) -> Tensors:
    return {k: a[k].double() - lr * b[k].double() for k in a}


def _close(got: Tensors, want: Tensors, tol: float) -> None:
    for k in want:
        err = float((got[k].double() - want[k].double()).abs().max())
        assert err <= tol, (k, err, tol)


def _same(a: Tensors, b: Tensors) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _mean_step(row: str, theta: Tensors, uniform: bool = False) -> Tensors:
    """``theta - sum_p w_p delta_p(theta) / sum_p w_p`` over the used nodes (fp64)."""
    th = _f64(theta)
    return _minus(th, _wmean([delta(th, p) for p in USED], _weights(row, uniform)))


def _wipe(ctx) -> int:
    """Empty a node's ``context.state`` (its restart); how many records it held."""
    keys = list(ctx.state.keys())
    for k in keys:
        del ctx.state[k]
    return len(keys)


# ----------------------------------------------------------------------------- buffers
VAR, MEAN = (0.5, 2.0, 3.0, 9.0), (-1.0, 0.25, 4.0, 7.0)


def _bn_model(var0: float = 5.0) -> Tensors:
    g = torch.Generator().manual_seed(0)
    return {
        "fc.weight": torch.randn(3, 4, generator=g),
        "bn.running_var": torch.full((4,), var0),
        "bn.running_mean": torch.full((4,), -2.0),
    }


def _bn_train(weights, var=VAR, mean=MEAN):
    """Node ``p`` moves ``fc.weight`` and reports its own statistics ``var[p]``, ``mean[p]``
    whatever model it was sent."""

    def train(msg: Message, ctx) -> Message:
        th = msg.content["arrays"].to_torch_state_dict()
        p = _pid(ctx)
        new = {
            "fc.weight": th["fc.weight"] * 0.9 + 0.01 * p,
            "bn.running_var": torch.full((4,), var[p]),
            "bn.running_mean": torch.full((4,), mean[p]),
        }
        metrics = MetricRecord({"num-examples": weights[p]})
        return Message(RecordDict({"arrays": ArrayRecord(new), "metrics": metrics}), reply_to=msg)

    return train


def check_buffers(row: str) -> None:
    """Each round's statistics = ``sum_p w_p x_p / sum_p w_p`` over the used nodes."""
    s = _strategy(row)
    _, _, models = _run(row, s, {"train": _bn_train([1, 2, 3, 4])}, 2, model=_bn_model)
    ws = _weights(row)
    for key, values in (("bn.running_var", VAR), ("bn.running_mean", MEAN)):
        want = sum(w * values[p] for p, w in zip(USED, ws, strict=True)) / sum(ws)
        for r in (1, 2):
            _close({key: models[r][key]}, {key: torch.full((4,), want)}, _tol(row, 8))


def check_buffers_async() -> None:
    """K = 2, order 0 1 | 2 1: step 2 merges node 2 (trained from version 0: tau 1, weight
    ``n s(1) = 2 / sqrt 2``) and node 1 (tau 0, weight 1); the statistics are the weighted mean
    of the reported values, not scaled by ``rho``."""
    s = async_strategy(replies_per_step=2)
    grid = ScriptedGrid([0, 1, 2, 1])
    grid.app = {"train": _bn_train(N_EX)}
    _, _, models = _run("asynchronous", s, None, 2, model=_bn_model, grid=grid)
    sd = 1 / math.sqrt(2)
    for key, x in (("bn.running_var", VAR), ("bn.running_mean", MEAN)):
        want = {1: (x[0] + x[1]) / 2, 2: (2 * sd * x[2] + x[1]) / (2 * sd + 1)}
        for r, v in want.items():
            _close({key: models[r][key]}, {key: torch.full((4,), v)}, 1e-6)


# ----------------------------------------------------------------------------- central DP
def _clipped(d: Tensors, c: float) -> Tensors:
    n = math.sqrt(sum(float(t.double().pow(2).sum()) for t in d.values()))
    return {k: t.double() * min(1.0, c / n) for k, t in d.items()}


def _released(deltas, ref: Tensors, z: float, c: float, k: int, r: int, seed=SEED) -> Tensors:
    """``(sum_i clip(delta_i, C) + N(0, (z C)^2)) / k``, the noise of tensor ``i`` (model
    order) recomputed with ``noise_like(seed, round, i)``."""
    clipped = [_clipped(d, c) for d in deltas]
    return {
        key: (sum(cd[key] for cd in clipped) + noise_like(ref[key], z * c, seed, r, i)) / k
        for i, key in enumerate(ref)
    }


def check_central_dp(row: str) -> None:
    """Two rounds: ``theta_r = theta_{r-1} - g_r``, ``g_r`` :func:`_released` with ``k`` the
    nodes sampled (the quorum's late node counts as a zero update); epsilon = Flower's
    accountant after ``r`` Gaussian releases of multiplier ``z``."""
    z, c = 0.8, 0.5
    s = _strategy(row, privacy=CentralDP(noise_multiplier=z, clipping_norm=c, seed=SEED))
    res, _, models = _run(row, s, Nodes().handlers(), 2)
    for r in (1, 2):
        th = _f64(models[r - 1])
        g = _released([delta(th, p) for p in USED], th, z, c, _n(row), r)
        _close(models[r], _minus(th, g), 2e-6)
        eps = res.train_metrics_clientapp[r]["dp-epsilon"]
        assert eps == pytest.approx(flower_epsilon(z, r, 1e-5, 1), rel=1e-12)


def check_central_dp_buffers() -> None:
    """Central DP releases the statistics noised too (the whole delta is clipped): with
    ``z C / k`` larger than the variance the noised running variance falls below 0 on some
    entries, and is clamped at 0; the running mean and the parameter are not clamped."""
    z, c, seed = 3.0, 1.0, 1  # a seed whose noise has both signs on the variance
    s = _strategy("synchronous", privacy=CentralDP(noise_multiplier=z, clipping_norm=c, seed=seed))
    var, mean = (0.08, 0.1, 0.12), (-0.1, 0.0, 0.1)
    train = _bn_train([1, 1, 1], var, mean)
    _, _, models = _run("synchronous", s, {"train": train}, 1, model=lambda: _bn_model(0.1))
    th = _f64(_bn_model(0.1))
    nodes = []
    for p in USED:
        new = {"fc.weight": (th["fc.weight"].float() * 0.9 + 0.01 * p).double()}
        new["bn.running_var"] = torch.full((4,), var[p], dtype=torch.float64)
        new["bn.running_mean"] = torch.full((4,), mean[p], dtype=torch.float64)
        nodes.append({k: th[k] - new[k] for k in th})
    g = _released(nodes, th, z, c, 3, 1, seed)
    raw = th["bn.running_var"] - g["bn.running_var"]
    assert (raw < 0).any() and (raw > 0).any()  # the noise did push some entries below 0
    _close(models[1], {"bn.running_var": raw.clamp(min=0.0)}, 1e-6)
    _close(models[1], {k: th[k] - g[k] for k in ("fc.weight", "bn.running_mean")}, 1e-6)


# ----------------------------------------------------------------------------- local DP
def check_local_dp(row: str) -> None:
    """Each node clips and noises its own delta (``privatize``, seeded by the test); the
    model takes the weighted mean of the released deltas, and epsilon is each site's own:
    Flower's accountant at multiplier ``z / 2`` (replace-one)."""
    z, c = 1.5, 0.5
    nodes = Nodes()
    s = _strategy(row, privacy=LocalDP(noise_multiplier=z, clipping_norm=c))
    res, _, models = _run(row, s, nodes.handlers(), 2)
    for r in (1, 2):
        g = _wmean([nodes.noised[p, r] for p in USED], _weights(row))
        _close(models[r], _minus(models[r - 1], g), _tol(row))
        eps = res.train_metrics_clientapp[r]["dp-epsilon"]
        assert eps == pytest.approx(flower_epsilon(z / 2, r, 1e-5, 1), rel=1e-12)
        assert res.train_metrics_clientapp[r]["replies-used"] == 3


# ----------------------------------------------------------------------------- robust
def _median(ds: list[Tensors]) -> Tensors:
    return {k: torch.stack([d[k].double() for d in ds]).median(dim=0).values for k in ds[0]}


def check_robust(row: str) -> None:
    """``robust="median"``: ``theta_r = theta_{r-1} - median_p delta_p`` (torch.median over
    the used nodes, coordinate-wise; three values: the middle one)."""
    s = _strategy(row, robust="median")
    _, _, models = _run(row, s, Nodes().handlers(), 2)
    for r in (1, 2):
        th = _f64(models[r - 1])
        _close(models[r], _minus(th, _median([delta(th, p) for p in USED])), 2e-6)


def check_robust_async() -> None:
    """K = 3, order 0 1 2 | 0 1 2: step 1 is the median of three fresh deltas; in step 2 nodes
    0 and 1 trained from version 0 again (tau 1), node 2 from version 1:
    ``g_2 = rho median(delta_0(th0), delta_1(th0), delta_2(th1))``, ``rho = (s + s + 2) / 4``."""
    s = async_strategy(replies_per_step=3, robust=Median())
    grid = ScriptedGrid([0, 1, 2, 0, 1, 2])
    _, _, models = _run("asynchronous", s, None, 2, grid=grid)
    th0 = _f64(init_model())
    th1 = _minus(th0, _median([delta(th0, p) for p in (0, 1, 2)]))
    _close(models[1], th1, 2e-6)
    sd = 1 / math.sqrt(2)
    rho = (sd + sd + 2) / 4
    med = _median([delta(th0, 0), delta(th0, 1), delta(th1, 2)])
    _close(models[2], _minus(th1, med, rho), 2e-6)


# ----------------------------------------------------------------------------- upload codec
def _int8_bytes() -> int:
    """Bytes of an int8 record of the model's shapes (what one reply carries)."""
    return payload_nbytes(
        compress({k: torch.zeros_like(v) for k, v in init_model().items()}, "int8")
    )


def _decoded(theta: Tensors, p: int) -> Tensors:
    """``decode(Q(theta - theta_p))``, the delta as the node sends it (fp32, as the node)."""
    th = {k: v.float() for k, v in theta.items()}
    new = local(th, p)
    return decompress(compress({k: th[k] - new[k] for k in th}, "int8"))


def check_upload(row: str) -> None:
    """``upload_mod`` on the nodes: ``theta_r = theta_{r-1} - sum w_p decode(Q(delta_p)) /
    sum w_p``, and bytes up = the used replies x the int8 record of the model's shapes."""
    s = _strategy(row, upload=INT8)
    res, _, models = _run(row, s, Nodes().app(upload_mod), 2)
    for r in (1, 2):
        th = models[r - 1]
        g = _wmean([_decoded(th, p) for p in USED], _weights(row))
        _close(models[r], _minus(th, g), 2e-6)
    assert res.train_metrics_clientapp[1]["bytes-up"] == 3 * _int8_bytes()


def check_upload_async() -> None:
    """K = 2, order 0 1 | 2 1: node 2's int8 delta is decoded against version 0, the model it
    was sent: ``g_2 = (2 s decode(Q(delta_2(th0))) + decode(Q(delta_1(th1)))) / 3``."""
    s = async_strategy(replies_per_step=2, upload=INT8)
    grid = ScriptedGrid([0, 1, 2, 1])
    app = ClientApp(mods=[upload_mod])
    app.train()(async_train)
    grid.app = app
    res, _, models = _run("asynchronous", s, None, 2, grid=grid)
    th0 = init_model()
    th1 = _minus(th0, _wmean([_decoded(th0, 0), _decoded(th0, 1)], [1, 1]))
    _close(models[1], th1, 2e-6)
    sd = 1 / math.sqrt(2)
    g2 = {k: (2 * sd * _decoded(th0, 2)[k].double() + _decoded(models[1], 1)[k]) / 3 for k in th0}
    _close(models[2], _minus(models[1], g2), 2e-6)
    assert res.train_metrics_clientapp[1]["bytes-up"] == 2 * _int8_bytes()


# ----------------------------------------------------------------------------- download codec
def _broadcasts(models: dict[int, Tensors], rounds: int) -> tuple[dict[int, Tensors], dict]:
    """``B_1 = theta_0``, ``B_r = B_{r-1} + decode(Q(theta_{r-1} - B_{r-1}))`` recomputed,
    and the bytes of each round's update."""
    b, nbytes = {1: {k: v.clone() for k, v in models[0].items()}}, {}
    for r in range(2, rounds + 1):
        u = compress({k: models[r - 1][k] - b[r - 1][k] for k in b[r - 1]}, "int8")
        b[r], nbytes[r] = apply_update(b[r - 1], decompress(u)), payload_nbytes(u)
    return b, nbytes


def check_download(row: str) -> None:
    """``download_mod`` on the nodes: every node (the late one too) trains on ``B_r``
    (:func:`_broadcasts`), the deltas are taken against it (``theta_r = theta_{r-1} -
    mean_w 0.5 (B_r - target_p)``); synchronous bytes down: the full model to each node in
    round 1, then each node the int8 update, or the model where that is smaller."""
    nodes = Nodes()
    s = _strategy(row, download="int8")
    res, _, models = _run(row, s, nodes.app(download_mod), 3)
    b, nbytes = _broadcasts(models, 3)
    for (p, r), got in nodes.trained.items():
        assert _same(got, b[r]), (p, r)
    assert {p for p, _ in nodes.trained} == set(range(_n(row)))
    for r in (1, 2, 3):
        g = _wmean([delta(b[r], p) for p in USED], _weights(row))
        _close(models[r], _minus(models[r - 1], g), 2e-6)
    if row == "synchronous":  # the update, or the model where that is smaller (this tiny one)
        full = payload_nbytes(ArrayRecord(init_model()))
        down = [res.train_metrics_clientapp[r]["bytes-down"] for r in (1, 2, 3)]
        assert down == [3 * full, 3 * min(full, nbytes[2]), 3 * min(full, nbytes[3])]


# ----------------------------------------------------------------------------- divergence skip
LR, MU = 0.7, 0.9


def check_divergence_skip(row: str) -> None:
    """``on_divergence="skip"`` and a loss that blows up in round 2: round 2's model is put
    back to round 1's bitwise, and round 3 steps from it with round 1's momentum:
    ``b_3 = mu g_1 + g_3``, ``theta_3 = theta_1 - lr (g_3 + mu b_3)`` (Nesterov)."""
    evaluated: list[int] = []

    def evaluate_fn(rnd, arrays):
        evaluated.append(rnd)
        return MetricRecord({"loss": 1e6 if evaluated == [0, 1, 2] else 1.0})

    s = _strategy(row, outer_lr=LR, outer_momentum=MU, divergence=Divergence(on_divergence="skip"))
    res, _, models = _run(row, s, Nodes().handlers(), 3, evaluate_fn=evaluate_fn)
    assert evaluated == [0, 1, 2, 2, 3]
    assert res.evaluate_metrics_serverapp[2]["diverged"] == 1
    assert _same(models[2], models[1])  # the restored model
    th0, th1 = _f64(models[0]), _f64(models[1])
    g1 = _wmean([delta(th0, p) for p in USED], _weights(row))
    g3 = _wmean([delta(th1, p) for p in USED], _weights(row))
    b3 = {k: MU * g1[k] + g3[k] for k in g1}
    _close(models[3], _minus(th1, {k: g3[k] + MU * b3[k] for k in g3}, LR), _tol(row, 10))


def check_divergence_skip_async() -> None:
    """The step whose loss blows up is put back (bitwise step 1's model) and no task is ever
    sent from the skipped model: ``test_async_rounds``' test of it, run as this cell."""
    async_tests.test_divergence_skip_puts_the_step_back_and_sends_no_work_from_the_skipped_model()


# ----------------------------------------------------------------------------- resume
def _through_file(s, tmp_path) -> dict:
    sd = s.state_dict()
    tensors, meta = load_checkpoint(
        save_checkpoint(tmp_path / "ck.safetensors", sd["tensors"], sd["meta"])
    )
    return {"tensors": tensors, "meta": meta}


def check_resume(row: str, tmp_path) -> None:
    """Nesterov, 4 rounds; a checkpoint written after round 2 (through the file) and loaded
    by a fresh strategy on a fresh grid: rounds 3-4 end bitwise where the uninterrupted run
    does. SecAgg+: the clients' stochastic rounding draws from numpy's global generator, so
    the resumed run continues from the state it had at the checkpoint."""
    kw = dict(outer_lr=LR, outer_momentum=MU)
    saved: dict = {}

    def after(rnd, grid):
        if rnd == 2:
            saved["state"], saved["np"] = _through_file(s, tmp_path), np.random.get_state()

    outside = np.random.get_state()
    try:
        np.random.seed(SEED)
        s = _strategy(row, **kw)
        _, _, whole = _run(row, s, Nodes().handlers(), 4, after=after)
        again = _strategy(row, **kw)
        again.load_state_dict(saved["state"], reference=init_model())
        np.random.set_state(saved["np"])
        res, _, rest = _run(row, again, Nodes().handlers(), 4)
    finally:
        np.random.set_state(outside)
    assert sorted(res.train_metrics_clientapp) == [3, 4]
    assert _same(rest[4], whole[4])


def check_resume_async(tmp_path) -> None:
    """A checkpoint after step 2, with tasks in flight from older versions; the resumed run
    on a grid whose arrival order continues the script ends bitwise at step 5."""
    kw = dict(replies_per_step=2, momentum_every=2, outer_lr=LR, outer_momentum=MU)
    saved: dict = {}

    def after(rnd, grid):
        if rnd == 2:
            saved["state"], saved["taken"] = _through_file(s, tmp_path), grid.taken

    s = async_strategy(**kw)
    _, _, whole = _run("asynchronous", s, None, 5, grid=ScriptedGrid(ORDER), after=after)
    assert saved["state"]["meta"]["async"]["tasks"]
    again = async_strategy(**kw)
    again.load_state_dict(saved["state"], reference=init_model())
    grid = ScriptedGrid(ORDER[saved["taken"] :])
    _, _, rest = _run("asynchronous", again, None, 5, grid=grid)
    assert _same(rest[5], whole[5])


# ----------------------------------------------------------------------------- node restart
def check_restart(row: str) -> None:
    """Node 0 loses its ``context.state`` after round 1 (the upload residual; SecAgg+: its
    protocol state): it still trains, every round merges every used node's reply."""
    nodes = Nodes()
    wiped: list[int] = []

    def after(rnd, grid):
        if rnd == 1:
            wiped.append(_wipe(grid.contexts[grid.node_ids[0]]))

    if row == "secagg":
        s, app = _strategy(row), nodes.handlers()
    else:
        s, app = _strategy(row, upload="int8"), nodes.app(upload_mod)
    res, _, _ = _run(row, s, app, 3, after=after)
    assert wiped[0] > 0  # the node did hold state
    for r in (1, 2, 3):
        m = res.train_metrics_clientapp[r]
        assert (m["replies-used"], m["replies-rejected"]) == (3, 0), r
        assert (0, r) in nodes.trained


def check_restart_download() -> None:
    """Node 0 loses its copy of ``B`` after round 2: in round 3 it still trains, on ``B_3``
    (the full model sent to it within the round), and its reply is merged."""
    nodes = Nodes()

    def after(rnd, grid):
        if rnd == 2:
            _wipe(grid.contexts[grid.node_ids[0]])

    s = _strategy("synchronous", download="int8")
    res, _, models = _run("synchronous", s, nodes.app(download_mod), 3, after=after)
    b, _ = _broadcasts(models, 3)
    assert res.train_metrics_clientapp[3]["replies-used"] == 3
    assert _same(nodes.trained[0, 3], b[3])


def check_restart_async() -> None:
    """Node 0 loses its upload residual after step 1; every step still merges K = 2 replies
    and none is rejected."""
    s = async_strategy(replies_per_step=2, upload="int8")
    grid = ScriptedGrid(ORDER)
    app = ClientApp(mods=[upload_mod])
    app.train()(async_train)
    grid.app = app
    wiped: list[int] = []

    def after(rnd, g):
        if rnd == 1:
            wiped.append(_wipe(g.contexts[g.node_ids[0]]))

    res, _, _ = _run("asynchronous", s, None, 4, grid=grid, after=after)
    assert wiped[0] > 0
    for r in (1, 2, 3, 4):
        m = res.train_metrics_clientapp[r]
        assert (m["replies-used"], m["replies-rejected"]) == (2, 0), r


# ----------------------------------------------------------------------------- late / stale
def _said(caplog, *parts: str) -> bool:
    return any(all(p in r.getMessage() for p in parts) for r in caplog.records)


class _LateGrid(FakeGrid):
    """Node 2's first message is answered only once the next round's messages are pushed:
    its reply comes after its round closed (at the round's timeout, on the virtual clock)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.held: tuple[str, int] | None = None  # (message id, push it came with)
        self.pushes = 0

    def push_messages(self, messages):
        messages = list(messages)
        ids = list(super().push_messages(messages))
        self.pushes += 1
        for m, mid in zip(messages, ids, strict=True):
            if self.held is None and m.metadata.dst_node_id == self.node_ids[2]:
                self.held = (mid, self.pushes)
        return ids

    def pull_messages(self, message_ids):
        ids = list(message_ids)
        if self.held is not None and self.pushes == self.held[1]:
            ids = [i for i in ids if i != self.held[0]]
        return super().pull_messages(ids)


def check_late(row: str, caplog) -> None:
    """Synchronous: node 2 answers round 1 after the round's timeout; quorum: node 3 after
    the quorum closed, every round. The round merges the others (its model is their weighted
    mean step), counts the reply late and names the node; the late reply is discarded."""
    late = 2 if row == "synchronous" else 3
    used = [p for p in range(_n(row)) if p != late]
    s = _strategy(row)
    handlers = Nodes().handlers()
    grid = _LateGrid(handlers, num_nodes=3) if row == "synchronous" else _grid(row, handlers)
    with caplog.at_level(logging.INFO, logger="flwr"):
        res, _, models = _run(row, s, None, 2, grid=grid)
    m1 = res.train_metrics_clientapp[1]
    assert (m1["replies-used"], m1["replies-late"]) == (len(used), 1)
    th0 = _f64(models[0])
    ws = [p + 1.0 for p in used]
    _close(models[1], _minus(th0, _wmean([delta(th0, p) for p in used], ws)), 2e-6)
    node = str(grid.node_ids[late])
    assert _said(caplog, "without the reply of node", node)
    assert _said(caplog, "late reply of node", node, "round 1 discarded")


def check_late_async(caplog) -> None:
    """``max_staleness=0``: replies one step old are dropped, counted and named; within the
    bound a stale reply weighs ``(1 + tau)^-0.5`` (``test_async_rounds``' hand computation
    runs the latter at length; here: step 2's model of order 0 1 | 2 1)."""
    s = async_strategy(replies_per_step=2, max_staleness=0)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        res, grid, _ = _run("asynchronous", s, None, 2, grid=ScriptedGrid([0, 1, 2, 0, 1, 2]))
    m = res.train_metrics_clientapp[2]
    assert (m["replies-stale"], m["replies-used"]) == (2, 2)
    for p in (0, 2):
        assert _said(caplog, f"node {grid.node_ids[p]}", "stale")
    s = async_strategy(replies_per_step=2)
    _, _, models = _run("asynchronous", s, None, 2, grid=ScriptedGrid([0, 1, 2, 1]))
    th0, th1 = _f64(init_model()), _f64(models[1])
    sd = 1 / math.sqrt(2)
    g = {k: (2 * sd * delta(th0, 2)[k] + delta(th1, 1)[k]) / 3 for k in th0}
    _close(models[2], _minus(th1, g), 2e-6)


class _SilentGrid(FakeGrid):
    """Node 3 never answers its third message (round 1's masked-vector stage of SecAgg+)."""

    def _deliver(self, msg):
        nid = msg.metadata.dst_node_id
        self.seen = getattr(self, "seen", {})
        self.seen[nid] = self.seen.get(nid, 0) + 1
        if nid == self.node_ids[3] and self.seen[nid] == 3:
            return None
        return super()._deliver(msg)


def check_late_secagg(caplog) -> None:
    """4 nodes; node 3 is silent at the masked-vector stage of round 1: the others' shares
    unmask it, the round merges nodes 0-2 (their mean within one step), counts one missing and
    names it."""
    nodes = Nodes()
    s = _strategy("secagg", min_available_nodes=4)
    app = {"train": lambda m, c: secagg_mod(m, c, nodes.train)}
    with caplog.at_level(logging.WARNING, logger="flwr"):
        res, grid, models = _run("secagg", s, None, 1, grid=_SilentGrid(app, num_nodes=4))
    m = res.train_metrics_clientapp[1]
    assert (m["replies-used"], m["replies-missing"]) == (3, 1)
    _close(models[1], _mean_step("secagg", models[0]), _tol("secagg"))
    assert _said(caplog, str(grid.node_ids[3]))


# ----------------------------------------------------------------------------- evaluation
def check_evaluation(row: str) -> None:
    """``fraction_evaluate=1``: every node evaluates bitwise the model after the round's step,
    and the aggregated loss is the weighted mean of the used nodes' ``||theta_r - target_p||^2``
    (quorum: the late node's reply is left out)."""
    nodes = Nodes()
    s = _strategy(row, fraction_evaluate=1.0)
    res, _, models = _run(row, s, nodes.handlers(), 2)
    assert {r for _, r in nodes.evaluated} == {1, 2}
    for (p, r), got in nodes.evaluated.items():
        assert _same(got, models[r]), (p, r)
    for r in (1, 2):
        th = _f64(models[r])
        losses = [sum(float((th[k] - target(p)[k]).pow(2).sum()) for k in th) for p in USED]
        ws = [p + 1.0 for p in USED]  # the evaluate replies' num-examples
        want = sum(w * x for w, x in zip(ws, losses, strict=True)) / sum(ws)
        assert res.evaluate_metrics_clientapp[r]["loss"] == pytest.approx(want, rel=1e-6)


def check_evaluation_download() -> None:
    """Compressed downloads: the model a node evaluates after round ``r`` is the model after
    round ``r``'s step, to within one int8 step of the update it was sent
    (``max|theta_r - B_r| / 127``), not ``B_r``, the model from before the step."""
    nodes = Nodes()
    s = _strategy("synchronous", download="int8", fraction_evaluate=1.0)
    _, _, models = _run("synchronous", s, nodes.app(download_mod), 2)
    b, _ = _broadcasts(models, 2)
    for (_, r), got in nodes.evaluated.items():
        gap = max(float((models[r][k] - b[r][k]).abs().max()) for k in b[r])
        assert gap > 0.01
        _close(got, models[r], gap / 127)


# ----------------------------------------------------------------------------- the cells
def _cell_checks() -> dict[tuple[str, str], Callable]:
    """(collector, guarantee) -> the check of a cell that holds."""
    out: dict[tuple[str, str], Callable] = {}
    shared = {
        "buffers": check_buffers,
        "central-dp": check_central_dp,
        "local-dp": check_local_dp,
        "robust": check_robust,
        "upload": check_upload,
        "download": check_download,
        "divergence-skip": check_divergence_skip,
        "resume": check_resume,
        "restart": check_restart,
        "late": check_late,
        "evaluation": check_evaluation,
    }
    for row in ("synchronous", "quorum", "secagg"):
        for col, fn in shared.items():
            if isinstance(MATRIX[row, col], Holds):
                out[row, col] = fn
    out["secagg", "late"] = lambda row, caplog: check_late_secagg(caplog)
    asynchronous = {
        "buffers": check_buffers_async,
        "robust": check_robust_async,
        "upload": check_upload_async,
        "divergence-skip": check_divergence_skip_async,
        "resume": check_resume_async,
        "restart": check_restart_async,
        "late": check_late_async,
        "evaluation": check_evaluation_async,
    }
    for col, fn in asynchronous.items():
        out["asynchronous", col] = lambda row, *a, fn=fn: fn(*a)
    return out


CHECKS = _cell_checks()
EXTRA = {  # a second guarantee met in the same cell: (collector, guarantee, with) -> check
    ("synchronous", "central-dp", "buffers"): lambda: check_central_dp_buffers(),
    ("synchronous", "restart", "download"): lambda: check_restart_download(),
    ("synchronous", "evaluation", "download"): lambda: check_evaluation_download(),
}
PENDING: dict[tuple[str, str, str], str] = {}
"""Checks (``(collector, guarantee, "")`` for a cell's own) whose fix has not landed yet:
strict xfail, with the reason."""


def _holding() -> list:
    params = []
    for (row, col), cell in MATRIX.items():
        if isinstance(cell, Holds):
            key = (row, col, "")
            marks = [pytest.mark.xfail(strict=True, reason=PENDING[key])] if key in PENDING else []
            params.append(pytest.param(row, col, id=f"{row}-{col}", marks=marks))
    return params


@pytest.mark.parametrize("row,col", _holding())
def test_a_cell_that_holds(row, col, tmp_path, caplog):
    fn = CHECKS[row, col]
    args = {"resume": (tmp_path,), "late": (caplog,)}.get(col, ())
    fn(row, *args)


def _extras() -> list:
    params = []
    for key in EXTRA:
        marks = [pytest.mark.xfail(strict=True, reason=PENDING[key])] if key in PENDING else []
        params.append(pytest.param(key, id="-".join(key[:2]) + "+" + key[2], marks=marks))
    return params


@pytest.mark.parametrize("key", _extras())
def test_a_cell_with_a_second_guarantee(key):
    row, col, _ = key
    assert isinstance(MATRIX[row, col], Holds)
    EXTRA[key]()


# ----------------------------------------------------------------------------- refusals
ASYNC = dict(rounds=Rounds(asynchronous=True), fraction_evaluate=0.0)
UNIFORM = dict(checks=ReplyChecks(weighting="uniform"), fraction_evaluate=0.0)
BUILDS: dict[tuple[str, str], Callable[[], object]] = {
    ("asynchronous", "central-dp"): lambda: DiLoCo(
        **ASYNC, privacy=CentralDP(noise_multiplier=1.0, clipping_norm=1.0)
    ),
    ("asynchronous", "local-dp"): lambda: DiLoCo(
        **ASYNC, privacy=LocalDP(noise_multiplier=1.0, clipping_norm=1.0)
    ),
    ("asynchronous", "download"): lambda: DiLoCo(**ASYNC, download="int8"),
    ("secagg", "central-dp"): lambda: use_secagg(
        DiLoCo(**UNIFORM, privacy=CentralDP(noise_multiplier=1.0, clipping_norm=1.0))
    ),
    ("secagg", "robust"): lambda: use_secagg(DiLoCo(**UNIFORM, robust="median")),
    ("secagg", "upload"): lambda: use_secagg(DiLoCo(**UNIFORM, upload="int8")),
    ("secagg", "download"): lambda: use_secagg(DiLoCo(**UNIFORM, download="int8")),
    ("asynchronous", "quorum"): lambda: Rounds(asynchronous=True, quorum=2),
    ("asynchronous", "secagg"): lambda: use_secagg(
        DiLoCo(**UNIFORM, rounds=Rounds(asynchronous=True))
    ),
    ("quorum", "secagg"): lambda: use_secagg(DiLoCo(**UNIFORM, rounds=Rounds(quorum=2))),
}
"""Each refused pair, built as a user would."""


def _refused() -> list:
    cells = [k for k, c in MATRIX.items() if isinstance(c, Refused)]
    return [pytest.param(a, b, id=f"{a}-{b}") for a, b in [*cells, *ROW_PAIRS]]


@pytest.mark.parametrize("a,b", _refused())
def test_a_refused_pair_raises_its_sentence_when_built(a, b):
    with pytest.raises(ValueError) as err:
        BUILDS[a, b]()
    assert composition.refusal(a, b) in str(err.value)


def test_every_refused_pair_has_a_build_and_every_cell_a_check():
    refused = {k for k, c in MATRIX.items() if isinstance(c, Refused)} | set(ROW_PAIRS)
    assert set(BUILDS) == refused
    assert {k for k, c in MATRIX.items() if isinstance(c, Holds)} == set(CHECKS)
    assert len(MATRIX) == len(composition.COLLECTORS) * len(composition.GUARANTEES)
    with pytest.raises(KeyError):
        composition.refusal("synchronous", "buffers")


# ----------------------------------------------------------------------------- the docs
def test_the_docs_table_is_render():
    text = (REPO / "docs" / "strategies.md").read_text(encoding="utf-8")
    assert "## What composes with what" in text
    assert composition.replace_block(text) == text, (
        "docs/strategies.md: the composition matrix is stale; run "
        "python -m flwr_isoloco.strategies.diloco.composition docs/strategies.md"
    )


def test_render_names_every_cell_once():
    md = composition.render()
    for (row, col), cell in MATRIX.items():
        what = cell.check if isinstance(cell, Holds) else ""
        name = composition.COLLECTORS[row][0]
        assert f"| {name} | {composition.GUARANTEES[col]} | {what}" in md
    for cell in {
        c.reason for c in [*MATRIX.values(), *ROW_PAIRS.values()] if isinstance(c, Refused)
    }:
        assert md.count(f". {cell}.") == 1
