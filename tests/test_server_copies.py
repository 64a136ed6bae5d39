"""The server keeps one record of the model per model state (issue 18, 135M at M = 64): the
record sent, the round's result and what evaluation / the round-end hook see are one object;
the sent-message ledger keeps metadata, not the model; a resume reference holds no data."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, Message, Metadata, MetricRecord, RecordDict

from flwr_isoloco.strategies import DiLoCo

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "simulations" / "isoloco-lm"))
from isoloco_lm.server_app import shape_reference  # noqa: E402


def _train(msg: Message, ctx) -> Message:
    sd = msg.content["arrays"].to_torch_state_dict()
    pid = int(ctx.node_config["partition-id"])
    new = {k: v - 0.01 * (pid + 1) for k, v in sd.items()}
    metrics = MetricRecord({"num-examples": 10 * (pid + 1)})
    return Message(RecordDict({"arrays": ArrayRecord(new), "metrics": metrics}), reply_to=msg)


def _init() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}


def test_one_record_per_model_state_and_the_ledger_keeps_no_model():
    s = DiLoCo(fraction_evaluate=0.0, min_evaluate_nodes=0, outer_lr=0.7, outer_momentum=0.9)
    grid = FakeGrid({"train": _train}, num_nodes=3)
    seen: list[tuple[int, ArrayRecord]] = []
    evaluated: list[ArrayRecord] = []

    def evaluate_fn(rnd, arrays):
        evaluated.append(arrays)
        return MetricRecord({"loss": 1.0})

    result = s.start(
        grid=grid,
        initial_arrays=ArrayRecord(_init()),
        num_rounds=2,
        evaluate_fn=evaluate_fn,
        on_round_end=lambda rnd, arrays, tm, em: seen.append((rnd, arrays)),
    )
    assert result.arrays is s.current_arrays() is seen[-1][1] is evaluated[-1]
    assert seen[0][1] is evaluated[1] and seen[0][1] is not seen[1][1]  # round 1's, round 2's
    want = {k: v.clone() for k, v in s.theta.items()}
    got = result.arrays.to_torch_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)  # the record is the model now
    sent = s.book.train_ledger.sent()
    assert sent and all(isinstance(m, Metadata) for m in sent)
    s.theta = {k: v + 1 for k, v in s.theta.items()}  # a new model: a new record
    fresh = s.current_arrays()
    assert fresh is not result.arrays
    assert torch.equal(fresh.to_torch_state_dict()["w"], want["w"] + 1)


def test_shape_reference_has_shapes_and_dtypes_but_no_data():
    rec = ArrayRecord({"w": torch.zeros(49, 7), "n": torch.arange(3), "h": torch.zeros(2).half()})
    ref = shape_reference(rec)
    assert {k: (tuple(v.shape), v.dtype) for k, v in ref.items()} == {
        "w": ((49, 7), torch.float32),
        "n": ((3,), torch.int64),
        "h": ((2,), torch.float16),
    }
    assert all(v.device.type == "meta" for v in ref.values())
