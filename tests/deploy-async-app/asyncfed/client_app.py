"""ClientApp: a deterministic update, ``theta_i = theta + 0.125 (pid + 1)`` (so the server's
model is a sum of known steps). Partition ``slow-partition`` sleeps ``slow-s`` per task (the
slowed site); partition ``doomed-partition`` writes ``<output-dir>/doomed-started`` and then
sleeps ``doomed-s`` (the test SIGKILLs its SuperNode meanwhile). The delays are this test app's,
not the library's."""

import time
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    cfg = context.run_config
    pid = int(context.node_config["partition-id"])
    if pid == int(cfg["doomed-partition"]):
        Path(str(cfg["output-dir"])).mkdir(parents=True, exist_ok=True)
        (Path(str(cfg["output-dir"])) / "doomed-started").write_text(str(time.time()))
        time.sleep(float(cfg["doomed-s"]))
    if pid == int(cfg["slow-partition"]):
        time.sleep(float(cfg["slow-s"]))
    params = msg.content["arrays"].to_numpy_ndarrays()[0]
    new = params + np.float32(0.125 * (pid + 1))
    metrics = MetricRecord({"num-examples": 1, "partition-id": pid})
    return Message(
        RecordDict(
            {"arrays": ArrayRecord([np.asarray(new, dtype=np.float32)]), "metrics": metrics}
        ),
        reply_to=msg,
    )
