"""A plain Flower ServerApp, as in Flower's quickstart-pytorch, with FedAvg.

Any of flwr-isoloco's strategies replaces FedAvg by changing the one ``strategy =`` line::

    FedAvg(fraction_evaluate=0.5)      # Flower's
    DiLoCo(fraction_evaluate=0.5)      # merge pseudo-gradients + outer Nesterov step
    IsoLoCo(fraction_evaluate=0.5)     # DiLoCo with Iso-C merging
    RWLoRA(fraction_evaluate=0.5)      # one model walks the nodes, one node per round
    GossipLoRA(fraction_evaluate=0.5)  # every node trains, then Metropolis mixing

The ClientApp stays as it is (RW-LoRA and gossip use the connected nodes as graph vertices,
in node-id order, when the ClientApp has no ``@app.query()`` handler).
"""

import json
import os

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from flwr_isoloco.strategies import DiLoCo, GossipLoRA, IsoLoCo, RWLoRA  # noqa: F401

from .task import Net, load_data, test

app = ServerApp()
LAST: dict = {}  # the last run's Result, for tests running the app in-process


@app.main()
def main(grid: Grid, context: Context) -> None:
    net = Net()
    x, y = load_data(-1)

    def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        net.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = test(net, x, y)
        return MetricRecord({"loss": loss, "accuracy": acc})

    strategy = FedAvg(fraction_evaluate=0.5)
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(Net().state_dict()),
        num_rounds=int(context.run_config.get("num-server-rounds", 3)),
        evaluate_fn=global_evaluate,
    )
    LAST.update(strategy=type(strategy).__name__, result=result)
    acc = {r: float(m["accuracy"]) for r, m in result.evaluate_metrics_serverapp.items()}
    print(f"quickstart-swap: {type(strategy).__name__} test accuracy per round: {acc}")
    out = context.run_config.get("output-dir", "")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "result.json"), "w") as fh:
            json.dump({"strategy": type(strategy).__name__, "accuracy": acc}, fh)
