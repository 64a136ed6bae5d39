"""Buffers (BatchNorm running statistics) are merged as FedAvg merges them (issue 34, item 3).

Model: ``fc.weight`` (a parameter) and ``bn.running_var`` / ``bn.running_mean`` (buffers) at
1.0 / 0.0; node ``p`` (weights 1, 1, 2) reports ``running_var = VAR[p]``. FedAvg gives the
weighted mean of the reported values; the outer Nesterov step used to extrapolate them
(``DiLoCo()``: ``1 - 0.7 (0.8 + 0.9 x 0.8) = -0.064`` after round 1 when every node says 0.2).
"""

from __future__ import annotations

import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from torch import nn

from flwr_isoloco.merging import MERGE_RULES
from flwr_isoloco.merging.fold import RoundFold, RoundMerge
from flwr_isoloco.strategies import CentralDP, DiLoCo, IsoLoCo, MergeSettings, ReplyChecks

torch.set_num_threads(1)

WEIGHTS = [1, 1, 2]


def bn_client(var=(0.2, 0.2, 0.2), cov: bool = False):
    """Node ``p`` (weight ``WEIGHTS[p]``) reports ``running_var = var[p]`` and ``running_mean =
    0.5 p`` whatever model it was sent, and moves ``fc.weight``."""

    def train(msg: Message, ctx) -> Message:
        th = msg.content["arrays"].to_torch_state_dict()
        pid = int(ctx.node_config["partition-id"])
        new = dict(th)
        new["fc.weight"] = th["fc.weight"] * 0.9 + 0.01 * pid
        new["bn.running_var"] = torch.full_like(th["bn.running_var"], var[pid])
        new["bn.running_mean"] = torch.full_like(th["bn.running_mean"], 0.5 * pid)
        if cov:
            new["bn.cov"] = torch.full_like(th["bn.cov"], var[pid]) + torch.eye(3) * pid
        metrics = MetricRecord({"num-examples": WEIGHTS[pid]})
        return Message(RecordDict({"arrays": ArrayRecord(new), "metrics": metrics}), reply_to=msg)

    return {"train": train}


def _init(cov: bool = False) -> dict[str, torch.Tensor]:
    init = {"fc.weight": torch.ones(3, 4), "bn.running_var": torch.ones(4)}
    init["bn.running_mean"] = torch.zeros(4)
    init["bn.num_batches_tracked"] = torch.tensor(0)
    if cov:
        init["bn.cov"] = torch.ones(3, 3)
    return init


def _quiet(**kw):
    return dict(min_train_nodes=1, min_evaluate_nodes=1, min_available_nodes=1, **kw)


def _run(strategy, rounds=2, var=(0.2, 0.2, 0.2), cov=False):
    grid = FakeGrid(bn_client(var, cov), num_nodes=3)
    return strategy.start(grid=grid, initial_arrays=ArrayRecord(_init(cov)), num_rounds=rounds)


STRATEGIES = {
    "DiLoCo()": lambda **kw: DiLoCo(**_quiet(fraction_evaluate=0.0), **kw),
    "IsoLoCo()": lambda **kw: IsoLoCo(**_quiet(fraction_evaluate=0.0), **kw),
    "paper": lambda **kw: IsoLoCo(preset="isoloco-paper", **_quiet(fraction_evaluate=0.0), **kw),
}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_running_var_becomes_the_nodes_value_not_an_extrapolation(name):
    s = STRATEGIES[name]()
    _run(s, rounds=2)
    assert torch.allclose(s.theta["bn.running_var"], torch.full((4,), 0.2), atol=1e-6)
    # running_mean: nodes 0, 0.5, 1.0 with weights 1, 1, 2 -> 2.5 / 4
    assert torch.allclose(s.theta["bn.running_mean"], torch.full((4,), 0.625), atol=1e-6)
    assert s.theta["fc.weight"].ne(0.9).any()  # the parameter did take the outer step


def test_buffers_take_the_weighted_mean_with_the_bounded_weights():
    s = DiLoCo(
        **_quiet(fraction_evaluate=0.0),
        checks=ReplyChecks(max_weight_ratio=1.5),
    )
    _run(s, rounds=1, var=(0.2, 0.4, 0.6))
    # the round's own median weight is 1: weight 2 is bounded to 1.5 -> (0.2 + 0.4 + 0.9) / 3.5
    want = (0.2 + 0.4 + 1.5 * 0.6) / 3.5
    assert s.theta["bn.running_var"][0].item() == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize("name", ["DiLoCo()", "IsoLoCo()"])
def test_outer_state_has_no_momentum_for_buffers(name):
    s = STRATEGIES[name]()
    _run(s, rounds=2)
    assert set(s.outer.momentum_buffer) == {"fc.weight"}
    assert set(s.state_dict()["tensors"]["outer"]["momentum_buffer"]) == {"fc.weight"}


def test_buffers_none_gives_the_old_outer_step():
    s = DiLoCo(**_quiet(fraction_evaluate=0.0), merge_settings=MergeSettings(buffers="none"))
    _run(s, rounds=1)
    # 1 - 0.7 * (g + 0.9 g), g = 0.8: every float tensor is owned by the outer step
    assert s.theta["bn.running_var"][0].item() == pytest.approx(1 - 0.7 * 1.9 * 0.8, abs=1e-6)


class _BN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3, bias=False)
        self.bn = nn.BatchNorm1d(4)


@pytest.mark.parametrize(
    "spec",
    [
        ["bn.running_var"],
        r"running_var$",
        lambda name, t: name == "bn.running_var",
    ],
    ids=["names", "regex", "callable"],
)
def test_explicit_buffers_override_the_default(spec):
    s = DiLoCo(**_quiet(fraction_evaluate=0.0), merge_settings=MergeSettings(buffers=spec))
    _run(s, rounds=1)
    assert s.theta["bn.running_var"][0].item() == pytest.approx(0.2, abs=1e-6)
    # running_mean is not named: the outer step owns it (1.9 x the mean delta -0.625, lr 0.7)
    assert s.theta["bn.running_mean"][0].item() == pytest.approx(0.7 * 1.9 * 0.625, abs=1e-5)


def test_module_buffers_and_auto_names():
    from flwr_isoloco.merging.buffers import check_buffers_spec, resolve_buffers

    theta = {k: v for k, v in _BN().state_dict().items()}
    assert resolve_buffers(_BN(), theta) == {"bn.running_mean", "bn.running_var"}
    names = {
        "a.running_mean": torch.zeros(2),
        "b.moving_variance": torch.zeros(2),
        "params.batch_stats.BatchNorm_0.mean": torch.zeros(2),
        "conv.weight_orig": torch.zeros(2, 2),  # spectral_norm: weight_u / weight_v buffers
        "conv.weight_u": torch.zeros(2),
        "wn.weight_g": torch.zeros(2, 1),  # weight_norm: weight_v is a parameter
        "wn.weight_v": torch.zeros(2, 2),
        "lone.weight_u": torch.zeros(2),  # no weight_orig beside it: a parameter (safe side)
        "lin.parametrizations.weight.0._v": torch.zeros(2),
        "lin.weight": torch.zeros(2, 2),
        "running.weight": torch.zeros(2),
        "bn.num_batches_tracked": torch.tensor(3),
    }
    assert resolve_buffers("auto", names) == {
        "a.running_mean",
        "b.moving_variance",
        "params.batch_stats.BatchNorm_0.mean",
        "conv.weight_u",
        "lin.parametrizations.weight.0._v",
    }
    assert resolve_buffers("none", names) == frozenset()
    with pytest.raises(ValueError, match="not a floating tensor"):
        resolve_buffers(["bn.num_batches_tracked"], names)
    with pytest.raises(ValueError, match="regular expression"):
        check_buffers_spec("running_(")
    with pytest.raises(ValueError, match="regular expression"):
        MergeSettings(buffers="(")


def test_run_config_key():
    s = DiLoCo.from_run_config({"strategy.buffers": "none"})
    assert s.buffers == "none"
    assert DiLoCo.from_run_config({}).buffers == "auto"


@pytest.mark.parametrize("spill", [False, True])
def test_a_2d_buffer_takes_the_mean_not_the_rule(spill):
    """Iso-C acts on 2-D tensors; a 2-D buffer (named explicitly) takes the plain mean, in the
    folded and in the spilled merge (``max_norm_ratio`` forces spilling)."""
    kw = {"checks": ReplyChecks(max_norm_ratio=100.0)} if spill else {}
    s = IsoLoCo(
        **_quiet(fraction_evaluate=0.0), merge_settings=MergeSettings(buffers=r"^bn\."), **kw
    )
    _run(s, rounds=1, cov=True)
    want = torch.full((3, 3), 0.2) + torch.eye(3) * (0 + 1 + 2 * 2) / 4
    assert torch.allclose(s.theta["bn.cov"], want, atol=1e-6)


def test_robust_median_buffers_stay_outside_the_outer_step():
    s = DiLoCo(**_quiet(fraction_evaluate=0.0), robust="median")
    _run(s, rounds=1, var=(0.2, 0.4, 0.6))
    assert s.theta["bn.running_var"][0].item() == pytest.approx(0.4, abs=1e-6)  # the median
    assert set(s.outer.momentum_buffer) == {"fc.weight"}


def test_central_dp_noises_the_buffers_too():
    """Under central DP the buffers are in the clipped delta and the noised sum: the released
    running_var is not the exact mean of the sites' values (nothing leaves un-noised)."""
    s = DiLoCo(
        **_quiet(fraction_evaluate=0.0),
        checks=ReplyChecks(weighting="uniform"),
        privacy=CentralDP(noise_multiplier=1.0, clipping_norm=10.0, seed=1),
    )
    _run(s, rounds=1)
    assert not torch.allclose(s.theta["bn.running_var"], torch.full((4,), 0.2), atol=1e-3)
    assert set(s.outer.momentum_buffer) <= {"fc.weight"}


class _Reply:
    def __init__(self, node_id: int, delta: dict[str, torch.Tensor]) -> None:
        self.node_id, self._delta = node_id, delta

    def update(self, theta):
        return self._delta

    def release(self) -> None:
        pass


def test_finish_keep_subset_without_spill_is_refused():
    """Before: a folded round returned the mean of every reply while reporting only ``keep``."""
    theta = {"w": torch.zeros(4)}
    rm = RoundMerge(MERGE_RULES["mean"], "mean", {}, device="cpu")
    replies = [_Reply(i, {"w": torch.full((4,), float(i))}) for i in range(3)]
    fold = RoundFold(rm, theta, 1)
    for r in replies:
        fold.add(r, 1.0)
    with pytest.raises(ValueError, match="spill=True"):
        fold.finish(replies[:2], lambda r: 1.0, reject=lambda r, why: None)
    with RoundFold(rm, theta, 1, spill=True) as fold:  # spilled: a subset is fine
        for r in replies:
            fold.add(r, 1.0)
        g, used = fold.finish(replies[:2], lambda r: 1.0, reject=lambda r, why: None)
    assert used == replies[:2] and torch.allclose(g["w"], torch.full((4,), 0.5))
