"""ServerApp: RW-LoRA / gossip LoRA / FedAvg-LoRA fine-tuning of all-MiniLM-L6-v2 on sentences.

After every round the server appends a row to ``results.json`` (local updates so far, bytes
relayed through the server and as a peer-to-peer deployment would send them, the walk vertex,
train loss, and every ``eval-every`` rounds the test accuracy of the token / vertex average /
global adapter on a fixed held-out subset; for gossip also the mean of each vertex's own
adapter's accuracy), redraws the plots and writes an atomic checkpoint
(``checkpoint.safetensors``); ``resume-from=<checkpoint>`` continues the same run exactly.
A run in which ``strategy.max-empty-rounds`` consecutive rounds used no reply stops with
``NoProgressError`` and ``status: failed``.
"""

from __future__ import annotations

import json
import math
import random
import time
from logging import ERROR, INFO, WARNING
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from flwr_isoloco.checkpoint import (
    RNG_FIELD,
    CheckpointError,
    Field,
    check_tensors,
    checkpoint_error,
    load_checkpoint,
    restoring,
    rng_state,
    save_checkpoint,
    set_rng_state,
    write_json_atomic,
)
from flwr_isoloco.data import sentiment
from flwr_isoloco.models import classifier
from flwr_isoloco.models.export import export_adapter
from flwr_isoloco.runconfig import RunConfigError, check_resumable, prepare_output_dir
from flwr_isoloco.strategies.common import NoProgressError
from flwr_isoloco.strategies.nodes import wait_for_nodes

from .fedavg import FedAvgBaseline
from .plots import plot_results, plot_title
from .task import (
    CURSORS_KEY,
    config_dict,
    load_config,
    lora_spec,
    output_dir,
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
    "num-server-rounds",
    "strategy.node-wait-s",
    "strategy.max-empty-rounds",
}


def data_sizes(cfg, n: int) -> list[int]:
    """Training rows per partition (same computation as the clients; Metropolis target)."""
    d = cfg.data
    sizes = []
    for pid in range(n):
        shard = sentiment.load_partition(
            pid,
            n,
            d.source,
            d.partitioner,
            d["dirichlet-alpha"],
            d["test-size"],
            cfg.seed,
            d["max-examples"],
        )
        sizes.append(len(shard) - int(len(shard) * d["val-fraction"]))
    return sizes


def build_strategy(cfg, n: int, round_end_fn=None):
    """The strategy named by ``strategy.name`` for ``n`` clients."""
    s = cfg.strategy
    max_norm = s["max-update-norm"] or None
    if s.name == "fedavg":
        return FedAvgBaseline(
            local_steps=s["local-steps"],
            fraction_train=s["fraction-train"],
            fraction_evaluate=0.0,
            min_train_nodes=max(1, math.ceil(s["fraction-train"] * n)),
            min_evaluate_nodes=0,
            min_available_nodes=n,
        )
    common = dict(
        num_vertices=n,
        graph_seed=cfg.seed,
        local_steps=s["local-steps"],
        node_wait_s=s["node-wait-s"],
        max_update_norm=max_norm,
        round_end_fn=round_end_fn,
        max_empty_rounds=s["max-empty-rounds"],
    )
    if s.name == "rwlora":
        from flwr_isoloco.strategies.rwlora import RWLoRA

        return RWLoRA(
            s.graph,
            transition=s.transition,
            target=data_sizes(cfg, n) if s.target == "data-size" else None,
            lazy=s.lazy,
            seed=cfg.seed,
            carry_optimizer_state=s["carry-optimizer-state"],
            max_norm_ratio=s["max-norm-ratio"] or None,
            dead_after=s["dead-after"],
            dead_backoff=s["dead-backoff"],
            dead_backoff_max=s["dead-backoff-max"],
            **common,
        )
    from flwr_isoloco.strategies.gossip import GossipLoRA

    return GossipLoRA(s.graph, **common)


# ----------------------------------------------------------------------------- resume
_COUNT = Field("int", min=0)
# What ``resume-from`` must hold (checked before anything is restored; see load_checkpoint).
CHECKPOINT_SPEC = {
    "round": _COUNT,
    "config": Field("dict"),
    "strategy": Field("dict"),
    "history": Field("list", items=Field("dict", fields={"round": _COUNT})),
    "totals": Field(
        "dict", fields=dict.fromkeys(("local-updates", "bytes-relayed", "bytes-p2p"), _COUNT)
    ),
    "cursors": Field("dict", keys=r"[0-9]{1,9}", values=_COUNT),
    "rng": RNG_FIELD,
}


def read_checkpoint(path: str, conf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load and verify a ``resume-from`` checkpoint: kind, fields (:data:`CHECKPOINT_SPEC`), an
    unchanged config and a history of rounds ``0..round``. Raises CheckpointError naming the
    file and field, or RunConfigError for a changed setting."""
    tensors, meta = load_checkpoint(path, kind="rwlora_sentiment", spec=CHECKPOINT_SPEC)
    check_resumable(meta["config"], conf, RESUMABLE_DIFFERENCES, source=str(path))
    done = meta["round"]
    if [r["round"] for r in meta["history"]] != list(range(done + 1)):
        raise checkpoint_error(
            path, f"field 'history' does not hold rounds 0..{done} (field 'round' = {done})"
        )
    return tensors, meta


def optimizer_shapes(model) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the AdamW state the LoRA client carries with the token:
    ``<param>.exp_avg`` and ``<param>.exp_avg_sq`` per trainable parameter (as
    :func:`flwr_isoloco.clients.lora_client.optimizer_to_arrays` writes them)."""
    return {
        f"{n}.{m}": tuple(p.shape)
        for n, p in model.named_parameters()
        if p.requires_grad
        for m in ("exp_avg", "exp_avg_sq")
    }


# ----------------------------------------------------------------------------- server
class Recorder:
    """``results.json``, the plots and the checkpoint of one run, fed by the round-end hook.

    Rows: round 0 (the initial adapter's test accuracy), then one per round with the totals
    so far (local updates, bytes relayed / peer-to-peer), the train loss (mean over the
    replies that entered the model), failed replies, the walk vertex and, every
    ``eval-every`` rounds and at the last, the test accuracy and loss.
    """

    def __init__(self, cfg, out, conf, strategy, n: int, results: dict[str, Any]) -> None:
        self.cfg, self.out, self.conf, self.strategy = cfg, out, conf, strategy
        self.name, self.n, self.results = cfg.strategy.name, n, results
        self.history: list[dict[str, Any]] = results["rounds"]
        self.base = {"local-updates": 0, "bytes-relayed": 0, "bytes-p2p": 0}
        self.cursors: dict[int, int] = {}
        self.clock = {"start": time.perf_counter(), "last": time.perf_counter()}
        self.evaluator: tuple = ()  # (model, tokenizer, test texts, test labels)

    def totals(self) -> dict[str, int]:
        """Run totals; FedAvg's start from the checkpoint's (its ledger counts this run)."""
        s = self.strategy
        if self.name == "fedavg":
            relayed = self.base["bytes-relayed"] + s.bytes_relayed
            lu, bp = self.base["local-updates"] + s.local_updates, relayed
        else:
            relayed, lu, bp = s.bytes_relayed, s.local_updates, s.bytes_p2p
        return {"local-updates": int(lu), "bytes-relayed": int(relayed), "bytes-p2p": int(bp)}

    def evaluate(self, arrays: ArrayRecord) -> dict[str, float]:
        """Accuracy and loss of ``arrays`` (an adapter) on the fixed test subset."""
        model, tokenizer, texts, labels = self.evaluator
        classifier.load_adapter_state_dict(model, arrays.to_torch_state_dict())
        return classifier.evaluate(
            model, tokenizer, texts, labels, max_length=self.cfg.model["max-length"]
        )

    def evaluate_fn(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """Test accuracy/loss every ``eval-every`` rounds (gossip: also each vertex's own)."""
        if not self.wants_eval(server_round):
            return None
        tw = time.perf_counter()
        res = self.evaluate(arrays)
        m = {"test-accuracy": res["accuracy"], "test-loss": res["loss"]}
        if self.name == "gossip":  # each vertex's own adapter, not the A/B average
            own = [self.evaluate(a) for a in self.strategy.vertex_adapters().values()]
            m["test-accuracy-vertex-mean"] = sum(r["accuracy"] for r in own) / len(own)
            m["test-loss-vertex-mean"] = sum(r["loss"] for r in own) / len(own)
        m["eval-time-s"] = time.perf_counter() - tw
        if server_round == 0:
            self.add_row(0, None, m)
        return MetricRecord(m)

    def wants_eval(self, rnd: int) -> bool:
        return rnd == 0 or rnd % self.cfg["eval-every"] == 0 or rnd == self.cfg["num-server-rounds"]

    def add_row(self, rnd: int, train_metrics, eval_metrics) -> None:
        """Append round ``rnd``'s row, write results.json, the checkpoint and the plots."""
        row: dict[str, Any] = {
            "round": rnd,
            **(self.totals() if rnd else dict.fromkeys(self.base, 0)),
        }
        if rnd:
            replies = self.strategy.round_replies
            for _, m in replies:
                if "partition-id" in m and "data-cursor" in m:
                    self.cursors[int(m["partition-id"])] = int(m["data-cursor"])
            losses = [m["train_loss"] for _, m in replies if "train_loss" in m]
            row["train-loss"] = sum(losses) / len(losses) if losses else None
            tm = dict(train_metrics or {})
            fails = self.strategy.round_failures if self.name == "fedavg" else tm.get("failures", 0)
            row["failed-replies"] = int(fails)
            if self.name == "rwlora" and self.strategy.trajectory:
                v = self.strategy.trajectory[-1]
                row["walk-vertex"] = int(v) if isinstance(v, int) else str(v)
                row["hop-failures-total"] = self.strategy.failures
            if self.name == "rwlora":
                row["dead-vertices"] = int(tm.get("dead-vertices", 0))
                row["relays-total"] = int(tm.get("relays-total", 0))
        row.update(dict(eval_metrics or {}))
        now = time.perf_counter()
        row["round-wall-s"] = now - self.clock["last"]
        self.clock["last"] = now
        self.history.append(row)
        if rnd == 0:  # as in every app's results.json: the initial evaluation on its own too
            self.results["initial"] = row
        log(INFO, "rwlora-sentiment: %s", row)
        write_json_atomic(self.out / "results.json", self.results)
        if self.cfg["checkpoint"] and rnd > 0:
            self.checkpoint(rnd)
        if rnd and (self.wants_eval(rnd) or rnd == self.cfg["num-server-rounds"]):
            self.plots()

    def finish(self, t0: float, done: int) -> None:
        """Final plots, status ``completed`` and the closing log line (``done``: rounds
        restored from the checkpoint)."""
        self.plots()
        self.results["status"] = "completed"
        self.results["wall-time-s"] = time.perf_counter() - t0
        write_json_atomic(self.out / "results.json", self.results)
        last = next((r for r in reversed(self.history) if "test-accuracy" in r), None)
        log(
            INFO,
            "rwlora-sentiment: done, %d rounds in this run, %d of %d in total; final test "
            "accuracy %s; results in %s, adapter in %s",
            len(self.history) - 1 - done,  # history holds rounds 0..last
            len(self.history) - 1,
            self.cfg["num-server-rounds"],
            "n/a" if last is None else f"{last['test-accuracy']:.4f}",
            self.out / "results.json",
            self.out / "adapter",
        )

    def checkpoint(self, rnd: int) -> None:
        if self.name == "fedavg":
            ts: dict[str, Any] = {"arrays": self.strategy.current_arrays().to_torch_state_dict()}
            smeta: dict[str, Any] = {}
        else:
            sd = self.strategy.state_dict()
            ts, smeta = {"strategy": sd["tensors"]}, sd["meta"]
        meta = {
            "app": "rwlora_sentiment",
            "round": rnd,
            "config": self.conf,
            "strategy": smeta,
            "history": self.history,
            "totals": self.totals(),
            "cursors": {str(k): v for k, v in self.cursors.items()},
            "rng": rng_state(),
        }
        save_checkpoint(self.out / CHECKPOINT, ts, meta)

    def plots(self) -> None:
        visits = None
        if self.name == "rwlora":
            visits = {str(k): int(v) for k, v in self.strategy.visit_counts().items()}
        elif self.cursors:
            per_visit = self.cfg.strategy["local-steps"] * self.cfg.train["batch-size"]
            visits = {str(k): c // per_visit for k, c in sorted(self.cursors.items())}
        self.results["visit-counts"] = visits
        title = plot_title(self.name, self.cfg.strategy.graph, self.n)
        try:
            plot_results(self.history, visits, self.out, title=title)
        except Exception as exc:  # plots must never stop a run
            log(WARNING, "rwlora-sentiment: plotting failed: %s", exc)


def new_results(cfg, out, conf, n, adapter_bytes, n_test, meta) -> dict[str, Any]:
    """The ``results.json`` envelope (docs/user-guide.md) before the first row; a resumed run
    continues the checkpoint's history."""
    return {
        "app": "rwlora_sentiment",
        "status": "running",
        "output-dir": str(out),
        "config": conf,
        "num-clients": n,
        "adapter-bytes": adapter_bytes,
        "test-examples": n_test,
        "resumed-from": cfg["resume-from"] or None,
        "initial": None if meta is None else meta["history"][0],
        "rounds": [] if meta is None else meta["history"],
    }


def load_evaluator(cfg):
    """``(model, tokenizer, test texts, test labels, initial adapter)`` for server-side tests:
    the server's own model copy, and the adapter as initialised (not the cached model's)."""
    d = cfg.data
    test = sentiment.load_test(d.source, d["test-size"], cfg.seed, d["eval-examples"])
    spec = lora_spec(cfg)
    model = classifier.get_model(spec, slot="server")  # not the clients' copy
    tokenizer = classifier.load_tokenizer(spec.model)
    initial_adapter = classifier.initial_adapter(spec)
    texts, labels = list(test["text"]), [int(y) for y in test["label"]]
    return model, tokenizer, texts, labels, initial_adapter


def restore(cfg, strategy, model, initial_adapter, tensors, meta) -> ArrayRecord:
    """Restore the strategy (FedAvg: its arrays and round) and the RNGs from a verified
    checkpoint; returns the initial arrays for ``start``. Raises CheckpointError."""
    path, done = cfg["resume-from"], meta["round"]
    initial = ArrayRecord(initial_adapter)
    with restoring(path, "strategy state: "):
        if cfg.strategy.name == "fedavg":
            check_tensors(tensors.get("arrays"), initial_adapter, "arrays")
            initial = ArrayRecord(tensors["arrays"])
            strategy.round = done
        else:
            strategy.load_state_dict(
                {"tensors": tensors.get("strategy", {}), "meta": meta["strategy"]},
                reference=initial_adapter,
                optimizer_reference=optimizer_shapes(model),
            )
            if meta["strategy"]["round"] != done:
                raise CheckpointError(
                    f"field 'round' = {meta['strategy']['round']}, the checkpoint's is {done}"
                )
    with restoring(path):
        set_rng_state(meta["rng"])
    return initial


def _strategy_for(cfg, n: int):
    try:
        return build_strategy(cfg, n)
    except ValueError as exc:
        s = cfg.strategy
        msg = (
            f"run-config keys strategy.graph={s.graph!r}, strategy.transition={s.transition!r}, "
            f"strategy.target={s.target!r} with {n} clients: {exc}"
        )
        log(ERROR, "rwlora-sentiment: bad run config: %s", msg)
        raise RunConfigError(msg) from None


def run_server(grid: Grid, run_config: dict[str, Any], run_id: int = 0, *, settle_s: float = 3.0):
    """The whole server side; returns the output folder. Raises on a bad run config."""
    try:
        cfg = load_config(run_config)
    except RunConfigError as exc:
        log(ERROR, "rwlora-sentiment: bad run config: %s", exc)
        raise
    if cfg["torch-threads"]:
        torch.set_num_threads(cfg["torch-threads"])
    out = prepare_output_dir(output_dir(cfg, run_id))
    conf = config_dict(cfg)
    t0 = time.perf_counter()
    model, tokenizer, test_texts, test_labels, initial_adapter = load_evaluator(cfg)
    adapter_bytes = sum(t.numel() * 4 for t in initial_adapter.values())
    log(INFO, "rwlora-sentiment: output %s; adapter %d bytes", out, adapter_bytes)
    total = cfg["num-server-rounds"]
    tensors, meta = {}, None
    if cfg["resume-from"]:
        try:
            tensors, meta = read_checkpoint(cfg["resume-from"], conf)
        except (CheckpointError, RunConfigError) as exc:
            log(ERROR, "rwlora-sentiment: cannot resume: %s", exc)
            raise
    want = cfg.strategy["num-clients"]  # 0: as many as connect (count stable for settle_s)
    n = len(
        wait_for_nodes(
            grid,
            max(want, 1),
            settle_s=0.0 if want else settle_s,
            timeout_s=cfg.strategy["node-wait-s"],
            what="rwlora-sentiment",
        )
    )
    strategy = _strategy_for(cfg, n)
    results = new_results(cfg, out, conf, n, adapter_bytes, len(test_texts), meta)
    rec = Recorder(cfg, out, conf, strategy, n, results)
    rec.evaluator = (model, tokenizer, test_texts, test_labels)
    train_config: dict[str, Any] = {}
    initial = ArrayRecord(initial_adapter)
    # FedAvg samples nodes with Python's global ``random``: seed it so runs repeat exactly
    # (a resumed run restores the generator's state from the checkpoint).
    random.seed(cfg.seed)
    if meta is not None:
        try:
            initial = restore(cfg, strategy, model, initial_adapter, tensors, meta)
        except CheckpointError as exc:
            log(ERROR, "rwlora-sentiment: cannot resume: %s", exc)
            raise
        rec.base = {k: meta["totals"][k] for k in rec.base}
        rec.cursors = {int(k): v for k, v in meta["cursors"].items()}
        train_config[CURSORS_KEY] = json.dumps(rec.cursors)
        log(
            INFO, "rwlora-sentiment: resumed from %s at round %d", cfg["resume-from"], meta["round"]
        )

    try:
        result = strategy.start(
            grid=grid,
            initial_arrays=initial,
            num_rounds=total,
            timeout=cfg["round-timeout"],
            train_config=ConfigRecord(train_config),
            evaluate_fn=rec.evaluate_fn,
            on_round_end=lambda rnd, _arrays, tm, em: rec.add_row(rnd, tm, em),
        )
    except NoProgressError as exc:
        rec.plots()
        results.update(status="failed", error=str(exc), **{"wall-time-s": time.perf_counter() - t0})
        write_json_atomic(out / "results.json", results)
        raise
    if len(result.arrays):  # the adapter whose accuracy was reported last; loads with peft
        export_adapter(
            model, result.arrays.to_torch_state_dict(), out / "adapter", tokenizer=tokenizer
        )
    rec.finish(t0, 0 if meta is None else meta["round"])
    return out


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_server(grid, dict(context.run_config), context.run_id)
