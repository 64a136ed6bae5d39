"""Compressed downloads across whole rounds: the mods under any config record name, federated
evaluation of the stepped model (and across a resume, a skipped round), a ClientApp without the
mods; upload_mod around a plain handler."""

from __future__ import annotations

import logging

import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from test_download import TRAINED_ON, make_app, run, theta0

from flwr_isoloco.clients import download_mod, upload_mod
from flwr_isoloco.compression import compress, payload_nbytes
from flwr_isoloco.compression.broadcast import BASE_KEY, DIGEST_KEY, apply_update, model_digest
from flwr_isoloco.compression.record import decompress
from flwr_isoloco.strategies import DiLoCo, Divergence, Records


def train_any(msg: Message, context: Context) -> Message:
    """A plain handler that takes the message's one ArrayRecord and one ConfigRecord, whatever
    their names, and pulls each tensor 10 % towards ``partition-id + 1``."""
    (key,) = msg.content.array_records
    sd = msg.content.array_records[key].to_torch_state_dict()
    pid = int(context.node_config["partition-id"])
    new = {k: v + 0.1 * (float(pid + 1) - v) for k, v in sd.items()}
    metrics = MetricRecord({"num-examples": 10})
    return Message(RecordDict({key: ArrayRecord(new), "metrics": metrics}), reply_to=msg)


def app_with(mods) -> ClientApp:
    app = ClientApp(mods=list(mods))
    app.train()(train_any)
    return app


def int8_nbytes() -> int:
    """Bytes of an int8 record of theta0's shapes (the update down, the delta up)."""
    return payload_nbytes(compress({k: torch.zeros_like(v) for k, v in theta0().items()}, "int8"))


def test_mods_read_the_config_the_strategy_named_otherwise():
    """configrecord_key="cfg": download_mod and upload_mod find the ConfigRecord carrying their
    keys, so rounds 2+ send the int8 update down and every round the int8 delta up; per node
    exactly the bytes of an int8 record of the model's shapes (fp32: 8,448 bytes a node)."""
    full = payload_nbytes(ArrayRecord(theta0()))
    assert full == 4 * (32 * 64 + 64)
    s = DiLoCo(
        min_available_nodes=2,
        fraction_evaluate=0.0,
        records=Records(configrecord_key="cfg"),
        download="int8",
        upload="int8",
    )
    grid = FakeGrid(app_with([download_mod, upload_mod]), num_nodes=2)
    res = s.start(grid=grid, initial_arrays=ArrayRecord(theta0()), num_rounds=3)
    m = res.train_metrics_clientapp
    int8 = int8_nbytes()
    assert int8 < full / 3
    assert [m[r]["bytes-down"] for r in (1, 2, 3)] == [2 * full, 2 * int8, 2 * int8]
    assert [m[r]["bytes-up"] for r in (1, 2, 3)] == [2 * int8] * 3
    assert [m[r]["replies-used"] for r in (1, 2, 3)] == [2, 2, 2]


def test_mods_refuse_a_message_with_two_configs_carrying_their_keys():
    """Two ConfigRecords that both carry the mod's key: an error reply saying so, the handler
    never runs (a silent pass-through would train on an update as if it were the model)."""
    ran = []

    def handler(msg: Message, context: Context) -> Message:
        ran.append(msg)
        return train_any(msg, context)

    app = ClientApp(mods=[download_mod, upload_mod])
    app.train()(handler)
    ctx = Context(
        run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={}
    )
    for keys in ({DIGEST_KEY: "a" * 64, BASE_KEY: ""}, {"upload-codec": "int8"}):
        content = {"arrays": ArrayRecord(theta0())}
        content.update({name: ConfigRecord({**keys, "server-round": 1}) for name in ("a", "b")})
        msg = Message(RecordDict(content), dst_node_id=1, message_type="train")
        reply = app(msg, ctx)
        assert reply.has_error() and "ambiguous" in reply.error.reason
    assert not ran


SEEN: dict[tuple[str, int, int], torch.Tensor] = {}  # (train|evaluate, node, round) -> model


def shrink_app(mods) -> ClientApp:
    """Train: w <- 0.95 w; evaluate: the sum of w. Both record the model they got."""
    app = ClientApp(mods=list(mods))

    def seen(kind: str, msg: Message, context: Context) -> torch.Tensor:
        (cfg,) = msg.content.config_records.values()
        w = msg.content["arrays"].to_torch_state_dict()["w"]
        SEEN[(kind, int(context.node_config["partition-id"]), int(cfg["server-round"]))] = w
        return w

    @app.train()
    def _train(msg: Message, context: Context) -> Message:
        w = seen("train", msg, context)
        arrays = ArrayRecord({"w": 0.95 * w})
        metrics = MetricRecord({"num-examples": 1})
        return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)

    @app.evaluate()
    def _evaluate(msg: Message, context: Context) -> Message:
        w = seen("evaluate", msg, context)
        metrics = MetricRecord({"num-examples": 1, "sum": float(w.sum())})
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

    return app


def test_evaluation_after_round_r_measures_the_model_after_its_step():
    """16 x 16 ones, 2 nodes, FedAvg (outer lr 1, no momentum), w <- 0.95 w: the model after
    round r sums to 256 * 0.95^r. Evaluation after round r sees that sum with an int8 download
    (the update of a constant delta is exact) as without a codec (it lagged one round:
    256.0 / 243.2 / 230.4), and each node evaluates in round r the very model it trains from
    in round r + 1."""
    sums = {}
    for download in (None, "int8"):
        SEEN.clear()
        s = DiLoCo(
            min_available_nodes=2,
            outer_lr=1.0,
            outer_momentum=0.0,
            download=download,
        )
        grid = FakeGrid(shrink_app([download_mod]), num_nodes=2)
        initial = ArrayRecord({"w": torch.ones(16, 16)})
        res = s.start(grid=grid, initial_arrays=initial, num_rounds=4)
        sums[download] = [res.evaluate_metrics_clientapp[r]["sum"] for r in (1, 2, 3)]
        for r in (1, 2, 3):
            for node in (0, 1):
                assert torch.equal(SEEN[("evaluate", node, r)], SEEN[("train", node, r + 1)])
    for download, got in sums.items():
        for r, value in zip((1, 2, 3), got, strict=True):
            assert abs(value - 256 * 0.95**r) < 1e-3, (download, r, got)


def test_a_clientapp_without_the_mods_is_named_after_round_1(caplog):
    """IsoLoCo(upload="int4", download="int4") with a plain ClientApp (no mods): its replies
    carry no digest and fp32 weights, so every round costs the fp32 bytes both ways; after
    round 1 one WARNING per direction names the missing mod and how to add it (once per run).
    With the mods: none, and fewer bytes."""
    from flwr_isoloco.strategies import IsoLoCo

    full = payload_nbytes(ArrayRecord(theta0()))
    for mods in ((), (download_mod, upload_mod)):
        caplog.clear()
        s = IsoLoCo(min_available_nodes=2, fraction_evaluate=0.0, upload="int4", download="int4")
        grid = FakeGrid(app_with(mods), num_nodes=2)
        with caplog.at_level(logging.WARNING, logger="flwr"):
            res = s.start(grid=grid, initial_arrays=ArrayRecord(theta0()), num_rounds=3)
        m = res.train_metrics_clientapp
        assert all(m[r]["replies-used"] == 2 for r in (1, 2, 3))
        said = [r.getMessage() for r in caplog.records if "mods=[download_mod" in r.getMessage()]
        if mods:
            assert said == [] and m[3]["bytes-down"] < full and m[3]["bytes-up"] < full
            continue
        assert [m[r]["bytes-down"] for r in (1, 2, 3)] == [2 * full] * 3
        assert [m[r]["bytes-up"] for r in (1, 2, 3)] == [2 * full] * 3
        assert len(said) == 2, said
        down, up = sorted(said)  # "download=..." sorts before "upload=..."
        assert down.startswith("download='int4'") and "round 1" in down and "download_mod" in down
        assert up.startswith("upload='int4'") and "round 1" in up and "upload_mod" in up


def test_resume_after_an_evaluated_round_continues_bitwise(tmp_path):
    """A checkpoint taken after round 2 (trained, then evaluated) holds the B the nodes evaluated
    and train from in round 3: the resumed strategy does not advance it again (int8's residual
    would move it), so it ends bitwise where the uninterrupted run does, evaluations included."""
    from flwr_isoloco.checkpoint import load_checkpoint, save_checkpoint

    def strategy() -> DiLoCo:
        return DiLoCo(min_available_nodes=2, download="int8")

    whole = strategy()
    res_whole = whole.start(
        grid=FakeGrid(make_app(), num_nodes=2), initial_arrays=ArrayRecord(theta0()), num_rounds=4
    )
    first, grid = strategy(), FakeGrid(make_app(), num_nodes=2)
    first.start(grid=grid, initial_arrays=ArrayRecord(theta0()), num_rounds=2)
    sd = first.state_dict()
    save_checkpoint(tmp_path / "ck", sd["tensors"], sd["meta"])
    tensors, meta = load_checkpoint(tmp_path / "ck")
    resumed = strategy()
    resumed.load_state_dict({"tensors": tensors, "meta": meta})
    res = resumed.start(grid=grid, initial_arrays=ArrayRecord(theta0()), num_rounds=4)
    for r in (3, 4):
        assert (
            res.evaluate_metrics_clientapp[r]["loss"]
            == res_whole.evaluate_metrics_clientapp[r]["loss"]
        )
    a, b = res.arrays.to_torch_state_dict(), res_whole.arrays.to_torch_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.broadcast.digest == whole.broadcast.digest
    from flwr_isoloco.checkpoint.spec import CheckpointError

    forged = {**meta, "broadcast": {**meta["broadcast"], "current": "yes"}}
    with pytest.raises(CheckpointError, match="broadcast.current' must be a bool"):
        strategy().load_state_dict({"tensors": tensors, "meta": forged})


def test_a_skipped_round_sends_b_towards_the_restored_model():
    """Round 2 diverges (evaluate_fn) and is skipped: theta goes back to round 1's, after B was
    advanced towards the diverged model for round 2's evaluation. Round 3's nodes train from
    B_2 + decode(int8(theta_1 - B_2)), computed here from the codec, not from the diverged B_2."""
    seen: dict[str, dict[str, torch.Tensor]] = {}
    bases: list[tuple[int, dict[str, torch.Tensor]]] = []  # (rounds aggregated, B) per advance

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        if server_round == 2 and "diverged" not in seen:
            seen["diverged"] = arrays.to_torch_state_dict()
            return MetricRecord({"loss": float("inf")})
        if server_round == 2:
            seen["restored"] = arrays.to_torch_state_dict()  # the guard evaluates it again
        return MetricRecord({"loss": 1.0})

    s = DiLoCo(min_available_nodes=2, download="int8", divergence=Divergence("skip"))
    advance = s.broadcast.advance

    def recording(theta, dtypes):
        advance(theta, dtypes)
        bases.append((s.server_round, {k: v.clone() for k, v in s.broadcast.base.items()}))

    s.broadcast.advance = recording
    TRAINED_ON.clear()
    grid = FakeGrid(make_app(), num_nodes=2)
    s.start(grid=grid, initial_arrays=ArrayRecord(theta0()), num_rounds=3, evaluate_fn=evaluate_fn)
    assert [r for r, _ in bases] == [0, 1, 2, 2, 3]  # B0, evaluations 1, 2, after the skip, 3
    b2, theta1 = bases[2][1], seen["restored"]
    gap = {k: theta1[k].float() - b2[k].float() for k in b2}
    expected = apply_update(b2, decompress(compress(gap, "int8")))
    assert model_digest(expected) != model_digest(b2)
    assert TRAINED_ON[(0, 3)] == TRAINED_ON[(1, 3)] == model_digest(expected)


def test_upload_mod_compresses_a_plain_handlers_reply_with_error_feedback():
    """[download_mod, upload_mod] around the unchanged FedAvg-style handler: the reply is the
    int8 delta theta - theta_i, decoded within half an int8 step of the true delta, its residual
    kept in context.state; upload bytes 3.3x below fp32 (2,112 entries: the header weighs); the
    model moves as with uncompressed replies, to int8 accuracy."""
    from flwr_isoloco.clients import upload_mod
    from flwr_isoloco.clients.worker_reply import RESIDUAL_STATE_KEY
    from flwr_isoloco.compression.record import decompress

    app = make_app([download_mod, upload_mod])  # the very same handlers
    s, res, grid = run("int8", rounds=3, upload="int8", grid=FakeGrid(app, num_nodes=2))
    _, ref, _ = run("int8", rounds=3)
    up = [m["bytes-up"] for m in res.train_metrics_clientapp.values()]
    up_ref = [m["bytes-up"] for m in ref.train_metrics_clientapp.values()]
    assert all(u < r / 3 for u, r in zip(up, up_ref, strict=True))  # 5,110 vs 16,896 B
    assert all(m["replies-used"] == 2 for m in res.train_metrics_clientapp.values())
    for ctx in grid.contexts.values():
        assert RESIDUAL_STATE_KEY in ctx.state.array_records
    a, b = res.arrays.to_torch_state_dict(), ref.arrays.to_torch_state_dict()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 0.05
    # one reply by hand: the delta decodes to within half an int8 step of theta - theta_i
    msg = Message(
        RecordDict(
            {
                "arrays": ArrayRecord(theta0()),
                "config": ConfigRecord({"upload-codec": "int8", "server-round": 1}),
            }
        ),
        dst_node_id=1,
        message_type="train",
    )
    ctx = Context(
        run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={}
    )
    reply = app(msg, ctx)
    got = decompress(reply.content["arrays"])
    for k, v in theta0().items():
        true = v - (v + 0.1 * (1.0 - v))
        step = float(true.abs().max()) / 127
        assert float((got[k] - true).abs().max()) <= step / 2 + 1e-6


def test_upload_mod_passes_through_what_it_need_not_touch():
    """No codec asked: the reply is the handler's own (full weights, no residual); a bad codec
    option is refused with an error reply naming it, the handler never runs."""
    from flwr_isoloco.clients import upload_mod

    app = make_app([upload_mod])
    base = {"arrays": ArrayRecord(theta0())}
    ctx = Context(
        run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={}
    )
    msg = Message(
        RecordDict({**base, "config": ConfigRecord({"server-round": 1})}),
        dst_node_id=1,
        message_type="train",
    )
    reply = app(msg, ctx)
    assert not reply.has_error() and "config" not in reply.content.config_records
    assert len(ctx.state.array_records) == 0
    TRAINED_ON.clear()
    bad = ConfigRecord({"upload-codec": "int8", "codec-block-size": -3, "server-round": 1})
    msg = Message(RecordDict({**base, "config": bad}), dst_node_id=1, message_type="train")
    reply = app(msg, ctx)
    assert reply.has_error() and "upload_mod refused" in reply.error.reason
    assert not TRAINED_ON
