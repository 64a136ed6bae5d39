"""download="exact": the nodes take the server's step from the round's sparse uploads, so the
model they hold is the server's bit for bit; the step against an independent computation; the
record checked as hostile input; the settings that cannot give such a step refused."""

from __future__ import annotations

import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flwr_isoloco.clients import download_mod, upload_mod
from flwr_isoloco.compression import compress, decompress, payload_nbytes
from flwr_isoloco.compression.broadcast import model_digest
from flwr_isoloco.compression.step import build_step, decode_step
from flwr_isoloco.merging import merge
from flwr_isoloco.strategies import Codec, DiLoCo, IsoLoCo

SL = {"chunk": 256, "k": 8, "bits": 2}  # 16 x 16 tiles of the 64 x 64 matrix, 8 kept each
SHAPES = {"w": (64, 64), "b": (64,)}


def theta0() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(*s, generator=g) for k, s in SHAPES.items()}


def train_random(msg: Message, context: Context) -> Message:
    """A plain handler: a node- and round-seeded random step (the uploads differ in support)."""
    (key,) = msg.content.array_records
    sd = msg.content.array_records[key].to_torch_state_dict()
    pid = int(context.node_config["partition-id"])
    g = torch.Generator().manual_seed(1000 * pid + len(context.state.config_records))
    new = {k: v + 0.01 * (pid + 1) * torch.randn(v.shape, generator=g) for k, v in sd.items()}
    reply = RecordDict({key: ArrayRecord(new), "metrics": MetricRecord({"num-examples": 10})})
    return Message(reply, reply_to=msg)


def evaluate_any(msg: Message, context: Context) -> Message:
    return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)


def exact_strategy(**kw) -> DiLoCo:
    args = dict(
        min_available_nodes=4,
        fraction_evaluate=0.0,
        merge="sparseloco",
        outer_lr=1.0,
        outer_momentum=0.0,
        nesterov=False,
        upload=Codec("sparseloco", **SL),
        download="exact",
    )
    return DiLoCo(**{**args, **kw})


@pytest.mark.parametrize(
    "rule,upload",
    [("sparseloco", Codec("sparseloco", **SL)), ("mean", Codec("topk", fraction=0.03))],
)
def test_nodes_hold_the_servers_model_bitwise_and_download_less_than_the_model(rule, upload):
    app = ClientApp(mods=[download_mod, upload_mod])
    app.train()(train_random)
    app.evaluate()(evaluate_any)  # after each step: B advances, the nodes apply it
    grid = FakeGrid(app, num_nodes=4)
    s = exact_strategy(fraction_evaluate=1.0, merge=rule, upload=upload)
    res = s.start(grid=grid, initial_arrays=ArrayRecord(theta0()), num_rounds=4)
    m = res.train_metrics_clientapp
    final = res.arrays.to_torch_state_dict()
    # B (what every node holds after applying the records, each checked against the digest
    # by download_mod: a mismatch is an error reply) is the server's model, bit for bit
    assert model_digest(s.broadcast.base) == model_digest(final)
    assert all(torch.equal(s.broadcast.base[k], final[k]) for k in final)
    assert [m[r]["replies-used"] for r in range(1, 5)] == [4] * 4
    full = payload_nbytes(ArrayRecord(theta0()))
    assert m[1]["bytes-down"] == 4 * full
    # the evaluation after each step carries the step record; the next training needs nothing
    assert [m[r]["bytes-down"] for r in (2, 3, 4)] == [0, 0, 0]
    e = res.evaluate_metrics_clientapp
    step_bytes = [e[r]["bytes-down"] / 4 for r in (1, 2, 3, 4)]
    assert all(0 < b < full / 2 for b in step_bytes), (step_bytes, full)
    assert final["w"].ne(theta0()["w"]).any()


def _uploads(m: int, seed: int) -> list[ArrayRecord]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(m):
        d = {k: torch.randn(*s, generator=g) * (1 + i) for k, s in SHAPES.items()}
        out.append(compress(d, "sparseloco", **SL))
    return out


@pytest.mark.parametrize("rule", ["sparseloco", "mean"])
def test_step_is_minus_lr_times_the_merge_of_the_decoded_uploads(rule):
    ups = _uploads(5, seed=1)
    weights = [0.1, 0.3, 0.2, 0.25, 0.15]
    per_entry = ["w"] if rule == "sparseloco" else []
    d = decode_step(build_step(ups, weights, per_entry, -0.7, SHAPES), SHAPES)
    want = merge(rule, [decompress(u) for u in ups], weights, device="cpu")
    for k in SHAPES:
        torch.testing.assert_close(d[k], -0.7 * want[k], rtol=1e-5, atol=1e-6)
    assert (d["w"] != 0).float().mean() < 0.2  # sparse: 5 peers x 8 of 256 per tile at most


def test_a_tampered_record_is_refused_naming_the_part():
    ups = _uploads(3, seed=2)
    rec = build_step(ups, [1 / 3] * 3, ["w"], -1.0, SHAPES)
    bad = ArrayRecord(
        {**dict(rec.items()), "a:w": Array(torch.tensor([1.0, float("nan"), 1.0]).numpy())}
    )
    with pytest.raises(ValueError, match="a:w"):
        decode_step(bad, SHAPES)
    extra = ArrayRecord({**dict(rec.items()), "p7:w/i": rec["p0:w/i"]})
    with pytest.raises(ValueError, match="p7"):
        decode_step(extra, SHAPES)
    with pytest.raises(ValueError, match="missing|differ"):
        decode_step(rec, {**SHAPES, "c": (3,)})


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(outer_momentum=0.9, nesterov=True), "outer_momentum"),
        (dict(merge="iso_c"), "dense"),
        (dict(upload=None), "upload codec"),
        (dict(upload="int8"), "dense"),
    ],
)
def test_settings_that_cannot_give_an_exact_step_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        exact_strategy(**kw)


def test_exact_is_a_download_mode_and_isoloco_is_told_to_recompress():
    with pytest.raises(ValueError, match="download mode"):
        exact_strategy(upload=Codec("exact"), download=None)
    with pytest.raises(ValueError, match="dense"):
        IsoLoCo(upload=Codec("sparseloco"), download="exact")


def test_a_step_larger_than_the_model_sends_the_model():
    """sparseloco keeping every entry (k = chunk): each upload is ~10/32 of the model, 4 of
    them more than the model, so every node gets the full model (and still trains)."""
    app = ClientApp(mods=[download_mod, upload_mod])
    app.train()(train_random)
    s = exact_strategy(upload=Codec("sparseloco", chunk=256, k=256, bits=2))
    grid = FakeGrid(app, num_nodes=4)
    res = s.start(grid=grid, initial_arrays=ArrayRecord(theta0()), num_rounds=3)
    m = res.train_metrics_clientapp
    full = payload_nbytes(ArrayRecord(theta0()))
    assert [m[r]["bytes-down"] for r in (1, 2, 3)] == [4 * full] * 3
    assert [m[r]["replies-used"] for r in (1, 2, 3)] == [4] * 3


def test_a_quorum_round_with_a_late_node_keeps_the_nodes_on_the_servers_model():
    """Rounds(quorum=3, grace_s=0) with node 3 answering one pull late: each round's step is
    the record of the 3 replies in time, and every node (the late one too, which misses some
    versions and then gets a chain or the model) still trains from the server's model: each
    train message rebuilds the announced digest (or download_mod refuses, an error reply)."""
    from flwr_isoloco.strategies import Rounds

    app = ClientApp(mods=[download_mod, upload_mod])
    app.train()(train_random)
    app.evaluate()(evaluate_any)
    grid = FakeGrid(app, num_nodes=4)
    grid.set_delay(3, pulls=1, times=10**6)
    s = exact_strategy(fraction_evaluate=1.0, rounds=Rounds(quorum=3, grace_s=0.0))
    res = s.start(grid=grid, initial_arrays=ArrayRecord(theta0()), num_rounds=4)
    m = res.train_metrics_clientapp
    final = res.arrays.to_torch_state_dict()
    assert all(torch.equal(s.broadcast.base[k], final[k]) for k in final)
    assert [m[r]["replies-used"] for r in range(1, 5)] == [3] * 4
    assert all(m[r]["replies-rejected"] == 0 for r in range(1, 5))
