"""A plain FedAvg ClientApp: train locally, reply weights + num-examples. Unchanged by the swap."""

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from .task import Bigram, loss_on, node_data, val_loss

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    model = Bigram()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    data = node_data(context.node_config["partition-id"], context.node_config["num-partitions"])
    opt = torch.optim.Adam(model.parameters(), lr=context.run_config["lr"])
    g = torch.Generator().manual_seed(int(context.node_config["partition-id"]))
    for _ in range(context.run_config["local-steps"]):
        start = int(torch.randint(0, len(data) - 4097, (1,), generator=g))
        loss = loss_on(model, data[start : start + 4097])
        opt.zero_grad()
        loss.backward()
        opt.step()
    metrics = MetricRecord({"train-loss": float(loss.detach()), "num-examples": len(data)})
    reply = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
    return Message(reply, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    model = Bigram()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    metrics = MetricRecord({"eval-loss": val_loss(model), "num-examples": 1})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)
