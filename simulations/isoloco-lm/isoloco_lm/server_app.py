"""ServerApp: DiLoCo / IsoLoCo / FedAvg pre-training of a small LLaMA on Shakespeare.

Per round the strategy sends the global model to the nodes, merges their pseudo-gradients and
takes the outer step; the server then evaluates the held-out validation split (loss and
perplexity) in fp32 on the server's device, ``strategy.merge-device`` (where the merge runs too). Results rows, ``results.json``, ``loss.png``, the checkpoint, ``resume-from``
and the export (``model/``: the model and its tokenizer) are the shared runner's
(:mod:`flwr_isoloco.apprunner`); this module is the app's part: model, evaluator, row.
"""

from __future__ import annotations

import math
import time
from logging import INFO
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from flwr_isoloco.apprunner import CHECKPOINT, AppRun, AppSpec, run_app
from flwr_isoloco.clients.node_state import remove_run_temp_dir
from flwr_isoloco.merging.device import resolve_device
from flwr_isoloco.models.export import export_causal_lm, export_pretrained
from flwr_isoloco.models.hf import load_model_arrays, model_arrays
from flwr_isoloco.models.llama import count_parameters

from .plots import plot_losses, plot_title
from .pretrained import is_pretrained, peak_rss_mb
from .pretrained import source as pretrained_source
from .pretrained import tokenizer as pretrained_tokenizer
from .task import (
    build_model,
    build_strategy,
    cache_dir,
    check_seq_len,
    evaluate_model,
    load_config,
    strategy_outer,
    text_data,
    train_config,
    validation_batches,
)

__all__ = ["CHECKPOINT", "SPEC", "app", "run_server"]

app = ServerApp()
# Round columns copied from the strategy's aggregated train metrics.
TRAIN_COLUMNS = ("train-loss", "aggregation-time-s", "pseudo-grad-norm", "bytes-up", "bytes-down")
DP_COLUMNS = ("dp-epsilon", "dp-unclipped-fraction", "dp-clipping-norm")  # released values only
SECAGG_COLUMNS = ("secagg-bound", "secagg-clipped-entries", "secagg-time-s")
ROBUST_COLUMNS = ("robust-kept",)  # krum, multikrum, distance-filter: updates merged
REPLY_COLUMNS = ("replies-used", "replies-rejected", "replies-missing")
# Nodes not in when a round closed (late) and nodes gone (NODE_UNAVAILABLE): 0 when none.
ACCOUNT_COLUMNS = ("replies-late", "replies-lost")
# With a pretrained model: the workers' time and memory (token-weighted means over the nodes).
HF_COLUMNS = ("worker-time-s", "worker-peak-rss-mb")


PPL_CAP_LOSS = 50.0
"""``val-ppl = exp(min(val-loss, 50))``: beyond a loss of 50 the number is the cap, not the
model's perplexity (and exp would overflow a float near 710)."""


def ppl_text(loss: float, ppl: float) -> str:
    """The perplexity for a log line: ``91.3``, or ``>5.2e+21 (capped)`` when the loss is above
    :data:`PPL_CAP_LOSS` (the metric then holds the cap, not ``exp(loss)``)."""
    if loss > PPL_CAP_LOSS:
        return f">{math.exp(PPL_CAP_LOSS):.1e} (capped)"
    return f"{ppl:.1f}"


def summary(row: dict[str, Any]) -> str:
    """``val loss 4.5139 ppl 91.3 | train loss 4.61 | replies 4 used, 0 rejected, ...``."""
    text = f"val loss {row['val-loss']:.4f} ppl {ppl_text(row['val-loss'], row['val-ppl'])}"
    if row["round"] == 0:
        return text
    train = "n/a" if row.get("train-loss") is None else f"{row['train-loss']:.4f}"
    flag = " (diverged: see the divergence guard's warning)" if row.get("diverged") else ""
    return (
        f"{text}{flag} | train loss {train} | replies {row['replies-used']} used, "
        f"{row['replies-rejected']} rejected, {row['replies-missing']} missing | "
        f"aggregation {row.get('aggregation-time-s') or 0.0:.3f} s"
    )


def shape_reference(arrays: ArrayRecord) -> dict[str, torch.Tensor]:
    """``arrays``' names, shapes and dtypes as tensors on the meta device (no data): what a
    resumed strategy's state is checked against, without a second copy of the model."""
    return {
        k: torch.empty(a.shape, dtype=torch.from_numpy(np.empty(0, a.dtype)).dtype, device="meta")
        for k, a in arrays.items()
    }


def build(cfg, nodes: list[int]) -> AppRun:
    """Data (the BPE tokenizer is trained here, before any node needs it), model, strategy."""
    t0 = time.perf_counter()
    data, val = text_data(cfg), validation_batches(cfg)
    check_seq_len(cfg)
    log(
        INFO,
        "isoloco-lm: corpus %r: %d train / %d validation tokens (vocab %d) in %.1f s",
        cfg.data.corpus,
        len(data.train),
        len(data.val),
        data.vocab_size,
        time.perf_counter() - t0,
    )
    model, strategy = build_model(cfg), build_strategy(cfg)
    hf_model = is_pretrained(cfg)
    initial = model_arrays(model)  # a tied tensor once (flwr_isoloco.models.hf)
    device = resolve_device(cfg.strategy["merge-device"])  # checked by load_config
    model.to(device)  # the server's copy: evaluated where the merge runs
    log(INFO, "isoloco-lm: %s", strategy_outer(cfg).message)
    n_params = count_parameters(model)  # a tied tensor counted once
    cache = str(cache_dir(cfg)) if cache_dir(cfg) else None
    src = pretrained_source(cfg, cache) if hf_model else None
    outer = strategy.outer
    title = plot_title(
        cfg.strategy.name, strategy.merge_name, outer.momentum, n_params, outer.nesterov
    )

    def evaluate(server_round: int, arrays: ArrayRecord) -> dict[str, float]:
        load_model_arrays(model, arrays)
        loss = evaluate_model(model, val)
        return {"val-loss": loss, "val-ppl": math.exp(min(loss, PPL_CAP_LOSS))}

    def row(server_round: int, tm: dict[str, Any], em: dict[str, Any]) -> dict[str, Any]:
        return {
            "val-loss": em.get("val-loss"),
            "val-ppl": em.get("val-ppl"),
            "diverged": int(em.get("diverged", 0)),
            **{k: int(tm.get(k, 0)) for k in REPLY_COLUMNS},
            **{k: int(tm.get(k, 0)) for k in ACCOUNT_COLUMNS},
            **{k: tm.get(k) for k in TRAIN_COLUMNS},
            **({k: tm.get(k) for k in HF_COLUMNS} if hf_model else {}),
            **({"server-peak-rss-mb": peak_rss_mb()} if hf_model else {}),
            **{k: tm[k] for k in DP_COLUMNS if k in tm},  # central DP runs only
            **{k: tm[k] for k in SECAGG_COLUMNS if k in tm},  # strategy.secagg runs only
            **{k: tm[k] for k in ROBUST_COLUMNS if k in tm},
        }

    def export(arrays: ArrayRecord, out: Path) -> Path:
        load_model_arrays(model.cpu(), arrays)  # written from the CPU, then back
        try:
            if hf_model:  # its own architecture, tokenizer and generation config
                return export_pretrained(model, pretrained_tokenizer(cfg, cache), out / "model")
            export_causal_lm(model, data.tokenizer_path, out / "model")  # model + its tokenizer
            return out / "model"
        finally:
            model.to(device)

    return AppRun(
        strategy=strategy,
        initial_arrays=initial,
        evaluate=evaluate,
        row=row,
        summary=summary,
        train_config=train_config(cfg),
        info={
            "model-parameters": n_params,
            "train-tokens": len(data.train),
            "val-tokens-evaluated": sum(b[:, 1:].numel() for b in val),
            **({"model": cfg.model["name-or-path"], "model-source": src} if hf_model else {}),
        },
        restore_kwargs={"reference": shape_reference(initial)},
        plot=lambda res, out: plot_losses(
            res["rounds"], out / "loss.png", title, initial=res["initial"]
        ),
        export=export,
    )


SPEC = AppSpec(
    name="isoloco_lm",
    label="isoloco-lm",
    load_config=load_config,
    nodes=lambda cfg: (cfg.strategy["min-nodes"], False, 120.0),
    build=build,
)


def run_server(
    grid: Grid, run_config: dict[str, Any], run_id: int = 0, *, settle_s: float = 2.0
) -> Path:
    """The whole server side; returns the output folder. Raises on a bad run config."""
    try:
        return run_app(SPEC, grid, run_config, run_id, settle_s=settle_s)
    finally:  # checkpoint=false: the nodes' state files of this run (client_app.py), if here
        remove_run_temp_dir(run_id)


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_server(grid, dict(context.run_config), context.run_id)
