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
from collections.abc import Callable, Iterable
from logging import ERROR, INFO, WARNING
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord
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
from flwr_isoloco.strategies.wire import check_train_metrics

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


# ----------------------------------------------------------------------------- grid recorder
def _array_bytes(msg: Message) -> int:
    if not msg.has_content():
        return 0
    return sum(len(a.data) for rec in msg.content.array_records.values() for a in rec.values())


class RecordingGrid(Grid):
    """Wraps a Grid; counts array bytes each way and keeps every node's latest train metrics
    (``partition-id``, ``data-cursor``, ``local-steps``, ``train_loss``) per round.

    Client metrics are untrusted: a train reply whose metrics fail
    :func:`~flwr_isoloco.strategies.wire.check_train_metrics` (against the ``local-steps`` its
    instruction asked for, default ``default_steps``, and the vertex of the node it was sent
    to, via ``vertex_of``) is logged with the node and not recorded; the strategy drops it too.
    """

    def __init__(
        self,
        grid: Grid,
        default_steps: int | None = None,
        vertex_of: Callable[[int], Any] | None = None,
    ) -> None:
        self._grid = grid
        self.default_steps = default_steps
        self.vertex_of = vertex_of
        self._sent: dict[str, Message] = {}
        self.bytes_down = 0
        self.bytes_up = 0
        self.local_updates = 0
        self.cursors: dict[int, int] = {}
        self.round_losses: list[float] = []
        self.round_failures = 0

    # delegate the Grid interface
    def set_run(self, run_id: int) -> None:
        self._grid.set_run(run_id)

    @property
    def run(self):
        return self._grid.run

    def create_message(self, *args, **kwargs) -> Message:
        return self._grid.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        return self._grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        self.bytes_down += sum(_array_bytes(m) for m in messages)
        ids = list(self._grid.push_messages(messages))
        self._remember(messages)
        return ids

    def _remember(self, messages: list[Message]) -> None:
        self._sent = {m.metadata.message_id: m for m in messages if m.metadata.message_id}

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = list(self._grid.pull_messages(message_ids))
        self._observe(replies)
        return replies

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None):
        messages = list(messages)
        self.bytes_down += sum(_array_bytes(m) for m in messages)
        replies = list(self._grid.send_and_receive(messages, timeout=timeout))
        self._remember(messages)
        self._observe(replies)
        return replies

    def _bad_metrics(self, reply: Message) -> str | None:
        sent = self._sent.get(reply.metadata.reply_to_message_id)
        node = sent.metadata.dst_node_id if sent is not None else reply.metadata.src_node_id
        asked = self.default_steps
        if sent is not None and "config" in sent.content.config_records:
            k = sent.content.config_records["config"].get("local-steps", asked)
            asked = k if isinstance(k, int) else asked
        vertex = self.vertex_of(node) if self.vertex_of is not None else None
        why = check_train_metrics(reply.content, asked_steps=asked, vertex=vertex)
        return None if why is None else f"node {node}: {why}"

    def _observe(self, replies: list[Message]) -> None:
        for r in replies:
            self.bytes_up += _array_bytes(r)
            if r.has_error():
                self.round_failures += 1
                continue
            if r.metadata.message_type != "train":
                continue
            m = r.content.metric_records.get("metrics")
            if m is None:
                continue
            bad = self._bad_metrics(r)
            if bad is not None:
                log(WARNING, "rwlora-sentiment: %s; reply metrics not recorded", bad)
                continue
            if "partition-id" in m and "data-cursor" in m:
                self.cursors[int(m["partition-id"])] = int(m["data-cursor"])
            self.local_updates += int(m.get("local-steps", 0))
            loss = m.get("train_loss")
            if isinstance(loss, (int, float)) and math.isfinite(loss):
                self.round_losses.append(float(loss))

    def take_round(self) -> tuple[float | None, int]:
        losses, fails = self.round_losses, self.round_failures
        self.round_losses, self.round_failures = [], 0
        return (sum(losses) / len(losses) if losses else None), fails


# ----------------------------------------------------------------------------- helpers
def wait_for_nodes(grid: Grid, want: int, settle_s: float, timeout_s: float) -> int:
    """Wait for ``want`` nodes (``0``: until the count is stable for ``settle_s``)."""
    t0 = time.monotonic()
    last, since = -1, time.monotonic()
    while True:
        n = len(list(grid.get_node_ids()))
        now = time.monotonic()
        if n != last:
            last, since = n, now
        if want and n >= want:
            return n
        if not want and n >= 1 and now - since >= settle_s:
            return n
        if now - t0 > timeout_s:
            if n >= max(want, 1):
                return n
            raise RuntimeError(f"only {n} nodes connected after {timeout_s:.0f} s (want {want})")
        time.sleep(0.25)


def _vertex_of(strategy, node: int) -> Any:
    """The graph vertex a node id holds (None before discovery or for unmapped nodes)."""
    vmap = getattr(strategy, "vmap", None)
    if vmap is None:
        return None
    return next((v for v, nid in vmap.node_of.items() if nid == node), None)


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
        from flwr.serverapp.strategy import FedAvg

        return FedAvg(
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
    d = cfg.data
    test = sentiment.load_test(d.source, d["test-size"], cfg.seed, d["eval-examples"])
    test_texts, test_labels = list(test["text"]), [int(y) for y in test["label"]]
    spec = lora_spec(cfg)
    model = classifier.get_model(spec, slot="server")  # not the clients' copy
    tokenizer = classifier.load_tokenizer(spec.model)
    initial_adapter = classifier.initial_adapter(spec)  # not the cached model's current state
    adapter_bytes = sum(t.numel() * 4 for t in initial_adapter.values())
    log(INFO, "rwlora-sentiment: output %s; adapter %d bytes", out, adapter_bytes)

    total = cfg["num-server-rounds"]
    history: list[dict[str, Any]] = []
    done = 0
    meta: dict[str, Any] | None = None
    tensors: dict[str, Any] = {}
    if cfg["resume-from"]:
        try:
            tensors, meta = read_checkpoint(cfg["resume-from"], conf)
        except (CheckpointError, RunConfigError) as exc:
            log(ERROR, "rwlora-sentiment: cannot resume: %s", exc)
            raise
        done, history = meta["round"], meta["history"]

    rec = RecordingGrid(grid)
    n = wait_for_nodes(grid, cfg.strategy["num-clients"], settle_s, cfg.strategy["node-wait-s"])
    state: dict[str, Any] = {"strategy": None}
    try:
        strategy = build_strategy(cfg, n)
    except ValueError as exc:
        s = cfg.strategy
        msg = (
            f"run-config keys strategy.graph={s.graph!r}, strategy.transition={s.transition!r}, "
            f"strategy.target={s.target!r} with {n} clients: {exc}"
        )
        log(ERROR, "rwlora-sentiment: bad run config: %s", msg)
        raise RunConfigError(msg) from None
    state["strategy"] = strategy
    name = cfg.strategy.name
    rec.default_steps = cfg.strategy["local-steps"]
    if name != "fedavg":
        rec.vertex_of = lambda node: _vertex_of(strategy, node)
    base = {"local-updates": 0, "bytes-relayed": 0, "bytes-p2p": 0}
    train_config: dict[str, Any] = {}
    initial = ArrayRecord(initial_adapter)
    # FedAvg samples nodes with Python's global ``random``: seed it so runs repeat exactly
    # (a resumed run restores the generator's state from the checkpoint below).
    random.seed(cfg.seed)
    if meta is not None:
        path = cfg["resume-from"]
        try:
            with restoring(path, "strategy state: "):
                if name == "fedavg":
                    check_tensors(tensors.get("arrays"), initial_adapter, "arrays")
                    initial = ArrayRecord(tensors["arrays"])
                else:
                    strategy.load_state_dict(
                        {"tensors": tensors.get("strategy", {}), "meta": meta["strategy"]},
                        reference=initial_adapter,
                        optimizer_reference=optimizer_shapes(model),
                    )
                    if meta["strategy"]["round"] != done:
                        raise CheckpointError(
                            f"field 'round' = {meta['strategy']['round']}, the checkpoint's "
                            f"is {done}"
                        )
            with restoring(path):
                set_rng_state(meta["rng"])
        except CheckpointError as exc:
            log(ERROR, "rwlora-sentiment: cannot resume: %s", exc)
            raise
        base = {k: meta["totals"][k] for k in base}
        rec.cursors = {int(k): v for k, v in meta["cursors"].items()}
        train_config[CURSORS_KEY] = json.dumps(rec.cursors)
        log(INFO, "rwlora-sentiment: resumed from %s at round %d", cfg["resume-from"], done)

    results: dict[str, Any] = {
        "app": "rwlora_sentiment",
        "status": "running",
        "output-dir": str(out),
        "config": conf,
        "num-clients": n,
        "adapter-bytes": adapter_bytes,
        "test-examples": len(test_texts),
        "resumed-from": cfg["resume-from"] or None,
        "rounds": history,
    }
    offset = done if name == "fedavg" else 0  # FedAvg numbers resumed rounds from 1
    clock = {"start": time.perf_counter(), "last": time.perf_counter()}

    def totals() -> dict[str, int]:
        s = strategy
        lu = getattr(s, "local_updates", None)
        br = getattr(s, "bytes_relayed", None)
        bp = getattr(s, "bytes_p2p", None)
        if name == "fedavg":
            lu, br = base["local-updates"] + rec.local_updates, None
        relayed = base["bytes-relayed"] + rec.bytes_down + rec.bytes_up if br is None else br
        return {
            "local-updates": int(
                lu if lu is not None else base["local-updates"] + rec.local_updates
            ),
            "bytes-relayed": int(relayed),
            "bytes-p2p": int(bp if bp is not None else relayed),
        }

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        rnd = server_round + offset
        if server_round == 0 and done > 0:
            return None
        want_eval = rnd == 0 or rnd % cfg["eval-every"] == 0 or rnd == total
        row: dict[str, Any] = {"round": rnd, **(totals() if rnd else dict.fromkeys(base, 0))}
        loss, fails = rec.take_round()
        if rnd:
            row["train-loss"] = loss
            row["failed-replies"] = fails
            if name == "rwlora" and strategy.trajectory:
                v = strategy.trajectory[-1]
                row["walk-vertex"] = int(v) if isinstance(v, int) else str(v)
                row["hop-failures-total"] = strategy.failures
        if want_eval:
            tw = time.perf_counter()
            res = _evaluate(arrays)
            row.update({"test-accuracy": res["accuracy"], "test-loss": res["loss"]})
            if name == "gossip":  # each vertex's own adapter, not the A/B average
                own = [_evaluate(a) for a in strategy.vertex_adapters().values()]
                row["test-accuracy-vertex-mean"] = sum(r["accuracy"] for r in own) / len(own)
                row["test-loss-vertex-mean"] = sum(r["loss"] for r in own) / len(own)
            row["eval-time-s"] = time.perf_counter() - tw
        now = time.perf_counter()
        row["round-wall-s"] = now - clock["last"]
        clock["last"] = now
        history.append(row)
        log(INFO, "rwlora-sentiment: %s", row)
        write_json_atomic(out / "results.json", results)
        if cfg["checkpoint"] and rnd > 0:
            _checkpoint(rnd, arrays)
        if rnd and (want_eval or rnd == total):
            _plots()
        if "test-accuracy" in row:
            return MetricRecord(
                {"test-accuracy": row["test-accuracy"], "test-loss": row["test-loss"]}
            )
        return None

    def _evaluate(arrays: ArrayRecord) -> dict[str, float]:
        classifier.load_adapter_state_dict(model, arrays.to_torch_state_dict())
        return classifier.evaluate(
            model, tokenizer, test_texts, test_labels, max_length=cfg.model["max-length"]
        )

    def _checkpoint(rnd: int, arrays: ArrayRecord) -> None:
        if name == "fedavg":
            ts: dict[str, Any] = {"arrays": arrays.to_torch_state_dict()}
            smeta: dict[str, Any] = {}
        else:
            sd = strategy.state_dict()
            ts, smeta = {"strategy": sd["tensors"]}, sd["meta"]
        save_checkpoint(
            out / CHECKPOINT,
            ts,
            {
                "app": "rwlora_sentiment",
                "round": rnd,
                "config": conf,
                "strategy": smeta,
                "history": history,
                "totals": totals(),
                "cursors": {str(k): v for k, v in rec.cursors.items()},
                "rng": rng_state(),
            },
        )

    def _plots() -> None:
        visits = None
        if name == "rwlora":
            visits = {str(k): int(v) for k, v in strategy.visit_counts().items()}
        elif rec.cursors:
            per_visit = cfg.strategy["local-steps"] * cfg.train["batch-size"]
            visits = {str(k): c // per_visit for k, c in sorted(rec.cursors.items())}
        results["visit-counts"] = visits
        try:
            plot_results(history, visits, out, title=plot_title(name, cfg.strategy.graph, n))
        except Exception as exc:  # plots must never stop a run
            log(WARNING, "rwlora-sentiment: plotting failed: %s", exc)

    remaining = total - done
    result = None
    if remaining <= 0:
        log(INFO, "rwlora-sentiment: checkpoint already holds all %d rounds", total)
    else:
        try:
            result = strategy.start(
                grid=rec,
                initial_arrays=initial,
                num_rounds=total if name != "fedavg" else remaining,
                timeout=cfg["round-timeout"],
                train_config=ConfigRecord(train_config),
                evaluate_fn=evaluate_fn,
            )
        except NoProgressError as exc:
            _plots()
            results.update(
                status="failed", error=str(exc), **{"wall-time-s": time.perf_counter() - t0}
            )
            write_json_atomic(out / "results.json", results)
            raise
    _plots()
    if result is not None:  # the adapter whose accuracy was reported last; loads with peft
        adapter = result.arrays.to_torch_state_dict()
        export_adapter(model, adapter, out / "adapter", tokenizer=tokenizer)
    results["status"] = "completed"
    results["wall-time-s"] = time.perf_counter() - t0
    write_json_atomic(out / "results.json", results)
    last = next((r for r in reversed(history) if "test-accuracy" in r), None)
    log(
        INFO,
        "rwlora-sentiment: done, %d rounds in this run, %d of %d in total; final test accuracy "
        "%s; results in %s, adapter in %s",
        len(history) - 1 - done,  # history holds rounds 0..last
        len(history) - 1,
        total,
        "n/a" if last is None else f"{last['test-accuracy']:.4f}",
        out / "results.json",
        out / "adapter",
    )
    return out


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_server(grid, dict(context.run_config), context.run_id)
