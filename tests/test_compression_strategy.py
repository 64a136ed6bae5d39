"""Compressed uploads end to end: DiLoCo worker (error feedback in context.state) and strategy
(codec request, decoding in ReplyValidator, bytes-up / bytes-down), in-process via FakeGrid."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common.serde import context_from_proto, context_to_proto

from flwr_isoloco.clients import TrainSettings, make_diloco_train_handler
from flwr_isoloco.clients.diloco_worker import RESIDUAL_STATE_KEY
from flwr_isoloco.compression import codecs as C
from flwr_isoloco.compression import decompress, is_compressed, payload_nbytes
from flwr_isoloco.models.llama import build_llama, llama_config
from flwr_isoloco.strategies import Codec, DiLoCo, IsoLoCo
from flwr_isoloco.strategies.diloco.setup import codec_request

torch.set_num_threads(1)

CFG = llama_config(vocab_size=64, hidden=32, layers=1, heads=2, max_seq_len=16)
H = 2


def model_fn(_ctx=None):
    return build_llama(CFG, seed=0)


def data_fn(ctx):
    g = torch.Generator().manual_seed(int(ctx.node_config.get("partition-id", 0)))
    batches = [torch.randint(0, 64, (2, 9), generator=g) for _ in range(4)]
    return lambda i: batches[i % len(batches)]


def worker(**kw):
    train = TrainSettings(lr=1e-2, local_steps=H, num_server_rounds=4)
    return make_diloco_train_handler(model_fn, data_fn, train=train, **kw)


def theta0():
    return {k: v.detach().clone() for k, v in model_fn().state_dict().items()}


def send(train, theta, rnd, ctx, **config):
    msg = Message(
        RecordDict(
            {"arrays": ArrayRecord(theta), "config": ConfigRecord({"server-round": rnd, **config})}
        ),
        77,
        "train",
    )
    return train(msg, ctx)


def new_context(pid=0):
    FakeGrid({}, num_nodes=1)  # sets Flower's task identity so Messages can be built
    return Context(1, 77, {"partition-id": pid, "num-partitions": 1}, RecordDict(), {})


def test_worker_replies_compressed_delta_close_to_the_plain_delta():
    theta = theta0()
    plain = send(worker(payload="delta"), theta, 1, new_context())
    ctx = new_context()
    comp = send(worker(), theta, 1, ctx, **{"upload-codec": "int8"})
    rec = comp.content["arrays"]
    assert is_compressed(rec) and comp.content["config"]["payload"] == "delta"
    want = plain.content["arrays"].to_torch_state_dict()
    got = decompress(rec)
    for k, w in want.items():
        if w.dim() >= 2:
            amax = float(w.abs().max())
            assert float((got[k] - w).abs().max()) <= amax / 254 * (1 + 1e-5), k
        else:
            assert torch.equal(got[k], w), k  # vectors travel as fp32
    res = ctx.state[RESIDUAL_STATE_KEY].to_torch_state_dict()
    assert set(res) == {k for k, w in want.items() if w.dim() >= 2}
    for k in res:  # e_1 = delta_1 - decoded_1
        torch.testing.assert_close(res[k], want[k] - got[k], rtol=0, atol=1e-9)
    assert payload_nbytes(rec) < 0.3 * payload_nbytes(plain.content["arrays"])


def test_residual_survives_rounds_and_a_fresh_process_and_is_used():
    theta = theta0()
    conf = {"upload-codec": "topk", "codec-fraction": 0.05}
    ctx = new_context()
    send(worker(), theta, 1, ctx, **conf)
    e1 = ctx.state[RESIDUAL_STATE_KEY].to_torch_state_dict()
    resumed = context_from_proto(context_to_proto(ctx))  # deployment: a new process per message
    r2 = send(worker(), theta, 2, resumed, **conf)
    r2_again = send(worker(), theta, 2, context_from_proto(context_to_proto(ctx)), **conf)
    assert all(
        np.array_equal(r2.content["arrays"][k].numpy(), r2_again.content["arrays"][k].numpy())
        for k in r2.content["arrays"].keys()
    )
    # Round 2 sent top-k of (delta_2 + e_1): a fresh node (no residual) sends something else.
    fresh = new_context()
    send(worker(), theta, 1, fresh, **{"upload-codec": "int8"})  # same cursor, other residual
    r2_other = send(worker(), theta, 2, fresh, **conf)
    k = next(iter(e1))
    assert not torch.equal(
        decompress(r2.content["arrays"])[k], decompress(r2_other.content["arrays"])[k]
    )
    # Without error feedback the residual is dropped from the state.
    send(worker(), theta, 3, resumed, **conf, **{"upload-error-feedback": False})
    assert RESIDUAL_STATE_KEY not in resumed.state


def test_bad_codec_request_is_an_error_reply_not_training():
    with pytest.raises(ValueError, match="'upload-codec'='gzip'"):
        send(worker(), theta0(), 1, new_context(), **{"upload-codec": "gzip"})


def _mixed_app(plain_pid=0):
    """Node ``plain_pid`` is a plain FedAvg client (fp32 weights, ignores codec keys)."""
    compressed, plain = worker(), worker(payload="weights")

    def train(msg, ctx):
        if int(ctx.node_config["partition-id"]) == plain_pid:
            cfg = msg.content.config_records["config"]
            keep = {k: v for k, v in cfg.items() if not k.startswith(("upload-", "codec-"))}
            msg.content["config"] = ConfigRecord(keep)
            return plain(msg, ctx)
        return compressed(msg, ctx)

    return {"train": train}


@pytest.mark.parametrize(
    "cls,codec,opts",
    [
        (DiLoCo, "int8", {}),
        (IsoLoCo, "fp8", {}),
        (DiLoCo, "topk", {"fraction": 0.1, "values": "int8"}),
    ],
)
def test_strategy_accepts_compressed_and_plain_replies_in_the_same_round(cls, codec, opts):
    grid = FakeGrid(_mixed_app(), num_nodes=3)
    s = cls(
        min_available_nodes=3,
        min_train_nodes=3,
        fraction_evaluate=0.0,
        upload=Codec(codec, **(opts or {})),
    )
    theta = theta0()
    res = s.start(
        grid=grid,
        initial_arrays=ArrayRecord(theta),
        num_rounds=2,
        train_config=ConfigRecord({"num-server-rounds": 4}),
    )
    fp32 = payload_nbytes(ArrayRecord(theta))
    for rnd in (1, 2):
        m = res.train_metrics_clientapp[rnd]
        assert (m["replies-used"], m["replies-rejected"]) == (3, 0)
        assert m["bytes-down"] == 3 * fp32
        assert fp32 < m["bytes-up"] < 1.6 * fp32  # one fp32 reply + two compressed ones
    final = res.arrays.to_torch_state_dict()
    assert max(float((final[k] - theta[k]).abs().max()) for k in theta) > 1e-4


def test_compressed_round_matches_the_uncompressed_one_within_the_codec_error():
    """Mean merge, outer lr 1, no momentum (FedAvg): theta_1 = theta - mean(decoded deltas)."""
    kw = dict(
        min_available_nodes=2,
        min_train_nodes=2,
        fraction_evaluate=0.0,
        outer_lr=1.0,
        outer_momentum=0.0,
    )
    theta = theta0()
    tc = ConfigRecord({"num-server-rounds": 4})
    plain = DiLoCo(**kw).start(
        grid=FakeGrid({"train": worker()}, num_nodes=2),
        initial_arrays=ArrayRecord(theta),
        num_rounds=1,
        train_config=tc,
    )
    comp = DiLoCo(**kw, upload="int8").start(
        grid=FakeGrid({"train": worker()}, num_nodes=2),
        initial_arrays=ArrayRecord(theta),
        num_rounds=1,
        train_config=ConfigRecord({"num-server-rounds": 4}),
    )
    a, b = plain.arrays.to_torch_state_dict(), comp.arrays.to_torch_state_dict()
    for k in a:
        d = a[k] - theta[k]
        tol = float(d.abs().max()) * 2 / 254 + 1e-7 if d.dim() >= 2 else 1e-7
        assert float((a[k] - b[k]).abs().max()) <= tol, k
    assert (
        comp.train_metrics_clientapp[1]["bytes-up"]
        < 0.3 * plain.train_metrics_clientapp[1]["bytes-up"]
    )


def _break_scale(reply: Message) -> Message:
    rec = reply.content["arrays"]
    key = next(k for k in rec.keys() if k.endswith("/s"))
    s = rec[key].numpy().copy()
    s[0] = np.nan
    reply.content["arrays"] = ArrayRecord({**{k: rec[k] for k in rec.keys()}, key: Array(s)})
    return reply


def _claim_huge_shape(reply: Message) -> Message:
    import json

    rec = reply.content["arrays"]
    h = json.loads(bytes(rec["__codec__"].numpy()).decode())
    name = next(iter(h["tensors"]))
    h["tensors"][name]["shape"] = [10**6, 10**6]
    blob = np.frombuffer(json.dumps(h).encode(), np.uint8).copy()
    reply.content["arrays"] = ArrayRecord(
        {**{k: rec[k] for k in rec.keys()}, "__codec__": Array(blob)}
    )
    return reply


@pytest.mark.parametrize(
    "fault,needle",
    [
        (_break_scale, "non-finite scales"),
        (_claim_huge_shape, "shape (1000000, 1000000), expected"),
    ],
)
def test_compressed_reply_that_does_not_decode_is_dropped_naming_the_key(fault, needle):
    grid = FakeGrid({"train": worker()}, num_nodes=3)
    grid.set_fault(1, fault, times=1)
    s = DiLoCo(min_available_nodes=3, min_train_nodes=3, fraction_evaluate=0.0, upload="int8")
    theta = theta0()
    s.start(
        grid=grid,
        initial_arrays=ArrayRecord(theta),
        num_rounds=1,
        train_config=ConfigRecord({"num-server-rounds": 4}),
    )
    # Validate the same kind of reply directly to read the reason.
    ctx = new_context()
    bad = fault(send(worker(), theta, 1, ctx, **{"upload-codec": "int8"}))
    checked, report = s.train_validator.validate([bad], s.theta)
    assert checked == [] and report.rejected == 1
    reason = report.reasons[0][1]
    assert reason.startswith("compressed record does not decode: tensor '") and needle in reason
    assert report.bytes_up == payload_nbytes(bad.content["arrays"])


def test_run_config_sparseloco_and_int4_options():
    """strategy.codec-chunk / -k / -bits / -ef-decay reach the Codec options the codec takes
    (-1 decay: the codec's default), and are checked."""
    s = DiLoCo.from_run_config(
        {
            "strategy.upload-codec": "sparseloco",
            "strategy.codec-chunk": 1024,
            "strategy.codec-k": 32,
            "strategy.codec-bits": 4,
            "strategy.codec-ef-decay": 0.9,
        }
    )
    req = codec_request(s.upload)
    assert (req["codec-chunk"], req["codec-k"], req["codec-bits"]) == (1024, 32, 4)
    assert req["upload-ef-decay"] == 0.9
    default = codec_request(DiLoCo.from_run_config({"strategy.upload-codec": "sparseloco"}).upload)
    assert (default["codec-chunk"], default["codec-k"], default["codec-bits"]) == (4096, 64, 2)
    assert default["upload-ef-decay"] == 0.95  # -1: sparseloco's own decay
    int4 = codec_request(
        DiLoCo.from_run_config(
            {"strategy.upload-codec": "int4", "strategy.codec-k": 8, "strategy.codec-ef-decay": 0.5}
        ).upload
    )
    assert "codec-k" not in int4 and "codec-chunk" not in int4  # options int4 does not take
    assert int4["upload-ef-decay"] == 0.5
    for key, bad in [("codec-bits", 3), ("codec-ef-decay", 1.5), ("codec-k", 0)]:
        with pytest.raises(ValueError, match=f"strategy.{key}"):
            DiLoCo.from_run_config({f"strategy.{key}": bad})
    with pytest.raises(ValueError, match="chunk"):  # not a square: the codec refuses
        DiLoCo.from_run_config(
            {"strategy.upload-codec": "sparseloco", "strategy.codec-chunk": 1000}
        )


def test_run_config_keys_and_codec_request():
    s = IsoLoCo.from_run_config(
        {
            "strategy.upload-codec": "topk",
            "strategy.codec-fraction": 0.1,
            "strategy.error-feedback": False,
        }
    )
    assert codec_request(s.upload)["upload-codec"] == "topk"
    assert (
        codec_request(s.upload)["codec-fraction"] == 0.1
        and codec_request(s.upload)["upload-error-feedback"] is False
    )
    assert codec_request(DiLoCo.from_run_config({}).upload) == {}  # default: plain replies
    sparse = codec_request(DiLoCo.from_run_config({"strategy.upload-codec": "sparseloco"}).upload)
    assert sparse["upload-codec"] == "sparseloco"  # options without a key: the codec's defaults
    with pytest.raises(ValueError, match="strategy.upload-codec"):
        DiLoCo.from_run_config({"strategy.upload-codec": "gzip"})
    with pytest.raises(ValueError, match="strategy.codec-fraction"):
        DiLoCo.from_run_config({"strategy.codec-fraction": 0.0})
    with pytest.raises(ValueError, match="block_size"):
        DiLoCo(upload=Codec("int8", block_size=0))
    grid = FakeGrid({"train": worker()}, num_nodes=2)
    msgs = list(s.configure_train(1, ArrayRecord(theta0()), ConfigRecord({}), grid))
    cfg = msgs[0].content["config"]
    assert cfg["upload-codec"] == "topk" and cfg["codec-values"] == "fp32"
    assert C.topk_count(100, cfg["codec-fraction"]) == 10
