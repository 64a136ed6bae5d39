"""A plain Flower ClientApp, as in Flower's quickstart-pytorch: ``@app.train`` and
``@app.evaluate`` only. The same for FedAvg and for every strategy that replaces it.

``download_mod`` lets a strategy with compressed downloads (``DiLoCo(download="int8")``...)
send this node the compressed difference to the model it holds: the mod rebuilds the full model
before the handlers below run (a message without the download entries, FedAvg's, passes
through untouched)."""

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flwr_isoloco.clients import download_mod

from .task import Net, load_partition, test, train

MODS = [download_mod]
app = ClientApp(mods=MODS)


def _data(context: Context):
    rc = context.run_config  # pyproject.toml's values; the defaults serve run_simulation()
    return load_partition(
        int(context.node_config["partition-id"]),
        int(context.node_config.get("num-partitions", rc.get("num-partitions", 4))),
        str(rc.get("partitioner", "iid")),
        float(rc.get("alpha", 0.5)),
        int(rc.get("partition-seed", 0)),
        str(rc.get("split", "test")),
    )


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    net = Net(model=str(context.run_config.get("model", "cnn")))
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = _data(context)
    rc = context.run_config
    server_round = int(msg.content["config"].get("server-round", 0))
    pid = int(context.node_config["partition-id"])
    loss = train(
        net,
        x,
        y,
        int(rc.get("local-epochs", 1)),
        float(rc.get("lr", 0.05)),
        int(rc.get("batch-size", 32)),
        float(rc.get("momentum", 0.9)),
        seed=1000 * server_round + pid,
    )
    metrics = MetricRecord({"train_loss": loss, "num-examples": len(y)})
    content = RecordDict({"arrays": ArrayRecord(net.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate_fn(msg: Message, context: Context) -> Message:
    net = Net(model=str(context.run_config.get("model", "cnn")))
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = _data(context)
    loss, acc = test(net, x, y)
    metrics = MetricRecord({"eval_loss": loss, "eval_acc": acc, "num-examples": len(y)})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
