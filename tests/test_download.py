"""Compressed downloads (``download=``, compression/broadcast.py, clients/download.py): an
unchanged FedAvg-style ClientApp behind ``download_mod``, in-process via FakeGrid."""

from __future__ import annotations

import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from outer_reference import assert_close, sync_rounds

from flwr_isoloco.clients import download_mod, make_download_mod
from flwr_isoloco.clients.download import STATE_ARRAYS, STATE_CONFIG
from flwr_isoloco.compression import compress, payload_nbytes
from flwr_isoloco.compression.broadcast import (
    BASE_KEY,
    DIGEST_KEY,
    NEEDS_FULL,
    NEEDS_FULL_CODE,
    model_digest,
    reply_digest,
)
from flwr_isoloco.strategies import Codec, DiLoCo
from flwr_isoloco.strategies.diloco.downloads import train_base

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


def test_a_restarted_node_trains_that_round_from_the_full_model():
    """Both nodes restart after round 2 (their context.state is gone) while the server, untouched,
    takes them to hold round 2's B and sends the update: each refuses it asking for the full B,
    gets it within round 3 and trains from it. Each trained from the very B (digest) the nodes of
    an uninterrupted run rebuilt from the updates, so round 3 ends bitwise where that run's does;
    bytes down: the int8 update plus the fp32 model per node (counted on records built here)."""
    _, whole, _ = run("int8", rounds=3)
    whole_b3 = {k: d for k, d in TRAINED_ON.items() if k[1] == 3}
    s, _, grid = run("int8", rounds=2)
    for ctx in grid.contexts.values():
        ctx.state = RecordDict()  # a restart: nothing the node kept survives
    TRAINED_ON.clear()
    res = s.start(grid=grid, initial_arrays=ArrayRecord(theta0()), num_rounds=s.server_round + 1)
    (m,) = res.train_metrics_clientapp.values()  # round 3 (the count continues)
    assert (m["replies-used"], m["replies-rejected"]) == (2, 0)
    assert TRAINED_ON == whole_b3 and len(whole_b3) == 2
    update = payload_nbytes(compress({k: torch.zeros_like(v) for k, v in theta0().items()}, "int8"))
    assert m["bytes-down"] == 2 * (update + 4 * (32 * 64 + 64))
    a, b = res.arrays.to_torch_state_dict(), whole.arrays.to_torch_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_node_holding_another_copy_gets_the_full_model_within_the_round():
    """A node whose stored copy is of another version refuses round 3's update (its handler
    does not run on it) and asks for the full B: it gets it within the round and trains from the
    server's B. A node that asks every time is answered once a round (3 full models down in
    round 1: 2 sent, 1 resent), then its refusal is dropped and named; the round goes on."""
    digests = {}
    s, _, grid = run("int8", rounds=2)
    record_digests(s, digests)
    ctx = next(iter(grid.contexts.values()))
    ctx.state[STATE_CONFIG] = ConfigRecord({"held": "0" * 64})  # a copy of another version
    TRAINED_ON.clear()
    res = s.start(grid=grid, initial_arrays=ArrayRecord(theta0()), num_rounds=s.server_round + 1)
    (m,) = res.train_metrics_clientapp.values()
    assert (m["replies-used"], m["replies-rejected"]) == (2, 0)
    assert len(TRAINED_ON) == 2 and set(TRAINED_ON.values()) == {digests[3]}

    def asks_always(msg: Message, context: Context, call_next) -> Message:
        if int(context.node_config["partition-id"]) == 1:
            return Message(Error(NEEDS_FULL_CODE, f"{NEEDS_FULL} (every time)"), reply_to=msg)
        return call_next(msg, context)

    _, res, _ = run("int8", rounds=2, grid=FakeGrid(make_app([asks_always, download_mod]), 2))
    for r in (1, 2):
        m = res.train_metrics_clientapp[r]
        assert (m["replies-used"], m["replies-rejected"]) == (1, 1)
    assert res.train_metrics_clientapp[1]["bytes-down"] == 3 * payload_nbytes(ArrayRecord(theta0()))


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
    """Evaluation after round 2: B takes its step towards round 2's theta, so the nodes (holding
    the B they trained from) get the int8 update (the evaluation's bytes-down, counted on a
    record built here), rebuild and evaluate that B: the reported loss is its loss. Round 3's
    training then sends no arrays: the nodes hold its B already."""
    s, res, grid = run("int8", rounds=2, nodes=2)
    assert res.evaluate_metrics_clientapp == {}  # fraction_evaluate 0 in run(); now evaluate
    s.fraction_evaluate, s.min_evaluate_nodes = 1.0, 2
    before = s.broadcast.digest
    msgs = list(s.configure_evaluate(2, ArrayRecord(), ConfigRecord({}), grid))
    update = payload_nbytes(compress({k: torch.zeros_like(v) for k, v in theta0().items()}, "int8"))
    assert [payload_nbytes(m.content["arrays"]) for m in msgs] == [update, update]
    assert s.broadcast.digest != before
    agg = s.aggregate_evaluate(2, grid.send_and_receive(msgs))
    b = s.broadcast.base
    assert agg["loss"] == pytest.approx(float(sum(v.float().pow(2).mean() for v in b.values())))
    assert agg["bytes-down"] == 2 * update
    msgs = list(s.configure_train(3, ArrayRecord(), ConfigRecord({}), grid))
    assert [len(m.content["arrays"]) for m in msgs] == [0, 0]


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
    assert train_base(s.broadcast, s.theta) is s.theta and s.broadcast is None


def test_hostile_digests_and_corrupt_copies():
    """A reply's 'held' that is not a 64-char string counts as none (full B next time); a
    stored copy changed behind its digest is refused (the full B follows within the round), an
    update that does not decode too."""
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
    assert (m["replies-used"], m["replies-rejected"]) == (2, 0) and len(TRAINED_ON) == 2
    assert len(set(TRAINED_ON.values())) == 1  # the full B resent: the corrupt copy replaced
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


def test_a_node_whose_own_initial_model_differs_gets_the_full_model_in_round_1():
    """One node builds another initial model: it refuses round 1's empty update (its handler
    never runs on its own build) and gets the full B within round 1, as both nodes of a plain
    download_mod (no ``initial``: they hold nothing) do; round 1's bytes down are the full
    models resent, and every node trained from the server's B."""

    def initial(ctx):
        t = theta0()
        if int(ctx.node_config["partition-id"]) == 1:
            t["b"] = t["b"] + 1.0
        return t

    full = payload_nbytes(ArrayRecord(theta0()))
    for mod, resent in ((make_download_mod(initial=initial), 1), (download_mod, 2)):
        TRAINED_ON.clear()
        digests = {}
        s = DiLoCo(
            min_available_nodes=2,
            min_train_nodes=1,
            fraction_evaluate=0.0,
            download=Codec("int8", nodes_hold_initial=True),
        )
        record_digests(s, digests)
        grid = FakeGrid(make_app([mod]), num_nodes=2)
        res = s.start(grid=grid, initial_arrays=ArrayRecord(theta0()), num_rounds=2)
        r1, r2 = res.train_metrics_clientapp[1], res.train_metrics_clientapp[2]
        assert (r1["replies-used"], r1["replies-rejected"]) == (2, 0)
        assert r1["bytes-down"] == resent * full
        assert r2["replies-used"] == 2
        assert len(TRAINED_ON) == 4 and all(d == digests[r] for (_, r), d in TRAINED_ON.items())


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
