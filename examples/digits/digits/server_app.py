"""A plain Flower ServerApp, as in Flower's quickstart-pytorch, with FedAvg.

Any of flwr-isoloco's server strategies replaces FedAvg by the README's two-line swap::

    from flwr_isoloco.strategies import IsoLoCo     # was: from flwr.serverapp.strategy import FedAvg
    strategy = IsoLoCo()                            # was: strategy = FedAvg()

(the import is already below). The server evaluates every round on the fixed test set.
"""

from __future__ import annotations

import json
import math
import os

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from flwr_isoloco.strategies import DiLoCo, IsoLoCo  # noqa: F401

from .task import Net, load_test, test

app = ServerApp()
LAST: dict = {}  # the last run's strategy name and Result, for tests running the app in-process


def run_federation(grid: Grid, context: Context, strategy) -> dict[int, float]:
    """Train with ``strategy`` for ``num-server-rounds``; test accuracy per round."""
    rc = context.run_config
    net = Net(int(rc.get("model-seed", 0)), str(rc.get("model", "cnn")))
    x, y = load_test(str(rc.get("split", "test")))  # "validation": for tuning

    def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        net.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = test(net, x, y)
        return MetricRecord({"loss": loss if math.isfinite(loss) else 1e30, "accuracy": acc})

    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(net.state_dict()),
        num_rounds=int(rc.get("num-server-rounds", 10)),
        evaluate_fn=global_evaluate,
    )
    LAST.update(strategy=type(strategy).__name__, result=result)
    acc = {r: float(m["accuracy"]) for r, m in result.evaluate_metrics_serverapp.items()}
    print(f"digits: {type(strategy).__name__} test accuracy per round: {acc}")
    out = rc.get("output-dir", "")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "result.json"), "w") as fh:
            json.dump({"strategy": type(strategy).__name__, "accuracy": acc}, fh)
    return acc


@app.main()
def main(grid: Grid, context: Context) -> None:
    strategy = FedAvg()
    run_federation(grid, context, strategy)
