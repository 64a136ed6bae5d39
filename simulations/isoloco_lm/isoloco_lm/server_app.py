"""ServerApp: DiLoCo / IsoLoCo / FedAvg pre-training of a small LLaMA on Shakespeare.

Per round: the strategy sends the global model to the nodes, merges their pseudo-gradients
and takes the outer step; the server then evaluates the held-out validation split (loss and
perplexity), appends the round to ``results.json``, redraws ``loss.png`` and writes an atomic
checkpoint (``checkpoint.safetensors``). ``resume-from=<checkpoint>`` continues exactly.
"""

from __future__ import annotations

import math
import time
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from flwr_isoloco.checkpoint import (
    RNG_FIELD,
    CheckpointError,
    Field,
    checkpoint_error,
    load_checkpoint,
    restoring,
    rng_state,
    save_checkpoint,
    set_rng_state,
    write_json_atomic,
)
from flwr_isoloco.models.export import export_causal_lm
from flwr_isoloco.models.llama import count_parameters
from flwr_isoloco.runconfig import RunConfigError, check_resumable, prepare_output_dir
from flwr_isoloco.strategies.common import NoProgressError

from .plots import plot_losses, plot_title
from .task import (
    RESUME_DIR_KEY,
    RESUME_ROUND_KEY,
    STATE_DIR_KEY,
    build_model,
    build_strategy,
    config_dict,
    evaluate_model,
    load_config,
    output_dir,
    text_data,
    train_config,
    validation_batches,
)

app = ServerApp()

CHECKPOINT = "checkpoint.safetensors"
# Keys that may differ between a run and the run that resumes it.
RESUMABLE_DIFFERENCES = {
    "output-dir",
    "resume-from",
    "round-timeout",
    "torch-threads",
    "checkpoint",
    "rounds-this-run",
}


def wait_for_nodes(
    grid: Grid, min_nodes: int, settle_s: float = 2.0, timeout_s: float = 120.0
) -> int:
    """Wait until >= ``min_nodes`` are connected and their number is stable for ``settle_s``
    (simulated nodes register after the ServerApp starts); returns how many there are."""
    t0 = time.monotonic()
    last, since = -1, time.monotonic()
    while True:
        n = len(list(grid.get_node_ids()))
        now = time.monotonic()
        if n != last:
            last, since = n, now
        if n >= min_nodes and now - since >= settle_s:
            return n
        if now - t0 > timeout_s:
            if n >= min_nodes:
                return n
            raise RuntimeError(
                f"only {n} nodes connected after {timeout_s:.0f} s; strategy.min-nodes is {min_nodes}"
            )
        time.sleep(0.25)


# What ``resume-from`` must hold (checked before anything is restored; see load_checkpoint).
CHECKPOINT_SPEC = {
    "round": Field("int", min=0),
    "config": Field("dict"),
    "strategy": Field("dict"),
    "history": Field("list", items=Field("dict", fields={"round": Field("int", min=1)})),
    "initial": Field("dict", nullable=True),
    "rng": RNG_FIELD,
}


def resume(path: Path, conf: dict[str, Any], strategy, model) -> tuple[int, list, Any]:
    """Verify the checkpoint at ``path`` and restore ``strategy`` and the RNGs from it; returns
    ``(rounds done, history, initial evaluation)``. Raises CheckpointError (naming the file
    and the field or tensor) or RunConfigError (a changed setting) before anything runs."""
    tensors, meta = load_checkpoint(path, kind="isoloco_lm", spec=CHECKPOINT_SPEC)
    check_resumable(meta["config"], conf, RESUMABLE_DIFFERENCES, source=str(path))
    done, history = meta["round"], meta["history"]
    if [r["round"] for r in history] != list(range(1, done + 1)):
        raise checkpoint_error(
            path, f"field 'history' does not hold rounds 1..{done} (field 'round' = {done})"
        )
    with restoring(path, "strategy state: "):
        strategy.load_state_dict(
            {"tensors": tensors.get("strategy", {}), "meta": meta["strategy"]},
            reference=model.state_dict(),
        )
        if strategy.server_round != done:
            raise CheckpointError(
                f"field 'server_round' = {strategy.server_round} but field 'round' = {done}"
            )
    with restoring(path):
        set_rng_state(meta["rng"])
    return done, history, meta["initial"]


def run_server(
    grid: Grid, run_config: dict[str, Any], run_id: int = 0, *, settle_s: float = 2.0
) -> Path:
    """The whole server side; returns the output folder. Raises on a bad run config."""
    try:
        cfg = load_config(run_config)
    except RunConfigError as exc:
        log(ERROR, "isoloco-lm: bad run config: %s", exc)
        raise
    torch.set_num_threads(cfg["torch-threads"])
    out = prepare_output_dir(output_dir(cfg, run_id))
    log(INFO, "isoloco-lm: results will be written to %s", out)
    conf = config_dict(cfg)

    t0 = time.perf_counter()
    data = text_data(cfg)  # trains/caches the tokenizer before any node needs it
    val = validation_batches(cfg)
    log(
        INFO,
        "isoloco-lm: corpus %r: %d train / %d validation tokens (BPE vocab %d) in %.1f s",
        cfg.data.corpus,
        len(data.train),
        len(data.val),
        data.vocab_size,
        time.perf_counter() - t0,
    )
    model = build_model(cfg)
    n_params = count_parameters(model)
    strategy = build_strategy(cfg)

    history: list[dict[str, Any]] = []
    initial: dict[str, Any] | None = None
    done = 0
    tc: dict[str, Any] = train_config(cfg)
    if cfg["checkpoint"]:
        tc[STATE_DIR_KEY] = str(out / "node-state")
    if cfg["resume-from"]:
        path = Path(cfg["resume-from"])
        try:
            done, history, initial = resume(path, conf, strategy, model)
        except (CheckpointError, RunConfigError) as exc:
            log(ERROR, "isoloco-lm: cannot resume: %s", exc)
            raise
        tc[RESUME_DIR_KEY] = str(path.parent / "node-state")
        tc[RESUME_ROUND_KEY] = done
        log(INFO, "isoloco-lm: resumed from %s at round %d", path, done)
    total = cfg["num-server-rounds"]
    remaining = total - done
    if cfg["rounds-this-run"]:
        remaining = min(remaining, cfg["rounds-this-run"])

    results: dict[str, Any] = {
        "app": "isoloco_lm",
        "status": "running",
        "output-dir": str(out),
        "config": conf,
        "model-parameters": n_params,
        "train-tokens": len(data.train),
        "val-tokens-evaluated": sum(b[:, 1:].numel() for b in val),
        "resumed-from": cfg["resume-from"] or None,
        "initial": initial,
        "rounds": history,
    }
    results_path, plot_path = out / "results.json", out / "loss.png"
    outer = strategy.outer
    title = plot_title(
        cfg.strategy.name, strategy.merge_name, outer.momentum, n_params, outer.nesterov
    )

    pending: dict[str, Any] = {}
    inner = strategy.aggregate_train

    def aggregate_train(server_round, replies):  # record train metrics for this round
        arrays, metrics = inner(server_round, replies)
        pending["train"] = dict(metrics) if metrics is not None else {}
        return arrays, metrics

    strategy.aggregate_train = aggregate_train  # instance hook; the strategy is unchanged
    clock = {"last": time.perf_counter(), "start": time.perf_counter()}

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        nonlocal initial
        global_round = done + server_round
        if server_round == 0 and done > 0:
            clock["last"] = time.perf_counter()
            return None  # already evaluated before the checkpoint
        t_eval = time.perf_counter()
        model.load_state_dict(arrays.to_torch_state_dict())
        loss = evaluate_model(model, val)
        ppl = math.exp(min(loss, 50.0))
        now = time.perf_counter()
        if server_round == 0:
            initial = {"round": 0, "val-loss": loss, "val-ppl": ppl}
            results["initial"] = initial
            log(INFO, "isoloco-lm: round 0/%d val loss %.4f ppl %.1f", total, loss, ppl)
        else:
            tm = pending.pop("train", {})
            row = {
                "round": global_round,
                "val-loss": loss,
                "val-ppl": ppl,
                "train-loss": tm.get("train-loss"),
                "replies-used": int(tm.get("replies-used", 0)),
                "replies-rejected": int(tm.get("replies-rejected", 0)),
                "replies-missing": int(tm.get("replies-missing", 0)),
                "aggregation-time-s": tm.get("aggregation-time-s"),
                "pseudo-grad-norm": tm.get("pseudo-grad-norm"),
                "bytes-up": tm.get("bytes-up"),
                "bytes-down": tm.get("bytes-down"),
                "eval-time-s": now - t_eval,
                "round-wall-s": now - clock["last"],  # since the previous round ended
                "elapsed-s": now - clock["start"],
            }
            history.append(row)
            log(
                INFO,
                "isoloco-lm: round %d/%d val loss %.4f ppl %.1f | train loss %s | replies %d used, "
                "%d rejected, %d missing | aggregation %.3f s | round %.1f s",
                global_round,
                total,
                loss,
                ppl,
                "n/a" if row["train-loss"] is None else f"{row['train-loss']:.4f}",
                row["replies-used"],
                row["replies-rejected"],
                row["replies-missing"],
                row["aggregation-time-s"] or 0.0,
                row["round-wall-s"],
            )
            if row["replies-used"] == 0:
                log(WARNING, "isoloco-lm: round %d had no usable reply; model kept", global_round)
        write_json_atomic(results_path, results)
        if history:
            plot_losses(history, plot_path, title, initial=initial)
        if cfg["checkpoint"] and server_round > 0:
            sd = strategy.state_dict()
            save_checkpoint(
                out / CHECKPOINT,
                {"strategy": sd["tensors"]},
                {
                    "app": "isoloco_lm",
                    "round": global_round,
                    "config": conf,
                    "strategy": sd["meta"],
                    "history": history,
                    "initial": initial,
                    "rng": rng_state(),
                },
            )
        clock["last"] = now
        return MetricRecord({"val-loss": loss, "val-ppl": ppl})

    if remaining <= 0:
        log(INFO, "isoloco-lm: checkpoint already holds all %d rounds; nothing to run", total)
    else:
        wait_for_nodes(grid, cfg.strategy["min-nodes"], settle_s=settle_s)
        try:
            strategy.start(
                grid=grid,
                initial_arrays=ArrayRecord(model.state_dict()),
                num_rounds=done + remaining,  # the total: the strategy runs rounds done+1 ..
                timeout=cfg["round-timeout"],
                train_config=ConfigRecord(tc),
                evaluate_fn=evaluate_fn,
            )
        except NoProgressError as exc:  # the run trained nothing: say so, never "completed"
            log(ERROR, "isoloco-lm: %s", exc)
            results.update({"status": "failed", "error": str(exc)})
            results["wall-time-s"] = time.perf_counter() - t0
            write_json_atomic(results_path, results)
            raise
    results["status"] = "completed" if len(history) == total else "partial"
    results["wall-time-s"] = time.perf_counter() - t0
    if strategy.theta is not None:
        model.load_state_dict(
            {k: v.to(model.state_dict()[k].dtype) for k, v in strategy.theta.items()}
        )
        export_causal_lm(model, data.tokenizer_path, out / "model")  # model + its tokenizer
    write_json_atomic(results_path, results)
    last = history[-1] if history else None
    log(
        INFO,
        "isoloco-lm: done: %d rounds in this run, %d of %d in total; final val loss %s. "
        "Results: %s (loss curve %s, model and tokenizer %s)",
        len(history) - done,
        len(history),
        total,
        "n/a" if last is None else f"{last['val-loss']:.4f}",
        results_path,
        plot_path,
        out / "model",
    )
    return out


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_server(grid, dict(context.run_config), context.run_id)
