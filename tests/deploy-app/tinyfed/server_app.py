"""ServerApp: FedAvg for a few rounds, then write results.json to an absolute output-dir."""

import json
import os
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    num_nodes = int(cfg["num-nodes"])
    out_dir = Path(str(cfg["output-dir"]))
    if not out_dir.is_absolute():
        raise ValueError(f"run config 'output-dir' must be an absolute path, got {out_dir!r}")
    strategy = FedAvg(
        fraction_train=1.0,
        fraction_evaluate=0.0,
        min_train_nodes=num_nodes,
        min_available_nodes=num_nodes,
    )
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord([np.zeros(2, dtype=np.float32)]),
        num_rounds=int(cfg["num-server-rounds"]),
        timeout=60.0,
    )
    final = result.arrays.to_numpy_ndarrays()[0]
    results = {
        "num-server-rounds": int(cfg["num-server-rounds"]),
        "final_params": [float(v) for v in final],
        "train_metrics": {str(r): dict(m) for r, m in result.train_metrics_clientapp.items()},
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=2))
    os.replace(tmp, out_dir / "results.json")
