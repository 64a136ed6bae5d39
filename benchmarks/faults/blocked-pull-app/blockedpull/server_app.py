"""ServerApp: synchronous DiLoCo (mean, outer lr 1, no momentum) with ``Rounds(quorum,
grace_s)`` and a round timeout of ``round-timeout-s``; writes results.json to output-dir: the
flwr_isoloco it imported (``flwr-isoloco-file``: the benchmark's "before" runs put an older
checkout first on PYTHONPATH), each round's wall time (its ``run_round``), the per-round
metrics (``wait-s``, ``replies-*``), the final model."""

import json
import os
import time
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

import flwr_isoloco
from flwr_isoloco.strategies import DiLoCo, ReplyChecks, Rounds

app = ServerApp()


class TimedDiLoCo(DiLoCo):
    """DiLoCo that notes when each round (train push to evaluate end) starts and ends."""

    marks: dict[int, list[float]] = {}

    def run_round(self, grid, server_round, *args, **kwargs):
        t0 = time.time()
        try:
            return super().run_round(grid, server_round, *args, **kwargs)
        finally:
            self.marks[server_round] = [t0, time.time()]


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    n = int(cfg["num-nodes"])
    out_dir = Path(str(cfg["output-dir"]))
    strategy = TimedDiLoCo(
        merge="mean",
        outer_lr=1.0,
        outer_momentum=0.0,
        fraction_evaluate=0.0,
        min_train_nodes=n,
        min_available_nodes=n,
        checks=ReplyChecks(max_weight_ratio=None),
        rounds=Rounds(quorum=int(cfg["quorum"]), grace_s=float(cfg["grace-s"])),
    )
    t0 = time.time()
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord([np.zeros(2, dtype=np.float32)]),
        num_rounds=int(cfg["num-server-rounds"]),
        timeout=float(cfg["round-timeout-s"]),
    )
    results = {
        "flwr-isoloco-file": flwr_isoloco.__file__,
        "start-s": time.time() - t0,
        "round-marks": {str(r): m for r, m in strategy.marks.items()},
        "round-wall-s": {str(r): m[-1] - m[0] for r, m in strategy.marks.items()},
        # None when no round stepped the model (Flower's Result.arrays then stays empty)
        "final_params": [float(v) for v in arrays[0]]
        if (arrays := result.arrays.to_numpy_ndarrays())
        else None,
        "train_metrics": {str(r): dict(m) for r, m in result.train_metrics_clientapp.items()},
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=2))
    os.replace(tmp, out_dir / "results.json")
