"""ClientApp: local gradient descent on this node's partition (from --node-config)."""

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from tinyfed.task import local_train, mse, node_data

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    pid = int(context.node_config["partition-id"])
    x, y = node_data(pid)
    params = msg.content["arrays"].to_numpy_ndarrays()[0]
    steps = int(context.run_config["local-steps"])
    lr = float(context.run_config["lr"])
    new = local_train(params, x, y, steps, lr)
    metrics = MetricRecord(
        {"train_loss": mse(new, x, y), "num-examples": len(x), "partition-id": pid}
    )
    return Message(
        RecordDict({"arrays": ArrayRecord([np.asarray(new)]), "metrics": metrics}), reply_to=msg
    )
