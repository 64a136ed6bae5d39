"""Benchmark-only ClientApp: synthetic workers for measuring the LM app's server at scale.

NOT a worker: it trains nothing. Each train message is answered with a seeded pseudo-gradient
of the received arrays' names, shapes and dtypes,

    delta_k = 1e-3 * N(0, 1)   (generator seed = seed * 1_000_003 + round * 10_007 + partition)

sent as ``payload = "delta"`` with the metrics a DiLoCo worker reports (``num-examples`` = the
tokens H inner steps of ``train.batch-size x train.seq-len`` would predict, ``train-loss``,
``lr``, ``inner-steps``), so the LM app's ServerApp, its strategy, the reply path and Flower run
unchanged while 64 x 135M workers (about 50 s per AdamW step each here) are not. An evaluate
message is answered with ``num-examples = 1`` and ``eval-loss = 0``.

``benchmarks/memory/server_memory.py --synthetic`` copies ``simulations/isoloco-lm`` to a temporary
folder, adds this module as ``isoloco_lm/synthetic_client.py`` and points the app's
``clientapp`` at it: the user's app is not changed.
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()
SCALE = 1e-3


def pseudo_gradient(arrays: ArrayRecord, seed: int) -> dict[str, torch.Tensor]:
    """``SCALE * N(0, 1)`` per floating array (zeros for integer ones), in the array's dtype."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in arrays.to_torch_state_dict().items():
        if t.is_floating_point():
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float32).mul_(SCALE)
            out[name] = noise.to(t.dtype)
        else:
            out[name] = torch.zeros_like(t)
        del t
    return out


def reply_seed(run_seed: int, server_round: int, partition: int) -> int:
    return run_seed * 1_000_003 + server_round * 10_007 + partition


@app.train()
def train(msg: Message, context: Context) -> Message:
    rc, nc = context.run_config, context.node_config
    cfg = msg.content["config"]
    seed = reply_seed(int(rc.get("seed", 0)), int(cfg["server-round"]), int(nc["partition-id"]))
    delta = pseudo_gradient(msg.content["arrays"], seed)
    steps = int(cfg.get("local-steps", rc.get("train.local-steps", 1)))
    tokens = steps * int(rc.get("train.batch-size", 8)) * int(rc.get("train.seq-len", 128))
    content = RecordDict(
        {
            "arrays": ArrayRecord(delta),
            "config": ConfigRecord({"payload": "delta"}),
            "metrics": MetricRecord(
                {"num-examples": tokens, "train-loss": 1.0, "lr": 0.0, "inner-steps": steps}
            ),
        }
    )
    return Message(content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    metrics = MetricRecord({"num-examples": 1, "eval-loss": 0.0})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)
