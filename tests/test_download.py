"""Compressed downloads (``download=``, compression/broadcast.py, clients/download.py): an
unchanged FedAvg-style ClientApp behind ``download_mod``, in-process via FakeGrid."""

from __future__ import annotations

import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from outer_reference import assert_close, sync_rounds

from flwr_isoloco.clients import download_mod, make_download_mod
from flwr_isoloco.clients.download import STATE_ARRAYS, STATE_CONFIG
from flwr_isoloco.compression import payload_nbytes
from flwr_isoloco.compression.broadcast import BASE_KEY, DIGEST_KEY, model_digest, reply_digest
from flwr_isoloco.strategies import Codec, DiLoCo

TRAINED_ON: dict[tuple[int, int], str] = {}  # (node, round) -> digest of the arrays it got


def theta0() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(32, 64, generator=g), "b": torch.randn(64, generator=g)}


def train_fn(msg: Message, context: Context) -> Message:
    """A plain FedAvg-style handler: pull each tensor 10 % towards a node-specific target."""
    sd = msg.content["arrays"].to_torch_state_dict()
    pid = int(context.node_config["partition-id"])
    rnd = int(msg.content["config"]["server-round"])
    TRAINED_ON[(pid, rnd)] = model_digest(sd)
    new = {k: v + 0.1 * (float(pid + 1) - v) for k, v in sd.items()}
    return Message(
        RecordDict({"arrays": ArrayRecord(new), "metrics": MetricRecord({"num-examples": 10})}),
        reply_to=msg,
    )


def evaluate_fn(msg: Message, context: Context) -> Message:
    sd = msg.content["arrays"].to_torch_state_dict()
    loss = float(sum(v.float().pow(2).mean() for v in sd.values()))
    metrics = MetricRecord({"num-examples": 10, "loss": loss})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)


def make_app(mods=(download_mod,)) -> ClientApp:
    """The plain handlers behind ``mods``."""
    app = ClientApp(mods=list(mods))
    app.train()(train_fn)
    app.evaluate()(evaluate_fn)
    return app


def run(download=None, rounds=3, nodes=2, fraction=1.0, grid=None, **kw):
    TRAINED_ON.clear()
    grid = grid or FakeGrid(make_app(), num_nodes=nodes)
    s = DiLoCo(
        min_available_nodes=nodes,
        min_train_nodes=1,
        min_evaluate_nodes=1,
        fraction_train=fraction,
        fraction_evaluate=0.0,
        download=download,
        **kw,
    )
    res = s.start(grid=grid, initial_arrays=ArrayRecord(theta0()), num_rounds=rounds)
    return s, res, grid


def half_of_four(download) -> DiLoCo:
    """DiLoCo sampling half of 4 nodes per round, with ``download``."""
    return DiLoCo(
        min_available_nodes=4,
        min_train_nodes=1,
        fraction_train=0.5,
        fraction_evaluate=0.0,
        download=download,
    )


def record_digests(s: DiLoCo, digests: dict[int, str]) -> None:
    """Keep the digest of each round's B in ``digests`` (round -> digest)."""
    orig = s.broadcast.advance

    def advance(theta, dtypes):
        orig(theta, dtypes)
        digests[s.server_round + 1] = s.broadcast.digest

    s.broadcast.advance = advance


def test_int8_download_sends_fewer_bytes_and_nodes_train_from_b():
    _, fp32, _ = run(None)
    s, res, _ = run("int8")
    down = [res.train_metrics_clientapp[r]["bytes-down"] for r in (1, 2, 3)]
    full = [fp32.train_metrics_clientapp[r]["bytes-down"] for r in (1, 2, 3)]
    assert down[0] == full[0]  # round 1: every node is new, it gets the full B
    assert sum(down) < sum(full) and down[2] < full[2] / 2
    for r in (1, 2, 3):
        assert res.train_metrics_clientapp[r]["replies-used"] == 2
    assert s.broadcast.digest == model_digest(s.broadcast.base)
    final = res.arrays.to_torch_state_dict()  # close to the fp32 run's (the codec's error)
    ref = fp32.arrays.to_torch_state_dict()
    assert max(float((final[k] - ref[k]).abs().max()) for k in ref) < 0.05


@pytest.mark.parametrize("download", [None, "none"])
def test_default_none_is_unchanged(download):
    """No download codec: every round sends both nodes the fp32 model, 2 x 4 x (32 x 64 + 64)
    bytes (hand-computed from the shapes), and the run is plain DiLoCo: its model is
    :func:`outer_reference.sync_rounds` (fp64) of train_fn's step (10 % towards pid + 1, equal
    weights) with DiLoCo's default Nesterov, lr 0.7, mu 0.9, over 3 rounds."""
    s, res, _ = run(download)
    assert s.broadcast is None
    for rnd in (1, 2, 3):
        assert res.train_metrics_clientapp[rnd]["bytes-down"] == 2 * 4 * (32 * 64 + 64)

    def local(theta, pid, _rnd):
        return {k: v + 0.1 * (float(pid + 1) - v) for k, v in theta.items()}

    want = sync_rounds(theta0(), local, 3, [10, 10], lr=0.7, momentum=0.9, nesterov=True)
    assert_close(res.arrays.to_torch_state_dict(), want)


def test_nodes_that_skip_rounds_train_from_the_broadcast_model():
    """fraction_train 0.5 of 4 nodes: a node sampled after skipping rounds gets the full B;
    every node trained on exactly the server's B of that round."""
    digests = {}
    s = half_of_four("int8")
    record_digests(s, digests)
    TRAINED_ON.clear()
    grid = FakeGrid(make_app(), num_nodes=4)
    s.start(grid=grid, initial_arrays=ArrayRecord(theta0()), num_rounds=5)
    assert len(TRAINED_ON) == 10
    for (_, rnd), d in TRAINED_ON.items():
        assert d == digests[rnd]
    assert len({pid for pid, _ in TRAINED_ON}) >= 3  # some nodes skipped rounds and came back


def test_deleted_state_gets_the_full_model():
    s, _, grid = run("int8", rounds=2)
    for ctx in grid.contexts.values():  # every node loses its stored copy
        del ctx.state[STATE_ARRAYS]
        del ctx.state[STATE_CONFIG]
    s.broadcast.held.clear()  # as a restarted node's missing reply digest would
    TRAINED_ON.clear()
    res = s.start(grid=grid, initial_arrays=ArrayRecord(theta0()), num_rounds=s.server_round + 1)
    (m,) = res.train_metrics_clientapp.values()  # round 3 (the count continues)
    assert m["replies-used"] == 2 and m["bytes-down"] == 2 * payload_nbytes(ArrayRecord(theta0()))
    assert set(TRAINED_ON.values()) == {s.broadcast.digest}


def test_node_refuses_an_update_for_a_base_it_does_not_hold():
    s, _, grid = run("int8", rounds=2)
    ctx = next(iter(grid.contexts.values()))
    ctx.state[STATE_CONFIG] = ConfigRecord({"held": "0" * 64})  # a copy of another version
    TRAINED_ON.clear()
    res = s.start(grid=grid, initial_arrays=ArrayRecord(theta0()), num_rounds=s.server_round + 1)
    (m,) = res.train_metrics_clientapp.values()
    assert (m["replies-used"], m["replies-rejected"]) == (1, 1)
    assert len(TRAINED_ON) == 1  # the refusing node never ran its handler
    # next round it reported nothing: it gets the full B and trains again
    TRAINED_ON.clear()
    res = s.start(grid=grid, initial_arrays=ArrayRecord(theta0()), num_rounds=s.server_round + 1)
    (m,) = res.train_metrics_clientapp.values()
    assert m["replies-used"] == 2


def test_mod_refuses_directly():
    app = make_app()
    ctx = Context(
        run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={}
    )
    cfg = ConfigRecord({DIGEST_KEY: "a" * 64, BASE_KEY: "b" * 64, "server-round": 1})
    msg = Message(
        RecordDict({"arrays": ArrayRecord(theta0()), "config": cfg}),
        dst_node_id=1,
        message_type="train",
    )
    reply = app(msg, ctx)
    assert reply.has_error() and "refused" in reply.error.reason


def test_evaluation_uses_the_same_path():
    """Evaluation after training: nodes holding B get an empty record and evaluate B; the
    reported loss is B's."""
    s, res, grid = run("int8", rounds=2, nodes=2)
    assert res.evaluate_metrics_clientapp == {}  # fraction_evaluate 0 in run(); now evaluate
    s.fraction_evaluate, s.min_evaluate_nodes = 1.0, 2
    msgs = list(s.configure_evaluate(2, ArrayRecord(), ConfigRecord({}), grid))
    assert all(len(m.content["arrays"]) == 0 for m in msgs)  # both hold the current B
    replies = grid.send_and_receive(msgs)
    agg = s.aggregate_evaluate(2, replies)
    b = s.broadcast.base
    assert agg["loss"] == pytest.approx(float(sum(v.float().pow(2).mean() for v in b.values())))


def test_resume_keeps_b_and_residual_bitwise(tmp_path):
    """A checkpoint holds B and the residual; a resumed run ends bitwise where the
    uninterrupted one does; a tampered B is refused."""
    from flwr_isoloco.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    whole, res_whole, _ = run("int8", rounds=4)
    s, _, grid = run("int8", rounds=2)
    sd = s.state_dict()
    save_checkpoint(tmp_path / "ck", sd["tensors"], sd["meta"])
    tensors, meta = load_checkpoint(tmp_path / "ck")
    fresh = DiLoCo(
        min_available_nodes=2,
        min_train_nodes=1,
        min_evaluate_nodes=1,
        fraction_evaluate=0.0,
        download="int8",
    )
    fresh.load_state_dict({"tensors": tensors, "meta": meta})
    for k, v in s.broadcast.base.items():
        assert torch.equal(v, fresh.broadcast.base[k])
    res = fresh.start(grid=grid, initial_arrays=ArrayRecord(theta0()), num_rounds=4)
    for k, v in res_whole.arrays.to_torch_state_dict().items():
        assert torch.equal(v, res.arrays.to_torch_state_dict()[k])
    assert fresh.broadcast.digest == whole.broadcast.digest
    bad = {**tensors, "broadcast": {**tensors["broadcast"]}}
    bad["broadcast"]["base"] = {k: v + 1 for k, v in tensors["broadcast"]["base"].items()}
    with pytest.raises(CheckpointError, match="digest"):
        fresh.load_state_dict({"tensors": bad, "meta": meta})


def test_diloco_worker_and_isoloco_run_config_through_the_mod():
    """The DiLoCo worker behind download_mod (its delta taken against B), IsoLoCo built from
    strategy.download-codec; SecAgg+ with a download codec is refused."""
    from test_compression_strategy import theta0 as lm_theta0
    from test_compression_strategy import worker

    from flwr_isoloco.strategies import IsoLoCo
    from flwr_isoloco.strategies.diloco.secagg import use_secagg

    handler = worker()
    grid = FakeGrid({"train": lambda m, c: download_mod(m, c, handler)}, num_nodes=2)
    s = IsoLoCo.from_run_config(
        {
            "strategy.download-codec": "int8",
            "strategy.codec-block-size": 64,
            "strategy.fraction-evaluate": 0.0,
        }
    )
    assert s.download.name == "int8" and s.download.options["block_size"] == 64
    res = s.start(grid=grid, initial_arrays=ArrayRecord(lm_theta0()), num_rounds=3)
    full = payload_nbytes(ArrayRecord(lm_theta0()))
    for r in (1, 2, 3):
        assert res.train_metrics_clientapp[r]["replies-used"] == 2
    assert res.train_metrics_clientapp[3]["bytes-down"] < full  # 2 updates < 1 full model
    for ctx in grid.contexts.values():
        held = ctx.state[STATE_ARRAYS].to_torch_state_dict()
        assert model_digest(held) == s.broadcast.digest
    assert DiLoCo.from_run_config({}).download is None
    with pytest.raises(ValueError, match="strategy.download-codec"):
        DiLoCo.from_run_config({"strategy.download-codec": "gzip"})
    with pytest.raises(ValueError, match="download codec"):
        use_secagg(DiLoCo(download="int8"))


def test_node_state_files_keep_b_between_rounds(tmp_path):
    """with_node_state offloads context.state (B among it) to files between rounds: the mod
    reads it back first, so no round is refused and B is in the node's file after each round."""
    from flwr_isoloco.clients.node_state import HANDLE_KEY, with_node_state

    handler = with_node_state(
        _train,
        default_dir=tmp_path,
    )
    grid = FakeGrid({"train": lambda m, c: download_mod(m, c, handler)}, num_nodes=2)
    s, res, _ = run("int8", rounds=4, grid=grid)
    for r in (1, 2, 3, 4):
        m = res.train_metrics_clientapp[r]
        assert (m["replies-used"], m["replies-rejected"]) == (2, 0)
    assert res.train_metrics_clientapp[4]["bytes-down"] < payload_nbytes(ArrayRecord(theta0()))
    for ctx in grid.contexts.values():
        assert HANDLE_KEY in ctx.state and STATE_ARRAYS not in ctx.state  # offloaded
    assert set(TRAINED_ON.values()) >= {s.broadcast.digest}


def _train(msg: Message, context: Context) -> Message:
    """make_app's train handler as a plain function (for wrappers)."""
    sd = msg.content["arrays"].to_torch_state_dict()
    pid = int(context.node_config["partition-id"])
    TRAINED_ON[(pid, int(msg.content["config"]["server-round"]))] = model_digest(sd)
    new = {k: v + 0.1 * (float(pid + 1) - v) for k, v in sd.items()}
    metrics = MetricRecord({"num-examples": 10})
    return Message(RecordDict({"arrays": ArrayRecord(new), "metrics": metrics}), reply_to=msg)


def test_none_sends_one_shared_record_and_deltas_against_theta():
    """download None: one RecordDict for every node, no download keys, deltas against theta."""
    s = DiLoCo(min_available_nodes=2, fraction_evaluate=0.0)
    grid = FakeGrid(make_app(), num_nodes=2)
    s.prepare(grid, ArrayRecord(theta0()), 5.0)
    msgs = list(s.configure_train(1, ArrayRecord(theta0()), ConfigRecord({}), grid))
    assert msgs[0].content is msgs[1].content and DIGEST_KEY not in msgs[0].content["config"]
    assert s.train_base is s.theta and s.broadcast is None


def test_hostile_digests_and_corrupt_copies():
    """A reply's 'held' that is not a 64-char string counts as none (full B next time); a
    stored copy changed behind its digest, or an update that does not decode, is refused."""
    s, _, grid = run("int8", rounds=2)
    nodes = list(grid.contexts)
    for held in (123, "x" * 10, ["a"]):
        reply = Message(RecordDict({"download": ConfigRecord({"held": held})}), reply_to=_sent())
        assert reply_digest(reply) is None
    ctx = grid.contexts[nodes[0]]
    stored = ctx.state[STATE_ARRAYS].to_torch_state_dict()
    ctx.state[STATE_ARRAYS] = ArrayRecord({k: v + 1 for k, v in stored.items()})
    TRAINED_ON.clear()
    res = s.start(grid=grid, initial_arrays=ArrayRecord(theta0()), num_rounds=s.server_round + 1)
    (m,) = res.train_metrics_clientapp.values()
    assert (m["replies-used"], m["replies-rejected"]) == (1, 1) and len(TRAINED_ON) == 1
    held = grid.contexts[nodes[1]].state[STATE_CONFIG]["held"]
    cfg = ConfigRecord({DIGEST_KEY: "c" * 64, BASE_KEY: held, "server-round": 9})
    junk = ArrayRecord({"w": torch.zeros(3)})  # no codec header: does not decode
    msg = Message(RecordDict({"arrays": junk, "config": cfg}), dst_node_id=1, message_type="train")
    reply = make_app()(msg, grid.contexts[nodes[1]])
    assert reply.has_error() and "does not decode" in reply.error.reason


def _sent() -> Message:
    cfg = ConfigRecord({"server-round": 1})
    return Message(RecordDict({"config": cfg}), dst_node_id=1, message_type="train")


@pytest.mark.parametrize("codec", ["sparseloco", "int8"])
def test_broadcast_gap_is_the_residual_and_closes_on_a_still_model(codec):
    """theta held still: each round sends Q(theta - B) and B moves by exactly its decode, so the
    gap theta - B is what was not sent and shrinks every round (with a separate residual added on
    top it was counted twice and grew: 0.94 -> 3.05 -> 105.9 of ||theta|| at rounds 1, 10, 40)."""
    from flwr_isoloco.compression.broadcast import Broadcast
    from flwr_isoloco.compression.record import decompress

    g = torch.Generator().manual_seed(0)
    theta = {"w": torch.randn(256, 256, generator=g)}
    b = Broadcast(codec, {"ef_decay": 0.95} if codec == "sparseloco" else {})
    b.advance({"w": torch.zeros(256, 256)}, {"w": torch.float32})  # nodes start from zeros
    gaps = []
    for _ in range(40):
        before = b.base["w"].clone()
        b.advance(theta, {"w": torch.float32})
        sent = decompress(b.update)["w"]
        assert torch.equal(b.base["w"], before + sent)
        gaps.append(float((theta["w"] - b.base["w"]).norm() / theta["w"].norm()))
    assert all(later <= earlier + 1e-6 for earlier, later in zip(gaps, gaps[1:], strict=False))
    assert gaps[-1] < (0.3 if codec == "sparseloco" else 1e-3)


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


def test_nodes_that_build_the_initial_model_get_no_arrays_in_round_1():
    """Codec(nodes_hold_initial=True) + make_download_mod(initial=theta0): round 1 sends no
    arrays (only digests) and rounds 2+ the same updates as without it; every node trained on
    the server's B of its round; 4 nodes at fraction 0.5, so nodes first sampled in a later
    round build theta0 then apply that round's update against it."""
    codec = Codec("int8", nodes_hold_initial=True)
    digests = {}
    s = half_of_four(codec)
    record_digests(s, digests)
    TRAINED_ON.clear()
    grid = FakeGrid(make_app([make_download_mod(initial=lambda ctx: theta0())]), num_nodes=4)
    res = s.start(grid=grid, initial_arrays=ArrayRecord(theta0()), num_rounds=4)
    assert len(TRAINED_ON) == 8 and all(d == digests[rnd] for (_, rnd), d in TRAINED_ON.items())
    _, ref, _ = run("int8", rounds=4, nodes=4, fraction=0.5)  # the same run without it
    down = [res.train_metrics_clientapp[r]["bytes-down"] for r in (1, 2, 3, 4)]
    ref_down = [ref.train_metrics_clientapp[r]["bytes-down"] for r in (1, 2, 3, 4)]
    assert down[0] == 0 and ref_down[0] == 2 * payload_nbytes(ArrayRecord(theta0()))
    assert all(d <= r for d, r in zip(down, ref_down, strict=True)) and sum(down) < sum(ref_down)
    assert all(res.train_metrics_clientapp[r]["replies-used"] == 2 for r in (1, 2, 3, 4))
    a, b = res.arrays.to_torch_state_dict(), ref.arrays.to_torch_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same training, fewer bytes


def test_a_node_whose_own_initial_model_differs_refuses_then_gets_the_full_model():
    """One node builds another initial model: it refuses round 1 (named, nothing trained on
    it) and gets the full B in round 2; a plain download_mod refuses the same way."""

    def initial(ctx):
        t = theta0()
        if int(ctx.node_config["partition-id"]) == 1:
            t["b"] = t["b"] + 1.0
        return t

    for mod in (make_download_mod(initial=initial), download_mod):
        TRAINED_ON.clear()
        s = DiLoCo(
            min_available_nodes=2,
            min_train_nodes=1,
            fraction_evaluate=0.0,
            download=Codec("int8", nodes_hold_initial=True),
        )
        grid = FakeGrid(make_app([mod]), num_nodes=2)
        res = s.start(grid=grid, initial_arrays=ArrayRecord(theta0()), num_rounds=2)
        r1, r2 = res.train_metrics_clientapp[1], res.train_metrics_clientapp[2]
        used = 1 if mod is not download_mod else 0
        assert (r1["replies-used"], r1["replies-rejected"]) == (used, 2 - used)
        assert r2["replies-used"] == 2 and r2["bytes-down"] >= payload_nbytes(ArrayRecord(theta0()))
        assert (1, 1) not in TRAINED_ON and (1, 2) in TRAINED_ON


def test_nodes_hold_initial_is_for_downloads_only():
    with pytest.raises(ValueError, match="downloads only"):
        DiLoCo(upload=Codec("int8", nodes_hold_initial=True))
    with pytest.raises(ValueError, match="nodes_hold_initial must be a bool"):
        Codec("int8", nodes_hold_initial="yes")


def test_lm_app_nodes_build_round_0_themselves(tmp_path):
    """The LM app in process with int8 downloads: with strategy.download-nodes-hold-initial
    round 1 sends no arrays down (each node builds the initial model from the run config and
    its digest matches the server's), and the run is the same run as without the key."""
    import json

    from isoloco_lm import client_app, server_app
    from lm_app import tiny_config, write_corpus

    (tmp_path / "corpus").mkdir()
    corpus = write_corpus(tmp_path / "corpus")
    base = tiny_config(corpus, tmp_path / "cache", num_server_rounds=2)
    base["strategy.download-codec"] = "int8"
    rows = {}
    for hold in (True, False):
        rc = {**base, "output-dir": str(tmp_path / f"out-{hold}")}
        rc["strategy.download-nodes-hold-initial"] = hold
        grid = FakeGrid(client_app.app, num_nodes=3, run_config=rc)
        out = server_app.run_server(grid, rc, settle_s=0.0)
        rows[hold] = json.loads((out / "results.json").read_text())["rounds"]
    assert [r["replies-used"] for r in rows[True]] == [3, 3]
    assert rows[True][0]["bytes-down"] == 0 < rows[False][0]["bytes-down"]
    assert rows[True][1]["bytes-down"] == rows[False][1]["bytes-down"]
    assert [r["val-loss"] for r in rows[True]] == [r["val-loss"] for r in rows[False]]
