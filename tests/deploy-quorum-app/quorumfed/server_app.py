"""ServerApp: DiLoCo (FedAvg settings) with strategy.quorum / strategy.grace-s from the run
config; writes results.json (metrics, final model, late replies discarded) to output-dir, and
``closed-<r>`` there as round r closes (the straggler waits for it: client_app.py)."""

import json
import os
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from flwr_isoloco.strategies import DiLoCo

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    n = int(cfg["num-nodes"])
    out_dir = Path(str(cfg["output-dir"]))
    out_dir.mkdir(parents=True, exist_ok=True)
    strategy = DiLoCo.from_run_config(
        cfg,
        outer_lr=1.0,
        outer_momentum=0.0,
        fraction_evaluate=0.0,
        min_train_nodes=n,
        min_available_nodes=n,
    )
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord([np.zeros(2, dtype=np.float32)]),
        num_rounds=int(cfg["num-server-rounds"]),
        timeout=120.0,
        on_round_end=lambda rnd, *_: (out_dir / f"closed-{rnd}").touch(),
    )
    results = {
        "final_params": [float(v) for v in result.arrays.to_numpy_ndarrays()[0]],
        "train_metrics": {str(r): dict(m) for r, m in result.train_metrics_clientapp.items()},
        "discarded_rounds": [rnd for _, rnd in strategy._train_stream.discarded],
    }
    tmp = out_dir / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=2))
    os.replace(tmp, out_dir / "results.json")
