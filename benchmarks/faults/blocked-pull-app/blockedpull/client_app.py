"""ClientApp: ``theta + 0.125 (pid + 1)`` (a 2-float model). The doomed partition adds an
ArrayRecord ``ballast`` of ``ballast-mb`` MB of distinct float32 values (distinct, so Flower's
content-addressed 5 MB chunks are all uploaded), so its SuperNode's upload to the SuperLink
takes a while: the benchmark SIGKILLs that SuperNode mid-upload.

Ordering (``first``): with ``fast`` the other partitions reply at once and the doomed one waits
for ``<output-dir>/go``; with ``doomed`` the other way round. Each partition writes
``<output-dir>/replying-<pid>`` just before it returns its reply. The waits are this app's,
not the library's."""

import time
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


def _wait_go(out: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not (out / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


@app.train()
def train(msg: Message, context: Context) -> Message:
    cfg = context.run_config
    out = Path(str(cfg["output-dir"]))
    out.mkdir(parents=True, exist_ok=True)
    pid = int(context.node_config["partition-id"])
    doomed = pid == int(cfg["doomed-partition"])
    if doomed == (str(cfg["first"]) == "fast"):
        _wait_go(out, float(cfg["go-timeout-s"]))
    params = msg.content["arrays"].to_numpy_ndarrays()[0]
    new = params + np.float32(0.125 * (pid + 1))
    records = {
        "arrays": ArrayRecord([np.asarray(new, dtype=np.float32)]),
        "metrics": MetricRecord({"num-examples": 1, "partition-id": pid}),
    }
    if doomed:
        n = int(float(cfg["ballast-mb"]) * 2**20) // 4
        records["ballast"] = ArrayRecord([np.arange(n, dtype=np.float32)])
    (out / f"replying-{pid}").write_text(str(time.time()))
    return Message(RecordDict(records), reply_to=msg)
