"""``merge_device`` / ``strategy.merge-device``: the strategy's choice reaches the round's merge,
"cpu" and "auto" both give the documented update (written out independently) on a CPU machine,
and a CUDA device that is not there is refused when the strategy is built."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from outer_reference import assert_close, capped_iso_c, iso_c, of_the_mean, sync_rounds, ties

import flwr_isoloco.merging.fold as round_mod
from flwr_isoloco.merging.streaming import OrderFreeMean
from flwr_isoloco.runconfig import RunConfigError, precheck_app_config
from flwr_isoloco.strategies import DiLoCo, IsoLoCo, MergeSettings

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


def _model():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(6, 4, generator=g), "b": torch.randn(4, generator=g)}


def _local(theta, pid, rnd):
    """A random step of 0.1 N(0, 1) per entry, seeded by (round, pid)."""
    g = torch.Generator().manual_seed(100 * rnd + pid)
    return {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in theta.items()}


def _train(msg, ctx):
    pid = int(ctx.node_config["partition-id"])
    rnd = int(msg.content["config"]["server-round"])
    new = _local(msg.content["arrays"].to_torch_state_dict(), pid, rnd)
    metrics = MetricRecord({"num-examples": pid + 1})
    return Message(RecordDict({"arrays": ArrayRecord(new), "metrics": metrics}), reply_to=msg)


def _run(cls, **kw):
    s = cls(min_train_nodes=1, min_available_nodes=3, fraction_evaluate=0.0, **kw)
    grid = FakeGrid({"train": _train}, num_nodes=3)
    s.start(grid=grid, initial_arrays=ArrayRecord(_model()), num_rounds=2)
    return s


# The documented update of each path, written out (outer_reference, fp64): 2 rounds of 3 nodes
# weighted n_p = p + 1; the drop-in preset is capped Iso-C (max_gain 2) with lr 0.5, mu 0.9;
# DiLoCo's default outer step is lr 0.7, mu 0.9; TIES's default prune_fraction is 0.1.
REFERENCE = {
    "fold": dict(
        lr=0.5, momentum=0.9, nesterov=True, rule=of_the_mean(lambda g: capped_iso_c(g, 2.0))
    ),
    "spill": dict(lr=0.7, momentum=0.9, nesterov=True, rule=ties(0.1)),
    "update": dict(lr=0.5, momentum=0.9, nesterov=True, transform=iso_c),
}


@pytest.mark.parametrize(
    "cls, kw, path",
    [
        (IsoLoCo, {}, "fold"),  # Iso-C folded into the order-free mean
        (DiLoCo, {"merge": "ties"}, "spill"),  # every delta spilled, merged tensor by tensor
        (IsoLoCo, {"orthogonalize": "update"}, "update"),  # Iso-C on the outer update
    ],
)
def test_cpu_and_auto_give_the_reference_model_and_the_device_reaches_the_merge(
    cls, kw, path, monkeypatch
):
    seen: list[object] = []
    result, merge = OrderFreeMean.result, round_mod.merge

    def spy_result(self, rule="mean", device="auto", **options):
        seen.append(device)
        return result(self, rule, device, **options)

    def spy_merge(*args, device="auto", **options):
        seen.append(device)
        return merge(*args, device=device, **options)

    monkeypatch.setattr(OrderFreeMean, "result", spy_result)
    monkeypatch.setattr(round_mod, "merge", spy_merge)
    want = sync_rounds(_model(), _local, 2, [1, 2, 3], **REFERENCE[path])
    for option in ("cpu", "auto"):
        seen.clear()
        rule = {k: v for k, v in kw.items() if k == "merge"}
        fields = {k: v for k, v in kw.items() if k != "merge"}  # MergeSettings' fields
        s = _run(cls, merge_settings=MergeSettings(device=option, **fields), **rule)
        assert s.merge_device == CPU and s.merger.device == CPU
        # every merge of the two rounds was handed the strategy's device, none left to "auto"
        assert seen and all(d == CPU for d in seen), (path, seen)
        assert_close(s.theta, want)


@no_gpu
@pytest.mark.parametrize("cls", [DiLoCo, IsoLoCo])
@pytest.mark.parametrize("option", ["cuda", "cuda:0"])
def test_cuda_without_a_gpu_is_refused_at_construction(cls, option):
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        cls(merge_settings=MergeSettings(device=option))


@pytest.mark.parametrize("bad", ["gpu", "tpu", "", "meta", 0])
def test_an_unknown_device_is_refused_at_construction(bad):
    with pytest.raises(ValueError, match="MergeSettings.device"):
        MergeSettings(device=bad)


def test_run_config_key_reaches_the_strategy_and_is_prechecked():
    assert DiLoCo.from_run_config({"strategy.merge-device": "cpu"}).merge_device == CPU
    assert IsoLoCo.from_run_config({}).merge_device == CPU  # default "auto", no GPU here
    with pytest.raises(RunConfigError, match="'strategy.merge-device' has bad value 'gpu'"):
        DiLoCo.from_run_config({"strategy.merge-device": "gpu"})
    lm = ROOT / "simulations" / "isoloco-lm"
    assert precheck_app_config(lm, {"strategy.merge-device": "cpu"}) == []
    (problem,) = precheck_app_config(lm, {"strategy.merge-device": "tpu"})
    assert "'strategy.merge-device' has bad value 'tpu'" in problem


def test_a_checkpoint_without_or_with_another_merge_device_resumes():
    """The merge device is where the arithmetic runs, like torch-threads: a checkpoint saved
    before the key existed, or on another machine, resumes; a changed merge rule does not."""
    from flwr_isoloco.apprunner import RESUMABLE_DIFFERENCES
    from flwr_isoloco.runconfig import RunConfigError, check_resumable

    saved = {"seed": 0, "strategy": {"merge": "mean"}}
    check_resumable(
        saved,
        {"seed": 0, "strategy": {"merge": "mean", "merge-device": "cpu"}},
        RESUMABLE_DIFFERENCES,
    )
    with pytest.raises(RunConfigError, match="strategy.merge"):
        check_resumable(
            saved,
            {"seed": 0, "strategy": {"merge": "iso_c", "merge-device": "cpu"}},
            RESUMABLE_DIFFERENCES,
        )
