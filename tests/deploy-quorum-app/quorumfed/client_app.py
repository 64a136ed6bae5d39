"""ClientApp: a deterministic update of the model; partition ``slow-partition`` sleeps first
(the straggler; this delay is the test app's, not the library's)."""

import time

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    pid = int(context.node_config["partition-id"])
    if pid == int(context.run_config["slow-partition"]):
        time.sleep(float(context.run_config["slow-s"]))
    params = msg.content["arrays"].to_numpy_ndarrays()[0]
    rnd = int(msg.content["config"]["server-round"])
    new = params + np.float32(0.125 * (pid + 1) * (-1) ** rnd)
    metrics = MetricRecord({"num-examples": 1 + pid})
    return Message(
        RecordDict(
            {"arrays": ArrayRecord([np.asarray(new, dtype=np.float32)]), "metrics": metrics}
        ),
        reply_to=msg,
    )
