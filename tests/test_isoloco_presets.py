"""IsoLoCo's presets and signature (issue 17): the default preset is the drop-in one, the paper
preset is the update IsoLoCo had before presets (checked against that update written out),
explicit arguments override a preset, ``strategy.preset`` works from a run config, and
``IsoLoCo`` spells out DiLoCo's signature."""

from __future__ import annotations

import inspect

import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from outer_reference import assert_close, iso_c, of_the_mean, sync_rounds

from flwr_isoloco.merging.outer import nesterov_step_limit
from flwr_isoloco.strategies import DiLoCo, IsoLoCo, MergeSettings
from flwr_isoloco.strategies.diloco.presets import ISOLOCO_PRESETS, resolve_preset

torch.set_num_threads(1)


def _model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w1": torch.randn(6, 5, generator=g),
        "w2": torch.randn(3, 6, generator=g),
        "b": torch.randn(3, generator=g),
    }


def _local(sd: dict[str, torch.Tensor], pid: int, rnd: int) -> dict[str, torch.Tensor]:
    """A deterministic 'local training': 30 % of the way to a random target of (pid, round)."""
    g = torch.Generator().manual_seed(100 + pid + rnd)
    return {k: v - 0.3 * (v - torch.randn(v.shape, generator=g)) for k, v in sd.items()}


def _train(msg: Message, context) -> Message:
    pid = int(context.node_config["partition-id"])
    rnd = int(msg.content["config"]["server-round"])
    new = _local(msg.content["arrays"].to_torch_state_dict(), pid, rnd)
    content = RecordDict(
        {"arrays": ArrayRecord(new), "metrics": MetricRecord({"num-examples": 10 + pid})}
    )
    return Message(content=content, reply_to=msg)


def _run(strategy, rounds: int = 4) -> dict[str, torch.Tensor]:
    grid = FakeGrid({"train": _train}, num_nodes=3)
    strategy.fraction_evaluate = 0.0
    res = strategy.start(grid=grid, initial_arrays=ArrayRecord(_model()), num_rounds=rounds)
    return res.arrays.to_torch_state_dict()


def test_paper_preset_is_the_old_isoloco():
    """The update before presets was DiLoCo(merge="iso_c", outer_lr=1.8, outer_momentum=0.8,
    nesterov=True) (IsoLoCo's old constructor passed exactly these): the paper preset, that
    DiLoCo and the default preset with every value it sets given explicitly all give the model
    of :func:`outer_reference.sync_rounds` (fp64) with that update written out: Iso-C
    (``mean(s) U V^T`` of the weighted mean delta, n_p = 10 + p) on the matrices, the mean on
    the bias, Nesterov with lr 1.8 and mu 0.8, 4 rounds of 3 nodes."""
    want = sync_rounds(
        _model(), _local, 4, [10, 11, 12], lr=1.8, momentum=0.8, nesterov=True,
        rule=of_the_mean(iso_c),
    )  # fmt: skip
    for strategy in (
        DiLoCo(merge="iso_c", outer_lr=1.8, outer_momentum=0.8, nesterov=True),
        IsoLoCo(preset="isoloco-paper"),
        IsoLoCo(merge="iso_c", outer_lr=1.8, outer_momentum=0.8, nesterov=True),
    ):  # tol: fp32 SVD round-off grown by lr 1.8 over 4 rounds (measured 2e-6 of the max)
        assert_close(_run(strategy), want, tol=1e-4)
    assert IsoLoCo(preset="isoloco-paper").merge_options == {}


def test_default_preset_differs_from_paper_as_documented():
    d, p = IsoLoCo(), IsoLoCo(preset="isoloco-paper")
    assert d.preset == "dropin" and p.preset == "isoloco-paper"
    assert (p.outer.lr, p.outer.momentum, p.outer.nesterov) == (1.8, 0.8, True)
    drop = ISOLOCO_PRESETS["dropin"]
    assert (d.outer.lr, d.outer.momentum, d.outer.nesterov) == (
        drop.outer_lr,
        drop.outer_momentum,
        True,
    )
    assert (d.merge_name, p.merge_name) == ("iso_c_matched", "iso_c")
    # the documented reason: the drop-in step is inside Nesterov's stability limit for a
    # pseudo-gradient that local training fully contracts (c = 1); the paper's is not
    assert drop.outer_lr < nesterov_step_limit(drop.outer_momentum, True)
    assert 1.8 > nesterov_step_limit(0.8, True)
    assert not torch.equal(_run(d)["w1"], _run(p)["w1"])


def test_explicit_arguments_override_the_preset():
    s = IsoLoCo(preset="isoloco-paper", outer_lr=0.5)
    assert (s.outer.lr, s.outer.momentum) == (0.5, 0.8)
    s = IsoLoCo(outer_momentum=0.0)
    assert s.outer.momentum == 0.0 and not s.outer.nesterov
    assert IsoLoCo(preset="isoloco-paper", merge="iso_c_ns").merge_name == "iso_c_ns"
    assert IsoLoCo(merge="mean").merge_name == "mean"
    assert IsoLoCo(merge_settings=MergeSettings(orthogonalize="update")).merge_name == "iso_c"
    fast = {"strategy.fast": True, "strategy.preset": "isoloco-paper"}
    assert IsoLoCo.from_run_config(fast).merge_name == "iso_c_ns"
    assert IsoLoCo.from_run_config({"strategy.merge": "ties"}).merge_name == "ties"


def test_fast_under_the_default_preset_is_refused_not_a_silent_change_of_rule():
    """strategy.fast = true is iso_c_ns, the Newton-Schulz form of iso_c only: under "dropin"
    (iso_c_matched at lr 0.5) it is an error naming the two ways to get what one meant, not a
    swap to another rule at another scale. The constructor has no fast=: it names
    merge="iso_c_ns" with the "isoloco-paper" preset."""
    with pytest.raises(TypeError, match=r"use IsoLoCo\(preset='isoloco-paper', merge='iso_c_ns'\)"):
        IsoLoCo(fast=True)
    with pytest.raises(ValueError, match=r"fast = true is iso_c_ns.*'dropin'.*iso_c_matched"):
        IsoLoCo.from_run_config({"strategy.fast": True})
    with pytest.raises(ValueError, match=r"strategy.preset = 'isoloco-paper'"):
        IsoLoCo.from_run_config({"strategy.fast": True})
    paper = IsoLoCo(preset="isoloco-paper", merge="iso_c_ns")
    assert (paper.merge_name, paper.outer.lr, paper.outer.momentum) == ("iso_c_ns", 1.8, 0.8)
    chosen = IsoLoCo(merge="iso_c_ns")  # the rule by name, with the dropin preset's lr
    assert (chosen.merge_name, chosen.outer.lr) == ("iso_c_ns", 0.5)


def test_unknown_preset_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown IsoLoCo preset 'paper'.*isoloco-paper"):
        IsoLoCo(preset="paper")
    with pytest.raises(ValueError):
        resolve_preset(None)


def test_preset_from_run_config():
    d = IsoLoCo.from_run_config({})
    assert (d.preset, d.merge_name, d.outer.lr, d.outer.momentum) == (
        "dropin",
        "iso_c_matched",
        0.5,
        0.9,
    )
    p = IsoLoCo.from_run_config({"strategy.preset": "isoloco-paper"})
    assert (p.preset, p.merge_name, p.outer.lr, p.outer.momentum) == (
        "isoloco-paper",
        "iso_c",
        1.8,
        0.8,
    )
    o = IsoLoCo.from_run_config({"strategy.preset": "isoloco-paper", "strategy.outer-lr": 0.4})
    assert (o.outer.lr, o.outer.momentum) == (0.4, 0.8)
    s = IsoLoCo.from_section({"preset": "isoloco-paper"})
    assert (s.outer.lr, s.outer.momentum) == (1.8, 0.8)
    with pytest.raises(ValueError, match="strategy.preset"):
        IsoLoCo.from_run_config({"strategy.preset": "fast"})
    with pytest.raises(ValueError, match="strategy.outer-lr"):
        IsoLoCo.from_run_config({"strategy.outer-lr": -0.5})


def test_signature_spells_out_every_diloco_parameter():
    """help(IsoLoCo) shows the arguments, not **kwargs: its signature is read from DiLoCo's
    (IsoLoCo forwards **kwargs), so a parameter added to DiLoCo appears in IsoLoCo's too."""
    iso = inspect.signature(IsoLoCo).parameters
    dil = inspect.signature(DiLoCo).parameters
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in iso.values())
    missing = [name for name in dil if name not in iso]
    assert not missing, f"IsoLoCo lacks DiLoCo's parameters {missing}"
    assert "preset" in iso and "fast" not in iso
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in iso.values())
    preset_owned = {"merge", "outer_lr", "outer_momentum", "nesterov"}
    for name, p in dil.items():
        if name not in preset_owned:
            assert iso[name].default == p.default, name
    doc = inspect.getdoc(IsoLoCo)
    for name in ("preset", "iso_c_ns", "outer_lr", "DiLoCo"):
        assert name in doc, name


def test_warning_when_the_outer_step_is_beyond_the_stability_limit(caplog):
    import logging

    with caplog.at_level(logging.WARNING):
        IsoLoCo()
        IsoLoCo(outer_lr=1.3, outer_momentum=0.9)  # limit 1.357: inside
    assert not [r for r in caplog.records if "stable only while" in r.getMessage()]
    with caplog.at_level(logging.WARNING):
        IsoLoCo(preset="isoloco-paper")  # the paper's values chosen by name: no warning
    assert not [r for r in caplog.records if "stable only while" in r.getMessage()]
    with caplog.at_level(logging.WARNING):
        IsoLoCo(outer_lr=1.8, outer_momentum=0.8)  # the same step, given as numbers
    msgs = [r.getMessage() for r in caplog.records if "stable only while" in r.getMessage()]
    assert len(msgs) == 1 and "77%" in msgs[0] and "lr*c < 1.385" in msgs[0], msgs


def test_step_limit_is_where_the_linear_recursion_stops_contracting():
    """Independent check of nesterov_step_limit: iterate the outer step on g = c (theta - 0)
    with OuterSGD itself, just below and just above a = lr c = limit."""
    from flwr_isoloco.merging.outer import OuterSGD

    for mu, nesterov in ((0.8, True), (0.9, True), (0.5, False), (0.0, False)):
        limit = nesterov_step_limit(mu, nesterov)
        for a, grows in ((0.97 * limit, False), (1.03 * limit, True)):
            opt = OuterSGD(a, mu, nesterov)  # c = 1, lr = a
            theta = {"x": torch.tensor([1.0], dtype=torch.float64)}
            for _ in range(3000):
                theta = opt.step(theta, {"x": theta["x"].clone()})
            assert (abs(float(theta["x"])) > 1.0) is grows, (mu, nesterov, a)


def test_preset_key_is_isolocos_only():
    """DiLoCo's section has no preset: its run config still builds, and refuses the key."""
    assert DiLoCo.from_run_config({}).outer.lr == 0.7
    with pytest.raises(ValueError, match="strategy.preset"):
        DiLoCo.from_run_config({"strategy.preset": "dropin"})
