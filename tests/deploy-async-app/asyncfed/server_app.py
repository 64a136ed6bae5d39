"""ServerApp: asynchronous DiLoCo (mean, outer lr 1, no momentum, no staleness discount),
``buffer`` replies per outer step, tasks given up after ``task-timeout-s``; each step lasts at
least ``step-min-s`` (the server-side evaluate_fn waits), so the run outlives the timeout of a
task lost with its node. Writes results.json (per-step metrics, final model) to output-dir."""

import json
import os
import time
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from flwr_isoloco.strategies import DiLoCo, ReplyChecks, Rounds

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    n = int(cfg["num-nodes"])
    out_dir = Path(str(cfg["output-dir"]))
    strategy = DiLoCo(
        merge="mean",
        outer_lr=1.0,
        outer_momentum=0.0,
        fraction_evaluate=0.0,
        min_train_nodes=n,
        min_available_nodes=n,
        checks=ReplyChecks(max_weight_ratio=None),
        rounds=Rounds(asynchronous=True, replies_per_step=int(cfg["buffer"]), staleness=0.0),
    )
    pace = float(cfg["step-min-s"])

    def paced(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        if server_round > 0:
            time.sleep(pace)
        return MetricRecord({"server-round": server_round})

    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord([np.zeros(2, dtype=np.float32)]),
        num_rounds=int(cfg["num-server-rounds"]),
        timeout=float(cfg["task-timeout-s"]),
        evaluate_fn=paced,
    )
    results = {
        "final_params": [float(v) for v in result.arrays.to_numpy_ndarrays()[0]],
        "train_metrics": {str(r): dict(m) for r, m in result.train_metrics_clientapp.items()},
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=2))
    os.replace(tmp, out_dir / "results.json")
