"""ClientApp: the DiLoCo worker on a Hugging Face causal LM and the node's share of the text."""

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from flwr_isoloco.clients import Runtime, TrainSettings, make_diloco_train_handler
from flwr_isoloco.clients.hf_lm import partition_texts, tokenize_texts, window_batches

from .task import model_fn_for, model_source, text_splits, tokenizer_for

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    rc = context.run_config
    pid = int(context.node_config["partition-id"])
    parts = int(context.node_config["num-partitions"])
    source = model_source(rc["model"], rc["cache-dir"])
    tok = tokenizer_for(source)

    def data_fn(ctx):
        train_ds, _ = text_splits(rc["text"], rc["val-docs"])
        texts = partition_texts(train_ds, pid, parts)  # flwr-datasets IidPartitioner
        tokens = tokenize_texts(texts, tok)
        return window_batches(tokens, rc["batch-size"], rc["seq-len"], seed=0, partition_id=pid)

    settings = TrainSettings(
        lr=rc["lr"],
        local_steps=rc["local-steps"],
        num_server_rounds=rc["num-server-rounds"],
        warmup_steps=0,
    )
    handler = make_diloco_train_handler(
        model_fn_for(source),
        data_fn,
        train=settings,
        runtime=Runtime(micro_batch=rc["micro-batch"]),
    )
    return handler(msg, context)
