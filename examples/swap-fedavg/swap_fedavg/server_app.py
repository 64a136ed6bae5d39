"""A FedAvg ServerApp switched to IsoLoCo with a one-line change.

Before (plain Flower)::

    strategy = FedAvg(fraction_train=1.0, min_available_nodes=2)

After (flwr-isoloco): the same keyword arguments, the same ClientApp, the same Result::

    strategy = IsoLoCo(fraction_train=1.0, min_available_nodes=2)
"""

import json
import os

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg  # noqa: F401  (the line we replaced used it)

from flwr_isoloco.strategies import IsoLoCo

from .task import Bigram, val_loss

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    model = Bigram()

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        return MetricRecord({"val-loss": val_loss(model)})

    strategy = IsoLoCo(fraction_train=1.0, min_available_nodes=2)  # was: FedAvg(...)
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(model.state_dict()),
        num_rounds=context.run_config["num-server-rounds"],
        evaluate_fn=evaluate,
    )
    losses = {r: float(m["val-loss"]) for r, m in result.evaluate_metrics_serverapp.items()}
    print(f"swap_fedavg: {type(strategy).__name__} validation loss per round: {losses}")
    out = context.run_config["output-dir"]
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "result.json"), "w") as fh:
            json.dump({"strategy": type(strategy).__name__, "val-loss": losses}, fh)
