"""ServerApp: DiLoCo over the nodes; held-out loss per round; the trained model exported."""

import json
import math
import os

import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from flwr_isoloco.clients.diloco_worker import next_token_loss
from flwr_isoloco.clients.hf_lm import tokenize_texts
from flwr_isoloco.data.text import eval_batches
from flwr_isoloco.models.export import export_pretrained
from flwr_isoloco.models.hf import load_model_arrays, model_arrays
from flwr_isoloco.strategies import DiLoCo

from .task import model_fn_for, model_source, text_splits, tokenizer_for

app = ServerApp()


def check_output_dir(out: str) -> None:
    """``output-dir`` must be absolute (the ServerApp runs in the SuperLink's folder); empty
    means nothing is written, which is said at once rather than found out after training."""
    if out and not os.path.isabs(out):
        raise ValueError(
            f"output-dir must be an absolute path (the ServerApp runs in the SuperLink's "
            f"folder), got {out!r}"
        )
    if not out:
        print(
            "hf_causal_lm: output-dir is empty: the trained model and result.json will not be "
            "written (add --run-config \"output-dir='/absolute/path'\")"
        )


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    check_output_dir(rc["output-dir"])  # before any model is loaded or trained
    source = model_source(rc["model"], rc["cache-dir"])  # converts a GGUF before any node
    model, tok = model_fn_for(source)(), tokenizer_for(source)
    _, val_ds = text_splits(rc["text"], rc["val-docs"])
    val = list(
        eval_batches(tokenize_texts(val_ds["text"], tok), 8, rc["seq-len"], rc["val-tokens"])
    )

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        load_model_arrays(model, arrays)  # the tied tensor arrives once; the tie holds
        model.eval()
        with torch.no_grad():
            losses = [next_token_loss(model, b) for b in val]
        loss = sum(float(v) * n for v, n in losses) / sum(n for _, n in losses)
        return MetricRecord({"val-loss": loss, "val-ppl": math.exp(min(loss, 50.0))})

    strategy = DiLoCo(fraction_train=1.0, min_available_nodes=2, fraction_evaluate=0.0)
    result = strategy.start(
        grid=grid,
        initial_arrays=model_arrays(model),  # each tied tensor once
        num_rounds=rc["num-server-rounds"],
        evaluate_fn=evaluate,
    )
    losses = {r: float(m["val-loss"]) for r, m in result.evaluate_metrics_serverapp.items()}
    print(f"hf_causal_lm: validation loss per round: {losses}")
    if rc["output-dir"]:
        load_model_arrays(model, result.arrays)
        export_pretrained(model, tok, os.path.join(rc["output-dir"], "model"))
        with open(os.path.join(rc["output-dir"], "result.json"), "w") as fh:
            json.dump({"val-loss": losses}, fh)
