"""Buffers (BatchNorm running statistics) with the features that touch them: asynchronous
rounds, ``buffers="auto"`` on real torch modules, central DP.

A buffer's new value is the weighted mean of the values the nodes reported (FedAvg's merge,
:mod:`flwr_isoloco.merging.buffers`); every expected value below is computed by hand from
the values the fake nodes report, not by the strategy's code.
"""

from __future__ import annotations

import math
import warnings

import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from test_async_rounds import ScriptedGrid
from test_async_rounds import strategy as async_strategy
from test_buffers import bn_client
from torch import nn

from flwr_isoloco.merging.buffers import nonnegative_variances, resolve_buffers
from flwr_isoloco.merging.dp import noise_like
from flwr_isoloco.strategies import CentralDP, DiLoCo, ReplyChecks

torch.set_num_threads(1)

N_EX = [1, 1, 2]  # num-examples of partitions 0, 1, 2 (as test_buffers.WEIGHTS)
MEAN = (0.0, 0.5, 1.0)  # the running_mean bn_client's node p reports: 0.5 p


def _bn_model(var0: float = 5.0) -> dict[str, torch.Tensor]:
    """A parameter and BatchNorm statistics far from what the nodes will report."""
    g = torch.Generator().manual_seed(0)
    return {
        "fc.weight": torch.randn(3, 4, generator=g),
        "bn.running_var": torch.full((4,), var0),
        "bn.running_mean": torch.full((4,), -2.0),
        "bn.num_batches_tracked": torch.tensor(0),
    }


def _async_run(order, steps, var):
    """Asynchronous DiLoCo (lr 0.7, Nesterov 0.9), K=2 of 3 nodes, replies in ``order``
    (partition ids), nodes of :func:`test_buffers.bn_client`; the model after each step
    (``evaluate_fn`` sees it)."""
    seen: dict[int, dict[str, torch.Tensor]] = {}

    def evaluate_fn(rnd, arrays):
        seen[rnd] = {k: v.clone() for k, v in arrays.to_torch_state_dict().items()}
        return None

    s = async_strategy(replies_per_step=2, outer_lr=0.7, outer_momentum=0.9)
    grid = ScriptedGrid(order)
    grid.app = bn_client(var)
    s.start(
        grid=grid,
        initial_arrays=ArrayRecord(_bn_model()),
        num_rounds=steps,
        evaluate_fn=evaluate_fn,
    )
    return s, seen


# Order 0 1 | 2 1 | 0 2 | 1 0. A reply that does not close a step gets its node new work from
# the model before the step; the closing one after it. Node 2's first reply (step 2) trained
# from version 0 (tau 1), node 0's in step 3 from version 0 (tau 2), node 2's in step 3 from
# version 1 (tau 1), nodes 1 and 0 in step 4 from version 2 (tau 1).
ORDER = [0, 1, 2, 1, 0, 2, 1, 0]


def test_async_running_var_all_one_stays_exactly_one():
    """Every node reports running_var 1.0: the merged value is 1.0 after every step, stale
    replies or not (it was ``theta - rho x`` the stale delta: -0.886 after step 2 here, from
    a model at 5.0)."""
    s, seen = _async_run(ORDER, 4, var=(1.0, 1.0, 1.0))
    assert sorted(seen) == [0, 1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        assert torch.equal(seen[step]["bn.running_var"], torch.ones(4)), step
    assert set(s.outer.momentum_buffer) == {"fc.weight"}
    assert not torch.equal(seen[4]["fc.weight"], seen[0]["fc.weight"])  # parameters did move


def test_async_buffers_are_the_weighted_mean_of_the_reported_values():
    """Distinct values: each step's buffer is ``sum_i w_i x_i / sum_i w_i`` over the step's
    replies, ``w_i = n_i s(tau_i)`` (the merge weights, ``s(tau) = 1/sqrt(1+tau)``), never
    scaled by ``rho``. Step 2 merges node 2 (tau 1) and node 1 (tau 0); step 3 node 0 (tau 2)
    and node 2 (tau 1); step 4 node 1 and node 0 (both sent version 2: tau 1)."""
    var = (0.5, 2.0, 3.0)
    _, seen = _async_run(ORDER, 4, var=var)
    s1, s2 = 1 / math.sqrt(2), 1 / math.sqrt(3)
    steps = {  # step -> [(partition, weight)]
        1: [(0, 1.0), (1, 1.0)],
        2: [(2, 2 * s1), (1, 1.0)],
        3: [(0, 1 * s2), (2, 2 * s1)],
        4: [(1, 1 * s1), (0, 1 * s1)],
    }
    for step, used in steps.items():
        total = sum(w for _, w in used)
        for key, values in (("bn.running_var", var), ("bn.running_mean", MEAN)):
            want = sum(w * values[p] for p, w in used) / total
            got = seen[step][key]
            assert torch.allclose(got, torch.full((4,), want), atol=1e-6), (step, key, got, want)


# ----------------------------------------------------------------------------- buffers="auto"
class _Kernel(nn.Module):
    """A parameter not called ``weight``: spectral norm's vectors are then ``kernel_u/_v``."""

    def __init__(self) -> None:
        super().__init__()
        self.kernel = nn.Parameter(torch.randn(3, 4))


def _normed() -> nn.Module:
    """Every torch weight/spectral normalisation, old style and parametrised, and BatchNorm."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the old-style functions are deprecated
        return nn.ModuleDict(
            {
                "wn": nn.utils.weight_norm(nn.Linear(4, 3)),  # params weight_g, weight_v
                "sn": nn.utils.spectral_norm(nn.Linear(4, 3)),  # buffers weight_u, weight_v
                "snk": nn.utils.spectral_norm(_Kernel(), name="kernel"),
                "pwn": nn.utils.parametrizations.weight_norm(nn.Linear(4, 3)),
                "psn": nn.utils.parametrizations.spectral_norm(nn.Linear(4, 3)),
                "bn": nn.BatchNorm1d(3),
            }
        )


def test_auto_tells_weight_norm_parameters_from_spectral_norm_buffers():
    """``"auto"`` sees names only; on a state_dict of real torch modules it must name exactly
    the module's own floating buffers (torch's ``named_buffers``), so weight_norm's trainable
    ``weight_v`` / ``weight_g`` are parameters and spectral_norm's ``weight_u`` / ``weight_v``
    buffers."""
    m = _normed()
    sd = m.state_dict()
    truth = {n for n, t in m.named_buffers() if t.is_floating_point()}
    assert {"sn.weight_u", "sn.weight_v", "snk.kernel_u", "bn.running_var"} <= truth
    assert resolve_buffers("auto", sd) == truth
    assert resolve_buffers(m, sd) == truth
    assert not {"wn.weight_v", "wn.weight_g"} & resolve_buffers("auto", sd)


def _wn_train(msg: Message, ctx) -> Message:
    """Every node shrinks every float tensor by 10 % (weights 1, 1, 2: the mean is the same)."""
    th = msg.content["arrays"].to_torch_state_dict()
    pid = int(ctx.node_config["partition-id"])
    new = {k: v * 0.9 if v.is_floating_point() else v for k, v in th.items()}
    metrics = MetricRecord({"num-examples": N_EX[pid]})
    return Message(RecordDict({"arrays": ArrayRecord(new), "metrics": metrics}), reply_to=msg)


def test_weight_norm_v_takes_the_outer_nesterov_step():
    """One round of DiLoCo (lr 0.7, Nesterov mu 0.9): a parameter with delta ``g = 0.1 x``
    becomes ``x - 0.7 (g + 0.9 g)``; a buffer becomes the nodes' value ``0.9 x``."""
    m = _normed()
    sd = {k: v.detach().clone() for k, v in m.state_dict().items()}
    s = DiLoCo(min_train_nodes=3, min_available_nodes=3, fraction_evaluate=0.0)
    grid = FakeGrid({"train": _wn_train}, num_nodes=3)
    s.start(grid=grid, initial_arrays=ArrayRecord(sd), num_rounds=1)
    for k in ("wn.weight_v", "wn.weight_g"):
        want = sd[k] * (1 - 0.7 * 1.9 * 0.1)
        torch.testing.assert_close(s.theta[k], want, rtol=1e-5, atol=1e-6)
        assert k in s.outer.momentum_buffer
    for k in ("sn.weight_u", "sn.weight_v", "bn.running_var"):
        torch.testing.assert_close(s.theta[k], sd[k] * 0.9, rtol=1e-5, atol=1e-6)
        assert k not in s.outer.momentum_buffer


# ----------------------------------------------------------------------------- central DP
def test_central_dp_running_var_is_clamped_at_zero_and_the_rest_is_the_release():
    """Central DP, 3 nodes, z = 1, C = 10, seed 1, one round. By hand (the mechanism of
    ``CentralDP``): no delta reaches C, so the released mean of tensor ``i`` (model order of the
    float entries) is ``(sum_p delta_p + N_i) / 3`` with ``N_i = noise_like(., z C, seed, 1, i)``;
    running_var ``= max(1 - released, 0)``, running_mean ``= -2 - released`` (no clamp: a mean
    may be negative)."""
    var, c = (0.2, 0.2, 0.2), 10.0
    init = _bn_model(var0=1.0)
    s = DiLoCo(
        min_train_nodes=3,
        min_available_nodes=3,
        fraction_evaluate=0.0,
        checks=ReplyChecks(weighting="uniform"),
        privacy=CentralDP(noise_multiplier=1.0, clipping_norm=c, seed=1),
    )
    grid = FakeGrid(bn_client(var), num_nodes=3)
    s.start(grid=grid, initial_arrays=ArrayRecord(init), num_rounds=1)

    floats = [k for k, t in init.items() if t.is_floating_point()]
    for p in range(3):  # each node's delta norm is under C: nothing is clipped
        d = torch.cat([(init["fc.weight"] * 0.1 - 0.01 * p).flatten(), torch.full((4,), 0.8)])
        assert torch.cat([d, torch.full((4,), -2.0 - MEAN[p])]).norm() < c

    def released(key: str, total: float) -> torch.Tensor:
        return (total + noise_like(torch.zeros(4), c, 1, 1, floats.index(key))) / 3

    raw_var = 1.0 - released("bn.running_var", 3 * 0.8)
    assert (raw_var < 0).any() and (raw_var > 0).any()  # the seed makes both kinds
    want_var = raw_var.clamp(min=0.0)
    torch.testing.assert_close(s.theta["bn.running_var"].double(), want_var, rtol=0, atol=1e-5)
    assert (s.theta["bn.running_var"][raw_var < 0] == 0).all()
    want_mean = -2.0 - released("bn.running_mean", sum(-2.0 - m for m in MEAN))
    assert (want_mean < 0).any()
    torch.testing.assert_close(s.theta["bn.running_mean"].double(), want_mean, rtol=0, atol=1e-5)


def test_only_variances_are_clamped():
    """The variance names of torch, Keras and Flax are clamped at 0; a mean, or a name that
    merely contains ``var``, keeps its negative value."""
    x = torch.tensor([-0.5, 0.25])
    names = {
        "bn.running_var": True,
        "norm.moving_variance": True,
        "moving_var": True,
        "params.batch_stats.BatchNorm_0.var": True,
        "bn.running_mean": False,
        "params.batch_stats.BatchNorm_0.mean": False,
        "layer.variance_scale": False,
        "bn.running_var.extra": False,
    }
    out = nonnegative_variances({k: x.clone() for k in names})
    for k, clamped in names.items():
        want = [0.0, 0.25] if clamped else [-0.5, 0.25]
        assert out[k].tolist() == want, k
