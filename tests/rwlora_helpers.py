"""The RWLoRA / GossipLoRA tests' fake federation: a LoRA adapter of two small arrays, a
deterministic client update per vertex (so a walk's token can be replayed exactly), the train
and query handlers of the fake grid, and the bytes Flower moves per adapter."""

import io
import json

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

torch.set_num_threads(1)

SHAPES = {"lora_A.weight": (2, 3), "lora_B.weight": (3, 2)}


def npy_bytes(shape) -> int:
    buf = io.BytesIO()
    np.save(buf, np.zeros(shape, np.float32), allow_pickle=False)
    return len(buf.getvalue())


# what Flower moves per adapter: each array as .npy (24 bytes of data + header each)
NBYTES = sum(npy_bytes(s) for s in SHAPES.values())


def init_adapter() -> dict[str, torch.Tensor]:
    return {k: torch.zeros(s) for k, s in SHAPES.items()}


def client_update(adapter: dict, vertex: int, steps: int) -> dict:
    """Deterministic stand-in for K local steps at `vertex`: x <- 0.5 x + (vertex + 1), K times."""
    out = {}
    for k, v in adapter.items():
        x = v.clone()
        for _ in range(steps):
            x = 0.5 * x + (vertex + 1)
        out[k] = x
    return out


def train(msg: Message, context) -> Message:
    pid = int(context.node_config["partition-id"])
    cfg = msg.content["config"]
    adapter = msg.content["arrays"].to_torch_state_dict()
    new = client_update(adapter, pid, int(cfg["local-steps"]))
    content = RecordDict(
        {
            "arrays": ArrayRecord(new),
            "metrics": MetricRecord({"num-examples": 10 + pid, "train-loss": 1.0 / (pid + 1)}),
        }
    )
    if cfg["carry-optimizer-state"]:
        old = msg.content.get("optimizer")
        count = old.to_torch_state_dict()["visits"] if old is not None else torch.zeros(1)
        content["optimizer"] = ArrayRecord({"visits": count + 1})
        content["optimizer-config"] = ConfigRecord({"step": int(count.item()) + 1})
    return Message(content, reply_to=msg)


def query(msg: Message, context) -> Message:
    key = msg.content["config"]["vertex-key"]
    return Message(
        RecordDict({"config": ConfigRecord({key: context.node_config[key]})}), reply_to=msg
    )


HANDLERS = {"train": train, "query": query}


def replay(trajectory, steps, start=None):
    x = init_adapter() if start is None else start
    for v in trajectory:
        x = client_update(x, v, steps)
    return x


def run(strategy, grid, rounds, **kw):
    return strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(init_adapter()),
        num_rounds=rounds,
        timeout=5,
        **kw,
    )


def assert_token(result, expected):
    got = result.arrays.to_torch_state_dict()
    assert set(got) == set(expected)
    for k in expected:
        assert torch.equal(got[k], expected[k]), k


def arm(strategy, grid, node, fault):
    """Map vertices (QUERY round) while every node is up, then inject ``fault`` on ``node``."""
    strategy.setup(grid, timeout=5)
    grid.set_fault(node, fault)


def train_log(grid):
    return [r for r in grid.log if r.message_type.startswith("train")]


def json_roundtrip(state):
    return {"tensors": state["tensors"], "meta": json.loads(json.dumps(state["meta"]))}
