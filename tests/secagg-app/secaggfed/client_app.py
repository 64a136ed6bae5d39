"""ClientApp: the DiLoCo worker behind ``secagg_mod``; it also writes its true pseudo-gradient
to the output folder (the test's ground truth: what must never reach the ServerApp). torch is
imported in the handler only: three of SecAgg+'s four stages start a client process without
it (each message is a fresh process in a deployment)."""

from __future__ import annotations

from pathlib import Path

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from flwr_isoloco.clients import secagg_mod

app = ClientApp(mods=[secagg_mod])


@app.train()
def train(msg: Message, context: Context) -> Message:
    import numpy as np

    from flwr_isoloco.clients import TrainSettings, make_diloco_train_handler
    from secaggfed.task import build_model, node_batches

    pid = int(context.node_config["partition-id"])
    rounds = int(context.run_config["num-server-rounds"])
    handler = make_diloco_train_handler(
        build_model,
        lambda _c: node_batches(pid),
        train=TrainSettings(lr=1e-2, local_steps=2, num_server_rounds=rounds, warmup_steps=0),
    )
    theta = msg.content["arrays"].to_torch_state_dict()
    reply = handler(msg, context)
    new = reply.content["arrays"].to_torch_state_dict()
    rnd = int(msg.content["config"]["server-round"])
    out = Path(str(context.run_config["output-dir"]))
    tag = str(context.run_config["tag"])
    deltas = {k: (theta[k] - new[k]).numpy() for k in theta}
    np.savez(out / f"{tag}-delta-p{pid}-r{rnd}.npz", **deltas)
    return reply
