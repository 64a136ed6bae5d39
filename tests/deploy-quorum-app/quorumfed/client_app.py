"""ClientApp: a deterministic update of the model; partition ``slow-partition`` is the
straggler: it answers round r only once the server has closed round r (the ServerApp writes
``<output-dir>/closed-<r>``), so its reply is late by construction, whatever the machine's
load (at most ``slow-s`` seconds of waiting, a safety cap). The delay is the test app's, not
the library's."""

import time
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


def wait_until_closed(out_dir: str, rnd: int, cap_s: float) -> None:
    """Block until the server has closed round ``rnd`` (its marker file exists) or ``cap_s``."""
    marker = Path(out_dir) / f"closed-{rnd}"
    deadline = time.monotonic() + cap_s
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


@app.train()
def train(msg: Message, context: Context) -> Message:
    pid = int(context.node_config["partition-id"])
    rnd = int(msg.content["config"]["server-round"])
    if pid == int(context.run_config["slow-partition"]):
        wait_until_closed(
            str(context.run_config["output-dir"]), rnd, float(context.run_config["slow-s"])
        )
    params = msg.content["arrays"].to_numpy_ndarrays()[0]
    new = params + np.float32(0.125 * (pid + 1) * (-1) ** rnd)
    metrics = MetricRecord({"num-examples": 1 + pid})
    return Message(
        RecordDict(
            {"arrays": ArrayRecord([np.asarray(new, dtype=np.float32)]), "metrics": metrics}
        ),
        reply_to=msg,
    )
