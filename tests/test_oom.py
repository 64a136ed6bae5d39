"""Out of memory in the server merge is not the replies' fault.

A fake ``OrderFreeMean.result`` raises ``torch.OutOfMemoryError`` on its first call: the merge
is retried on the CPU (logged) instead of rejecting every reply (three such rounds would end the
run with ``NoProgressError``), and an out-of-memory error on the CPU ends the run loudly. The
transform of the outer update (``orthogonalize="update"``, a fake ``merge``) falls back the same
way.
"""

from __future__ import annotations

import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

import flwr_isoloco.merging.device as device_mod
import flwr_isoloco.merging.fold as round_mod
from flwr_isoloco.merging.streaming import OrderFreeMean
from flwr_isoloco.strategies import DiLoCo, MergeSettings, ReplyChecks, Rounds

torch.set_num_threads(1)


def _client():
    def train(msg: Message, ctx) -> Message:
        th = msg.content["arrays"].to_torch_state_dict()
        pid = int(ctx.node_config["partition-id"])
        new = {k: v * 0.5 + pid for k, v in th.items()}
        metrics = MetricRecord({"num-examples": 1})
        return Message(RecordDict({"arrays": ArrayRecord(new), "metrics": metrics}), reply_to=msg)

    return {"train": train}


def _strategy() -> DiLoCo:
    kw = dict(min_train_nodes=1, min_evaluate_nodes=1, min_available_nodes=1)
    return DiLoCo(
        **kw,
        fraction_evaluate=0.0,
        merge_settings=MergeSettings(device="cpu"),
        rounds=Rounds(max_empty_rounds=1),
    )


def _oom_once(monkeypatch, error: Exception) -> list[str]:
    """Make the first ``OrderFreeMean.result`` call raise ``error``; the devices asked for."""
    orig, devices = OrderFreeMean.result, []

    def fake(self, rule="mean", device="auto", **kw):
        devices.append(str(device))
        if len(devices) == 1:
            raise error
        return orig(self, rule, device="cpu", **kw)  # a GPU that works, after the first call

    monkeypatch.setattr(OrderFreeMean, "result", fake)
    return devices


def _run(s: DiLoCo, rounds: int = 1):
    init = {"w": torch.ones(2, 3), "b": torch.zeros(3)}
    grid = FakeGrid(_client(), num_nodes=3)
    return s.start(grid=grid, initial_arrays=ArrayRecord(init), num_rounds=rounds)


@pytest.mark.parametrize(
    "error",
    [torch.OutOfMemoryError("CUDA out of memory."), RuntimeError("CUDA error: out of memory")],
    ids=["OutOfMemoryError", "RuntimeError"],
)
def test_gpu_out_of_memory_falls_back_to_the_cpu_for_the_round(monkeypatch, error):
    devices = _oom_once(monkeypatch, error)
    warnings: list[str] = []
    monkeypatch.setattr(device_mod._log, "warning", lambda msg, *a: warnings.append(msg % a))
    s = _strategy()
    s.merger.device = torch.device("cuda")  # as if resolved on a GPU server (never used here)
    res = _run(s, rounds=2)
    m = res.train_metrics_clientapp[1]
    assert m["replies-used"] == 3 and m["replies-rejected"] == 0
    # round 1 (spilled: no reference weight yet) merges tensor by tensor: "w" runs out on the
    # GPU, then "w" and "b" on the CPU; round 2 (folded) is on the GPU again
    assert devices == ["cuda", "cpu", "cpu", "cuda"], devices
    assert any("out of memory" in w and "on the CPU" in w for w in warnings)


def test_cpu_out_of_memory_fails_loudly(monkeypatch):
    _oom_once(monkeypatch, RuntimeError("DefaultCPUAllocator: can't allocate memory"))
    from flwr_isoloco.merging.device import MergeOutOfMemoryError

    with pytest.raises(MergeOutOfMemoryError, match="on the CPU"):
        _run(_strategy())


def test_a_data_error_still_rejects_the_replies(monkeypatch):
    _oom_once(monkeypatch, RuntimeError("linalg.svd: The algorithm failed to converge"))
    kw = dict(
        min_train_nodes=1, min_available_nodes=1, checks=ReplyChecks(max_weight_ratio=0)
    )  # folded round
    res = _run(DiLoCo(**kw, fraction_evaluate=0.0))
    assert res.train_metrics_clientapp[1]["replies-rejected"] == 3


def _fake_transform_oom(monkeypatch, error: Exception) -> list[str]:
    """``merge`` (the update transform's call) raises ``error`` whenever it is asked for a
    device other than the CPU; the fold's mean computes on the CPU whatever it is asked for."""
    orig_merge, orig_result, devices = round_mod.merge, OrderFreeMean.result, []

    def fake_merge(rule, deltas, weights=None, *, device="auto", **kw):
        devices.append(str(device))
        if str(device) != "cpu":
            raise error
        return orig_merge(rule, deltas, weights, device=device, **kw)

    def fake_result(self, rule="mean", device="auto", **kw):
        return orig_result(self, rule, device="cpu", **kw)

    monkeypatch.setattr(round_mod, "merge", fake_merge)
    monkeypatch.setattr(OrderFreeMean, "result", fake_result)
    return devices


def _update_strategy() -> DiLoCo:
    kw = dict(min_train_nodes=1, min_evaluate_nodes=1, min_available_nodes=1)
    return DiLoCo(
        **kw,
        merge="iso_c",
        merge_settings=MergeSettings(orthogonalize="update", device="cpu"),
        fraction_evaluate=0.0,
        rounds=Rounds(max_empty_rounds=1),
    )


def test_update_transform_out_of_memory_falls_back_to_the_cpu(monkeypatch):
    """orthogonalize="update": Iso-C of the outer update u runs on the merge device; out of
    memory there is retried on the CPU (logged), and the step equals the CPU's."""
    devices = _fake_transform_oom(monkeypatch, torch.OutOfMemoryError("CUDA out of memory."))
    warnings: list[str] = []
    monkeypatch.setattr(device_mod._log, "warning", lambda msg, *a: warnings.append(msg % a))
    s = _update_strategy()
    s.merger.device = torch.device("cuda")  # as if resolved on a GPU server (never used here)
    res = _run(s, rounds=2)
    assert res.train_metrics_clientapp[2]["replies-used"] == 3
    assert devices == ["cuda", "cpu", "cuda", "cpu"], devices  # each round tries the device
    assert sum("out of memory" in w and "on the CPU" in w for w in warnings) == 2, warnings

    reference = _update_strategy()  # the same run on the CPU from the start
    expected = _run(reference, rounds=2).arrays.to_torch_state_dict()
    got = res.arrays.to_torch_state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_update_transform_out_of_memory_on_the_cpu_fails_loudly(monkeypatch):
    from flwr_isoloco.merging.device import MergeOutOfMemoryError

    def fake_merge(*a, **kw):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(round_mod, "merge", fake_merge)
    with pytest.raises(MergeOutOfMemoryError, match="on the CPU"):
        _run(_update_strategy())
