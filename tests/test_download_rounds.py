"""Compressed downloads across whole rounds: the mods under any config record name, a node that
lost its copy, federated evaluation of the stepped model, a ClientApp without the mods."""

from __future__ import annotations

import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from test_download import theta0

from flwr_isoloco.clients import download_mod, upload_mod
from flwr_isoloco.compression import compress, payload_nbytes
from flwr_isoloco.compression.broadcast import BASE_KEY, DIGEST_KEY
from flwr_isoloco.strategies import DiLoCo


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
        configrecord_key="cfg",
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
